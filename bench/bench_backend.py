"""The file backend side by side with raw O_DIRECT, SGLang's HiCacheFile and LMCache's disk backend.

Run as root (to drop the page cache) from the repository root::

    .venv/bin/python bench/bench_backend.py --objects 512 --write-md

One run measures, in this order, on the same filesystem and the same 512 objects of 8 MiB:
raw O_DIRECT (threads, fdatasync per file), hicache-store ``file://`` with O_DIRECT and
``durability=data``, the same with buffered I/O (``direct_io=never``), SGLang ``HiCacheFile``
and LMCache ``LocalDiskBackend`` (each in the peer interpreter ``.build/bench-venv`` via
``bench_backend_peers.py``), then raw O_DIRECT again (to show drift within the run). Then exists
over 10,000 keys: hicache-store in the writing process, in a freshly started process and for
keys another process wrote after we opened, against SGLang's
``batch_exists``. ``--write-md`` appends a dated "Backends"
section to the run log (docs/benchmarks/log.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from _markdown import log_run

from hicache_store.backends.file import FileBackend
from hicache_store.commands.bench_backend import (
    BenchConfig,
    Progress,
    RawBaseline,
    bench_store,
    drop_page_cache,
)

ROOT = Path(__file__).resolve().parent.parent
OBJECT_BYTES = 8 << 20  # the peers' page: 2 x 32 layers x 64 tokens x 8 heads x 128 x bf16


def gb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def raw(cfg: BenchConfig, where: Path) -> dict[str, float]:
    base = RawBaseline(where, cfg)
    try:
        write = base.write_seconds()
        drop_page_cache()
        read = base.read_seconds()
    finally:
        base.cleanup()
    total = cfg.objects * cfg.size
    return {
        "write": gb_s(total, write),
        "write_returned": gb_s(total, write),
        "cold_read": gb_s(total, read),
    }


def ours(cfg: BenchConfig, where: Path, **options: Any) -> dict[str, float]:
    store = FileBackend(where, **options)

    async def go() -> dict[str, float]:
        measures = await bench_store(
            store,
            cfg,
            run=os.urandom(4).hex(),
            progress=Progress(enabled=False),
            before_cold_read=drop_page_cache,
        )
        await store.close()
        out = {m.phase.replace(" ", "_"): m.gbps for m in measures if m.phase != "exists"}
        out["write_returned"] = out["write"]  # durability=data: durable when put returns
        return out

    try:
        return asyncio.run(go())
    finally:
        shutil.rmtree(where, ignore_errors=True)


def peer(
    system: str, cfg: BenchConfig, where: Path, python: str, exists_keys: int
) -> dict[str, Any]:
    cmd = [
        python,
        str(ROOT / "bench" / "bench_backend_peers.py"),
        system,
        "--dir",
        str(where),
        "--objects",
        str(cfg.objects),
        "--batch",
        str(cfg.batch),
        "--threads",
        "4",
        "--exists-keys",
        str(exists_keys),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    data: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    total = data["objects"] * data["object_bytes"]
    data.update(
        write=gb_s(total, data["write_durable_s"]),
        write_returned=gb_s(total, data["write_returned_s"]),
        cold_read=gb_s(total, data["cold_read_s"]),
        second_read=gb_s(total, data["second_read_s"]),
        warm_read=gb_s(total, data["warm_read_s"]),
    )
    return data


_PROBE = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from hicache_store.backends.file import FileBackend
    keys = json.load(open(sys.argv[2]))
    t0 = time.perf_counter()
    store = FileBackend(sys.argv[1])
    opened = time.perf_counter() - t0
    async def main():
        t1 = time.perf_counter()
        n = await store.exists_prefix_length(keys)
        print(json.dumps({"open_s": opened, "exists_s": time.perf_counter() - t1, "hits": n}))
    asyncio.run(main())
    """
)
_WRITER = textwrap.dedent(
    """
    import asyncio, json, sys
    from hicache_store.backends.file import FileBackend
    keys = json.load(open(sys.argv[2]))
    async def main():
        store = FileBackend(sys.argv[1], durability="none")
        for s in range(0, len(keys), 500):
            await store.put(keys[s:s + 500], [bytes(4096)] * len(keys[s:s + 500]))
    asyncio.run(main())
    """
)


