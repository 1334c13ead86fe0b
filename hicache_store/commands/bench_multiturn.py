"""``hicache-store bench multiturn``: the multi-turn workload under L1, L1+L2, L1+L2+L3.

The default L3 is the file backend under ``--workdir`` (a fresh folder each run). L1 and L2 are
sized below the workload's working set (``--l1-fraction``, ``--l2-fraction``), so the smaller
configurations must recompute what they lost. Prints a table, and writes JSON (``--json``) and
a PNG chart (``--chart``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache_store.demo.bench.workload import WorkloadSpec

from hicache_store.commands._common import (
    add_command,
    add_json_output,
    json_on_stdout,
    require_module,
    write_json,
)
from hicache_store.errors import UsageError
from hicache_store.ops.progress import ProgressBar


def add_workload_arguments(
    parser: Any, title: str, *, turns: int, question_tokens: int, answer_tokens: int
) -> None:
    """The shared-prefix multi-turn workload's options (``workload_spec`` reads them back)."""
    work = parser.add_argument_group(title)
    work.add_argument("--groups", type=int, default=4, help="groups sharing a prefix")
    work.add_argument("--conversations", type=int, default=4, help="conversations per group")
    work.add_argument("--turns", type=int, default=turns, help="rounds per conversation")
    work.add_argument("--system-tokens", type=int, default=2048, help="shared prefix length")
    work.add_argument("--question-tokens", type=int, default=question_tokens,
                      help="new input per round")
    work.add_argument("--answer-tokens", type=int, default=answer_tokens,
                      help="output per round")
    work.add_argument("--seed", type=int, default=0)


def add_transfer_policy_arguments(parser: Any) -> None:
    """``--write-policy`` and ``--prefetch-policy``, the tier's (``TierConfig``) names; spelled
    out here rather than read from ``tier.config``, which would import torch at CLI start."""
    parser.add_argument(
        "--write-policy",
        default="write_through",
        choices=["write_through", "write_through_selective", "write_back"],
    )
    parser.add_argument(
        "--prefetch-policy",
        default="wait_complete",
        choices=["best_effort", "wait_complete", "timeout"],
    )


