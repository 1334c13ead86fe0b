"""The conformance suite's bound on backend calls detects hangs; it is not a speed limit.

A backend that keeps answering, one key after another, passes however long a large batch
takes on a loaded machine (up to ``call_timeout_s`` plus ``key_timeout_s`` per key); one that
never answers fails, in a time fixed by the call's size, with a message naming the call and
its bound. The slow backend here sleeps per key instead of being slow by load, so that the
tests do not depend on the machine either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from hicache_store.backends import Backend
from hicache_store.backends.memory import MemoryBackend
from hicache_store.backends.types import ByteRange, ObjectStat
from hicache_store.testing import BackendTests
from hicache_store.testing.backend import bound_calls, call_keys

#: seconds the slow backend spends on each key of a call, one key after another.
PER_KEY_S = 0.002


class SlowMemory(MemoryBackend):
    """A correct backend that takes ``PER_KEY_S`` for every key of every call, serially."""

    async def _crawl(self, keys: Sequence[str]) -> None:
        for _ in keys:
            await asyncio.sleep(PER_KEY_S)

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        await self._crawl(keys)
        return await super()._exists(keys)

    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: Sequence[ByteRange | None]
    ) -> list[int | None]:
        await self._crawl(keys)
        return await super()._get_into(keys, buffers, ranges)

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        await self._crawl(keys)
        await super()._put(keys, buffers)

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        await self._crawl(keys)
        return await super()._stat(keys)

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        await self._crawl(keys)
        return await super()._delete(keys)


class HungMemory(MemoryBackend):
    """``exists`` waits for a wake-up that never comes."""

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class SlowSuite(BackendTests):
    """The suite with a bound far below what a 333-key call of ``SlowMemory`` takes (0.67 s)
    when it is not given time per key (not collected: the name does not start with Test)."""

    call_timeout_s = 0.3

    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, MemoryBackend)
        return backend.raw_get(key)

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, MemoryBackend)
        backend.raw_set(key, data)

    async def reopen(self, backend: Backend) -> Backend | None:
        return None


async def test_a_slow_backend_that_keeps_answering_passes_the_large_batch_test() -> None:
    suite = SlowSuite()
    backend = bound_calls(SlowMemory(), suite.call_timeout_s, suite.key_timeout_s)
    try:
        await suite.test_large_batches_map_every_key_to_its_own_buffer(backend)
    finally:
        await backend.close()


async def test_the_bound_grows_with_the_keys_of_the_call() -> None:
    backend = bound_calls(SlowMemory(), 0.05, 0.1)
    keys = [f"a{i:02x}" for i in range(100)]  # 0.2 s of work against a 10.05 s bound
    await backend.put(keys, [b"x"] * len(keys))
    assert await backend.exists(keys) == [True] * len(keys)
    await backend.close()


async def test_a_hung_backend_fails_in_bounded_time_with_the_call_and_its_bound() -> None:
    backend = bound_calls(HungMemory(), 0.2, 0.01)
    keys = [f"a{i:02x}" for i in range(50)]
    with pytest.raises(AssertionError) as failure:
        # The outer bound only keeps this test from hanging if bound_calls were broken.
        await asyncio.wait_for(backend.exists(keys), 30)
    assert str(failure.value).startswith(
        "HungMemory.exists did not return within 0.7 s (0.2 s + 0.01 s for each of its 50 keys)"
    )
    await backend.close()


def test_calls_count_their_keys() -> None:
    assert call_keys((["a0", "a1", "a2"],), {}) == 3
    assert call_keys((), {"keys": ["a0"]}) == 1
    assert call_keys(("a0", [bytearray(4)], None), {}) == 1  # get_scatter: one object
    assert call_keys(("a0", b"data"), {}) == 1  # put_if_absent
    assert call_keys((7,), {}) == 1  # an invalid key still gets its time to be refused
    assert call_keys((), {}) == 0  # close
