"""The file backend with a fleet's index (``index=valkey://...``): the backend conformance suite
and the retention suite, on a real Valkey server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from hicache_store.backends import Backend, open_backend
from hicache_store.backends.file import FileBackend
from hicache_store.testing import BackendTests, RetentionTests

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