def exists_figures(where: Path, count: int) -> dict[str, Any]:
    """exists over ``count`` keys: same process, after a restart, written by another process."""
    import hashlib

    keys = [hashlib.sha256(f"exists-{i}".encode()).hexdigest() for i in range(count)]
    other = [hashlib.sha256(f"other-{i}".encode()).hexdigest() for i in range(count)]
    key_file, other_file = where / "keys.json", where / "other.json"
    store_dir = where / "store"
    where.mkdir(parents=True, exist_ok=True)
    key_file.write_text(json.dumps(keys))
    other_file.write_text(json.dumps(other))
    out: dict[str, Any] = {}
    try:
        store = FileBackend(store_dir, durability="none")

        async def same_process() -> None:
            for s in range(0, count, 500):
                await store.put(keys[s : s + 500], [bytes(4096)] * len(keys[s : s + 500]))
            t0 = time.perf_counter()
            hits = await store.exists_prefix_length(keys)
            out["same_process_s"] = time.perf_counter() - t0
            assert hits == count
            # Another process writes keys this process has never seen.
            await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", _WRITER, str(store_dir), str(other_file)],
                check=True,
            )
            t0 = time.perf_counter()
            hits = await store.exists_prefix_length(other)
            out["other_writer_s"] = time.perf_counter() - t0
            assert hits == count, hits
            await store.close()

        asyncio.run(same_process())
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, str(store_dir), str(key_file)],
            capture_output=True,
            text=True,
            check=True,
        )
        restarted = json.loads(probe.stdout)
        assert restarted["hits"] == count
        out["restart_s"] = restarted["exists_s"]
        out["restart_open_s"] = restarted["open_s"]
        out["restart_open_objects"] = 2 * count
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128, help="SGLang's STORAGE_BATCH_SIZE")
    parser.add_argument("--threads", type=int, default=16,
                        help="raw baseline threads = the file backend's pool = LMCache's")
    parser.add_argument("--exists-keys", type=int, default=10_000)
    parser.add_argument("--dir", default=str(ROOT / ".build" / "bench-data"))
    parser.add_argument(
        "--peer-python", default=str(ROOT / ".build" / "bench-venv" / "bin" / "python")
    )
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--write-md", action="store_true", help="update the run log (docs/benchmarks/log.md)")
    parser.add_argument("--json", help="also write the raw results to this file")
    args = parser.parse_args()
    data = Path(args.dir)
    data.mkdir(parents=True, exist_ok=True)
    cfg = BenchConfig(
        objects=args.objects,
        size=OBJECT_BYTES,
        batch=args.batch,
        exists_keys=args.exists_keys,
        threads=args.threads,
    )
    cold = drop_page_cache()
    results: dict[str, Any] = {"objects": cfg.objects, "object_bytes": cfg.size, "cold": cold,
                               "load_start": os.getloadavg()[0]}
    steps: list[tuple[str, Any]] = [
        ("raw O_DIRECT", lambda: raw(cfg, data / "raw")),
        (
            "hicache-store file (O_DIRECT, durability=data)",
            lambda: ours(cfg, data / "ours", durability="data"),
        ),
        (
            "hicache-store file (buffered, durability=data)",
            lambda: ours(cfg, data / "ours-buf", durability="data", direct_io="never"),
        ),
    ]
    if not args.skip_peers:
        steps += [
            (
                "SGLang HiCacheFile",
                lambda: peer("sglang", cfg, data / "sglang", args.peer_python, args.exists_keys),
            ),
            (
                "LMCache LocalDiskBackend",
                lambda: peer("lmcache", cfg, data / "lmcache", args.peer_python, args.exists_keys),
            ),
        ]
    steps.append(("raw O_DIRECT (end of run)", lambda: raw(cfg, data / "raw2")))
    systems: dict[str, dict[str, Any]] = {}
    for name, step in steps:
        print(f"... {name}", file=sys.stderr, flush=True)
        systems[name] = step()
    results["systems"] = systems
    print("... exists", file=sys.stderr, flush=True)
    results["exists"] = exists_figures(data / "exists", args.exists_keys)
    results["load_end"] = os.getloadavg()[0]
    text = render(results, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.write_md:
        log_run(text)
    return 0


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    systems = results["systems"]
    n, size = results["objects"], results["object_bytes"]
    cmd = f".venv/bin/python bench/bench_backend.py --objects {n} --write-md"
    lines = [
        "## Backends",
        "",
        f"Command (as root, so the page cache can be dropped): `{cmd}`. One run, side by side, "
        f"{n} objects of {size >> 20} MiB on the same filesystem (ext4 on the VM's virtio disk), "
        f'warm memory, batches of {args.batch} objects. GB/s = 10^9 bytes/s. "durable write": '
        "the data is on the device when the measured call returns (hicache-store: "
        "`durability=data`, an fdatasync per object before its rename; the peers do not flush, so "
        "their figure includes an `os.sync()` after the last call; raw: fdatasync per file). "
        '"as returned": the same without that sync. "cold read": page cache dropped first '
        f"(`sync; echo 3 > /proc/sys/vm/drop_caches`; dropped: {results['cold']}). Raw = "
        f"{args.threads} threads of O_DIRECT `pwrite`/`preadv` of the same bytes. \"second read\" "
        "and \"warm read\": the same objects read a second and a third time. The peers' buffered "
        "cold read fills the page cache, so their second read is already warm; hicache-store "
        "reads cold bytes with O_DIRECT (the cache stays as it was) and reads a key buffered on "
        "its second cold read (`page_cache=second`), so its third read is the first from the "
        "page cache. Load average "
        f"(other work on the 2 cores) {results['load_start']:.1f} at the start, "
        f"{results['load_end']:.1f} at the end.",
        "",
        "| system | durable write | write as returned | cold read | second read | warm read | "
        "range read (1/4) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in systems.items():

        def cell(key: str, m: dict[str, Any] = m) -> str:
            value = m.get(key)
            return f"{value:.2f}" if isinstance(value, float) else "-"

        lines.append(
            f"| {name} | {cell('write')} | {cell('write_returned')} | "
            f"{cell('cold_read')} | {cell('second_read')} | {cell('warm_read')} | "
            f"{cell('range_read')} |"
        )
    ours_d = systems["hicache-store file (O_DIRECT, durability=data)"]
    raw0 = systems["raw O_DIRECT"]
    lines += ["", "Ratios (hicache-store file with O_DIRECT, `durability=data`):", ""]
    lines.append(
        f"- against raw O_DIRECT: durable write {ours_d['write'] / raw0['write']:.2f}, "
        f"cold read {ours_d['cold_read'] / raw0['cold_read']:.2f}"
    )
    for peer_name in ("SGLang HiCacheFile", "LMCache LocalDiskBackend"):
        if peer_name in systems:
            p = systems[peer_name]
            lines.append(
                f"- against {peer_name}: durable write {ours_d['write'] / p['write']:.2f}x, "
                f"cold read {ours_d['cold_read'] / p['cold_read']:.2f}x, "
                f"write as returned {ours_d['write_returned'] / p['write_returned']:.2f}x, "
                f"warm read {ours_d['warm_read'] / p['warm_read']:.2f}x"
            )
    peers = [systems[p] for p in ("SGLang HiCacheFile", "LMCache LocalDiskBackend")
             if p in systems]
    if peers:
        fastest = max(p["warm_read"] for p in peers)
        lines.append(f"- warm read against the faster peer's: {ours_d['warm_read'] / fastest:.2f}x")
    ex = results["exists"]
    keys = args.exists_keys
    lines += [
        "",
        f"Exists over {keys:,} keys (all present; `exists_prefix_length`, which is what an engine's "
        "`batch_exists` returns):",
        "",
        "| case | ms | keys/s |",
        "|---|---|---|",
    ]
    rows = [
        ("hicache-store, in the writing process", ex["same_process_s"]),
        ("hicache-store, fresh process (the shared index)", ex["restart_s"]),
        (
            "hicache-store, keys another process wrote after we opened",
            ex["other_writer_s"],
        ),
    ]
    sg = systems.get("SGLang HiCacheFile")
    if sg:
        rows.append(("SGLang HiCacheFile.batch_exists", sg["exists_s"]))
    for label, seconds in rows:
        lines.append(f"| {label} | {seconds * 1e3:.1f} | {keys / seconds:,.0f} |")
    lines.append("")
    lines.append(
        f"Opening the store ({ex['restart_open_objects']:,} objects) in the fresh process took "
        f"{ex['restart_open_s'] * 1e3:.0f} ms."
    )
    if sg:
        lines.append(
            f"Ratio against SGLang `batch_exists`: {sg['exists_s'] / ex['same_process_s']:.1f}x "
            f"(same process), {sg['exists_s'] / ex['restart_s']:.1f}x (fresh process), "
            f"{sg['exists_s'] / ex['other_writer_s']:.1f}x (another writer's keys)."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
