"""vLLM's secondary tier: a store job's time from ``submit_store`` to the poll that finds it
done, while the scheduler thread keeps the interpreter busy (as vLLM's engine loop does).

Run with the vLLM venv (``make setup-vllm``)::

    .venv-vllm/bin/python bench/bench_vllm_tier_store.py [--jobs 150] [--rows 2] [--busy-ms 0,2]

``HiCacheStoreTier`` on ``file://`` (``durability=none``, 1 GiB), driven as vLLM's tiering
manager drives it (``tests/vllm/test_secondary_tier_unit.Harness``: a real primary region, a
real ``OffloadingSpec``), one job of ``--rows`` rows of 12 KiB at a time; between polls the
main thread runs Python for ``--busy-ms`` (0: it sleeps), so every hand-off to another
thread waits for the GIL as it does beside vLLM's engine loop. Four stores side by side, their
jobs rotating:

* ``native``: the tier as it is on ``file://`` (``native_writes``: the job's rows sealed on
  the scheduler thread and its put handed straight to the backend's pool as one job, found
  done by the poll without the library's loop);
* ``native-pool``: ``native`` with the file engine's own write threads hidden
  (``starts_writes``), so the put is one job of the backend's pool: reservation, writes and
  settle on a pool thread that must win the GIL to begin and again after its C write;
* ``one-job``: the same store with ``native_writes`` hidden, so the job goes through the
  library's loop and write queue (the put still one pool job: reservation, room, writes and
  settle);
* ``steps``: as ``one-job`` with the put forced through the step-by-step path (reservation,
  ``make_room``, writes and settle each a pool job of its own, ``make_room`` always called).

Per variant: median, mean and 25th percentile of the job times.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

import test_secondary_tier_unit as unit


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def harness(root: Path, *, native: bool = False, steps: bool = False,
            pool: bool = False) -> Any:
    h = unit.Harness(root, backend_options={"durability": "none", "capacity_bytes": 1 << 30})
    if pool:  # the native put as one pool job (the engine does not start its own writes)
        h.tier.backend._engine.starts_writes = False
    if not native:  # through the library's loop, as before native writes
        backend = h.tier.backend
        backend.capabilities = backend.capabilities.replace(native_writes=False)
    if steps:
        backend = h.tier.backend
        calls = iter(range(1 << 62))
        write_run = backend._engine.write_run
        # _put_batch's check sees 0 (so the step-by-step path); _write_batch the real run
        backend._engine.write_run = lambda count, threads: (
            0 if next(calls) % 2 == 0 else write_run(count, threads))
        reserve = backend._index.reserve
        backend._index.reserve = lambda *a, **k: dataclasses.replace(reserve(*a, **k), fits=False)
    return h


def one_job(h: Any, first: int, rows: int, busy_ms: float) -> float:
    keys = [unit.key(first + i) for i in range(rows)]
    job = h.job(keys, [i % unit.CHUNKS for i in range(rows)], promotion=False)
    start = time.perf_counter()
    h.tier.submit_store(job)
    while True:
        if busy_ms:
            busy(busy_ms)
        else:
            time.sleep(0.0002)
        done = [r for r in h.tier.get_finished_jobs() if r.job_id == job.job_id]
        if done:
            assert done[0].success, done
            return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=150)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--busy-ms", default="0,2")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-tier-store-"))
    stores = {"native": harness(base / "native", native=True),
              "native-pool": harness(base / "native-pool", native=True, pool=True),
              "one-job": harness(base / "one-job"),
              "steps": harness(base / "steps", steps=True)}
    print("| busy ms between polls | put path | median ms | mean ms | p25 ms |")
    print("|---|---|---|---|---|")
    key = 0
    for busy_ms in [float(x) for x in args.busy_ms.split(",")]:
        times: dict[str, list[float]] = {name: [] for name in stores}
        for j in range(args.jobs):
            names = list(stores)
            for name in names[j % len(names):] + names[: j % len(names)]:
                key += args.rows
                times[name].append(one_job(stores[name], key, args.rows, busy_ms))
        for name, xs in times.items():
            print(f"| {busy_ms:g} | {name} | {1000 * statistics.median(xs):.1f} | "
                  f"{1000 * statistics.fmean(xs):.1f} | {1000 * sorted(xs)[len(xs) // 4]:.1f} |",
                  flush=True)
    for h in stores.values():
        h.tier.shutdown()


if __name__ == "__main__":
    main()
