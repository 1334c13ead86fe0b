"""Sealed (tenant key ring) against plain KV on the file backend, side by side in one run.

Run as root (to drop the page cache) from the repository root::

    .venv/bin/python bench/bench_tenant.py --pages 256 --rounds 3 --write-md

The SGLang adapter (``batch_set_v1`` / ``batch_get_v1``, the data path an engine uses) moves
the same page_first MHA host pool (8 MiB pages: 2 x 32 layers x 64 tokens x 8 KV heads x 128 x
bf16) to ``file://`` with ``durability=data`` (on the device when the call returns) and back
after ``sync; echo 3 > /proc/sys/vm/drop_caches``, once plain and once with
``tenant_key_file`` (keyed names, AES-256-GCM per layer block, encrypted in place in the
staging buffer), alternating in each round so both see the same machine state. Every read is
checked bit-exact. Also measured: the AEAD alone (one thread, in place, 8 MiB objects of 32
layer blocks), which bounds what sealing can cost. ``--write-md`` appends a dated "Tenant
sealing"
section to the run log (docs/benchmarks/log.md).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _markdown import log_run
from bench_sglang import BATCH, PAGE_SIZE, PageFirstPool, storage_config, timed

from hicache_store.backends import aligned_buffer
from hicache_store.commands.bench_backend import drop_page_cache
from hicache_store.integrations.sglang import HiCacheStoreStorage
from hicache_store.layout import sealing
from hicache_store.tenant import new_ring_text

ROOT = Path(__file__).resolve().parent.parent
SECTION = "Tenant sealing"


#: thread name prefixes -> the group their CPU time is reported under; threads Python does
#: not know (torch's intra-op pool, which runs the relayout copies) are "native".
GROUPS = (("hicache-seal", "seal/verify"), ("hicache-file", "file I/O"),
          ("hicache-store-sync-bridge", "event loop"), ("MainThread", "caller"))
_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads so far, by ``GROUPS`` (else "native",
    or "other" for the remaining Python threads)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
        name = names.get(int(task.name))
        group = "native" if name is None else next(
            (g for prefix, g in GROUPS if name.startswith(prefix)), "other")
        out[group] = out.get(group, 0.0) + seconds
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {g: after[g] - before.get(g, 0.0) for g in after}


def run(pool: PageFirstPool, keys: list[str], where: Path, snapshot: torch.Tensor,
        ring: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "backend_name": "hicache_store", "module_path": "hicache_store.integrations.sglang",
        "class_name": "HiCacheStoreStorage", "interface_v1": 1, "url": f"file://{where}",
        "backend_options": {"durability": "data"},
    }
    if ring is not None:
        extra["tenant_key_file"] = ring
    store = HiCacheStoreStorage(storage_config(extra), {})
    store.register_mem_pool_host(pool)
    n = len(keys)

    def batches(fn: Any) -> None:
        for s in range(0, n, BATCH):
            e = min(s + BATCH, n)
            assert all(fn(keys[s:e], torch.arange(s * PAGE_SIZE, e * PAGE_SIZE)))

    cpu0, threads0 = time.process_time(), thread_cpu()
    out: dict[str, Any] = {"write_s": timed(lambda: batches(store.batch_set_v1))}
    out["write_cpu_s"] = time.process_time() - cpu0
    out["write_threads"] = cpu_delta(threads0, thread_cpu())
    assert store.batch_exists(keys) == n
    pool.kv_buffer.zero_()
    out["cold"] = drop_page_cache()
    cpu0, threads0 = time.process_time(), thread_cpu()
    out["cold_read_s"] = timed(lambda: batches(store.batch_get_v1))
    out["read_cpu_s"] = time.process_time() - cpu0
    out["read_threads"] = cpu_delta(threads0, thread_cpu())
    out["exact"] = torch.equal(pool.kv_buffer.view(torch.int16), snapshot)
    out["tamper"] = store.counters.get("tamper", 0)
    store.close()
    return out


def aead_alone(objects: int = 32, blocks: int = 32, block: int = 256 << 10) -> dict[str, float]:
    """GB/s of sealing and of opening 8 MiB payloads in place, one thread: per second of
    wall time and per CPU-second of the thread (the cipher's cost, whatever the load)."""
    key = sealing.TenantKey(os.urandom(32))
    buf = np.frombuffer(aligned_buffer(blocks * block, populate=True), dtype=np.uint8)
    buf[:] = 7
    view = memoryview(buf).cast("B")
    aad = sealing.associated_data("0" * 64, bytes(144))
    seal_s = open_s = seal_cpu = open_cpu = 0.0
    for _ in range(objects):
        salt = os.urandom(sealing.SALT_BYTES)
        t0, c0 = time.perf_counter(), time.thread_time()
        tags = sealing.seal_blocks(key.object_cipher_key(salt), aad, view, blocks)
        t1, c1 = time.perf_counter(), time.thread_time()
        sealing.open_blocks(key.object_cipher_key(salt), aad, view, tags, first_block=0)
        open_s += time.perf_counter() - t1
        open_cpu += time.thread_time() - c1
        seal_s += t1 - t0
        seal_cpu += c1 - c0
    gb = objects * blocks * block / 1e9
    return {"seal": gb / seal_s, "open": gb / open_s,
            "seal_cpu": gb / seal_cpu, "open_cpu": gb / open_cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=ROOT / ".build" / "bench-tenant")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--write-md", action="store_true")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    ring = args.dir / f"tenant-{os.getpid()}.keys"
    ring.write_text(new_ring_text())
    ring.chmod(0o600)
    pool = PageFirstPool(args.pages)
    snapshot = pool.kv_buffer.view(torch.int16).clone()
    page_bytes = pool.kv_buffer[:, :PAGE_SIZE].numel() * pool.kv_buffer.element_size()
    total = args.pages * page_bytes
    load0 = os.getloadavg()[0]
    aead = aead_alone()
    rows: dict[str, list[dict[str, Any]]] = {"plain": [], "sealed": []}
    try:
        for r in range(args.rounds):
            order = ("plain", "sealed") if r % 2 == 0 else ("sealed", "plain")
            for name in order:
                where = args.dir / f"{name}-{r}-{os.getpid()}"
                shutil.rmtree(where, ignore_errors=True)
                keys = [hashlib.sha256(f"{name}-{r}-{i}".encode()).hexdigest()
                        for i in range(args.pages)]
                pool.kv_buffer.view(torch.int16).copy_(snapshot)
                try:
                    result = run(pool, keys, where, snapshot,
                                 str(ring) if name == "sealed" else None)
                finally:
                    shutil.rmtree(where, ignore_errors=True)
                print(name, r, {k: round(v, 3) if isinstance(v, float) else
                                {g: round(c, 2) for g, c in v.items()} if isinstance(v, dict)
                                else v for k, v in result.items()}, file=sys.stderr)
                rows[name].append(result)
    finally:
        ring.unlink(missing_ok=True)
    load1 = os.getloadavg()[0]
    md = render(args, rows, total, page_bytes, aead, load0, load1)
    print(md)
    if args.write_md:
        log_run(md)
    return 0


def render(args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]], total: int,
           page_bytes: int, aead: dict[str, float], load0: float, load1: float) -> str:
    def gbps(name: str, key: str) -> list[float]:
        return [total / row[key] / 1e9 for row in rows[name]]

    exact = all(row["exact"] for rs in rows.values() for row in rs)
    cold = all(row["cold"] for rs in rows.values() for row in rs)
    tamper = sum(row["tamper"] for rs in rows.values() for row in rs)
    gb = total / 1e9
    lines = [
        f"## {SECTION}",
        "",
        f"Command (as root): `.venv/bin/python bench/bench_tenant.py --pages {args.pages} "
        f"--rounds {args.rounds} --write-md`. The SGLang adapter (`batch_set_v1`/`batch_get_v1`) "
        f"on `file://` with `durability=data`, {args.pages} pages of {page_bytes >> 20} MiB "
        f"({gb:.2f} GB; page_first MHA, 32 layers x 64 tokens x 8 KV heads x 128 x bf16), "
        "batches of 128, plain and sealed (`tenant_key_file`: keyed names, AES-256-GCM per "
        "layer block, in place in the staging buffer, on worker threads) alternating in each "
        "round. Durable write: on the device when the call returns. Cold read: after `sync; "
        f"echo 3 > /proc/sys/vm/drop_caches` (dropped: {cold}). Every read bit-exact: {exact}; "
        f"tamper events: {tamper}. GB/s = 10^9 bytes/s of KV. Load average {load0:.1f} at the "
        f"start, {load1:.1f} at the end ({os.cpu_count()} vCPUs, shared).",
        "",
        "| round | plain write | sealed write | plain cold read | sealed cold read |",
        "|---|---|---|---|---|",
    ]
    pw, sw = gbps("plain", "write_s"), gbps("sealed", "write_s")
    pr, sr = gbps("plain", "cold_read_s"), gbps("sealed", "cold_read_s")
    for r in range(len(pw)):
        lines.append(f"| {r + 1} | {pw[r]:.2f} | {sw[r]:.2f} | {pr[r]:.2f} | {sr[r]:.2f} |")
    med = statistics.median
    lines.append(f"| median | {med(pw):.2f} | {med(sw):.2f} | {med(pr):.2f} | {med(sr):.2f} |")

    def per_gb(name: str, key: str, group: str | None = None) -> float:
        if group is None:
            return med(row[key] for row in rows[name]) / gb
        return med(row[key].get(group, 0.0) for row in rows[name]) / gb

    groups = [g for _, g in GROUPS] + ["native", "other"]
    lines += [
        "",
        "CPU-seconds per GB of KV (medians; process total, then by thread):",
        "",
        "| | total | " + " | ".join(groups) + " |",
        "|---|---|" + "---|" * len(groups),
    ]
    for name, op, cpu_key, thread_key in (
        ("plain", "write", "write_cpu_s", "write_threads"),
        ("sealed", "write", "write_cpu_s", "write_threads"),
        ("plain", "cold read", "read_cpu_s", "read_threads"),
        ("sealed", "cold read", "read_cpu_s", "read_threads"),
    ):
        lines.append(f"| {name} {op} | {per_gb(name, cpu_key):.3f} | " + " | ".join(
            f"{per_gb(name, thread_key, g):.3f}" for g in groups) + " |")
    lines += [
        "",
        f"Sealed throughput as a share of plain (medians): durable write "
        f"{med(sw) / med(pw):.0%}, cold read {med(sr) / med(pr):.0%}; per round, write "
        + ", ".join(f"{s / p:.0%}" for s, p in zip(sw, pw, strict=True))
        + "; cold read "
        + ", ".join(f"{s / p:.0%}" for s, p in zip(sr, pr, strict=True))
        + f". Sealing adds {per_gb('sealed', 'write_cpu_s') - per_gb('plain', 'write_cpu_s'):.3f}"
        f" CPU-s/GB to writing and "
        f"{per_gb('sealed', 'read_cpu_s') - per_gb('plain', 'read_cpu_s'):.3f} to reading. "
        f"The AEAD alone, one thread, in place on 8 MiB objects of 32 blocks: seal "
        f"{aead['seal']:.2f} GB/s, open {aead['open']:.2f} GB/s of wall time; "
        f"{aead['seal_cpu']:.2f} and {aead['open_cpu']:.2f} GB per CPU-second of the thread "
        f"({1 / aead['seal_cpu']:.3f} and {1 / aead['open_cpu']:.3f} CPU-s/GB).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
