"""Run hicache-store's conformance suite on the example backend (a plugin author's test file)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from hicache_store.backends import Backend, open_backend
from hicache_store.testing import BackendTests

ExampleBackend = pytest.importorskip(
    "hicache_example_backend",
    reason="pip install --no-deps --no-build-isolation -e tests/plugins/example_backend",
).ExampleBackend


class TestExampleBackend(BackendTests):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        store = open_backend(f"example://{uuid.uuid4().hex}")
        yield store
        await store.close()

    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, ExampleBackend)
        return backend.data.get(key)

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, ExampleBackend)
        backend.data[key] = data
