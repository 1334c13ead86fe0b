"""Retention and pins on the memory backend: the shared retention suite, and refusal; the
capacity usage suite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hicache_store.backends import Backend, NotSupportedError, Retention
from hicache_store.backends.memory import MemoryBackend
from hicache_store.testing import CapacityUsageTests, RetentionTests


class TestMemoryRetention(RetentionTests):
    async def open_retention_backend(
        self, where: Path, capacity_bytes: int, pin_fraction: float, clock: Callable[[], float]
    ) -> Backend:
        return MemoryBackend(capacity_bytes=capacity_bytes, pin_fraction=pin_fraction,
                             clock=clock)


class TestMemoryCapacityUsage(CapacityUsageTests):
    async def open_bounded_backend(self, where: Path, capacity_bytes: int) -> Backend:
        return MemoryBackend(capacity_bytes=capacity_bytes)


async def test_undeclared_backend_refuses() -> None:
    class NoRetention(MemoryBackend):
        capabilities = MemoryBackend.capabilities.replace(retention=False)

    with pytest.raises(NotSupportedError):
        await NoRetention().retain(["a0"], Retention("o", None, pinned=True))


async def test_the_capacity_usage_suite_catches_a_backend_that_miscounts() -> None:
    class Miscounts(MemoryBackend):
        def _usage(self) -> tuple[int, int]:  # every byte put, never one deleted or evicted
            return self.capacity_bytes, self.stats.bytes_written

    opened: list[Backend] = []

    async def open_(capacity_bytes: int) -> Backend:
        opened.append(Miscounts(capacity_bytes=capacity_bytes))
        return opened[-1]

    suite = TestMemoryCapacityUsage()
    for test in (suite.test_used_bytes_track_puts_rewrites_and_deletes,
                 suite.test_used_bytes_follow_evictions_and_never_pass_the_capacity):
        with pytest.raises(AssertionError):
            await test(open_)
    for store in opened:
        await store.close()
