"""The conformance suite's bounds on backend calls detect hangs and a blocked event loop;
they are not speed limits.

A backend that keeps answering, one key after another, passes however long a large batch
takes on a loaded machine; one that never answers fails, in a time fixed by the call's size
and the backend's own pace on smaller calls, with a message naming the call and its bound.
A call that holds the event loop (a blocking call on the loop's thread) fails, naming the
method; the same wait off the loop passes. The slow backends here sleep instead of being slow
by load, so that the tests do not depend on the machine either.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Sequence

import pytest

from hicache_store.backends import Backend
from hicache_store.backends.memory import MemoryBackend
from hicache_store.backends.types import ByteRange, ObjectStat
from hicache_store.testing import BackendTests
from hicache_store.testing.backend import CallBounds, LoopWatch, bound_calls, call_bytes, call_keys

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


class HangsOver50(MemoryBackend):
    """``exists`` answers batches of up to 50 keys, and never returns on larger ones."""

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        if len(keys) > 50:
            await asyncio.Event().wait()
        return await super()._exists(keys)


class DefaultSuite(SlowSuite):
    """The suite's default bounds (not collected)."""

    call_timeout_s = BackendTests.call_timeout_s


@pytest.mark.slow
async def test_a_hang_on_large_batches_fails_the_large_batch_test_in_well_under_a_minute() -> None:
    suite = DefaultSuite()
    backend = bound_calls(HangsOver50(), suite.call_bounds())
    with pytest.raises(AssertionError) as failure:
        # The outer bound only keeps this test from hanging if the bounds were broken.
        await asyncio.wait_for(
            suite.test_large_batches_map_every_key_to_its_own_buffer(backend), 120)
    message = str(failure.value)
    assert message.startswith("HangsOver50.exists did not return within "), message
    bound = float(message.split("within ")[1].split(" s", maxsplit=1)[0])
    assert bound < 30, message  # 20 s + 0.01 s for each of 333 keys
    assert "slowest earlier call" in message
    await backend.close()


async def test_the_pace_bound_never_exceeds_the_first_call_bound() -> None:
    bounds = CallBounds(10.0, 0.5, pace_factor=20, pace_floor_s=0.01)
    first, _ = bounds.time_limit(100, 0, None)
    assert first == 60.0
    assert bounds.time_limit(100, 0, 1e-5)[0] == pytest.approx(11.0)  # the floor
    assert bounds.time_limit(100, 0, 0.002)[0] == pytest.approx(14.0)  # 20 x the pace
    assert bounds.time_limit(100, 0, 1.0)[0] == first  # never more than key_s per key
    assert CallBounds(10.0, 0.0, mib_s=2.0).time_limit(0, 3 << 20, None)[0] == 16.0


class BlocksOnTheLoop(MemoryBackend):
    """``exists`` waits ``WAIT_S`` blocking the loop's thread, as a synchronous call does."""

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        time.sleep(WAIT_S)  # noqa: ASYNC251 - the defect under test
        return await super()._exists(keys)


class WaitsOffTheLoop(MemoryBackend):
    """The same wait, in an executor thread: the loop stays free."""

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        await asyncio.to_thread(time.sleep, WAIT_S)
        return await super()._exists(keys)


#: how long the blocking backends wait, against a loop bound of ``LOOP_S``.
WAIT_S = 1.0
LOOP_S = 0.2


async def test_a_call_that_blocks_the_loop_fails_naming_the_method() -> None:
    backend = bound_calls(BlocksOnTheLoop(), CallBounds(30.0, 1.0, loop_block_s=LOOP_S))
    with pytest.raises(AssertionError) as failure:
        await backend.exists(["a0"])
    message = str(failure.value)
    held = re.fullmatch(r"BlocksOnTheLoop\.exists held the event loop for ([\d.]+) s \(more "
                        r"than 0\.2 s plus twice the [\d.]+ s every thread of the process was "
                        r"held up\) without yielding: .*executor.*", message)
    assert held is not None, message
    assert float(held[1]) >= WAIT_S - 0.02, message
    await backend.close()


async def test_the_same_wait_off_the_loop_passes() -> None:
    backend = bound_calls(WaitsOffTheLoop(), CallBounds(30.0, 1.0, loop_block_s=LOOP_S))
    assert await backend.exists(["a0"]) == [False]
    await backend.close()


class HoldsEveryThread(MemoryBackend):
    """``exists`` keeps the interpreter lock for ``STALL_S`` (no other thread runs meanwhile),
    as a machine too loaded to run the process does to every thread at once."""

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        # The interpreter hands the lock to another thread only every switch interval: set
        # past the stall, this loop keeps it for STALL_S of the clock whatever the load (a C
        # call sized by a timing taken first ran short when the load changed in between).
        interval = sys.getswitchinterval()
        sys.setswitchinterval(STALL_S * 10)
        try:
            end = time.monotonic() + STALL_S
            while time.monotonic() < end:
                pass
        finally:
            sys.setswitchinterval(interval)
        return await super()._exists(keys)


#: how long ``HoldsEveryThread`` holds every thread.
STALL_S = 3.0


async def test_a_stall_of_every_thread_is_not_counted_against_the_backend() -> None:
    # What the loop watch must not blame on a backend: on a busy machine, or while other
    # threads hold the interpreter lock, the whole process waits, not the loop alone. (How
    # much later one thread runs than another after such a stall varies by a few tenths of a
    # second under load; the suite's default bound is 1 s.)
    limit = 0.75
    backend = bound_calls(HoldsEveryThread(), CallBounds(30.0, 1.0, loop_block_s=limit))
    watch = LoopWatch()
    assert await backend.exists(["a0"]) == [False]
    assert watch.stop() > limit  # the loop was held past the bound, and not blamed for it
    await backend.close()


async def test_the_loop_watch_measures_a_stretch_that_never_yields() -> None:
    watch = LoopWatch()
    time.sleep(0.3)  # noqa: ASYNC251 - the loop is held until stop()
    assert watch.stop() >= 0.29
    # A free loop runs the ticker all along: without it, stop() would count the whole wait.
    watch = LoopWatch()
    await asyncio.sleep(2.0)
    assert watch.stop() < 1.5


async def test_a_blocking_call_that_also_fails_is_reported_as_blocking() -> None:
    class BlocksThenFails(BlocksOnTheLoop):
        async def _exists(self, keys: Sequence[str]) -> list[bool]:
            await super()._exists(keys)
            raise RuntimeError("and then fails")

    backend = bound_calls(BlocksThenFails(), CallBounds(30.0, 1.0, loop_block_s=LOOP_S))
    with pytest.raises(AssertionError, match="held the event loop") as failure:
        await backend.exists(["a0"])
    assert isinstance(failure.value.__cause__, RuntimeError)
    await backend.close()


def test_calls_count_their_bytes() -> None:
    assert call_bytes((["a0", "a1"], [b"xyz", bytearray(5)]), {}) == 8
    assert call_bytes(("a0", b"data"), {}) == 4  # put_if_absent: one buffer
    assert call_bytes(("a0", [memoryview(bytearray(10))], None), {}) == 10  # get_scatter
    assert call_bytes((["a0"],), {}) == 0  # exists
    assert call_bytes((), {"keys": ["a0"], "buffers": [b"ab"]}) == 2
    assert call_bytes((["a0"], [7]), {}) == 0  # not a buffer: the call refuses it
