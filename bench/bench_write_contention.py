"""Writes on a loaded disk: what a backup stores in its deadline, and how many concurrent puts.

Run from the repository root (SGLang 0.5.23 is in ``.venv`` after ``make setup``)::

    .venv/bin/python bench/bench_write_contention.py --label after --json /tmp/contention.json
    .venv/bin/python bench/bench_write_contention.py --json /tmp/contention.json --write-md

Each run records its figures under ``--label`` in the JSON file (run it once per code state:
on ``main`` for "before", on the change for "after"); ``--write-md`` appends every label in
the file as a dated "Writes under contention" section to the run log (docs/benchmarks/log.md). The disk is loaded by
``--writers`` competing processes that rewrite and fsync 1 MiB files on the same filesystem
(``tests/_disk_load.py``) for the whole of each measurement:

* **SGLang backup**: SGLang 0.5.23's own ``HybridCacheController`` (``tests/sglang/
  sglang_cpu.py``) backs up ``--pages`` pages (one ``batch_set_v1``, SGLang's batch of 128) of
  a model of 4 layers x 8 KV heads x head dim 64, 16 tokens a page, through the adapter on
  ``file://`` (``durability=data``): grid 1x1, 32 objects of 4 KiB a page, and grid 4x8, one
  object of 128 KiB a page; default deadlines (``io_timeout_s`` 20 s + 16 MiB/s). Figures:
  the pages the adapter reported stored (a leading run), the pages SGLang's hit query finds
  afterwards, the tokens SGLang's controller counts completed, and the call's seconds.
* **Concurrent puts**: ``--puts`` puts of one 8 KiB object each, issued at once on one
  ``FileBackend``, each under ``asyncio.wait_for(.., 3)``: how many were stored, how many of
  the first were (the leading run), and the seconds until every call returned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _markdown import log_run

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "sglang"))

from _disk_load import competing_writers  # noqa: E402

PAGE_SIZE = 16
GRIDS = {"1x1": "32 objects of 4 KiB", "4x8": "1 object of 128 KiB"}


def sglang_backup(workdir: Path, grid: str, pages: int, writers: int) -> dict[str, Any]:
    import sglang_cpu

    error = sglang_cpu.load()
    if error is not None:
        raise SystemExit(f"SGLang 0.5.23 does not import: {error}")
    geometry = sglang_cpu.Geometry(layers=4, heads=8, head_dim=64, page_size=PAGE_SIZE,
                                   device_tokens=pages * PAGE_SIZE)
    rank = sglang_cpu.Rank(f"file://{workdir / 'kv'}", geometry=geometry, extra={"grid": grid})
    storage = rank.storage
    calls: list[tuple[list[bool], float]] = []
    batch_set_v1 = storage.batch_set_v1

    def timed(keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        started = time.monotonic()
        results: list[bool] = batch_set_v1(keys, host_indices, extra_info)
        calls.append((results, time.monotonic() - started))
        return results

    storage.batch_set_v1 = timed
    tokens = sglang_cpu.tokens_for(pages, PAGE_SIZE, seed=48)
    data = [rank.random_page(s) for s in range(pages)]
    with competing_writers(workdir / "load", processes=writers):
        completed = rank.backup(tokens, data, timeout=600)
    (results, seconds), *_ = calls
    found = storage.batch_exists(rank.hashes(tokens))
    rank.close()
    reported = results.index(False) if False in results else len(results)
    return {"reported": reported, "found": found, "completed_tokens": completed,
            "seconds": seconds, "pages": pages}


async def _concurrent_puts(root: Path, n: int) -> tuple[list[bool], float]:
    from hicache_store.backends.file import FileBackend

    store = FileBackend(root)
    data = [os.urandom(8 << 10) for _ in range(n)]

    async def put(i: int) -> bool:
        try:
            await asyncio.wait_for(store.put([f"{i:04x}"], [data[i]]), 3.0)
        except asyncio.TimeoutError:  # (on 3.10 not the builtin one)
            return False
        return True

    started = time.monotonic()
    results = await asyncio.gather(*(put(i) for i in range(n)))
    seconds = time.monotonic() - started
    await store.close()
    return results, seconds


def concurrent_puts(workdir: Path, n: int, writers: int) -> dict[str, Any]:
    with competing_writers(workdir / "load", processes=writers):
        results, seconds = asyncio.run(_concurrent_puts(workdir / "kv", n))
    leading = results.index(False) if False in results else n
    return {"stored": sum(results), "leading": leading, "seconds": seconds, "puts": n}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"load_start": os.getloadavg()[0], "cores": os.cpu_count(),
                           "writers": args.writers, "backup": {}, "puts": []}
    for grid in GRIDS:
        runs = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                runs.append(sglang_backup(Path(d), grid, args.pages, args.writers))
            print(grid, runs[-1], flush=True)
        out["backup"][grid] = runs
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            out["puts"].append(concurrent_puts(Path(d), args.puts, args.writers))
        print("puts", out["puts"][-1], flush=True)
    out["load_end"] = os.getloadavg()[0]
    return out


def _span(values: list[float], fmt: str) -> str:
    """The median, and the range when the runs differ."""
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    return format(med, fmt) if lo == hi else f"{format(med, fmt)} ({format(lo, fmt)}-{format(hi, fmt)})"


def render(results: dict[str, dict[str, Any]]) -> str:
    first = next(iter(results.values()))
    lines = [
        "## Writes under contention",
        "",
        "Commands: `.venv/bin/python bench/bench_write_contention.py --label LABEL --json "
        "/tmp/contention.json` once per code state (before: on `main` before the ordered write "
        "queue; after: with it), then `--write-md`. The disk is loaded by "
        f"{first['writers']} competing processes rewriting and fsyncing 1 MiB files on the "
        "same filesystem for the whole of each measurement (contention, not an injected "
        "latency; cgroup `io.max` needs cgroup v2, which this VM does not have). Medians of "
        f"{len(first['puts'])} runs, the range in parentheses. "
        f"{first['cores']} shared vCPUs.",
        "",
        f"**SGLang's controller backs up {first['backup']['1x1'][0]['pages']} pages** (one "
        "`batch_set_v1`; 4 layers x 8 KV heads x 64, 16 tokens a page, `file://`, "
        "`durability=data`, default deadline: 20 s + bytes at 16 MiB/s): pages the adapter "
        "reported stored (a leading run), pages SGLang's hit query then finds, tokens the "
        "controller counts completed (all or nothing per call), seconds of the call.",
        "",
        "| code | grid | objects a page | reported stored | found | completed tokens | seconds | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, res in results.items():
        load = f"{res['load_start']:.1f}-{res['load_end']:.1f}"
        for grid, what in GRIDS.items():
            runs = res["backup"][grid]
            lines.append(
                f"| {label} | {grid} | {what} | {_span([r['reported'] for r in runs], '.0f')} "
                f"| {_span([r['found'] for r in runs], '.0f')} "
                f"| {_span([r['completed_tokens'] for r in runs], '.0f')} "
                f"| {_span([r['seconds'] for r in runs], '.1f')} | {load} |"
            )
    lines += [
        "",
        f"**{first['puts'][0]['puts']:,} concurrent puts of 8 KiB** on one `FileBackend` "
        "(`durability=data`), each under `asyncio.wait_for(.., 3)`: puts stored, the leading "
        "run of them (from the first issued), seconds until every call returned.",
        "",
        "| code | stored | leading run | seconds | load |",
        "|---|---|---|---|---|",
    ]
    for label, res in results.items():
        runs = res["puts"]
        lines.append(
            f"| {label} | {_span([r['stored'] for r in runs], '.0f')} "
            f"| {_span([r['leading'] for r in runs], '.0f')} "
            f"| {_span([r['seconds'] for r in runs], '.1f')} "
            f"| {res['load_start']:.1f}-{res['load_end']:.1f} |"
        )
    lines += [
        "",
        "Before, the adapter gathered one `write_page` per page, each its own `ObjectIO.put` "
        "with its own window: all 4,096 puts of a chunk reached the file backend at once, its "
        "first-in-first-out pool ran every put's reservation before any put's write and every "
        "settle after every write, so the chunk's pages all ended together, past the deadline "
        "(the call then waited its slack and returned nothing stored). The same happens to "
        "1,500 independent puts. Now every write of a backend goes through one queue "
        "(`objects/writes.py`: a page's objects together, the oldest page first, in runs of one "
        "backend call sized to the store's recent pace, each run within the deadline of its own "
        "bytes), the file backend's pool runs the jobs of the oldest call first "
        "(`backends/_call_order.py`), and the index's write transactions of a process go first "
        "come, first served (SQLite's own wait let one transaction be overtaken by 120-360 "
        "others). The loaded disk now stores a leading run, never all pages late together. "
        "The spread of the concurrent puts follows the machine's load: a stall of the machine "
        "longer than a put's 3 s leaves none stored, in any order.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", help="record this run's figures under this label")
    parser.add_argument("--json", type=Path, required=True, help="results file (appended to)")
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--puts", type=int, default=1500)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to make the stores (default: tmp)")
    parser.add_argument("--write-md", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = json.loads(args.json.read_text()) if args.json.exists() else {}
    if args.label:
        results[args.label] = measure(args)
        args.json.write_text(json.dumps(results, indent=1))
    if args.write_md:
        log_run(render(results))
    if not args.label and not args.write_md:
        print(render(results))
    shutil.rmtree(ROOT / "bench" / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
    main()
