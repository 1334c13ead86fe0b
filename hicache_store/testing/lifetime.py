"""Buffer lifetime: a read that gave up never writes into the caller's buffer afterwards.

Part of the conformance suite (``BackendTests`` inherits these tests). The contract
(``hicache_store.backends.base``): once ``get_into`` / ``get_scatter`` returns, raises, times
out or is cancelled, no byte lands in the caller's buffers any more. The cache tier relies on
it to hand host memory to the next page the moment a read is abandoned; a backend that lets a
late read land there serves another page's KV, silently.

Each test reads an object large enough for the read to still be in flight when the caller
gives up (``lifetime_object_bytes``; a backend whose reads are instant passes trivially),
cancels it at several points, overwrites its buffer, waits ``lifetime_settle_s`` for any late
write to land, and checks the buffer still holds exactly what the caller wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from hicache_store.backends import aligned_buffer
from hicache_store.backends.aio import wait_for
from hicache_store.backends.base import Backend
from hicache_store.backends.types import ByteRange

#: what the caller writes into its buffer after giving up on a read (not in any test object).
CALLER_FILL = 0xA5
#: how the caller gives up: ``cancel`` (the task is cancelled) or ``timeout``
#: (``asyncio.wait_for`` with a deadline shorter than the read).
GIVE_UP = ("cancel", "timeout")


def _object_bytes(size: int) -> bytes:
    """A pattern with no 0xA5 byte, so any late byte of the object is visible."""
    return bytes((i * 7 + 1) % 251 for i in range(251)) * (size // 251) + b"\x01" * (size % 251)


@pytest.mark.asyncio
class BufferLifetimeTests:
    """Mixin of ``BackendTests``: reads abandoned mid-flight leave the caller's memory alone."""

    #: object size for these tests: big enough that a read is still running when cancelled.
    lifetime_object_bytes = 4 << 20
    #: seconds to wait, after giving up, for a late write that must not come.
    lifetime_settle_s = 0.2
    #: cancellation points tried per way of giving up (each a fresh read into fresh buffers).
    lifetime_attempts = 4

    async def _give_up_repeatedly(
        self,
        read: Callable[[list[memoryview]], Awaitable[object]],
        sizes: list[int],
    ) -> None:
        """Start reads and give up on each (cancel, or a ``wait_for`` deadline) at several
        points; overwrite the buffers at once; after one settling pause, check them all."""
        given_up: list[tuple[str, list[memoryview]]] = []
        for how in GIVE_UP:
            for attempt in range(self.lifetime_attempts):
                buffers = [aligned_buffer(n) for n in sizes]
                # Give up at a different point each time: before the I/O starts, right after
                # it was handed to a thread or a request, and while it runs.
                delay = 0.0005 * attempt
                if how == "cancel":
                    task = asyncio.ensure_future(read(buffers))
                    if attempt:
                        await asyncio.sleep(delay)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task  # a read that finished first is fine too
                else:
                    with contextlib.suppress(TimeoutError):
                        await wait_for(read(buffers), delay)
                for buf in buffers:
                    buf[:] = bytes([CALLER_FILL]) * len(buf)
                given_up.append((f"{how} after {delay * 1e3:.1f} ms", buffers))
        await asyncio.sleep(self.lifetime_settle_s)
        for what, buffers in given_up:
            for i, buf in enumerate(buffers):
                assert bytes(buf) == bytes([CALLER_FILL]) * len(buf), (
                    f"{what}: buffer {i} was written after the read gave up "
                    "(a late read landed in the caller's memory)"
                )

    async def test_abandoned_read_never_writes_later(self, backend: Backend) -> None:
        size = self.lifetime_object_bytes
        await backend.put(["e0"], [_object_bytes(size)])

        async def read(buffers: list[memoryview]) -> object:
            return await backend.get_into(["e0"], buffers)

        await self._give_up_repeatedly(read, [size])

    async def test_abandoned_batch_and_range_reads_never_write_later(
        self, backend: Backend
    ) -> None:
        size = self.lifetime_object_bytes // 2
        await backend.put(["e1", "e2"], [_object_bytes(size), _object_bytes(size)])
        ranges: list[ByteRange | None] = [None, ByteRange(4096, size)]

        async def read(buffers: list[memoryview]) -> object:
            return await backend.get_into(["e1", "e2"], buffers, ranges)

        await self._give_up_repeatedly(read, [size, size])

    async def test_abandoned_scatter_read_never_writes_later(self, backend: Backend) -> None:
        size = self.lifetime_object_bytes
        await backend.put(["e3"], [_object_bytes(size)])

        async def read(buffers: list[memoryview]) -> object:
            return await backend.get_scatter("e3", buffers, ByteRange(0, size))

        await self._give_up_repeatedly(read, [4096, size - 4096])
