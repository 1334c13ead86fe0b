"""Mooncake backend vs Mooncake's own batch API, side by side, on one real deployment.

Starts ``mooncake_master`` and a separate segment holder on loopback (so every byte crosses
TCP), then writes and reads N objects of S bytes, alternating, R rounds:

- ``raw``: ``batch_upsert_from`` / ``batch_get_into`` called directly on registered memory;
- ``ours-registered``: ``MooncakeBackend.put`` / ``get_into`` on the same registered memory
  (``host_buffers().register``: the cache tier's path, zero-copy);
- ``ours-staged``: the same calls on ordinary (unregistered) buffers, through staging slabs.

Usage: ``python bench/bench_mooncake.py [--objects 256] [--size-mib 1] [--rounds 5]``.
Reports the median GiB/s per mode and our ratio to raw.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np

from hicache_store.backends import open_backend
from hicache_store.backends.mooncake import MooncakeBackend
from hicache_store.backends.mooncake_local import LocalMooncake

GiB = float(1 << 30)


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def run(deployment: LocalMooncake, objects: int, size: int, rounds: int) -> None:
    store = open_backend(deployment.url, threads=2, bounce="256MiB", timeout=120)
    assert isinstance(store, MooncakeBackend)
    client = await asyncio.to_thread(store._client_sync)
    raw = client.store
    total = objects * size
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    await store.host_buffers().register(src)
    await store.host_buffers().register(dst)
    plain_src, plain_dst = bytearray(src.tobytes()), bytearray(total)
    keys = [f"B{i:06d}" for i in range(objects)]
    ptr_src, ptr_dst = src.ctypes.data, dst.ctypes.data
    offsets = [i * size for i in range(objects)]
    sizes = [size] * objects

    async def raw_put() -> None:
        codes = await asyncio.to_thread(
            raw.batch_upsert_from, keys, [ptr_src + o for o in offsets], sizes
        )
        assert all(c == 0 for c in codes), codes[:4]

    async def raw_get() -> None:
        got = await asyncio.to_thread(
            raw.batch_get_into, keys, [ptr_dst + o for o in offsets], sizes
        )
        assert all(n == size for n in got), got[:4]

    src_view, dst_view = memoryview(src), memoryview(dst)
    psrc, pdst = memoryview(plain_src), memoryview(plain_dst)

    async def ours_put(view: memoryview) -> None:
        await store.put(keys, [view[o : o + size] for o in offsets])

    async def ours_get(view: memoryview) -> None:
        got = await store.get_into(keys, [view[o : o + size] for o in offsets])
        assert all(n == size for n in got)

    modes: dict[str, tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]] = {
        "raw": (raw_put, raw_get),
        "ours-registered": (lambda: ours_put(src_view), lambda: ours_get(dst_view)),
        "ours-staged": (lambda: ours_put(psrc), lambda: ours_get(pdst)),
    }
    results: dict[str, dict[str, list[float]]] = {m: {"put": [], "get": []} for m in modes}
    for _ in range(rounds):
        for mode, (put, get) in modes.items():
            await store.delete(keys)
            results[mode]["put"].append(total / await timed(put) / GiB)
            results[mode]["get"].append(total / await timed(get) / GiB)
    assert bytes(dst[:size]) == bytes(src[:size])
    assert plain_dst[:size] == plain_src[:size]
    await store.close()
    raw_put_med = statistics.median(results["raw"]["put"])
    raw_get_med = statistics.median(results["raw"]["get"])
    print(
        f"{objects} x {size / (1 << 20):g} MiB, {rounds} rounds, median GiB/s "
        "(TCP loopback, separate segment holder)"
    )
    print(f"{'mode':<18}{'put':>8}{'get':>8}{'put/raw':>9}{'get/raw':>9}")
    for mode, r in results.items():
        p, g = statistics.median(r["put"]), statistics.median(r["get"])
        print(f"{mode:<18}{p:8.3f}{g:8.3f}{p / raw_put_med:9.2f}{g / raw_get_med:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=256)
    parser.add_argument("--size-mib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    size = int(args.size_mib * (1 << 20))
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    segment = f"{max(512, 2 * args.objects * size // (1 << 20))} MB"
    with LocalMooncake(segment=segment, client_ttl=5) as deployment:
        asyncio.run(run(deployment, args.objects, size, args.rounds))


if __name__ == "__main__":
    main()
