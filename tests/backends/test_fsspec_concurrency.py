"""The fsspec backend runs a batch's requests concurrently, ``max_concurrency`` at a time.

A filesystem that counts the ``cat_file`` calls in flight, and holds each one until
``max_concurrency`` are (a barrier), shows how many requests a batch read keeps going: a
backend that reads a batch one request at a time breaks the barrier (the test fails, it does
not hang), and one that starts more than ``max_concurrency`` shows it in the count.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hicache_store.backends import Backend, open_backend
from hicache_store.backends.types import ByteRange

fsspec = pytest.importorskip("fsspec", reason="needs the fsspec extra: pip install 'hicache-store[fsspec]'")
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

CONCURRENCY = 4
BATCH = 4 * CONCURRENCY


class CountingMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem, with every ``cat_file`` waiting for ``CONCURRENCY`` - 1
    others (or failing after 120 s: a hang detector) and the most calls ever in flight
    recorded."""

    protocol = "hicache-counting"
    barrier = threading.Barrier(CONCURRENCY, timeout=120)
    lock = threading.Lock()
    in_flight = 0
    most = 0

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.most = max(cls.most, cls.in_flight)
        try:
            cls.barrier.wait()
            return bytes(super().cat_file(path, start=start, end=end, **kwargs))
        finally:
            with cls.lock:
                cls.in_flight -= 1


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    fsspec.register_implementation(CountingMemoryFileSystem.protocol, CountingMemoryFileSystem,
                                   clobber=True)
    CountingMemoryFileSystem.barrier.reset()
    CountingMemoryFileSystem.most = 0
    store = open_backend({
        "url": f"fsspec+{CountingMemoryFileSystem.protocol}://hicache-{secrets.token_hex(6)}/kv",
        "backend": "fsspec", "max_concurrency": CONCURRENCY, "atomic_write": "direct",
        "request_timeout": 30,
    })
    yield store
    await store.close()


@pytest.mark.parametrize("ranged", [False, True], ids=["whole", "ranged"])
async def test_a_batch_read_keeps_max_concurrency_requests_in_flight(
    backend: Backend, ranged: bool
) -> None:
    keys = [f"a{i:02x}" for i in range(BATCH)]
    values = [bytes([i]) * (100 + i) for i in range(BATCH)]
    await backend.put(keys, values)
    ranges = [ByteRange(i, 100) if ranged else None for i in range(BATCH)]
    buffers = [bytearray(len(v)) for v in values]
    got = await backend.get_into(keys, buffers, ranges)
    assert got == [100 - i if ranged else len(v) for i, v in enumerate(values)]
    for i, (buf, value) in enumerate(zip(buffers, values, strict=True)):
        wanted = value[i:100] if ranged else value
        assert bytes(buf[: len(wanted)]) == wanted
    assert CountingMemoryFileSystem.most == CONCURRENCY
