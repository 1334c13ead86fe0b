"""``hicache-store bench trace TRACE``: replay a production block-hash trace through the tier.

Each capacity (the L2 size, in blocks of the trace unless a unit says otherwise) is replayed
once per eviction policy through a fresh tier: an L1 that holds the request being served
(or an L1 cache of ``--l1``), L2 of that capacity, and an L3 backend (unless ``--backend``, the
file backend in a fresh folder under ``--workdir``, without flushes (``durability=none``): the
replay measures the cache, not the disk; ``none`` for L1+L2 only). Requests are served back to
back (``--time-scale`` paces them); the L3 writes then run behind the replay, and the table
counts the backups dropped and the prefetches started: ``--settle`` lets the tier's background
work finish after each request, as an engine's compute time does. Next to each replay it prints
what the benchmark computes from the trace alone at the same capacity: the token hit rate of
plain block LRU (the published reference) and the clairvoyant Belady bound.

``hit_rate`` is the share of prompt tokens served from memory (L1+L2: the cache whose size is
``capacity_blocks``, comparable to the references); ``hit_rate_with_l3`` adds L3. Figures are
fractions over all requests, with the second half of the requests beside them. Prints a
table; ``--json`` and ``--chart`` write the results and a PNG of hit rate against capacity.
The JSON file is rewritten as each row finishes (``"complete": false`` until the last), so an
interrupted run keeps its finished rows (``--json -``: on stdout at the end, or at the
interrupt). ``--max-requests N`` reads the trace only as far as its first N requests.

``--replay sim`` (the default for ``--format weka``, agent sessions: 47 M block references do
not go through the tier in minutes) replays at block level instead
(``trace_sim.simulate``: the tier's own eviction policies over the trace's block ids, a
prefix-closed cache of the capacity). Both replays hand each request what an engine would know
(``trace_sim.HintFeed``): the simulator to a policy that takes hints (``session``), the tier
replay to ``HiCache.match(hints=...)`` and ``HiCache.response_end``, the engine's API. Rows add
the hit rate per request kind (``main``, ``subagent``) where the trace has sessions (the tier
replay also the pages pinned at the end); ``unbounded`` is a capacity of the simulator.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache_store.commands._common import add_command, add_json_output, json_on_stdout, write_json
from hicache_store.commands.bench_multiturn import add_transfer_policy_arguments
from hicache_store.errors import UsageError
from hicache_store.ops.progress import ProgressBar, counted

if TYPE_CHECKING:
    from hicache_store.demo.bench.trace_format import Trace

#: the ``--json`` schema version (bump when a field changes meaning).
SCHEMA = 1

#: ``--capacities`` of a WEKA replay (those of the reference figures).
WEKA_CAPACITIES = ("10000", "20000", "40000", "80000", "160000", "320000", "unbounded")


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "trace", doc=__doc__,
        help="replay a production trace through the tier; hit rates next to LRU and Belady")
    parser.add_argument(
        "trace",
        type=Path,
        help="trace file (e.g. bench/traces/*.jsonl.gz), or for weka a folder or .tar.gz of "
        "session files",
    )
    parser.add_argument(
        "--format", default="mooncake", choices=["mooncake", "weka"], help="trace format"
    )
    parser.add_argument(
        "--replay",
        choices=["tier", "sim"],
        help="through the tier and a backend, or the block-level simulator (default: sim for "
        "weka, tier otherwise)",
    )
    parser.add_argument(
        "--capacities",
        help="L2 sizes to replay, comma-separated: N or Nblocks (blocks of the trace), Npages, "
        "Ntokens, or bytes of KV like 64MiB; with --replay sim also 'unbounded' (default "
        "1000,4000,16000,64000; weka: " + ",".join(WEKA_CAPACITIES) + ")",
    )
    parser.add_argument(
        "--policy",
        default="default",
        help="eviction policies, comma-separated: lru, arc, session, default (the tier's "
        "default) (default: default)",
    )
    parser.add_argument("--page-size", type=int, default=64, help="tier page in tokens (64)")
    parser.add_argument(
        "--l1",
        help="keep an L1 cache of this size above L2 (same units; at least the longest prompt); "
        "default: L1 holds only the request being served, so the cache measured is L2",
    )
    parser.add_argument(
        "--backend", help="L3 backend URL, or none (default: file backend under --workdir)"
    )
    parser.add_argument("--workdir", type=Path, default=Path(".run/trace"))
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.0,
        help="wall seconds per trace second (0.1: ten times faster than recorded; 0: back to "
        "back, the default)",
    )
    parser.add_argument(
        "--settle",
        action="store_true",
        help="wait for the tier's background L3 writes and prefetches after each request, as "
        "an engine computing between requests lets them finish (back to back, L3 writes fall "
        "behind the replay: backups are dropped and L3 misses what L2 evicts)",
    )
    add_transfer_policy_arguments(parser)
    parser.add_argument(
        "--partial-blocks",
        action="store_true",
        help="store a prompt's partial last block as an engine does (its full pages only) "
        "instead of padding it to a whole block as the published reference counts it",
    )
    parser.add_argument(
        "--belady",
        help="with --replay sim: the capacities to compute the Belady bound at, comma-separated "
        "(default: every one; 'none': none, also with --replay tier; it is the slowest "
        "reference)",
    )
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests")
    add_json_output(parser, "results")
    parser.add_argument("--chart", type=Path, metavar="PNG", help="write a PNG chart")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


def resolve_policies(text: str) -> list[str]:
    """Policy names from ``--policy`` (``default`` is the tier's default), in order, once each."""
    from hicache_store.tier.eviction import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES

    names: list[str] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name = DEFAULT_EVICTION_POLICY if item == "default" else item
        if name not in EVICTION_POLICIES:
            raise UsageError(
                f"--policy: {item!r} is not one of {', '.join(EVICTION_POLICIES)}, default"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise UsageError("--policy: no policy given")
    return names


def load_trace(args: argparse.Namespace) -> Trace:
    """The trace of ``args`` (path, format), checked, cut to ``--max-requests``: both replay
    modes start from it. Raises ``ValueError`` for a bad limit or an empty trace."""
    from hicache_store.demo.bench.trace_format import check_chains, read_trace

    if args.max_requests is not None and args.max_requests < 1:
        raise ValueError("--max-requests must be at least 1")
    trace = read_trace(args.trace, args.format, limit=args.max_requests)
    check_chains(trace)
    if not trace.requests:
        raise ValueError(f"{args.trace}: the trace has no requests")
    return trace


def run(args: argparse.Namespace) -> int:
    from hicache_store.demo.bench.trace_replay import KVShape, longest_request_pages, parse_capacity

    policies = resolve_policies(args.policy)
    replay_mode = args.replay or ("sim" if args.format == "weka" else "tier")
    if args.capacities is None:
        args.capacities = (
            ",".join(WEKA_CAPACITIES) if args.format == "weka" else "1000,4000,16000,64000"
        )
    if replay_mode == "sim":
        return run_simulated(args, policies)
    try:
        trace = load_trace(args)
        page = args.page_size
        if page < 1 or trace.block_tokens % page:
            raise ValueError(
                f"--page-size {page} must divide the trace's {trace.block_tokens}-token blocks"
            )
        shape = KVShape()
        page_bytes = shape.namespace(page).page_bytes

        def pages(text: str) -> int:
            return parse_capacity(
                text, block_tokens=trace.block_tokens, page_size=page, page_bytes=page_bytes
            )

        capacities = [pages(c) for c in args.capacities.split(",") if c.strip()]
        if not capacities:
            raise ValueError("--capacities: no capacity given")
        whole = not args.partial_blocks
        longest = longest_request_pages(trace, page, whole_blocks=whole)
        l1 = pages(args.l1) if args.l1 else longest
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if l1 < longest:
        raise UsageError(f"--l1: {l1} pages cannot hold the longest prompt ({longest} pages)")
    _say_trace(trace, f"{trace.block_accesses} blocks of {trace.block_tokens} tokens; page "
                      f"{page} tokens ({page_bytes} B of KV), L1 {l1} pages")
    results: list[dict[str, Any]] = []
    fields: dict[str, Any] = {"requests": len(trace)}
    with _keeping(args, results, fields):
        _replay_tier(args, trace, capacities, policies, l1, shape, results, fields)
    print(render_table(results), file=_table(args))
    _say_replayed(sum(r["wall_s"] for r in results), max(r["peak_rss_bytes"] for r in results))
    return write_outputs(args, trace, results, fields)


def _replay_tier(
    args: argparse.Namespace, trace: Trace, capacities: list[int], policies: list[str], l1: int,
    shape: Any, results: list[dict[str, Any]], fields: dict[str, Any],
) -> None:
    """Each capacity and policy through the tier; each row appended to ``results`` (and the
    JSON file rewritten) as it finishes."""
    from hicache_store.demo.bench.multiturn import fresh_directory
    from hicache_store.demo.bench.trace_replay import ReplaySetup, replay
    from hicache_store.demo.bench.trace_sim import belady, lru_reference

    page = args.page_size
    per_block = trace.block_tokens // page
    whole = not args.partial_blocks
    no_bound = (args.belady or "").strip() == "none"
    references: dict[int, dict[str, float | None]] = {}
    for capacity in capacities:
        blocks = max(1, capacity // per_block)
        if blocks not in references:
            lru = lru_reference(trace, blocks)
            bound = None if no_bound else belady(trace, blocks)
            references[blocks] = {
                "lru_reference": lru.hit_rate,
                "lru_reference_second_half": lru.second_half_hit_rate,
                "belady": None if bound is None else bound.hit_rate,
                "belady_second_half": None if bound is None else bound.second_half_hit_rate,
            }
        for policy in policies:
            url = args.backend
            if url is None:
                folder = fresh_directory(args.workdir / f"l3-{capacity}-{policy}")
                url = f"file://{folder.resolve()}?durability=none"
            elif url == "none":
                url = None
            setup = ReplaySetup(
                page_size=page,
                l1_pages=l1,
                l2_pages=capacity,
                l1_cache=args.l1 is not None,
                whole_blocks=whole,
                backend_url=url,
                eviction_policy=policy,
                time_scale=args.time_scale,
                shape=shape,
                write_policy=args.write_policy,
                prefetch_policy=args.prefetch_policy,
                settle=args.settle,
            )
            label = f"{capacity // per_block} blocks, {policy}"
            bar = ProgressBar(len(trace), "requests", label=f"  {label:<24}",
                              enabled=not args.no_progress)
            result = replay(trace, setup, progress=bar.update)
            bar.close()
            summary = result.summary()
            summary.update(references[blocks])
            results.append(summary)
            _save_rows(args, results, fields)


def sim_capacities(text: str, distinct_blocks: int) -> list[int]:
    """Block capacities of ``--capacities`` for ``--replay sim``: whole blocks (``N`` or
    ``Nblocks``), or ``unbounded`` (every distinct block of the trace)."""
    capacities: list[int] = []
    for item in (c.strip() for c in text.split(",")):
        if not item:
            continue
        if item == "unbounded":
            capacities.append(max(distinct_blocks, 1))
            continue
        number = item.removesuffix("blocks").replace("_", "")
        if not number.isdigit() or int(number) < 1:
            raise ValueError(
                f"--capacities: {item!r}: with --replay sim a capacity is N blocks or unbounded"
            )
        capacities.append(int(number))
    if not capacities:
        raise ValueError("--capacities: no capacity given")
    return capacities


def run_simulated(args: argparse.Namespace, policies: list[str]) -> int:
    """``--replay sim``: the references and every policy at block level (module docstring)."""
    import resource
    import time

    started = time.monotonic()
    try:
        trace = load_trace(args)
        distinct = len({b for r in trace.requests for b in r.hash_ids})
        capacities = sim_capacities(args.capacities, distinct)
        if args.belady is None:
            with_bound = set(capacities)
        elif args.belady.strip() == "none":
            with_bound = set()
        else:
            with_bound = set(sim_capacities(args.belady, distinct))
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    sessions = len({r.session.session for r in trace.requests if r.session is not None})
    _say_trace(trace, f"{sessions} sessions, {trace.block_accesses} block references "
                      f"({distinct} distinct) of {trace.block_tokens} tokens; read in "
                      f"{time.monotonic() - started:.0f} s")
    results: list[dict[str, Any]] = []
    fields: dict[str, Any] = {
        "format": args.format, "replay": "sim", "requests": len(trace), "sessions": sessions}
    with _keeping(args, results, fields):
        _simulate_all(args, trace, capacities, with_bound, distinct, policies, results, fields)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(render_sim_table(results), file=_table(args))
    _say_replayed(time.monotonic() - started, peak)
    return write_outputs(args, trace, results, {
        **fields, "peak_rss_bytes": peak, "wall_s": time.monotonic() - started})


def _simulate_all(
    args: argparse.Namespace, trace: Trace, capacities: list[int], with_bound: set[int],
    distinct: int, policies: list[str], results: list[dict[str, Any]], fields: dict[str, Any],
) -> None:
    """``--replay sim`` at each capacity and policy; each row appended to ``results`` (and
    the JSON file rewritten) as it finishes."""
    import time

    from hicache_store.demo.bench.trace_sim import belady, block_policy, lru_reference, simulate

    for blocks in capacities:
        clock = time.monotonic()
        lru = lru_reference(trace, blocks)
        bound = belady(trace, blocks) if blocks in with_bound else None
        references: dict[str, Any] = {
            "lru_reference": lru.hit_rate,
            "lru_reference_second_half": lru.second_half_hit_rate,
            "lru_reference_by_kind": lru.kind_hit_rates,
            "belady": None if bound is None else bound.hit_rate,
            "belady_second_half": None if bound is None else bound.second_half_hit_rate,
            "belady_by_kind": None if bound is None else bound.kind_hit_rates,
        }
        if not args.no_progress:
            print(f"  {blocks} blocks: references in {time.monotonic() - clock:.0f} s",
                  file=sys.stderr, flush=True)
        for policy in policies:
            clock = time.monotonic()
            count = simulate(trace, blocks, block_policy(policy, trace, blocks))
            wall = time.monotonic() - clock
            if not args.no_progress:
                print(f"  {blocks} blocks, {policy}: {100 * count.hit_rate:.2f}% in {wall:.0f} s",
                      file=sys.stderr, flush=True)
            results.append({
                "replay": "sim",
                "capacity_blocks": blocks,
                "unbounded": blocks >= distinct,
                "policy": policy,
                "hit_rate": count.hit_rate,
                "hit_rate_second_half": count.second_half_hit_rate,
                "hit_rate_by_kind": count.kind_hit_rates,
                "input_tokens": count.input_tokens,
                "wall_s": wall,
                **references,
            })
            _save_rows(args, results, fields)


def _say_trace(trace: Trace, detail: str) -> None:
    """A run's first line on stderr: the trace, its requests and span, then ``detail``."""
    print(f"trace {trace.name}: {len(trace)} requests over {trace.duration_s:.0f} s, {detail}",
          file=sys.stderr)


def _say_replayed(seconds: float, peak_bytes: int) -> None:
    """A run's last line on stderr: how long the replays took, and the peak memory."""
    print(f"replayed in {seconds:.0f} s, peak memory {peak_bytes / 2**20:.0f} MiB",
          file=sys.stderr)


def _table(args: argparse.Namespace) -> Any:
    """Where the table goes: stdout, or stderr when stdout carries the JSON (``--json -``)."""
    return sys.stderr if json_on_stdout(args) else sys.stdout


def _document(args: argparse.Namespace, results: list[dict[str, Any]], fields: dict[str, Any],
              *, complete: bool) -> dict[str, Any]:
    """The ``--json`` document: the schema, the trace, ``fields``, whether every row is in,
    then the rows."""
    return {"schema": SCHEMA, "trace": str(args.trace), **fields, "complete": complete,
            "results": results}


def _save_rows(args: argparse.Namespace, results: list[dict[str, Any]],
               fields: dict[str, Any]) -> None:
    """Rewrite the ``--json`` file with the rows finished so far (a file, not stdout)."""
    if args.json and not json_on_stdout(args):
        write_json(args.json, _document(args, results, fields, complete=False))


@contextlib.contextmanager
def _keeping(args: argparse.Namespace, results: list[dict[str, Any]],
             fields: dict[str, Any]) -> Iterator[None]:
    """On an interrupt, the rows finished so far as JSON (``--json``, ``complete`` false)
    and as a table on stderr, then the interrupt goes on (the CLI exits 130)."""
    try:
        yield
    except KeyboardInterrupt:
        if results:
            if args.json:
                write_json(args.json, _document(args, results, fields, complete=False))
            kept = ("on stdout" if json_on_stdout(args) else f"written to {args.json}"
                    if args.json else "not saved (no --json)")
            print(f"{counted(len(results), 'finished row')} {kept}", file=sys.stderr)
        raise


def write_outputs(
    args: argparse.Namespace, trace: Trace, results: list[dict[str, Any]],
    fields: dict[str, Any],
) -> int:
    """``--json`` (``_document``, complete) and ``--chart``."""
    if args.json:
        write_json(args.json, _document(args, results, fields, complete=True))
    if args.chart:
        args.chart.parent.mkdir(parents=True, exist_ok=True)
        write_chart(trace.name, results, args.chart, trace.block_tokens)
    return 0


def render_sim_table(results: list[dict[str, Any]]) -> str:
    """The ``--replay sim`` table: hit rates in %, per kind where the trace has sessions."""
    kinds = sorted({k for r in results for k in r["hit_rate_by_kind"]})
    head = (
        f"{'blocks':>9} {'policy':<8} {'hit':>6} {'2nd half':>8} "
        + "".join(f"{k:>9}" for k in kinds)
        + f" {'LRU ref':>7} {'Belady':>6} {'gap':>5} {'wall s':>6}"
    )
    lines = ["token hit rates in % (block-level replay; gap: share of LRU-to-Belady closed)", head]
    for r in results:
        blocks = "unbounded" if r["unbounded"] else f"{r['capacity_blocks']}"
        lines.append(
            f"{blocks:>9} {r['policy']:<8} {_hit_cells(r, kinds)} {_reference_cells(r)} "
            f"{r['wall_s']:>6.1f}"
        )
    return "\n".join(lines)


def _hit_cells(r: dict[str, Any], kinds: list[str]) -> str:
    """The hit rate, its second half and per session kind, in % (both tables)."""
    return (f"{100 * r['hit_rate']:>6.2f} {100 * r['hit_rate_second_half']:>8.2f}"
            + "".join(f"{100 * r['hit_rate_by_kind'].get(k, 0.0):>9.2f}" for k in kinds))


def _reference_cells(r: dict[str, Any]) -> str:
    """The LRU reference, the Belady bound and the gap closed (both tables)."""
    closed = gap_closed(r)
    bound = "-" if r["belady"] is None else f"{100 * r['belady']:.2f}"
    gap = "-" if closed is None else f"{100 * closed:.0f}%"
    return f"{100 * r['lru_reference']:>7.2f} {bound:>6} {gap:>5}"


def gap_closed(result: dict[str, Any]) -> float | None:
    """Share of the LRU-to-Belady gap the replay closed (None when the gap is under a point:
    a share of nothing says nothing, or there is no bound)."""
    if result["belady"] is None:
        return None
    gap = result["belady"] - result["lru_reference"]
    if gap < 0.01:
        return None
    return float((result["hit_rate"] - result["lru_reference"]) / gap)


def render_table(results: list[dict[str, Any]]) -> str:
    """The ``--replay tier`` table: hit rates in %, per kind where the trace has sessions, and
    the pages pinned at the end."""
    kinds = sorted({k for r in results for k in r["hit_rate_by_kind"]})
    head = (
        f"{'blocks':>7} {'policy':<7} {'hit':>6} {'2nd half':>8} "
        + "".join(f"{k:>9}" for k in kinds)
        + f" {'L1':>5} {'L2':>5} {'L3':>5} {'with L3':>7} {'LRU ref':>7} {'Belady':>6} "
        f"{'gap':>5} {'L3 wr':>8} {'L3 rd':>8} {'dropped':>8} {'prefetch':>8} {'pins':>5} "
        f"{'book ms':>7} {'wall s':>6}"
    )
    lines = ["token hit rates in % (hit = L1+L2, the cache of that size)", head]
    for r in results:
        lines.append(
            f"{r['capacity_blocks']:>7.0f} {r['policy']:<7} {_hit_cells(r, kinds)} "
            f"{100 * r['hit_rate_l1']:>5.1f} "
            f"{100 * r['hit_rate_l2']:>5.1f} {100 * r['hit_rate_l3']:>5.1f} "
            f"{100 * r['hit_rate_with_l3']:>7.2f} {_reference_cells(r)} "
            f"{r['l3_objects_written']:>8} {r['l3_objects_read']:>8} "
            f"{r['backups_dropped']:>8} {r['prefetch']['started']:>8} {r['pinned_pages']:>5} "
            f"{r['bookkeeping_ms']['mean']:>7.3f} {r['wall_s']:>6.1f}"
        )
    return "\n".join(lines)


def write_chart(
    name: str, results: list[dict[str, Any]], path: Path, block_tokens: int
) -> None:
    """Token hit rate against capacity: each replayed policy, the LRU reference, Belady."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_capacity = sorted({r["capacity_blocks"] for r in results})
    first = {c: next(r for r in results if r["capacity_blocks"] == c) for c in by_capacity}
    if all(first[c]["belady"] is not None for c in by_capacity):
        ax.plot(
            by_capacity, [100 * first[c]["belady"] for c in by_capacity], "k--", label="Belady"
        )
    ax.plot(
        by_capacity, [100 * first[c]["lru_reference"] for c in by_capacity], "k:",
        label="LRU reference",
    )
    for policy in dict.fromkeys(r["policy"] for r in results):
        rows = sorted((r for r in results if r["policy"] == policy),
                      key=lambda r: r["capacity_blocks"])
        ax.plot([r["capacity_blocks"] for r in rows], [100 * r["hit_rate"] for r in rows], "o-",
                label=f"tier, {policy}")
    ax.set_xscale("log")
    ax.set_xlabel(f"L2 capacity (blocks of {block_tokens} tokens)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"{name}: replay through the tier")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
