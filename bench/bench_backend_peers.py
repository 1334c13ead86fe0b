"""Drive SGLang's HiCacheFile and LMCache's LocalDiskBackend the way their engines do.

Runs in the peer interpreter (``.build/bench-venv``, see ``../shared/notes/peer-packages.md``),
never in hicache-store's own environment; ``bench_backend.py`` starts it once per system and
reads one JSON object from its stdout. Standalone on purpose: it imports only torch, numpy and
the peer package.

- ``sglang``: a page_first host pool ``(2, tokens, layers, heads, dim)``; writes are SGLang's
  generic controller path (``get_data_page`` gather copy per page, then ``batch_set`` of 128
  pages), reads likewise (``get_dummy_flat_data_page`` per page, ``batch_get``, then
  ``set_from_flat_data_page`` scatter copy); exists is ``batch_exists`` over 10,000 keys.
- ``lmcache``: ``LocalDiskBackend`` over a ``LocalCPUBackend`` with a ``HostMemoryAllocator``;
  writes copy each page into an allocated memory object and ``batched_submit_put_task`` it
  (waiting for the batch to land), reads are ``batched_get_blocking`` then a copy into the pool;
  exists is ``contains`` per key.

"Durable" write = the calls returned and then ``os.sync()`` finished (neither peer flushes).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import threading
import time

import torch

PAGE_SIZE, LAYERS, HEADS, DIM = 64, 32, 8, 128  # bf16: 8 MiB per page
DTYPE = torch.bfloat16


def drop_caches() -> bool:
    # A copy of hicache_store.commands.bench_backend.drop_page_cache: this script runs in the
    # peer interpreter, where hicache-store is not installed.
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def page_keys(n: int, salt: str) -> list[str]:
    return [hashlib.sha256(f"{salt}-{i}".encode()).hexdigest() for i in range(n)]


class PageFirstPool:
    """A stand-in for SGLang's MHATokenToKVPoolHost in the page_first layout."""

    def __init__(self, pages: int) -> None:
        self.kv_buffer = torch.empty((2, pages * PAGE_SIZE, LAYERS, HEADS, DIM), dtype=DTYPE)
        self.kv_buffer.view(torch.int16).random_(-30000, 30000)  # touch (pre-fault) every page

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + PAGE_SIZE, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, LAYERS, PAGE_SIZE, HEADS, DIM), dtype=DTYPE).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index : index + PAGE_SIZE, :, :, :] = data_page.reshape(
            2, PAGE_SIZE, LAYERS, HEADS, DIM
        )


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_sglang(args: argparse.Namespace) -> dict[str, object]:
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    def make(path: str) -> HiCacheFile:
        cfg = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name="bench",
            extra_config={"file_storage_path": path},
        )
        return HiCacheFile(cfg, file_path=path)

    n, batch = args.objects, 128  # STORAGE_BATCH_SIZE of SGLang's controller
    pool = PageFirstPool(n)
    store = make(os.path.join(args.dir, "pages"))
    keys = page_keys(n, "sglang")

    def write() -> None:
        for s in range(0, n, batch):
            data = [pool.get_data_page(i * PAGE_SIZE) for i in range(s, min(s + batch, n))]
            assert store.batch_set(keys[s : s + batch], data)

    def read() -> None:
        for s in range(0, n, batch):
            ks = keys[s : s + batch]
            dummies = [pool.get_dummy_flat_data_page() for _ in ks]
            pages = store.batch_get(ks, dummies)
            for j, page in enumerate(pages):
                assert page is not None
                pool.set_from_flat_data_page((s + j) * PAGE_SIZE, page)

    out: dict[str, object] = {"system": "sglang HiCacheFile (generic controller path)"}
    out["write_returned_s"] = timed(write)
    out["write_durable_s"] = out["write_returned_s"] + timed(os.sync)  # type: ignore[operator]
    out["cold"] = drop_caches()
    out["cold_read_s"] = timed(read)
    out["second_read_s"] = timed(read)
    out["warm_read_s"] = timed(read)
    out.update(sglang_exists(make, args))
    return out


