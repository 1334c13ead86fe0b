"""A cancelled ``prepopulate`` (Ctrl-C in the command) returns only once every write it
started has ended, so the caller's ``close`` never overtakes one (a put then finds its
backend's threads gone and fails half-way, its objects reported neither stored nor absent)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from hicache_store.backends.memory import MemoryBackend
from hicache_store.demo.engine.source import MiniEngineSource
from hicache_store.layout.namespace import Grid
from hicache_store.layout.topology import Topology
from hicache_store.ops.prepopulate import namespace_for, prepopulate


class SlowPuts(MemoryBackend):
    """Each put takes a while; how many are running is counted; ``started`` once several
    are."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self.started = asyncio.Event()

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        self.running += 1
        if self.running >= 3:  # the pages' writes (not the manifest's, written alone first)
            self.started.set()
        try:
            await asyncio.sleep(0.3)
            await super()._put(keys, buffers)
        finally:
            self.running -= 1


async def test_a_cancelled_run_returns_after_its_writes_in_flight() -> None:
    source = MiniEngineSource("tiny")
    # 2x1 grid: two objects a page; 16 prompts of 3 pages in one batch: a wave of 16 pages, of
    # which the write queue starts a window and keeps the rest queued (ended unstarted on
    # cancel: their callers return at once, the started ones when their puts end).
    namespace = namespace_for(source, page_size=4, grid=Grid(2, 1))
    prompts = [[p * 30 + t for t in range(1, 13)] for p in range(16)]  # ids under 512
    backend = SlowPuts()
    run = asyncio.ensure_future(
        prepopulate(backend, source, prompts, namespace, Topology(1, 1), batch_size=16))
    await asyncio.wait_for(backend.started.wait(), 60)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert backend.running == 0, f"{backend.running} puts still running after the run returned"
    await backend.close()
