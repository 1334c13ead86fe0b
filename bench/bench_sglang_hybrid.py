"""Mamba state snapshots through the SGLang adapter's v2 path against SGLang's own HiCacheFile.

Run as root (to drop the page cache) from the repository root, with sglang installed in the
venv::

    .venv/bin/python bench/bench_sglang_hybrid.py --states 64 --rounds 2

One SGLang 0.5.23 ``MambaPoolHost`` (page_first, built on CPU by the tests' harness
``tests/sglang/sglang_cpu.py``): ``--states`` slots of 16 layers x (float32 temporal state
16 x 64 x 64 + bfloat16 conv state 2048 x 4), 4.25 MiB per state. Each state is moved in its
own ``batch_set_v2`` / ``batch_get_v2`` call, one ``PoolTransfer(MAMBA)`` of one key, as SGLang's
controller backs up and prefetches one radix node's state:

* hicache-store: ``HiCacheStoreStorage`` on ``file://`` (``durability=data``: on disk when the
  call returns), one framed, checksummed object per state, verified on read;
* SGLang ``HiCacheFile``: its own ``batch_set_v2`` / ``batch_get_v2`` (``get_data_page`` then
  a raw file; ``get`` into a dummy page then ``set_from_flat_data_page``); it does not flush,
  so its durable figure adds an ``os.sync()``.

Cold reads follow ``sync; echo 3 > /proc/sys/vm/drop_caches``; every read is checked
bit-exact against the pool's bytes before it was cleared. Prints a Markdown table (GB/s of
state bytes, best of ``--rounds``, the two alternating in each round).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_sglang import storage_config, timed

from hicache_store.commands.bench_backend import drop_page_cache

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "sglang"))
import sglang_cpu  # noqa: E402

LAYERS, HEADS, DIM, CONV = 16, 16, 64, (2048, 4)


def transfer(names: Any, slot: int, key: str) -> Any:
    return names.PoolTransfer(
        name=names.PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=[key],
        hit_policy=names.PoolHitPolicy.TRAILING_PAGES,
    )


def run(store: Any, pool: Any, keys: list[str], snapshot: torch.Tensor, *,
        flushes: bool) -> dict[str, Any]:
    names = sglang_cpu.module("sglang.srt.mem_cache.hicache_storage")
    n = len(keys)

    def write() -> None:
        for slot, key in enumerate(keys):
            assert store.batch_set_v2([transfer(names, slot, key)])[names.PoolName.MAMBA] == [True]

    def read() -> None:
        for slot, key in enumerate(keys):
            assert store.batch_get_v2([transfer(names, slot, key)])[names.PoolName.MAMBA] == [True]

    out: dict[str, Any] = {"write_returned_s": timed(write)}
    out["write_durable_s"] = out["write_returned_s"] + (0.0 if flushes else timed(os.sync))
    for buf in pool.kv_buffer:
        buf.zero_()
    out["cold"] = drop_page_cache()
    out["cold_read_s"] = timed(read)
    out["exact"] = torch.equal(_pool_bytes(pool, n), snapshot)
    out["warm_read_s"] = timed(read)
    return out


def _pool_bytes(pool: Any, n: int) -> torch.Tensor:
    return torch.cat([pool.get_data_page(i, flat=True).view(torch.uint8) for i in range(n)])


def ours(pool: Any, where: Path) -> Any:
    from hicache_store.integrations.sglang import HiCacheStoreStorage

    names = sglang_cpu.module("sglang.srt.mem_cache.hicache_storage")
    _kv_device, kv_host = sglang_cpu.kv_host_pool(sglang_cpu.Geometry(), "page_first")
    extra = sglang_cpu.extra_config(f"file://{where}", backend_options={"durability": "data"})
    store = HiCacheStoreStorage(storage_config(extra), {})
    store.register_mem_pool_host(kv_host)
    store.register_mem_host_pool_v2(kv_host, names.PoolName.KV)
    store.register_mem_host_pool_v2(pool, names.PoolName.MAMBA)
    return store


def theirs(pool: Any, where: Path) -> Any:
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    names = sglang_cpu.module("sglang.srt.mem_cache.hicache_storage")
    store = names.HiCacheFile(
        storage_config({"file_storage_path": str(where)}), file_path=str(where)
    )
    store.register_mem_host_pool_v2(pool, names.PoolName.MAMBA)
    return store


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: tmp)")
    args = parser.parse_args()
    error = sglang_cpu.load()
    if error is not None:
        print(f"SGLang does not import: {error}", file=sys.stderr)
        return 2
    _device, pool = sglang_cpu.mamba_host_pool(
        LAYERS, args.states, heads=HEADS, dim=DIM, conv=CONV
    )
    n = args.states
    for slot in range(n):
        data = sglang_cpu.random_bytes(pool.size_per_token, slot)
        pool.set_from_flat_data_page(slot, data)
    snapshot = _pool_bytes(pool, n).clone()
    get_hash_str = sglang_cpu.module("sglang.srt.mem_cache.utils").get_hash_str
    keys = list(get_hash_str(sglang_cpu.tokens_for(n, 1, seed=9), None, page_size=1))
    state_bytes = int(pool.size_per_token)
    best: dict[str, dict[str, float]] = {}
    load_start = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, make, flushes in (("ours", ours, True), ("hicachefile", theirs, False)):
            where = Path(tempfile.mkdtemp(prefix=f"hyb-{name}-", dir=args.dir))
            try:
                store = make(pool, where)
                out = run(store, pool, keys, snapshot, flushes=flushes)
                if hasattr(store, "close"):
                    store.close()
            finally:
                shutil.rmtree(where, ignore_errors=True)
            assert out["exact"], f"{name}: a read was not bit-exact"
            row = best.setdefault(name, {})
            for k in ("write_durable_s", "write_returned_s", "cold_read_s", "warm_read_s"):
                gbps = n * state_bytes / out[k] / 1e9
                row[k] = max(row.get(k, 0.0), gbps)
            row["cold"] = float(out["cold"])
    print(f"{n} states of {state_bytes / 2**20:.2f} MiB, one per call; best of {args.rounds}; "
          f"cold caches dropped: {bool(best['ours']['cold'])}; all exact: True; load average "
          f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("| system | durable write | write as returned | cold read | warm read |")
    print("|---|---|---|---|---|")
    for name, label in (("ours", "hicache-store SGLang adapter (file)"),
                        ("hicachefile", "SGLang HiCacheFile")):
        r = best[name]
        print(f"| {label} | {r['write_durable_s']:.2f} | {r['write_returned_s']:.2f} | "
              f"{r['cold_read_s']:.2f} | {r['warm_read_s']:.2f} |")
    return 0


if __name__ == "__main__":
    started = time.time()
    code = main()
    print(f"({time.time() - started:.0f} s)", file=sys.stderr)
    raise SystemExit(code)
