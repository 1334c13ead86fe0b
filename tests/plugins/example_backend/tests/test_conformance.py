"""Run hicache-store's conformance suite on the example backend (a plugin author's test file).

Runs under any pytest-asyncio mode: the async fixture is declared with ``pytest_asyncio``, and
the suite's tests are marked ``asyncio`` themselves.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hicache_store.backends import Backend, open_backend
from hicache_store.testing import BackendTests

ExampleBackend = pytest.importorskip(
    "hicache_example_backend",
    reason="pip install -e tests/plugins/example_backend (see its README)",
).ExampleBackend


class TestExampleBackend(BackendTests):
    @pytest_asyncio.fixture
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

    async def reopen(self, backend: Backend) -> Backend | None:
        # A second instance over the same named store (what another user of it would open).
        assert isinstance(backend, ExampleBackend)
        return open_backend(f"example://{backend.store_name}")
