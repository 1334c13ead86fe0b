"""The sync bridge: many threads calling into async backends at once."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend


def test_threads_share_one_backend_through_the_bridge() -> None:
    store = open_backend("memory://")

    def work(i: int) -> bytes | None:
        key = f"a{i:x}"
        run_sync(store.put([key], [bytes([i]) * 100]))
        return run_sync(store.get_bytes(key))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(64)))
    assert results == [bytes([i]) * 100 for i in range(64)]


def test_errors_and_timeouts_propagate() -> None:
    async def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        run_sync(boom())
    with pytest.raises(TimeoutError):
        run_sync(asyncio.sleep(5), timeout=0.01)


def test_calling_from_the_bridge_loop_is_refused() -> None:
    async def nested() -> None:
        coro = asyncio.sleep(0)
        run_sync(coro)

    with pytest.raises(RuntimeError, match="own loop"):
        run_sync(nested())
