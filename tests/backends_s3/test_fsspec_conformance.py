"""The public conformance suite on the ``fsspec`` backend: memory, local files, and s3fs
against the real SeaweedFS server."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from hicache_store.backends import Backend, open_backend
from hicache_store.backends.fsspec import FsspecBackend
from hicache_store.testing import BackendTests

from .seaweed import SeaweedServer

pytest.importorskip("fsspec")


class FsspecOracle:
    """Reads and writes the object's file through the filesystem object, around the API."""

    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, FsspecBackend)

        def get() -> bytes | None:
            backend.fs.invalidate_cache()
            try:
                return bytes(backend.fs.cat_file(f"{backend.root}/{key}"))
            except FileNotFoundError:
                return None

        return await asyncio.to_thread(get)

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, FsspecBackend)
        await asyncio.to_thread(backend.fs.pipe_file, f"{backend.root}/{key}", data)

    async def reopen(self, backend: Backend) -> Backend | None:
        assert isinstance(backend, FsspecBackend)
        return open_backend({"url": f"fsspec+{backend.protocol}://{backend.root}",
                             "backend": "fsspec", **getattr(self, "extra", {})})

    def missing_location(self, backend: Backend, path: Path) -> dict[str, Any]:
        # A root beside the fixture's, on the same filesystem (a local path for ``file``).
        assert isinstance(backend, FsspecBackend)
        root = path if backend.protocol == "file" else f"{backend.root}-missing-{path.name}"
        return {"url": f"fsspec+{backend.protocol}://{root}", "backend": "fsspec",
                **getattr(self, "extra", {})}

    def location_exists(self, backend: Backend, config: str | Mapping[str, Any]) -> bool:
        assert isinstance(backend, FsspecBackend) and not isinstance(config, str)
        if backend.protocol == "file":
            return super().location_exists(backend, config)
        backend.fs.invalidate_cache()
        return bool(backend.fs.exists(str(config["url"]).split("://", 1)[1]))


class TestFsspecMemory(FsspecOracle, BackendTests):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        # The memory filesystem is one process-wide dict: a fresh root per test.
        store = open_backend(
            {"url": f"fsspec+memory://hicache-{secrets.token_hex(6)}/kv", "backend": "fsspec"}
        )
        yield store
        await store.close()


class TestFsspecFile(FsspecOracle, BackendTests):
    stateful_max_examples = 8

    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        store = open_backend({"url": f"fsspec+file://{tmp_path}/kv", "backend": "fsspec"})
        assert isinstance(store, FsspecBackend)
        assert store.atomic_write == "rename"
        yield store
        await store.close()


# The whole suite against a real server: minutes (its fsspec+file twin runs in the fast loop).
@pytest.mark.slow
@pytest.mark.s3
class TestFsspecS3(FsspecOracle, BackendTests):
    stateful_max_examples = 5
    extra: dict[str, Any]

    @pytest.fixture
    async def backend(self, seaweed: SeaweedServer, s3_prefix: str) -> AsyncIterator[Backend]:
        pytest.importorskip("s3fs")
        TestFsspecS3.extra = {
            "endpoint_url": seaweed.endpoint_url, "key": seaweed.access_key,
            "secret": seaweed.secret_key, "client_kwargs": {"region_name": "us-east-1"},
            "skip_instance_cache": True,
        }
        store = open_backend(
            {"url": f"fsspec+s3://{seaweed.bucket}/{s3_prefix}", "backend": "fsspec",
             **TestFsspecS3.extra}
        )
        yield store
        await store.close()
