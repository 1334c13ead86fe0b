"""The conformance suite on the hf3fs backend: POSIX engine on a local directory, and the
USRBIO engine against the FAKE ``hf3fs_fuse.io`` (which also checks the call sequence)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest

from hicache_store.backends import Backend, open_backend
from hicache_store.backends.hf3fs import HF3FSBackend
from hicache_store.testing import BackendTests


class HF3FSOracle:
    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, HF3FSBackend)
        path = backend.path_of(key)
        return path.read_bytes() if path.exists() else None

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, HF3FSBackend)
        path = backend.path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        await backend.adopt([key])  # files placed behind the backend's back join the index

    async def reopen(self, backend: Backend) -> Backend | None:
        assert isinstance(backend, HF3FSBackend)
        return HF3FSBackend(backend.root, engine=backend.engine,  # type: ignore[arg-type]
                            durability=backend.durability)

    def missing_location(self, backend: Backend, path: Path) -> str:
        return f"hf3fs://{path}?engine=posix"


class TestHF3FSPosix(HF3FSOracle, BackendTests):
    """A local directory is not a 3FS mount: ``engine=auto`` must choose POSIX."""

    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        store = open_backend(f"hf3fs://{tmp_path}/kv?durability=data", capacity_bytes="256MiB")
        assert isinstance(store, HF3FSBackend) and store.engine == "posix"
        yield store
        await store.close()


class TestHF3FSUsrbioFake(HF3FSOracle, BackendTests):
    """USRBIO engine on the FAKE: a small ring and staging region so batches split."""

    stateful_max_examples = 10

    @pytest.fixture
    async def backend(self, fake_usrbio: ModuleType, fake_mount: Path) -> AsyncIterator[Backend]:
        store = open_backend(
            f"hf3fs://{fake_mount}/kv", engine="usrbio", ring_entries=8,
            staging_bytes="256KiB", capacity_bytes="256MiB",
        )
        assert isinstance(store, HF3FSBackend) and store.engine == "usrbio"
        yield store
        await store.close()
        assert fake_usrbio.STATE.check_clean() == []
