"""The backend conformance suite on the file backend, as an installed package's user runs it
(``check_wheel.py`` copies this file out of the checkout as ``test_file_conformance.py``).

Runs under pytest-asyncio's default (strict) mode, like a plugin author's test file: the
fixture is declared with ``pytest_asyncio``, the suite's tests mark themselves.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from hicache_store.backends import Backend, open_backend
from hicache_store.backends.file import FileBackend
from hicache_store.testing import BackendTests


class TestInstalledFileBackend(BackendTests):
    @pytest_asyncio.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        store = open_backend(f"file://{tmp_path}/store?durability=data", capacity_bytes="256MiB")
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
        return FileBackend(backend.root, durability=backend.durability, index=backend.index_kind)

    def missing_location(self, backend: Backend, path: Path) -> str:
        assert isinstance(backend, FileBackend)
        return f"file://{path}?index={backend.index_kind}"