def workload_spec(args: Any, vocab_size: int) -> WorkloadSpec:
    """The ``WorkloadSpec`` of the options ``add_workload_arguments`` added (may raise ValueError)."""
    from hicache_store.demo.bench.workload import WorkloadSpec

    return WorkloadSpec(
        groups=args.groups,
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens,
        question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens,
        vocab_size=vocab_size,
        seed=args.seed,
    )


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "multiturn", doc=__doc__,
                         help="multi-turn shared-prefix workload under L1, L1+L2, L1+L2+L3")
    add_workload_arguments(parser, "workload", turns=4, question_tokens=32, answer_tokens=128)
    sizes = parser.add_argument_group("tiers")
    sizes.add_argument("--preset", default="bench", help="mini engine preset (tiny, bench)")
    sizes.add_argument(
        "--model",
        default="llama",
        choices=["llama", "hybrid"],
        help="llama: full-attention layers only; hybrid: every other layer a sliding-window "
        "layer plus a recurrent layer, with per-component hit rates",
    )
    sizes.add_argument(
        "--checkpoint-interval",
        type=int,
        default=0,
        metavar="PAGES",
        help="--model hybrid: also snapshot the recurrent state every PAGES pages (0: only at "
        "request ends and branch points)",
    )
    sizes.add_argument(
        "--sliding-window",
        type=int,
        default=256,
        help="tokens a sliding-window layer attends to (--model hybrid)",
    )
    sizes.add_argument("--page-size", type=int, default=16)
    sizes.add_argument("--l1-fraction", type=float, default=0.2, help="L1 size / working set")
    sizes.add_argument("--l2-fraction", type=float, default=0.5, help="L2 size / working set")
    sizes.add_argument("--backend", help="L3 backend URL (default: file backend in --workdir)")
    sizes.add_argument("--workdir", type=Path, default=Path(".run/multiturn"))
    sizes.add_argument(
        "--configs", default="L1,L1+L2,L1+L2+L3", help="comma-separated subset to run"
    )
    policy = parser.add_argument_group("policies")
    add_transfer_policy_arguments(policy)
    policy.add_argument("--host-mode", default="cache", choices=["cache", "buffer_only"])
    policy.add_argument(
        "--eviction-policy",
        metavar="NAME",
        help="order of eviction in every pool of the tier, KV and components (lru, arc, "
        "session; default: the tier's default, session, which is arc without hints)",
    )
    policy.add_argument(
        "--events", metavar="ADDR",
        help="publish the tier's KV events on this ZMQ address (e.g. ipc:///tmp/kv; "
        "TierConfig.events_endpoint), to measure what publishing costs",
    )
    out = parser.add_argument_group("output")
    add_json_output(out, "results")
    out.add_argument("--chart", type=Path, metavar="PATH", help="write a PNG chart")
    out.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch compute threads (1 leaves a core to the tier's I/O; the mini engine's "
        "small ops gain little from more on a 2-core machine)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Up front, not after the whole benchmark has run.
    require_module("torch", "bench multiturn")
    if args.chart:
        require_module("matplotlib", "--chart")
    from hicache_store.demo.bench.hybrid import hybrid_config, run_hybrid_setup
    from hicache_store.demo.bench.multiturn import (
        default_setups,
        describe_l2_effect,
        fresh_directory,
        l2_effect,
        run_setup,
    )
    from hicache_store.demo.bench.multiturn import write_chart as draw
    from hicache_store.demo.bench.workload import generate
    from hicache_store.demo.engine.config import MiniLlamaConfig
    from hicache_store.demo.engine.model import MiniLlama
    from hicache_store.demo.hybrid import HybridMiniLlama
    from hicache_store.tier.eviction import EVICTION_POLICIES

    try:
        config = MiniLlamaConfig.preset(args.preset)
        if args.checkpoint_interval < 0:
            raise ValueError("--checkpoint-interval must be >= 0")
        if args.model == "hybrid":
            config = hybrid_config(config, args.sliding_window)
        spec = workload_spec(args, config.vocab_size)
        if args.eviction_policy not in (None, *EVICTION_POLICIES):
            raise ValueError(
                f"--eviction-policy: {args.eviction_policy!r} is not one of "
                f"{', '.join(EVICTION_POLICIES)}"
            )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    workdir = fresh_directory(args.workdir)
    backend_url = args.backend or f"file://{(workdir / 'l3').resolve()}"
    setups = default_setups(
        spec,
        args.page_size,
        l1_fraction=args.l1_fraction,
        l2_fraction=args.l2_fraction,
        backend_url=backend_url,
    )
    wanted = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = set(wanted) - {s.name for s in setups}
    if unknown:
        raise UsageError(f"--configs: unknown {sorted(unknown)}; choose from L1, L1+L2, L1+L2+L3")
    setups = [s for s in setups if s.name in wanted]
    import torch

    torch.set_num_threads(max(1, args.threads))
    hybrid = HybridMiniLlama(config) if args.model == "hybrid" else None
    model = hybrid.base if hybrid is not None else MiniLlama(config)
    total = sum(1 for _ in generate(spec))
    options = {
        "write_policy": args.write_policy,
        "prefetch_policy": args.prefetch_policy,
        "host_mode": args.host_mode,
    }
    if args.eviction_policy is not None:
        options["eviction_policy"] = args.eviction_policy
    if args.events is not None:
        options["events_endpoint"] = args.events
    kinds = (
        f"{len(config.window_layers)} of them sliding-window ({config.sliding_window} tokens) "
        f"+ a recurrent layer"
        if hybrid is not None
        else "full attention"
    )
    print(
        f"model {args.preset} ({args.model}): {config.num_layers} layers, {kinds}, "
        f"{config.num_kv_heads} KV heads x {config.head_dim}, {config.dtype}; page "
        f"{args.page_size} tokens; {total} requests, working set {spec.working_set_tokens} tokens",
        file=sys.stderr,
    )
    summaries = []
    results = {}
    for setup in setups:
        # Redraws one line on a terminal; plain lines every few seconds into logs and pipes.
        bar = ProgressBar(total, "requests", label=f"  {setup.name:<9}",
                          enabled=not args.no_progress)

        def progress(done: int, bar: ProgressBar = bar) -> None:
            bar.update(done, final=done >= total)

        if hybrid is not None:
            result = run_hybrid_setup(
                hybrid,
                spec,
                setup,
                args.page_size,
                options,
                progress,
                checkpoint_interval_pages=args.checkpoint_interval,
            )
        else:
            result = run_setup(model, spec, setup, args.page_size, options, progress)
        bar.close()
        summaries.append(result.summary())
        results[setup.name] = result
    table = sys.stderr if json_on_stdout(args) else sys.stdout  # stdout carries the JSON alone
    print(render_table(summaries), file=table)
    effect = None
    if "L1" in results and "L1+L2" in results:
        effect = l2_effect(results["L1"], results["L1+L2"])
        print(describe_l2_effect(effect, ("L1", "L1+L2")), file=table)
    if hybrid is not None:
        print(file=table)
        print(render_components(summaries), file=table)
    if args.json:
        document: dict[str, Any] = {"workload": vars(spec), "results": summaries}
        if effect is not None:
            document["l2_effect"] = effect
        write_json(args.json, document)
    if args.chart:
        args.chart.parent.mkdir(parents=True, exist_ok=True)
        draw(summaries, args.chart)
    return 0


def render_table(summaries: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':<10} {'L1 pages':>8} {'L2 pages':>8} {'hit':>6} {'hit>t1':>7} {'L1':>6} "
        f"{'L2':>6} {'L3':>6} {'TTFT mean':>10} {'median':>8} {'input tok/s':>12} {'bookkeep':>9}"
    )
    lines = [head]
    for s in summaries:
        setup = s["setup"]
        lines.append(
            f"{setup['name']:<10} {setup['l1_pages']:>8} {setup['l2_pages']:>8} "
            f"{100 * s['hit_rate']:>5.1f}% {100 * s['hit_rate_after_first_turn']:>6.1f}% "
            f"{100 * s['hit_rate_l1']:>5.1f}% {100 * s['hit_rate_l2']:>5.1f}% "
            f"{100 * s['hit_rate_l3']:>5.1f}% {1e3 * s['ttft_mean_s']:>8.1f}ms "
            f"{1e3 * s['ttft_median_s']:>6.1f}ms {s['input_throughput_tok_s']:>12.0f} "
            f"{100 * s['bookkeeping_share']:>8.2f}%"
        )
    return "\n".join(lines)


def render_components(summaries: list[dict[str, Any]]) -> str:
    """Per-component hit rates of hybrid runs: what each component alone could have resumed
    (share of prompt tokens), what was reused, and how often each component was binding."""
    first = summaries[0]["tier"]["components"]
    names = [n for n in first["hit_rates"] if n != "all"]
    head = f"{'config':<10} {'reused':>7} " + " ".join(f"{n + ' hit':>14}" for n in names)
    head += "  " + " ".join(f"{n + ' bound':>16}" for n in names)
    lines = ["per-component hit rates (tokens each component alone could resume after)", head]
    for s in summaries:
        comp = s["tier"]["components"]
        rates, bound = comp["hit_rates"], comp["limited_by"]
        row = f"{s['setup']['name']:<10} {100 * rates['all']:>6.1f}% "
        row += " ".join(f"{100 * rates[n]:>13.1f}%" for n in names)
        row += "  " + " ".join(f"{bound[n]:>16}" for n in names)
        lines.append(row)
    return "\n".join(lines)
