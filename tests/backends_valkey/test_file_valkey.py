"""The file backend with a fleet's index (``index=valkey://...``): the backend conformance suite
and the retention suite, on a real Valkey server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from hicache_store.backends import Backend, WriterFencedError, open_backend
from hicache_store.backends.file import FileBackend
from hicache_store.testing import BackendTests, CapacityUsageTests, RetentionTests

from .valkey_server import ValkeyServer


class TestFileValkeyBackend(BackendTests):
    @pytest.fixture
    async def backend(self, tmp_path: Path, valkey: ValkeyServer) -> AsyncIterator[Backend]:
        self.url = valkey.url
        store = open_backend(f"file://{tmp_path}/store?index={valkey.url}",
                             capacity_bytes="256MiB")
        yield store
        await store.close()

    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, FileBackend)
        path = backend.path_of(key)
        return path.read_bytes() if path.exists() else None

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, FileBackend)
        path = backend.path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        await backend.adopt([key])  # files placed behind the backend's back join the index

    async def reopen(self, backend: Backend) -> Backend | None:
        assert isinstance(backend, FileBackend)
        return FileBackend(backend.root, durability=backend.durability, index=self.url)

    def missing_location(self, backend: Backend, path: Path) -> str:
        return f"file://{path}?index={self.url}"


class TestFileValkeyRetention(RetentionTests):
    @pytest.fixture(autouse=True)
    def _server(self, valkey: ValkeyServer) -> None:
        self.url = valkey.url

    async def open_retention_backend(
        self, where: Path, capacity_bytes: int, pin_fraction: float, clock: Callable[[], float]
    ) -> Backend:
        # the suite's sizes are exact: the bound counts lengths, not allocated blocks
        return FileBackend(where, durability="none", direct_io="never", index=self.url,
                           capacity_counts="size", capacity_bytes=capacity_bytes,
                           pin_fraction=pin_fraction, clock=clock)


class TestFileValkeyCapacityUsage(CapacityUsageTests):
    @pytest.fixture(autouse=True)
    def _server(self, valkey: ValkeyServer) -> None:
        self.url = valkey.url

    async def open_bounded_backend(self, where: Path, capacity_bytes: int) -> Backend:
        return FileBackend(where, durability="none", direct_io="never", index=self.url,
                           capacity_bytes=capacity_bytes)


async def test_a_put_reclaimed_before_it_published_leaves_no_unaccounted_object(
        tmp_path: Path, valkey: ValkeyServer) -> None:
    """A writer whose lease lapses between making room and publishing: another process
    reclaims the put (its object not there yet: absent), the writer then publishes it and its
    settle is refused. The put fails, and the object it published is removed at once, so the
    store holds nothing the index does not count (before, it stayed until gc's reconcile)."""
    url = f"file://{tmp_path}/store?index={valkey.url}"
    writer = open_backend(url, durability="none")
    other = open_backend(url, durability="none")
    assert isinstance(writer, FileBackend) and isinstance(other, FileBackend)
    index = writer._index  # type: ignore[attr-defined]
    make_room = index.make_room

    def lapse_then_room(*args: object, **kwargs: object) -> object:
        counts = make_room(*args, **kwargs)
        # the writer's heartbeat gone (a stop past its lease), the other process reclaims
        valkey.client().delete(index._link.key(f"H:{index.writer}"))
        assert other._index.recover() == 1  # type: ignore[attr-defined]
        return counts

    index.make_room = lapse_then_room
    try:
        with pytest.raises(WriterFencedError):
            await writer.put(["a0b1"], [b"kv" * 100])
        index.make_room = make_room
        assert not writer.path_of("a0b1").exists()
        assert await other.exists(["a0b1"]) == [False]
        check = await other.check_index()
        assert check is not None and check.consistent, check
        await writer.put(["a0b1"], [b"kv" * 100])  # the writer goes on, as a new incarnation
        assert await other.get_bytes("a0b1") == b"kv" * 100
    finally:
        await writer.close()
        await other.close()
