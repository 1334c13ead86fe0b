"""``hicache-store bench pd``: P/D with decode-side reuse off (baseline) against on (L1 + L2).

A prefill and a decode process per arm (``hicache_store.demo.bench.pd``) on the multi-turn
shared-prefix workload; the suffix KV travels over Mooncake's transfer engine in TCP mode (or
plain TCP sockets). Prints a table and the reductions after the first round; ``--json PATH``
writes ``{"workload", "setup", "baseline": {...}, "reuse": {...}, "comparison": {...}}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hicache_store.commands._common import (
    add_command,
    add_json_output,
    json_on_stdout,
    require_module,
    write_json,
)
from hicache_store.commands.bench_multiturn import add_workload_arguments, workload_spec
from hicache_store.errors import UsageError
from hicache_store.ops.progress import ProgressBar


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "pd", doc=__doc__,
        help="P/D disaggregation: decode-side prefix reuse off vs on, two processes")
    add_workload_arguments(parser, "workload (multi-turn conversations, scaled to a 2-core CPU)",
                           turns=6, question_tokens=64, answer_tokens=32)
    sizes = parser.add_argument_group("workers")
    sizes.add_argument("--preset", default="bench", help="mini engine preset (tiny, bench)")
    sizes.add_argument("--page-size", type=int, default=16)
    sizes.add_argument(
        "--transport", default="mooncake", choices=["mooncake", "tcp"], help="the KV data plane"
    )
    sizes.add_argument(
        "--l1-fraction",
        type=float,
        default=0.25,
        help="each worker's L1 (device pool) pages / the workload's working set",
    )
    sizes.add_argument(
        "--l2-fraction", type=float, default=1.0, help="each worker's L2 (host) pages / working set"
    )
    sizes.add_argument("--arms", default="baseline,reuse", help="comma-separated subset to run")
    sizes.add_argument("--workdir", type=Path, default=Path(".run/pd"))
    sizes.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    out = parser.add_argument_group("output")
    add_json_output(out, "results")
    out.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_module("torch", "bench pd")
    from hicache_store.demo.bench.multiturn import fresh_directory
    from hicache_store.demo.bench.pd import ARMS, run_arms, summarize
    from hicache_store.demo.bench.pd_worker import WorkerSetup
    from hicache_store.demo.bench.workload import generate
    from hicache_store.demo.engine.config import MiniLlamaConfig

    try:
        config = MiniLlamaConfig.preset(args.preset)
        spec = workload_spec(args, config.vocab_size)
        if args.page_size < 1 or args.threads < 1:
            raise ValueError("--page-size and --threads must be positive")
        if not args.l1_fraction > 0 or args.l2_fraction < 0:
            raise ValueError("--l1-fraction must be positive, --l2-fraction not negative")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or set(arms) - set(ARMS):
        raise UsageError(f"--arms: choose from {', '.join(ARMS)}")
    page = args.page_size
    working = -(-spec.working_set_tokens // page)
    longest = -(-(spec.max_prompt_tokens + spec.answer_tokens) // page)
    l1 = max(int(working * args.l1_fraction), 2 * longest)
    l2 = int(working * args.l2_fraction)
    common: dict[str, Any] = {
        "model": config.to_dict(),
        "page_size": page,
        "l1_pages": l1,
        "l2_pages": l2,
        "transport": args.transport,
        "landing_rows": longest + 8,
        "threads": args.threads,
    }
    prefill = WorkerSetup(**common)
    workdir = fresh_directory(args.workdir)
    total = sum(1 for _ in generate(spec))
    print(
        f"model {args.preset}: {config.num_layers} layers, {config.num_kv_heads} KV heads x "
        f"{config.head_dim}, {config.dtype} ({config.kv_bytes_per_token} B of KV per token); "
        f"page {page}; {total} requests; working set {spec.working_set_tokens} tokens; each "
        f"worker L1 {l1} / L2 {l2} pages; transport {args.transport}",
        file=sys.stderr,
    )

    bar = ProgressBar(total, "requests", label=f"  {'+'.join(arms)}", enabled=not args.no_progress)

    def progress(done: int, total: int) -> None:
        bar.update(done, final=done >= total)

    setups = {arm: (prefill, WorkerSetup(**{**common, "reuse": arm == "reuse"})) for arm in arms}
    raw = run_arms(setups, spec, workdir, progress)
    bar.close()
    results: dict[str, Any] = {}
    for arm in arms:
        results[arm] = summarize(raw[arm]["records"], spec.answer_tokens)
        results[arm]["decode_tier"] = raw[arm]["tier"]
        results[arm]["decode_hit_tokens"] = {
            tier: raw[arm]["tier"].get(f"hit_tokens_{tier}", 0) for tier in ("l1", "l2")
        }
        results[arm]["prefill"] = raw[arm]["prefill"]
    comparison = compare(results)
    table = sys.stderr if json_on_stdout(args) else sys.stdout  # stdout carries the JSON alone
    print(render_table(results), file=table)
    for line in describe(comparison):
        print(line, file=table)
    if args.json:
        write_json(args.json, {
            "workload": vars(spec),
            "setup": {**common, "model": args.preset, "working_set_pages": working},
            **results,
            "comparison": comparison,
        })
    return 0


def _fall(before: float, after: float) -> float | None:
    return 1 - after / before if before else None


def compare(results: dict[str, Any]) -> dict[str, Any]:
    """Reuse against baseline: relative falls (0.8 = 80 % less) overall and after round 1."""
    if not {"baseline", "reuse"} <= set(results):
        return {}
    base, reuse = results["baseline"], results["reuse"]
    out: dict[str, Any] = {}
    for scope, b, r in (
        ("all", base, reuse),
        ("after_first_round", base["after_first_round"], reuse["after_first_round"]),
    ):
        out[scope] = {
            f"{name}_fall": _fall(b[name], r[name])
            for name in ("bytes_transferred", "ttft_mean_s", "ttft_median_s")
        }
    out["e2e_fall"] = _fall(base["e2e_s"], reuse["e2e_s"])
    return out


def render_table(results: dict[str, Any]) -> str:
    head = (
        f"{'arm':<9} {'MiB sent':>9} {'after r1':>9} {'decode hit':>10} {'after r1':>9} "
        f"{'TTFT mean':>10} {'median':>8} {'r1+ median':>10} {'e2e s':>7} {'out tok/s':>9}"
    )
    lines = [head]
    for arm, s in results.items():
        later = s["after_first_round"]
        lines.append(
            f"{arm:<9} {s['bytes_transferred'] / 2**20:>9.1f} "
            f"{later['bytes_transferred'] / 2**20:>9.1f} {100 * s['decode_hit_rate']:>9.1f}% "
            f"{100 * later['decode_hit_rate']:>8.1f}% {1e3 * s['ttft_mean_s']:>8.1f}ms "
            f"{1e3 * s['ttft_median_s']:>6.1f}ms {1e3 * later['ttft_median_s']:>8.1f}ms "
            f"{s['e2e_s']:>7.1f} {s['output_tok_s']:>9.1f}"
        )
    return "\n".join(lines)


def describe(comparison: dict[str, Any]) -> list[str]:
    if not comparison:
        return []
    later, overall = comparison["after_first_round"], comparison["all"]

    def change(fall: float | None) -> str:
        return "n/a" if fall is None else f"{-100 * fall:+.1f}%"

    return [
        f"reuse vs baseline after the first round: bytes sent "
        f"{change(later['bytes_transferred_fall'])}, median TTFT "
        f"{change(later['ttft_median_s_fall'])}, mean TTFT {change(later['ttft_mean_s_fall'])}",
        f"over all rounds: bytes {change(overall['bytes_transferred_fall'])}, median TTFT "
        f"{change(overall['ttft_median_s_fall'])}, mean TTFT "
        f"{change(overall['ttft_mean_s_fall'])}; end-to-end time {change(comparison['e2e_fall'])}",
    ]
