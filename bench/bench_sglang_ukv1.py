"""The SGLang adapter's two keyspaces on the same pages: framed objects vs SGLang's bare ones.

Run as root (to drop the page cache) from the repository root, with sglang installed::

    .venv/bin/python bench/bench_sglang_ukv1.py --pages 128 --rounds 3

The pool and the batches are ``bench_sglang.py``'s (page_first MHA, 8 MiB pages, batches of 128
pages, ``file://`` with ``durability=data``). One side stores this library's framed objects
(``key_scheme: hicache``: a 4 KiB header with per-layer xxh3 checksums, written and verified),
the other SGLang's bare ``page-unified-v1`` objects (``key_scheme: sglang-ukv1``: the payload
only, nothing computed or checked). Rounds alternate; the best of each is kept. Every read is
checked bit-exact against the pool's bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sglang import (
    BATCH,
    DTYPE,
    HEADS,
    LAYERS,
    PAGE_SIZE,
    ROOT,
    PageFirstPool,
    storage_config,
    timed,
)

from hicache_store.commands.bench_backend import drop_page_cache
from hicache_store.integrations.sglang import HiCacheStoreStorage

SCHEMES = ("hicache", "sglang-ukv1")
DIM_BYTES = 128 * DTYPE.itemsize  # one head's vector


def run(scheme: str, pool: PageFirstPool, keys: list[str], where: Path,
        snapshot: torch.Tensor) -> dict[str, Any]:
    extra = {"backend_name": "hicache_store", "module_path": "hicache_store.integrations.sglang",
             "class_name": "HiCacheStoreStorage", "interface_v1": 1, "url": f"file://{where}",
             "backend_options": {"durability": "data"}, "key_scheme": scheme}
    store = HiCacheStoreStorage(storage_config(extra), {})
    store.register_mem_pool_host(pool)
    n = len(keys)

    def batches(fn: Any) -> None:
        for s in range(0, n, BATCH):
            e = min(s + BATCH, n)
            assert all(fn(keys[s:e], torch.arange(s * PAGE_SIZE, e * PAGE_SIZE)))

    out: dict[str, Any] = {"write_s": timed(lambda: batches(store.batch_set_v1))}
    pool.kv_buffer.zero_()
    out["cold"] = drop_page_cache()
    out["cold_read_s"] = timed(lambda: batches(store.batch_get_v1))
    out["exact"] = torch.equal(pool.kv_buffer.view(torch.int16), snapshot)
    out["warm_read_s"] = timed(lambda: batches(store.batch_get_v1))
    out["objects"] = sum(1 for p in where.rglob("*") if p.is_file())
    store.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=ROOT / ".build" / "bench-ukv1")
    args = parser.parse_args()
    pool = PageFirstPool(args.pages)
    snapshot = pool.kv_buffer.view(torch.int16).clone()
    total = args.pages * 2 * LAYERS * PAGE_SIZE * HEADS * DIM_BYTES
    load0 = os.getloadavg()[0]
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEMES}
    for r in range(args.rounds):
        for scheme in SCHEMES:
            where = args.dir / f"{scheme}-{r}-{os.getpid()}"
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            keys = [hashlib.sha256(f"{scheme}-{r}-{i}".encode()).hexdigest()
                    for i in range(args.pages)]
            pool.kv_buffer.view(torch.int16).copy_(snapshot)
            try:
                rows[scheme].append(run(scheme, pool, keys, where, snapshot))
            finally:
                shutil.rmtree(where, ignore_errors=True)
            print(scheme, r, rows[scheme][-1], file=sys.stderr)
    load1 = os.getloadavg()[0]
    print(f"{args.pages} pages of {total // args.pages >> 20} MiB, best of {args.rounds} "
          f"alternating rounds, load average {load0:.1f} -> {load1:.1f}")
    print("| key scheme (objects) | write GB/s (durable) | cold read GB/s | warm read GB/s |")
    print("|---|---|---|---|")
    for scheme in SCHEMES:
        best = {m: total / min(row[m] for row in rows[scheme]) / 1e9
                for m in ("write_s", "cold_read_s", "warm_read_s")}
        label = "hicache (framed)" if scheme == "hicache" else "sglang-ukv1 (bare)"
        print(f"| {label} | {best['write_s']:.2f} | {best['cold_read_s']:.2f} | "
              f"{best['warm_read_s']:.2f} |")
    exact = all(row["exact"] for rs in rows.values() for row in rs)
    cold = all(row["cold"] for rs in rows.values() for row in rs)
    print(f"bit-exact: {exact}; page cache dropped before cold reads: {cold}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
