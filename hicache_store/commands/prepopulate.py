"""``hicache-store prepopulate URL``: compute prompts' KV with a real model and store it in L3.

Writes the objects every rank of ``--topology`` would write for the target namespace (model,
dtype, ``--page-size``, grid, tenant), so that deployment (and any other topology reading the
same namespace) finds the KV as its own::

    hicache-store prepopulate file:///var/cache/kv --model /models/llama-3-8b \\
        --prompts system_prompts.jsonl --page-size 64 --topology tp=4,pp=2 --dtype bfloat16

Resumable (pages whose objects exist are skipped), batched, with a progress bar (tokens/s,
bytes/s) on stderr and a summary on stdout (``--json`` for data). ``--dry-run`` writes
nothing and reports what would be written. Exit code 1 when a write failed (rerun to retry).
Library: ``hicache_store.ops.prepopulate``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING, Any

from hicache_store._sync import run_sync
from hicache_store.commands._common import (
    add_prompts_argument,
    add_report_arguments,
    add_store_command,
    add_tenant_key_argument,
)
from hicache_store.errors import UsageError
from hicache_store.layout.errors import GridMismatchError, InvalidNamespaceError
from hicache_store.layout.namespace import HASH_ALGOS, Grid
from hicache_store.layout.topology import Topology
from hicache_store.ops.config import layered, require, resolve
from hicache_store.ops.progress import ProgressBar, counted, human_bytes
from hicache_store.ops.store import open_store
from hicache_store.weights import revision_source

if TYPE_CHECKING:
    from hicache_store.ops.deployment import Deployment


def register(subparsers: Any) -> None:
    parser = add_store_command(
        subparsers, "prepopulate",
        help="compute prompts' KV with a model and store it for a deployment", doc=__doc__)
    src = parser.add_argument_group("prompts and model")
    add_prompts_argument(src)
    src.add_argument("--model", metavar="DIR",
                     help="local Hugging Face model directory (tokenizer + causal LM)")
    src.add_argument("--mini-engine", metavar="PRESET",
                     help="use the project's MiniLlama preset instead (prompts give input_ids)")
    src.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="dtype the model runs in and the KV is stored in (default: auto)")
    src.add_argument("--device", default="cpu", help="torch device for the forward pass")
    src.add_argument("--max-tokens", type=int, default=None,
                     help="truncate each prompt to this many tokens (default: no limit)")
    ns = parser.add_argument_group(
        "target namespace and deployment",
        "Give the engine's own settings, or nothing will hit: the same model id, page size and "
        "dtype, and the SGLang extra-config the deployment runs with (--extra-config) or its "
        "grid and salt as flags.")
    ns.add_argument("--model-id", metavar="ID",
                    help="model identity in the namespace: SGLang's served model name, which "
                    "defaults to its --model-path exactly as given (default: --model as given, "
                    "or the mini engine preset's name)")
    ns.add_argument("--model-name", dest="model_id", help=argparse.SUPPRESS)  # the old name
    ns.add_argument("--extra-config", metavar="JSON|@FILE",
                    help="the deployment's SGLang --hicache-storage-backend-extra-config; its "
                    "grid, share_with, tenant_salt, model, model_revision and kv_dtype apply")
    ns.add_argument("--model-revision",
                    help="the weights' revision in the namespace (default: the identity of "
                    "--model's files, as the engine integrations derive it; none for "
                    "--mini-engine)")
    ns.add_argument("--page-size", type=int, default=64,
                    help="tokens per page, SGLang's --page-size (default: 64)")
    ns.add_argument("--layer-partition", type=int,
                    help="layers per object (default: as the SGLang adapter: the coarsest grid "
                    "the topology and every --share-with topology can write)")
    ns.add_argument("--head-partition", type=int,
                    help="KV heads per object (default: as for --layer-partition)")
    ns.add_argument("--topology", default="tp=1,pp=1",
                    help="writer topology, e.g. tp=4,pp=2 (default: tp=1,pp=1)")
    ns.add_argument("--share-with", action="append", default=[], metavar="TOPOLOGY",
                    help="another topology that will read this store (the adapter's share_with); "
                    "repeatable")
    ns.add_argument("--hash-algo", default="sha256", choices=list(HASH_ALGOS),
                    help="page-hash algorithm (default: sha256, as SGLang)")
    ns.add_argument("--tenant-salt", help="tenant salt of the namespace (default: none)")
    add_tenant_key_argument(ns, "tenant key ring: seal the KV for a deployment configured "
                                "with it", deployment=True)
    run_ = parser.add_argument_group("run")
    run_.add_argument("--batch-size", type=int, default=8,
                      help="prompts per batch (one exists probe and concurrent writes; default 8)")
    run_.add_argument("--max-inflight", default="256MiB",
                      help="bytes of writes in flight (default: 256MiB)")
    run_.add_argument("--dry-run", action="store_true",
                      help="compute and write nothing; report what would be written")
    add_report_arguments(run_, "summary")
    layered(parser, section="prepopulate")
    parser.set_defaults(func=run)


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} must be positive, got {value}")


def _deployment(args: argparse.Namespace, topology: Topology) -> Deployment:
    """The target deployment from ``--extra-config`` and the namespace flags; a flag that
    contradicts the extra-config is a usage error (one of them is not what the engine runs)."""
    from hicache_store.ops.deployment import Deployment, merge_extra_config

    try:
        config = merge_extra_config(args.extra_config, {
            "tenant_salt": ("--tenant-salt", args.tenant_salt),
            "model_revision": ("--model-revision", args.model_revision),
            "model": ("--model-id", args.model_id),
        }, args.share_with)
        if config.grid is not None and (args.layer_partition or args.head_partition):
            raise ValueError("give the grid either in the extra-config or as "
                             "--layer-partition/--head-partition, not both")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return Deployment(config=config, model_id=args.model, topology=topology,
                      hash_algo=args.hash_algo)


def _weights(deployment: Deployment, source: Any) -> str:
    """Where the namespace's revision came from, for the summary."""
    return revision_source(
        deployment.config.model_revision, source.weights, given="as given",
        unknown="unknown (no model files): only the model id tells other weights apart")


