"""``hicache-store plan``: which objects each rank of a deployment writes and reads per page.

Given a model shape, a grid (or ``--suggest-grid``) and writer/reader topologies, prints a table
per topology (objects, bytes and read amplification per rank per page), or with ``--json`` the
same as data::

    {"namespace": {...}, "grid": {...},
     "writers": [{"topology": "tp=4,pp=2", "ranks": [{"rank", "tp_rank", "pp_rank", "layers",
                  "heads", "objects": [{"suffix": "L30-59_H2", "byte_range": [a, b],
                  "host_offset": n}], "bytes": n}]}],
     "readers": [... same, plus "read_amplification" and "bytes_fetched" per rank ...]}

``byte_range`` is payload-relative: what a writer writes (the whole payload) or what a reader
fetches (a layer sub-range where it needs fewer layers). ``host_offset`` is where those bytes go
in (or come from) the rank's ``page_unified`` host page.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hicache_store.commands._common import add_command
from hicache_store.errors import UsageError
from hicache_store.layout.dtypes import KV_DTYPE_ITEMSIZE
from hicache_store.layout.errors import GridMismatchError, InvalidNamespaceError
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.plans import ReadPlan, WritePlan, plan_reads, plan_writes, suggest_grid
from hicache_store.layout.topology import Topology


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "plan", doc=__doc__,
                         help="show the objects each rank writes and reads per page")
    shape = parser.add_argument_group("model shape")
    shape.add_argument("--model", default="model", help="model name in the namespace")
    shape.add_argument("--layers", type=int, required=True, help="number of layers")
    shape.add_argument("--kv-heads", type=int, help="KV heads (MHA)")
    shape.add_argument("--head-dim", type=int, help="head dimension (MHA)")
    shape.add_argument("--mla", action="store_true", help="an MLA model (latent KV)")
    shape.add_argument("--kv-dim", type=int, help="latent KV dimension (MLA)")
    shape.add_argument("--dtype", default="bfloat16", choices=sorted(KV_DTYPE_ITEMSIZE))
    shape.add_argument("--page-size", type=int, default=64, help="tokens per page")
    grid = parser.add_argument_group("grid")
    grid.add_argument("--layer-partition", type=int, help="layers per object chunk")
    grid.add_argument("--head-partition", type=int, help="KV heads per object head group")
    grid.add_argument(
        "--suggest-grid", action="store_true", help="use the coarsest grid all topologies can write"
    )
    parser.add_argument(
        "--writer", action="append", default=[], metavar="TOPOLOGY", help="e.g. tp=4,pp=2"
    )
    parser.add_argument(
        "--reader", action="append", default=[], metavar="TOPOLOGY", help="e.g. tp=2,pp=1"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run)


def _shape(args: argparse.Namespace) -> ModelShape:
    if args.mla:
        if args.kv_dim is None or args.kv_heads is not None or args.head_dim is not None:
            raise UsageError("--mla takes --kv-dim (and no --kv-heads / --head-dim)")
        return ModelShape.mla(args.layers, args.kv_dim)
    if args.kv_heads is None or args.head_dim is None or args.kv_dim is not None:
        raise UsageError("an MHA model needs --kv-heads and --head-dim (or use --mla --kv-dim)")
    return ModelShape.mha(args.layers, args.kv_heads, args.head_dim)


def _topologies(texts: list[str]) -> list[Topology]:
    try:
        return [Topology.parse(text) for text in texts]
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    """The plan as data (what ``--json`` prints)."""
    shape = _shape(args)
    writers, readers = _topologies(args.writer), _topologies(args.reader)
    if not writers and not readers:
        raise UsageError("give at least one --writer or --reader topology")
    if args.suggest_grid:
        if args.layer_partition is not None or args.head_partition is not None:
            raise UsageError("--suggest-grid replaces --layer-partition / --head-partition")
        try:
            grid = suggest_grid(shape, writers + readers)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        if args.layer_partition is None:
            raise UsageError("give --layer-partition (and --head-partition) or --suggest-grid")
        default_heads = 1 if args.mla else shape.num_kv_heads
        grid = Grid(args.layer_partition, args.head_partition or default_heads)
    try:
        namespace = Namespace.create(args.model, shape, args.dtype, args.page_size, grid)
        return {
            "namespace": namespace.to_json(),
            "grid": {
                "layers_per_chunk": grid.layers_per_chunk,
                "heads_per_group": grid.heads_per_group,
                "objects_per_page": namespace.objects_per_page,
                "page_bytes": namespace.page_bytes,
            },
            "writers": [_topology_entry(namespace, t, write=True) for t in writers],
            "readers": [_topology_entry(namespace, t, write=False) for t in readers],
        }
    except (GridMismatchError, InvalidNamespaceError) as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # topology does not fit the model (heads, layers)
        raise UsageError(str(exc)) from None


def _topology_entry(namespace: Namespace, topology: Topology, *, write: bool) -> dict[str, Any]:
    ranks = []
    for rank in range(topology.world_size):
        plan: WritePlan | ReadPlan = (
            plan_writes(namespace, topology, rank)
            if write
            else plan_reads(namespace, topology, rank)
        )
        shard = plan.shard
        entry: dict[str, Any] = {
            "rank": rank,
            "tp_rank": shard.tp_rank,
            "pp_rank": shard.pp_rank,
            "layers": [shard.layer_start, shard.layer_stop],
            "heads": [shard.head_start, shard.head_stop],
        }
        if isinstance(plan, WritePlan):
            entry["replica"] = shard.replica
            entry["objects"] = [
                {
                    "suffix": o.coords.suffix,
                    "byte_range": [0, o.nbytes],
                    "host_offset": o.page_offset,
                }
                for o in plan.objects
            ]
            entry["bytes"] = plan.bytes_per_page
        else:
            entry["objects"] = [
                {
                    "suffix": o.coords.suffix,
                    "byte_range": [o.fetch_start, o.fetch_stop],
                    "host_offset": o.segments[0].dst_offset,
                    "whole": o.is_whole,
                }
                for o in plan.objects
            ]
            entry["bytes"] = plan.bytes_needed
            entry["bytes_fetched"] = plan.bytes_fetched
            entry["read_amplification"] = round(plan.read_amplification, 4)
        ranks.append(entry)
    return {"topology": str(topology), "ranks": ranks}


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def render_text(report: dict[str, Any]) -> str:
    ns, grid = report["namespace"], report["grid"]
    lines = [
        f"namespace {ns['digest']}  model={ns['model']} kv={ns['kv_kind']} layers={ns['num_layers']} "
        f"kv_heads={ns['num_kv_heads']} dim={ns['head_dim']} dtype={ns['dtype']} "
        f"page={ns['page_size']} tokens",
        f"grid {grid['layers_per_chunk']} layers x {grid['heads_per_group']} heads: "
        f"{grid['objects_per_page']} objects per page, {_human_bytes(grid['page_bytes'])} per page",
    ]
    for role in ("writers", "readers"):
        for topo in report[role]:
            lines.append("")
            lines.append(f"{role[:-1]} {topo['topology']}")
            header = f"  {'rank':>4} {'tp':>3} {'pp':>3} {'layers':>9} {'heads':>7} {'objs':>4} {'bytes/page':>11}"
            if role == "readers":
                header += f" {'fetched':>11} {'amp':>5}"
            lines.append(header + "  objects")
            for r in topo["ranks"]:
                row = (
                    f"  {r['rank']:>4} {r['tp_rank']:>3} {r['pp_rank']:>3} "
                    f"{'{}-{}'.format(r['layers'][0], r['layers'][1] - 1):>9} "
                    f"{'{}-{}'.format(r['heads'][0], r['heads'][1] - 1):>7} "
                    f"{len(r['objects']):>4} {_human_bytes(r['bytes']):>11}"
                )
                if role == "readers":
                    row += (
                        f" {_human_bytes(r['bytes_fetched']):>11} {r['read_amplification']:>5.2f}"
                    )
                names = ", ".join(o["suffix"] for o in r["objects"])
                if role == "writers" and not r["objects"]:
                    names = f"(replica {r['replica']}: writes nothing)"
                lines.append(f"{row}  {names}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = build_report(args)
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    return 0
