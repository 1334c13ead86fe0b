"""The public conformance suite on the ``s3`` backend, against a real SeaweedFS server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hicache_store.backends import Backend, open_backend
from hicache_store.backends.s3 import S3Backend
from hicache_store.testing import BackendTests

from .seaweed import SeaweedServer

# The whole suite against a real server: about 3 minutes (the same suite runs in the fast loop
# against the memory, file and hf3fs backends).
pytestmark = [pytest.mark.s3, pytest.mark.slow]


class S3Oracle:
    """Reads and writes objects with a plain boto3 client, around the backend's API."""

    server: SeaweedServer
    _client: Any = None

    def _raw(self) -> Any:
        if S3Oracle._client is None:
            S3Oracle._client = self.server.client()
        return S3Oracle._client

    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, S3Backend)

        def get() -> bytes | None:
            try:
                response = self._raw().get_object(Bucket=backend.bucket, Key=f"{backend.prefix}/{key}")
            except Exception as exc:
                if getattr(exc, "response", {}).get("Error", {}).get("Code") == "NoSuchKey":
                    return None
                raise
            return bytes(response["Body"].read())

        return await asyncio.to_thread(get)

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, S3Backend)
        await asyncio.to_thread(
            self._raw().put_object, Bucket=backend.bucket, Key=f"{backend.prefix}/{key}", Body=data
        )

    async def reopen(self, backend: Backend) -> Backend | None:
        assert isinstance(backend, S3Backend)
        return open_backend(f"s3://{backend.bucket}/{backend.prefix}", **self.server.options)


class TestS3Backend(S3Oracle, BackendTests):
    stateful_max_examples = 8
    stateful_step_count = 10

    @pytest.fixture
    async def backend(self, seaweed: SeaweedServer, s3_prefix: str) -> AsyncIterator[Backend]:
        S3Oracle.server = seaweed
        store = open_backend(
            f"s3://{seaweed.bucket}/{s3_prefix}?max_concurrency=8&max_attempts=2",
            **seaweed.options,
        )
        yield store
        await store.close()


class TestS3BackendCapacity(S3Oracle, BackendTests):
    """The same contracts with the capacity bound on (eviction code on every write) and
    plain check-then-write instead of conditional puts."""

    stateful_max_examples = 4

    @pytest.fixture
    async def backend(self, seaweed: SeaweedServer, s3_prefix: str) -> AsyncIterator[Backend]:
        S3Oracle.server = seaweed
        store = open_backend(
            {"url": f"s3://{seaweed.bucket}/{s3_prefix}", "capacity_bytes": "64MiB",
             "conditional_put": "false", "range_coalesce_gap": "4KiB", **seaweed.options}
        )
        yield store
        await store.close()
