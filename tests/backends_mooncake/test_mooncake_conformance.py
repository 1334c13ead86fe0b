"""The public conformance suite on the ``mooncake`` backend, against a real master and a
separate segment-holder process, every byte over TCP loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from hicache_store.backends import Backend, open_backend
from hicache_store.backends.mooncake import EMPTY_SUFFIX, MooncakeBackend
from hicache_store.testing import BackendTests

pytestmark = pytest.mark.mooncake


def raw_store(backend: Backend) -> Any:
    """The ``MooncakeDistributedStore`` under the backend: the oracle talks to it directly."""
    assert isinstance(backend, MooncakeBackend)
    client = backend._client_sync()
    return client.store


class MooncakeOracle:
    url: str
    options: dict[str, Any]

    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        store = raw_store(backend)

        def get() -> bytes | None:
            if store.is_exist(key) == 1:
                return bytes(store.get(key))
            return b"" if store.is_exist(key + EMPTY_SUFFIX) == 1 else None

        return await asyncio.to_thread(get)

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        store = raw_store(backend)

        def put() -> None:
            if data:  # Mooncake cannot hold 0 bytes: the backend stores a marker instead
                store.remove(key + EMPTY_SUFFIX, True)
                assert store.upsert(key, data) == 0
            else:
                store.remove(key, True)
                assert store.upsert(key + EMPTY_SUFFIX, b"\x00") == 0

        await asyncio.to_thread(put)

    async def reopen(self, backend: Backend) -> Backend | None:
        # Not persistent, but shared: a second client of the same master sees the objects.
        return open_backend(self.url, **self.options)


class TestMooncakeBackend(MooncakeOracle, BackendTests):
    stateful_max_examples = 8
    stateful_step_count = 10

    @pytest.fixture
    async def backend(self, mooncake_url: Callable[..., str]) -> AsyncIterator[Backend]:
        options: dict[str, Any] = {"bounce": "8MiB", "threads": 2, "timeout": 20}
        self.url, self.options = mooncake_url(**options), options
        store = open_backend(self.url, **options)
        raw = raw_store(store)
        await asyncio.to_thread(raw.remove_all, True)  # an empty store for every test
        yield store
        await store.close()


class TestMooncakeBackendSmallSlabs(MooncakeOracle, BackendTests):
    """The suite again with 1 MiB staging slabs, so the larger objects of the suite take the
    path that registers temporary memory per call (and batches split into several chunks)."""

    stateful_max_examples = 4
    stateful_step_count = 8

    @pytest.fixture
    async def backend(self, mooncake_url: Callable[..., str]) -> AsyncIterator[Backend]:
        options: dict[str, Any] = {"bounce": "2MiB", "threads": 2, "timeout": 20}
        self.url, self.options = mooncake_url(**options), options
        store = open_backend(self.url, **options)
        raw = raw_store(store)
        await asyncio.to_thread(raw.remove_all, True)
        yield store
        await store.close()
