"""The conformance suite on the memory backend, plus its bound and LRU order."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from hicache_store.backends import Backend, CapacityError, open_backend
from hicache_store.backends.memory import MemoryBackend
from hicache_store.testing import BackendTests


class TestMemoryBackend(BackendTests):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        store = open_backend("memory://", capacity_bytes="64MiB")
        yield store
        await store.close()

    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, MemoryBackend)
        return backend.raw_get(key)

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, MemoryBackend)
        backend.raw_set(key, data)

    async def reopen(self, backend: Backend) -> Backend | None:
        return None  # an in-process dict: not persistent, nothing to reopen


class _WithoutRangedReads(MemoryBackend):
    capabilities = MemoryBackend.capabilities.replace(ranged_reads=False)


class TestBaseClassRangeEmulation(TestMemoryBackend):
    """A backend without native ranges: ``get_into`` ranges and ``get_scatter`` (one range per
    buffer) go through the base class's emulation on whole-object reads."""

    stateful_max_examples = 5

    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        store = _WithoutRangedReads(capacity_bytes="64MiB")
        yield store
        await store.close()


async def test_capacity_bound_evicts_least_recently_used() -> None:
    store = MemoryBackend(capacity_bytes=1000)
    await store.put(["a0", "a1", "a2"], [b"x" * 300] * 3)
    await store.exists(["a0"])  # a0 is now the most recently used
    await store.put(["b0"], [b"y" * 300])
    assert await store.exists(["a0", "a1", "a2", "b0"]) == [True, True, False, True]
    assert store.used_bytes <= 1000
    assert store.stats.evictions == 1


async def test_eviction_takes_chain_tails_first() -> None:
    # One batch = one chain in order: its deepest page goes first, never its head.
    store = MemoryBackend(capacity_bytes=1000)
    chain = ["c0", "c1", "c2"]
    await store.put(chain, [b"x" * 300] * 3)
    await store.put(["d0"], [b"y" * 300])
    assert [store.raw_get(k) is not None for k in chain] == [True, True, False]
    # Re-reading the prefix keeps it; the untouched rest of the chain goes next.
    await store.get_into(["c0"], [bytearray(300)])
    await store.put(["d1"], [b"y" * 300])
    assert await store.exists(["c0", "c1", "d0", "d1"]) == [True, False, True, True]


async def test_object_larger_than_capacity_is_refused() -> None:
    store = MemoryBackend(capacity_bytes=100)
    with pytest.raises(CapacityError):
        await store.put(["a0"], [b"x" * 101])
    assert await store.exists(["a0"]) == [False]
