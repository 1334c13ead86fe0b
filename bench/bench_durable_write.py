"""Durable writes: the file backend (``durability=data``) against raw O_DIRECT, alternating.

Run from the repository root::

    .venv/bin/python bench/bench_durable_write.py --objects 256 --rounds 5

``bench_backend.py`` measures each system once; on a shared machine one run's ratio moves with
whatever else runs during it (0.73 to 1.07 of raw across runs). This measures only the durable
write, in rounds that alternate raw and ours on the same bytes, so both sides see the same
load, and reports the median ratio with every round's. Raw = ``io_threads`` threads of O_DIRECT
``pwrite`` + ``fdatasync`` per file (``commands.bench_backend.RawBaseline``); ours = ``put`` in
batches of ``--batch`` objects with ``durability=data`` (O_DIRECT, ``fdatasync`` per object
before its rename, two index commits per call), as ``bench_backend.py`` writes them. Also per
round: the CPU seconds of this process per GB for each side (what the code costs, apart from
the device and the load), and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from hicache_store.backends.file import FileBackend
from hicache_store.commands.bench_backend import BenchConfig, RawBaseline, make_buffers, stamp

ROOT = Path(__file__).resolve().parent.parent


def raw_round(cfg: BenchConfig, where: Path) -> tuple[float, float]:
    """Seconds and CPU seconds of one raw O_DIRECT durable write of every object."""
    base = RawBaseline(where, cfg)
    try:
        c0 = time.process_time()
        seconds = base.write_seconds()
        return seconds, time.process_time() - c0
    finally:
        base.cleanup()


def ours_round(cfg: BenchConfig, where: Path) -> tuple[float, float]:
    """Seconds and CPU seconds of ``put`` of every object with ``durability=data``."""
    store = FileBackend(where, durability="data", io_threads=cfg.threads)
    srcs = make_buffers(min(cfg.batch, cfg.objects), cfg.size, seed=1)
    keys = [f"{i:064x}" for i in range(cfg.objects)]

    async def go() -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        for start in range(0, cfg.objects, cfg.batch):
            batch = keys[start : start + cfg.batch]
            bufs = srcs[: len(batch)]
            for j, buf in enumerate(bufs):
                stamp(buf, start + j)
            await store.put(batch, bufs)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        await store.close()
        return seconds, cpu

    try:
        return asyncio.run(go())
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=256)
    parser.add_argument("--size", type=int, default=8 << 20)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=str(ROOT / ".build" / "bench-durable"))
    args = parser.parse_args()
    cfg = BenchConfig(objects=args.objects, size=args.size, batch=args.batch, threads=args.threads)
    where = Path(args.dir)
    total = cfg.objects * cfg.size
    ratios: list[float] = []
    print(f"{cfg.objects} objects of {cfg.size >> 20} MiB, batches of {cfg.batch}, "
          f"{cfg.threads} threads\n")
    print("| round | load | raw GB/s | ours GB/s | ours / raw | raw CPU-s/GB | ours CPU-s/GB |")
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        # Alternate which side goes first, so a trend in the load favours neither.
        order = ("raw", "ours") if r % 2 == 0 else ("ours", "raw")
        got: dict[str, tuple[float, float]] = {}
        for side in order:
            os.sync()
            got[side] = (raw_round if side == "raw" else ours_round)(cfg, where / side)
        raw_s, raw_cpu = got["raw"]
        ours_s, ours_cpu = got["ours"]
        ratio = raw_s / ours_s
        ratios.append(ratio)
        print(f"| {r + 1} | {os.getloadavg()[0]:.1f} | {total / raw_s / 1e9:.2f} | "
              f"{total / ours_s / 1e9:.2f} | {ratio:.2f} | {raw_cpu / total * 1e9:.3f} | "
              f"{ours_cpu / total * 1e9:.3f} |", flush=True)
    print(f"\nmedian ours / raw: {statistics.median(ratios):.2f} "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
