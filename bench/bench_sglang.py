"""The SGLang adapter against SGLang's own HiCacheFile, on the same host-pool pages, in one run.

Run as root (to drop the page cache) from the repository root, with sglang installed in the
venv (``pip install --no-deps sglang==0.5.23`` plus its small imports)::

    .venv/bin/python bench/bench_sglang.py --pages 256 --write-md

Both sides move the same pages of one page_first MHA host pool (2 x 32 layers x 64 tokens x
8 KV heads x 128 x bf16 = 8 MiB per page) in batches of 128 pages (SGLang's
``STORAGE_BATCH_SIZE``), the way SGLang's cache controller drives each:

* hicache-store: ``HiCacheStoreStorage.batch_set_v1`` / ``batch_get_v1`` (the ``interface_v1``
  path) on ``file://`` with ``durability=data`` (each object fdatasync-ed before its rename);
* SGLang ``HiCacheFile`` (``--hicache-storage-backend file``): the controller's generic path,
  ``get_data_page`` copies then ``batch_set``; reads ``batch_get`` into fresh dummy pages then
  ``set_from_flat_data_page``. It does not flush, so its durable figure adds an ``os.sync()``.

Cold reads follow ``sync; echo 3 > /proc/sys/vm/drop_caches``. Every read is checked bit-exact
against the pool's bytes before the pool was cleared. ``--write-md`` appends a dated "SGLang"
section to the run log (docs/benchmarks/log.md).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _markdown import log_run

from hicache_store.commands.bench_backend import drop_page_cache
from hicache_store.integrations.sglang import HiCacheStoreStorage

ROOT = Path(__file__).resolve().parent.parent
PAGE_SIZE, LAYERS, HEADS, DIM = 64, 32, 8, 128
DTYPE = torch.bfloat16
BATCH = 128


class PageFirstPool:
    """SGLang's MHATokenToKVPoolHost in the page_first layout, as the controller uses it."""

    def __init__(self, pages: int) -> None:
        self.layout = "page_first"
        self.page_size = PAGE_SIZE
        self.dtype = DTYPE
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, DIM
        self.start_layer, self.end_layer = 0, LAYERS
        self.size = pages * PAGE_SIZE
        self.kv_buffer = torch.empty((2, self.size, LAYERS, HEADS, DIM), dtype=DTYPE)
        self.kv_buffer.view(torch.int16).random_(-30000, 30000)

    # the generic path (same code as SGLang's HostKVCache for page_first)
    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + PAGE_SIZE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, LAYERS, PAGE_SIZE, HEADS, DIM), dtype=DTYPE).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index : index + PAGE_SIZE] = data_page.reshape(
            2, PAGE_SIZE, LAYERS, HEADS, DIM
        )


def storage_config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/model", extra_config=extra,
    )


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_ours(pool: PageFirstPool, keys: list[str], where: Path, snapshot: torch.Tensor) -> dict[str, Any]:
    extra = {
        "backend_name": "hicache_store",
        "module_path": "hicache_store.integrations.sglang",
        "class_name": "HiCacheStoreStorage",
        "interface_v1": 1,
        "url": f"file://{where}",
        "backend_options": {"durability": "data"},
    }
    store = HiCacheStoreStorage(storage_config(extra), {})
    store.register_mem_pool_host(pool)
    n = len(keys)

    def write() -> None:
        for s in range(0, n, BATCH):
            e = min(s + BATCH, n)
            idx = torch.arange(s * PAGE_SIZE, e * PAGE_SIZE)
            assert all(store.batch_set_v1(keys[s:e], idx))

    def read() -> None:
        for s in range(0, n, BATCH):
            e = min(s + BATCH, n)
            idx = torch.arange(s * PAGE_SIZE, e * PAGE_SIZE)
            assert all(store.batch_get_v1(keys[s:e], idx))

    out: dict[str, Any] = {"write_returned_s": timed(write)}
    out["write_durable_s"] = out["write_returned_s"]  # durability=data: on disk when it returns
    assert store.batch_exists(keys) == n
    pool.kv_buffer.zero_()
    out["cold"] = drop_page_cache()
    out["cold_read_s"] = timed(read)
    out["exact"] = torch.equal(pool.kv_buffer.view(torch.int16), snapshot)
    out["warm_read_s"] = timed(read)
    store.close()
    return out