def sglang_exists(make, args: argparse.Namespace) -> dict[str, object]:  # type: ignore[no-untyped-def]
    store = make(os.path.join(args.dir, "exists"))
    keys = page_keys(args.exists_keys, "exists")
    tiny = torch.zeros(2048, dtype=DTYPE)
    for s in range(0, len(keys), 128):
        store.batch_set(keys[s : s + 128], [tiny] * len(keys[s : s + 128]))
    t0 = time.perf_counter()
    hits = store.batch_exists(keys)
    seconds = time.perf_counter() - t0
    assert hits == len(keys), hits
    return {"exists_s": seconds, "exists_keys": len(keys)}


def bench_lmcache(args: argparse.Namespace) -> dict[str, object]:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    n, batch = args.objects, args.batch
    size = 2 * LAYERS * PAGE_SIZE * HEADS * DIM * 2
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=PAGE_SIZE,
        local_cpu=False,
        local_disk=os.path.join(args.dir, "pages"),
        max_local_disk_size=(n * size * 2 + (1 << 30)) / 1024**3,
        extra_config={"disk_io_threads": args.threads},
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    allocator = HostMemoryAllocator(size=3 * batch * size)
    cpu = LocalCPUBackend(cfg, memory_allocator=allocator, dst_device="cpu")
    disk = LocalDiskBackend(cfg, loop, cpu, dst_device="cpu")
    pool = PageFirstPool(n)
    shape = torch.Size([2, LAYERS, PAGE_SIZE, HEADS * DIM])

    def key(i: int) -> CacheEngineKey:
        return CacheEngineKey("bench", 1, 0, i, DTYPE)

    keys = [key(i) for i in range(n)]

    def write() -> None:
        for s in range(0, n, batch):
            ks = keys[s : s + batch]
            objs = []
            for j in range(len(ks)):
                obj = cpu.allocate(shape, DTYPE, MemoryFormat.KV_2LTD)
                assert obj is not None
                assert obj.tensor is not None
                # What LMCache's connector does from the paged KV: one copy into the object.
                obj.tensor.view(-1).copy_(pool.get_data_page((s + j) * PAGE_SIZE))
                objs.append(obj)
            disk.batched_submit_put_task(ks, objs)
            for obj in objs:
                obj.ref_count_down()
            while not all(disk.contains(k) for k in ks):
                time.sleep(0.0005)

    def read() -> None:
        for s in range(0, n, batch):
            ks = keys[s : s + batch]
            objs = disk.batched_get_blocking(ks)
            for j, obj in enumerate(objs):
                assert obj is not None
                assert obj.tensor is not None
                pool.set_from_flat_data_page((s + j) * PAGE_SIZE, obj.tensor.view(-1))
                obj.ref_count_down()

    out: dict[str, object] = {"system": f"LMCache LocalDiskBackend ({args.threads} io threads)"}
    out["write_returned_s"] = timed(write)
    out["write_durable_s"] = out["write_returned_s"] + timed(os.sync)  # type: ignore[operator]
    out["cold"] = drop_caches()
    out["cold_read_s"] = timed(read)
    out["second_read_s"] = timed(read)
    out["warm_read_s"] = timed(read)
    t0 = time.perf_counter()
    hits = sum(disk.contains(k) for k in keys)
    out["exists_in_memory_s"] = time.perf_counter() - t0
    out["exists_in_memory_keys"] = hits
    disk.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=("sglang", "lmcache"))
    parser.add_argument("--dir", required=True)
    parser.add_argument("--objects", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--exists-keys", type=int, default=10_000)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    result = bench_sglang(args) if args.system == "sglang" else bench_lmcache(args)
    result["object_bytes"] = 2 * LAYERS * PAGE_SIZE * HEADS * DIM * 2
    result["objects"] = args.objects
    print(json.dumps(result), file=sys.stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