def run(args: argparse.Namespace) -> int:
    resolve(args)
    url = require(args, "url", "a backend URL")
    if not args.prompts:
        raise UsageError("give at least one --prompts FILE")
    if (args.model is None) == (args.mini_engine is None):
        raise UsageError("give exactly one of --model DIR and --mini-engine PRESET")
    for value, flag in ((args.page_size, "--page-size"), (args.batch_size, "--batch-size"),
                        (args.max_tokens, "--max-tokens"),
                        (args.layer_partition, "--layer-partition"),
                        (args.head_partition, "--head-partition")):
        _positive(value, flag)
    try:
        topology = Topology.parse(args.topology)
        from hicache_store.backends.types import parse_size

        max_inflight = parse_size(args.max_inflight)
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    from hicache_store.demo.engine.source import MiniEngineSource
    from hicache_store.ops.prepopulate import (
        Progress,
        check_writer_topology,
        namespace_for,
        prepopulate,
    )
    from hicache_store.ops.sources import HFSource, PromptError, load_prompts

    try:
        prompts = list(load_prompts(args.prompts))
    except PromptError as exc:
        raise UsageError(str(exc)) from None
    deployment = _deployment(args, topology)
    model_id = deployment.model
    source: HFSource | MiniEngineSource
    if args.model is not None:
        source = HFSource(args.model, dtype=args.dtype, device=args.device,
                          model_name=model_id, progress=not args.no_progress)
    else:
        if args.dtype not in ("auto", "float32"):
            raise UsageError("--mini-engine presets compute in float32; leave --dtype auto")
        try:
            source = MiniEngineSource(args.mini_engine, model_name=model_id)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if deployment.kv_dtype is not None and deployment.kv_dtype != source.dtype:
        raise UsageError(f"the extra-config's kv_dtype {deployment.kv_dtype} differs from the "
                         f"model's KV dtype {source.dtype} (set --dtype)")
    try:
        tokens = [source.tokenize(p) for p in prompts]
    except PromptError as exc:
        raise UsageError(str(exc)) from None
    if args.max_tokens is not None:
        tokens = [t[: args.max_tokens] for t in tokens]
    from hicache_store.ops.deployment import deployment_keys

    try:
        keys = deployment_keys(deployment.config, args.tenant_key_file)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        if topology.pp_layers is None:  # PP stages as SGLang splits them
            topology = deployment.config.topology(topology.tp_size, topology.pp_size,
                                                  source.shape.num_layers)
            deployment = dataclasses.replace(deployment, topology=topology)
        grid = deployment.grid_for(source.shape)
        if args.layer_partition or args.head_partition:
            grid = Grid(args.layer_partition or grid.layers_per_chunk,
                        args.head_partition or grid.heads_per_group)
        namespace = namespace_for(source, page_size=args.page_size, grid=grid,
                                  model_revision=deployment.config.model_revision,
                                  hash_algo=args.hash_algo,
                                  tenant_salt=deployment.config.tenant_salt,
                                  key_scheme=deployment.config.key_scheme,
                                  sealed=keys is not None)
        check_writer_topology(namespace, topology)
    except (InvalidNamespaceError, ValueError) as exc:  # GridMismatchError included
        raise UsageError(str(exc)) from None

    bar = ProgressBar(0, "pages", label="prepopulate", enabled=not args.no_progress)

    def show(state: Progress) -> None:
        bar.total = state.pages_total
        bar.update(state.pages_done, tokens=state.tokens_done, nbytes=state.bytes_done)

    async def go() -> Any:
        backend = open_store(url)
        try:
            return await prepopulate(backend, source, tokens, namespace, topology,
                                     batch_size=args.batch_size, dry_run=args.dry_run,
                                     max_inflight_bytes=max_inflight, progress=show, keys=keys)
        finally:
            await backend.close()

    try:
        report = run_sync(go())
    except GridMismatchError as exc:
        raise UsageError(str(exc)) from None
    finally:
        bar.close()
    if args.json:
        print(json.dumps({**report.as_dict(), "namespace_json": namespace.to_json()}, indent=2))
    else:
        verb = "would write" if args.dry_run else "wrote"
        rate = report.tokens_computed / report.seconds if report.seconds else 0.0
        sealed = f", sealed with key {keys.active.key_id}" if keys is not None else ""
        print(f"namespace {namespace.digest} ({namespace.model}, {namespace.dtype}, page "
              f"{namespace.page_size}, grid {namespace.grid}{sealed}) for {topology} "
              f"({counted(report.ranks_writing, 'writing rank')}, "
              f"{report.objects_per_page} objects/page)")
        print(f"weights: {_weights(deployment, source)}")
        print(f"{counted(report.prompts, 'prompt')}, {counted(report.pages, 'page')}: "
              f"{report.pages_present} present, {verb} {report.pages_written} "
              f"({counted(report.objects_written, 'object')}, "
              f"{human_bytes(report.bytes_written)}); {counted(report.tokens_computed, 'token')} "
              f"computed in {report.seconds:.1f}s ({rate:,.0f} tok/s); "
              f"{counted(report.write_failures, 'failed write')}")
    return 1 if report.write_failures else 0
