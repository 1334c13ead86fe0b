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
