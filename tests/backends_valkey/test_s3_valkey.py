"""The fleet's index in front of ``s3://`` (SeaweedFS and Valkey, both real, on loopback): the
conformance and retention suites, then the bound, pins and events of several writers."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from hicache_store.backends import Backend, Retention, WriterFencedError, open_backend
from hicache_store.backends.feed import FeedFollower
from hicache_store.backends.s3 import S3Backend
from hicache_store.testing import BackendTests, CapacityUsageTests, RetentionTests

from .valkey_server import ValkeyServer

pytestmark = [pytest.mark.s3]


def _store(seaweed: Any, valkey: ValkeyServer, prefix: str, **options: Any) -> S3Backend:
    store = open_backend(f"s3://{seaweed.bucket}/{prefix}?index={valkey.url}",
                         **seaweed.options, **options)
    assert isinstance(store, S3Backend)
    return store


@pytest.mark.slow
class TestS3ValkeyBackend(BackendTests):
    stateful_max_examples = 4

    @pytest.fixture
    async def backend(self, seaweed: Any, valkey: ValkeyServer) -> AsyncIterator[Backend]:
        self.seaweed, self.valkey = seaweed, valkey
        store = _store(seaweed, valkey, f"t-{secrets.token_hex(6)}", capacity_bytes="256MiB")
        yield store
        await store.close()

    def _raw(self) -> Any:
        return self.seaweed.client()

    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, S3Backend)

        def get() -> bytes | None:
            try:
                response = self._raw().get_object(Bucket=backend.bucket,
                                                  Key=f"{backend.prefix}/{key}")
            except Exception as exc:
                if getattr(exc, "response", {}).get("Error", {}).get("Code") == "NoSuchKey":
                    return None
                raise
            return bytes(response["Body"].read())

        return await asyncio.to_thread(get)

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, S3Backend)
        await asyncio.to_thread(self._raw().put_object, Bucket=backend.bucket,
                                Key=f"{backend.prefix}/{key}", Body=data)
        assert backend._index is not None
        await asyncio.to_thread(backend._index.adopt, [key])  # joins the index, as file's adopt

    async def reopen(self, backend: Backend) -> Backend | None:
        assert isinstance(backend, S3Backend)
        return _store(self.seaweed, self.valkey, backend.prefix, capacity_bytes="256MiB")


class TestS3ValkeyRetention(RetentionTests):
    @pytest.fixture(autouse=True)
    def _servers(self, seaweed: Any, valkey: ValkeyServer) -> None:
        self.seaweed, self.valkey = seaweed, valkey

    async def open_retention_backend(
        self, where: Path, capacity_bytes: int, pin_fraction: float, clock: Callable[[], float]
    ) -> Backend:
        return _store(self.seaweed, self.valkey, f"t-{secrets.token_hex(6)}",
                      capacity_bytes=capacity_bytes, pin_fraction=pin_fraction, clock=clock)


class TestS3ValkeyCapacityUsage(CapacityUsageTests):
    @pytest.fixture(autouse=True)
    def _servers(self, seaweed: Any, valkey: ValkeyServer) -> None:
        self.seaweed, self.valkey = seaweed, valkey

    async def open_bounded_backend(self, where: Path, capacity_bytes: int) -> Backend:
        return _store(self.seaweed, self.valkey, f"t-{secrets.token_hex(6)}",
                      capacity_bytes=capacity_bytes)


async def test_writers_share_one_bound_pins_and_one_feed(seaweed: Any, valkey: ValkeyServer
                                                        ) -> None:
    """Three writers on one prefix, 1,000 bytes of room: together they never pass it, a pin
    made by one holds against the others' evictions, exists never HEADs, and a follower of the
    feed ends with exactly the listing of the bucket."""
    prefix = f"t-{secrets.token_hex(6)}"
    stores = [_store(seaweed, valkey, prefix, capacity_bytes=1000) for _ in range(3)]
    follower = FeedFollower(stores[0].change_feed(), from_start=True)
    seen: set[str] = set()

    def follow() -> None:
        found = follower.read()
        if found.listing is not None:
            seen.clear()
            seen.update(found.listing)
        for key, present in found.changes:
            (seen.add if present else seen.discard)(key)

    try:
        await stores[0].put(["f0"], [b"f" * 100])
        await stores[0].retain(["f0"], Retention("pinner", None, pinned=True))
        for i in range(30):
            store = stores[i % 3]
            await store.put([f"c{i:02d}a", f"c{i:02d}b"], [b"x" * 100, b"y" * 100])
            assert stores[1].used_bytes <= 1000
            if i % 7 == 0:
                follow()
        heads = stores[2].s3_stats.requests
        assert await stores[2].exists(["f0", "c29a", "c00a"]) == [True, True, False]
        assert stores[2].s3_stats.requests == heads  # the index answered: no HEAD
        listed = {key async for key in stores[1].list_prefix("")}
        assert "f0" in listed and sum(s.stats.evictions for s in stores) > 0
        assert stores[0].used_bytes == 100 * len(listed) <= 1000
        follow()
        assert seen == listed
        check = await stores[1].check_index()
        assert check is not None and check.consistent
    finally:
        for store in stores:
            await store.close()


async def test_a_put_reclaimed_before_it_published_leaves_no_unaccounted_object(
        seaweed: Any, valkey: ValkeyServer) -> None:
    """As for the file backend (``test_file_valkey``): a writer reclaimed between making room
    and uploading fails its put, and the object it uploaded is removed at once."""
    prefix = f"t-{secrets.token_hex(6)}"
    writer, other = _store(seaweed, valkey, prefix), _store(seaweed, valkey, prefix)
    index = writer._index
    assert index is not None and other._index is not None
    make_room = index.make_room

    def lapse_then_room(*args: Any, **kwargs: Any) -> Any:
        counts = make_room(*args, **kwargs)
        valkey.client().delete(index._link.key(f"H:{index.writer}"))  # type: ignore[attr-defined]
        assert other._index.recover() == 1  # type: ignore[union-attr]
        return counts

    index.make_room = lapse_then_room  # type: ignore[method-assign]
    try:
        with pytest.raises(WriterFencedError):
            await writer.put(["a0b1"], [b"kv" * 100])
        index.make_room = make_room  # type: ignore[method-assign]
        listed = await asyncio.to_thread(
            seaweed.client().list_objects_v2, Bucket=writer.bucket, Prefix=f"{prefix}/")
        assert listed.get("KeyCount", 0) == 0, listed.get("Contents")
        assert await other.exists(["a0b1"]) == [False]
        await writer.put(["a0b1"], [b"kv" * 100])
        assert await other.get_bytes("a0b1") == b"kv" * 100
    finally:
        await writer.close()
        await other.close()