def run_hicachefile(
    pool: PageFirstPool, keys: list[str], where: Path, snapshot: torch.Tensor
) -> dict[str, Any]:
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    store = HiCacheFile(storage_config({"file_storage_path": str(where)}), file_path=str(where))
    n = len(keys)

    def write() -> None:  # CacheController._generic_page_set
        for s in range(0, n, BATCH):
            data = [pool.get_data_page(i * PAGE_SIZE) for i in range(s, min(s + BATCH, n))]
            assert store.batch_set(keys[s : s + BATCH], data)

    def read() -> None:  # CacheController._generic_page_get
        for s in range(0, n, BATCH):
            ks = keys[s : s + BATCH]
            dummies = [pool.get_dummy_flat_data_page() for _ in ks]
            pages = store.batch_get(ks, dummies)
            for j, page in enumerate(pages):
                assert page is not None
                pool.set_from_flat_data_page((s + j) * PAGE_SIZE, page)

    out: dict[str, Any] = {"write_returned_s": timed(write)}
    out["write_durable_s"] = out["write_returned_s"] + timed(os.sync)
    pool.kv_buffer.zero_()
    out["cold"] = drop_page_cache()
    out["cold_read_s"] = timed(read)
    out["exact"] = torch.equal(pool.kv_buffer.view(torch.int16), snapshot)
    out["warm_read_s"] = timed(read)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=ROOT / ".build" / "bench-sglang")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds (best kept)")
    parser.add_argument("--write-md", action="store_true")
    args = parser.parse_args()
    pool = PageFirstPool(args.pages)
    snapshot = pool.kv_buffer.view(torch.int16).clone()
    page_bytes = 2 * LAYERS * PAGE_SIZE * HEADS * DIM * DTYPE.itemsize
    total = args.pages * page_bytes
    load0 = os.getloadavg()[0]
    rows: dict[str, list[dict[str, Any]]] = {"ours": [], "sglang": []}
    for r in range(args.rounds):
        for name, fn in (("sglang", run_hicachefile), ("ours", run_ours)):
            where = args.dir / f"{name}-{r}-{os.getpid()}"
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            keys = [hashlib.sha256(f"{name}-{r}-{i}".encode()).hexdigest() for i in range(args.pages)]
            pool.kv_buffer.view(torch.int16).copy_(snapshot)
            try:
                result = fn(pool, keys, where, snapshot)
            finally:
                shutil.rmtree(where, ignore_errors=True)
            print(name, r, {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()},
                  file=sys.stderr)
            rows[name].append(result)
    load1 = os.getloadavg()[0]

    def best(name: str, key: str) -> float:
        return total / min(row[key] for row in rows[name]) / 1e9

    measures = ("write_durable_s", "write_returned_s", "cold_read_s", "warm_read_s")
    table = {name: {m: best(name, m) for m in measures} for name in rows}
    exact = all(row["exact"] for rs in rows.values() for row in rs)
    cold = all(row["cold"] for rs in rows.values() for row in rs)
    md = render(args, table, exact, cold, load0, load1, page_bytes)
    print(md)
    if args.write_md:
        log_run(md)
    return 0


def render(
    args: argparse.Namespace, table: dict[str, dict[str, float]], exact: bool, cold: bool,
    load0: float, load1: float, page_bytes: int,
) -> str:
    ours, sg = table["ours"], table["sglang"]
    lines = [
        "## SGLang",
        "",
        f"Command (as root): `.venv/bin/python bench/bench_sglang.py --pages {args.pages} "
        f"--rounds {args.rounds} --write-md`. One process, one page_first MHA host pool "
        f"({args.pages} pages of {page_bytes >> 20} MiB: 32 layers x 64 tokens x 8 KV heads x 128 "
        "x bf16), batches of 128 pages, the same pages for both. hicache-store: "
        "`HiCacheStoreStorage.batch_set_v1`/`batch_get_v1` (SGLang's `interface_v1` path) on "
        "`file://` with `durability=data`. SGLang 0.5.23 `HiCacheFile` driven as its cache "
        "controller drives `--hicache-storage-backend file` (generic path: `get_data_page` + "
        "`batch_set`; `batch_get` into dummy pages + `set_from_flat_data_page`); it does not "
        "flush, so its durable write adds an `os.sync()`. Cold reads after "
        f"`sync; echo 3 > /proc/sys/vm/drop_caches` (dropped: {cold}). Every read checked "
        f"bit-exact against the pool (all exact: {exact}). GB/s = 10^9 bytes/s of KV, best of "
        f"{args.rounds} round(s). Load average {load0:.1f} at the start, {load1:.1f} at the end "
        "(2 shared vCPUs).",
        "",
        "| system | durable write | write as returned | cold read | warm read |",
        "|---|---|---|---|---|",
    ]
    for label, row in (("hicache-store SGLang adapter (file)", ours), ("SGLang HiCacheFile", sg)):
        lines.append(
            f"| {label} | {row['write_durable_s']:.2f} | {row['write_returned_s']:.2f} | "
            f"{row['cold_read_s']:.2f} | {row['warm_read_s']:.2f} |"
        )
    lines += [
        "",
        f"Adapter against HiCacheFile: durable write "
        f"{ours['write_durable_s'] / sg['write_durable_s']:.2f}x, cold read "
        f"{ours['cold_read_s'] / sg['cold_read_s']:.2f}x, write as returned "
        f"{ours['write_returned_s'] / sg['write_returned_s']:.2f}x, warm read "
        f"{ours['warm_read_s'] / sg['warm_read_s']:.2f}x. The adapter's figures include the "
        "host relayout (page_first -> unified) and the per-layer xxh3 checksums of every "
        "object; its objects are topology-free (readable by any TP/PP size) where "
        "HiCacheFile's keys carry the writer's TP rank and size.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
