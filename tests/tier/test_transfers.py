"""``Transfers.start_prefetch``: a prefetch is finished only when every read it started has
ended, a failed one included, so no read writes into a host row after the tier was told the
prefetch is over (the row may already hold another page)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import numpy as np
import pytest

from hicache_store.objects import IOStats
from hicache_store.tier.transfers import Fetch, Prefetch, Transfers


class _Link:
    """The part of an ``L3Link`` a prefetch uses: component object 0 fails at once, object 1
    lands its bytes only after the failure was raised."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()

    async def read_page(self, page_hash: str, row: np.ndarray, io: IOStats) -> bool:
        if page_hash == "bad":
            self.failed.set()
            raise RuntimeError("the backend broke")
        await self.failed.wait()
        await asyncio.sleep(0.05)  # the sibling's read is still running when the failure is raised
        row[:] = 7
        return True

    async def read_prefix(self, hashes: list[str], rows: list[Any], io: IOStats) -> int:
        return 0


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def test_a_failed_read_ends_the_prefetch_only_after_its_siblings(
        loop: asyncio.AbstractEventLoop) -> None:
    def submit(coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, loop)

    link = asyncio.run_coroutine_threadsafe(_make_link(), loop).result()
    rows = np.zeros((2, 8), dtype=np.uint8)
    op = Prefetch(kv=[], extra=[Fetch(tag=1, index=0, page_hash="bad", row=0),
                                Fetch(tag=1, index=0, page_hash="good", row=1)])
    seen_at_finish: list[np.ndarray] = []
    Transfers(submit).start_prefetch(op, {1: link}, lambda f: rows[f.row])  # type: ignore[dict-item]
    assert op.finished.wait(60.0)  # a hang detector
    seen_at_finish.append(rows[1].copy())
    assert op.future is not None
    with pytest.raises(RuntimeError, match="the backend broke"):
        op.future.result(60.0)
    # the sibling's bytes were in the row when the prefetch was said to be finished
    assert seen_at_finish[0].tolist() == [7] * 8


async def _make_link() -> _Link:
    return _Link()  # (its Event belongs to the loop it is made on)
