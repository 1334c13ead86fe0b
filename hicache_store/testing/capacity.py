"""``CapacityUsageTests``: the ``capacity_usage`` contract (``backends.protocols.CapacityUsage``).

A pytest mixin for backends that bound their size. A backend that declares
``capabilities.capacity_usage`` reports the capacity it was opened with, and bytes used that
track its puts, rewrites, deletes and evictions exactly (the bytes of the objects it holds
once no put is in flight) and never pass the capacity; one that does not declare it refuses
the accessor with ``NotSupportedError``. Subclass it (a class named ``Test...``) and implement
one hook::

    class TestMyCapacity(CapacityUsageTests):
        async def open_bounded_backend(self, where, capacity_bytes):
            return MyBackend(where, capacity_bytes=capacity_bytes)

``where`` is a fresh empty directory per store. Objects are whole multiples of 4 KiB, so a
store that charges allocated blocks charges their lengths. The mixin closes what it opened.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from hicache_store.backends import Backend, NotSupportedError

#: the size unit of the tests' objects (a filesystem block)
UNIT = 4096

OpenBounded = Callable[[int], Awaitable[Backend]]


@pytest.mark.asyncio
class CapacityUsageTests(abc.ABC):
    """Mixin: the capacity usage contract on a bounded backend. See the module docstring."""

    @abc.abstractmethod
    async def open_bounded_backend(self, where: Path, capacity_bytes: int) -> Backend:
        """An open, empty backend that keeps at most ``capacity_bytes``."""

    @pytest.fixture
    async def open_bounded(self, tmp_path: Path) -> AsyncIterator[OpenBounded]:
        opened: list[Backend] = []
        numbers = itertools.count()

        async def open_(capacity_bytes: int) -> Backend:
            where = tmp_path / f"capacity-{next(numbers)}"
            where.mkdir()
            store = await self.open_bounded_backend(where, capacity_bytes)
            opened.append(store)
            if not store.capabilities.capacity_usage:
                with pytest.raises(NotSupportedError):
                    store.capacity_usage()
                pytest.skip(f"{store.name} does not declare capabilities.capacity_usage")
            return store

        yield open_
        for store in opened:
            await store.close()

    @staticmethod
    async def _held(store: Backend, keys: list[str]) -> int:
        stats = await store.stat(keys)
        return sum(s.size for s in stats if s is not None)

    async def test_used_bytes_track_puts_rewrites_and_deletes(
        self, open_bounded: OpenBounded
    ) -> None:
        store = await open_bounded(64 * UNIT)
        usage = store.capacity_usage()
        assert usage.usage() == (64 * UNIT, 0)
        await store.put(["c0", "c1"], [bytes(2 * UNIT), bytes(3 * UNIT)])
        assert usage.usage() == (64 * UNIT, 5 * UNIT)
        await store.put(["c0"], [bytes(UNIT)])  # a rewrite replaces its old bytes
        assert usage.usage() == (64 * UNIT, 4 * UNIT)
        assert await store.delete(["c1", "dead"]) == [True, False]
        assert usage.usage() == (64 * UNIT, UNIT)
        await store.delete(["c0"])
        assert usage.usage() == (64 * UNIT, 0)

    async def test_used_bytes_follow_evictions_and_never_pass_the_capacity(
        self, open_bounded: OpenBounded
    ) -> None:
        capacity = 10 * UNIT
        store = await open_bounded(capacity)
        usage = store.capacity_usage()
        keys: list[str] = []
        for i in range(12):
            keys.append(f"e{i}")
            await store.put([keys[-1]], [bytes((1 + i % 3) * UNIT)])
            total, used = usage.usage()
            assert total == capacity
            assert used <= capacity
            assert used == await self._held(store, keys)
        assert store.stats.evictions > 0  # the bound was reached and enforced
        assert not all(await store.exists(keys))
