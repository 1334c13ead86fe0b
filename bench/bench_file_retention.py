"""The file backend's eviction path with and without retention, against the code before it.

Run from the repository root::

    .venv/bin/python bench/bench_file_retention.py --base 93de61b --rounds 3 --write-md

A put-heavy run under capacity pressure: a fresh root of ``--capacity`` objects of
``--payload`` bytes, filled, then ``--writes`` more objects in ``put`` batches of ``--batch``
(``durability=none``), so every batch evicts a batch. Each run is a fresh process; over the
eviction-heavy part it reports the CPU time of the process per object written (every thread:
the index's SQL, the file I/O syscalls; what the change could add, and far less sensitive to
the load of a shared machine than wall time) and the objects written per wall second. Configurations, run
alternately in each round so that the machine's load falls on all alike:

- ``base``: the library at commit ``--base`` (no retention table), imported from an extracted
  copy of that commit (``git archive``) placed first on ``PYTHONPATH``;
- ``new, no holds``: this tree, nothing retained (the hot path: one probe of an empty table);
- ``new, holds``: this tree, with a tenth of the first objects pinned and a tenth retained
  (every eviction then skips them, and expired entries are pruned).

``--write-md`` appends a dated "File backend: eviction with retention"
section to the run log (docs/benchmarks/log.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _markdown import log_run

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import asyncio, hashlib, json, sys, time
    from hicache_store.backends.file import FileBackend

    def keys(salt, n):
        return [hashlib.sha256(f"{salt}-{i}".encode()).hexdigest() for i in range(n)]

    async def main(root, capacity, payload, writes, batch, holds):
        store = FileBackend(root, durability="none", capacity_bytes=capacity * payload)
        blob = b"x" * payload
        first = keys("fill", capacity)
        for i in range(0, capacity, batch):
            await store.put(first[i : i + batch], [blob] * len(first[i : i + batch]))
        if holds:
            from hicache_store.backends import Retention
            tenth = capacity // 10
            await store.retain(first[:tenth], Retention("bench", None, pinned=True))
            await store.retain(first[tenth : 2 * tenth], Retention("bench", None, pinned=False))
        more = keys("more", writes)
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(0, writes, batch):
            await store.put(more[i : i + batch], [blob] * len(more[i : i + batch]))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        evicted = store.stats.evictions
        await store.close()
        import hicache_store.backends.file as module
        print(json.dumps({"objects_per_s": writes / seconds, "seconds": seconds,
                          "cpu_us_per_object": cpu / writes * 1e6,
                          "evictions": evicted, "module": module.__file__}))

    asyncio.run(main(sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6] == "1"))
    """
)


def extract(commit: str, into: Path) -> Path:
    """The library at ``commit`` as an importable ``hicache_store`` package under ``into``."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit, "hicache_store", "layout", "kernels",
                              "backends"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = into / "pkg" / "hicache_store"
    shutil.copytree(src / "hicache_store", pkg)
    for part in ("layout", "kernels", "backends"):
        shutil.copytree(src / part, pkg / part)
    for built in (ROOT / "layout").glob("*.so"):  # the C accelerators, built here
        shutil.copy(built, pkg / "layout" / built.name)
    return into / "pkg"


def run(pythonpath: str | None, args: argparse.Namespace, holds: bool, where: Path) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    root = where / "store"
    shutil.rmtree(root, ignore_errors=True)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(args.capacity), str(args.payload),
         str(args.writes), str(args.batch), "1" if holds else "0"],
        env=env, cwd=where, capture_output=True, text=True, check=True,
    )
    shutil.rmtree(root, ignore_errors=True)
    result: dict = json.loads(out.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="93de61b", help="commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=2000, help="objects the store holds")
    parser.add_argument("--payload", type=int, default=16384)
    parser.add_argument("--writes", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--write-md", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-retention-") as tmp:
        where = Path(tmp)
        base = extract(args.base, where / "base")
        configs = {"base": (str(base), False), "new, no holds": (None, False),
                   "new, holds": (None, True)}
        results: dict[str, list[dict]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, (path, holds) in configs.items():
                results[name].append(run(path, args, holds, where))
                print(name, json.dumps(results[name][-1]), flush=True)
    load = os.getloadavg()
    rows = []
    for name, runs in results.items():
        cpu = [r["cpu_us_per_object"] for r in runs]
        rates = [r["objects_per_s"] for r in runs]
        rows.append(f"| {name} | {statistics.median(cpu):,.0f} | "
                    f"{', '.join(f'{x:,.0f}' for x in cpu)} | {statistics.median(rates):,.0f} | "
                    f"{', '.join(f'{x:,.0f}' for x in rates)} | {runs[0]['evictions']:,} |")
    section = "\n".join([
        "## File backend: eviction with retention",
        "",
        f"`.venv/bin/python bench/bench_file_retention.py --base {args.base} --rounds "
        f"{args.rounds} --capacity {args.capacity} --payload {args.payload} --writes "
        f"{args.writes} --batch {args.batch} --write-md` (capacity {args.capacity:,} objects of {args.payload:,} bytes, "
        f"{args.writes:,} more written in puts of {args.batch}, `durability=none`; every put "
        "evicts; one fresh process per run, the configurations alternating in each round; "
        f"load average {load[0]:.1f} at the end, on the shared 2-core machine).",
        "",
        "| code | CPU us / object (median) | each round | objects / wall s (median) | each "
        "round | evictions per run |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "`base` is the commit before retention; `new, holds` pins a tenth of the first "
        "objects and retains another tenth. While nothing is retained an eviction asks one "
        "more question of the index (is the retention table empty), lost in the spread of a "
        "loaded machine; with holds, every eviction walks past the held rows (they are the "
        "oldest here, so first in rank order), one primary-key probe of the retention table "
        "per row inside SQLite.",
        "",
    ])
    print(section)
    if args.write_md:
        log_run(section)


if __name__ == "__main__":
    main()
