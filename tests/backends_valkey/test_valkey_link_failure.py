"""The fleet's index when its server fails: unreachable, stopped, restarted with and without
persistence; and a writer whose lease lapses while it writes. Real Valkey servers, real files."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_store.backends import (
    BackendUnavailableError,
    Retention,
    WriterFencedError,
    open_backend,
)
from hicache_store.backends.file import FileBackend

from .valkey_server import ValkeyServer, server_or_skip

#: a hang detector for one call (a correct refusal takes the index's 0.5 s timeout at most)
CALL_LIMIT_S = 60.0


@pytest.fixture
def server() -> Iterator[ValkeyServer]:
    node = ValkeyServer(server_or_skip()).start()
    yield node
    node.remove()


@pytest.fixture
def durable_server() -> Iterator[ValkeyServer]:
    node = ValkeyServer(server_or_skip(), appendonly=True).start()
    yield node
    node.remove()


def _open(root: Path, url: str, **options: object) -> FileBackend:
    store = open_backend(f"file://{root}?index={url}&index_timeout_s=0.5", **options)
    assert isinstance(store, FileBackend)
    return store


def _blob(key: str) -> bytes:
    return key.encode() * 100


async def test_unreachable_refuses_writes_once_logged_and_reads_probe_the_store(
        tmp_path: Path, server: ValkeyServer, caplog: pytest.LogCaptureFixture) -> None:
    store = _open(tmp_path / "s", server.url, capacity_bytes="1MiB")
    keys = [f"a{i}" for i in range(10)]
    try:
        await store.put(keys, [_blob(k) for k in keys])
        await store.retain(["a0"], Retention("pinner", None, pinned=True))
        server.kill()
        caplog.set_level(logging.WARNING)
        for i in range(5):
            with pytest.raises(BackendUnavailableError):
                await asyncio.wait_for(store.put([f"b{i}"], [_blob(f"b{i}")]), CALL_LIMIT_S)
        assert store.stats.index_refusals == 5
        down = [r for r in caplog.records if "does not answer" in r.getMessage()]
        assert len(down) == 1, [r.getMessage() for r in caplog.records]
        # reads go on: exists asks the files, reads verify as always
        assert await asyncio.wait_for(store.exists(["a3", "b0"]), CALL_LIMIT_S) == [True, False]
        assert await store.get_bytes("a3") == _blob("a3")
        # the server comes back empty (no persistence): the index is built from the files
        server.start()
        await asyncio.sleep(0.6)  # (the link refuses at once for RETRY_S after a failure)
        await store.put(["c0"], [_blob("c0")])
        assert store._index.rebuilt
        check = await store.check_index()
        assert check is not None and check.consistent and check.listed_objects == 11
        assert check.details.get("rebuilt_at", 0) > 0  # doctor says so
        assert await store.retention_of(["a0"]) == [()]  # the pin did not survive, and
        lost = [r for r in caplog.records if "pins and retention" in r.getMessage()]
        assert len(lost) == 1  # the loss was reported, not silent
        assert await store.exists([*keys, "c0"]) == [True] * 11
    finally:
        await store.close()


async def test_a_stopped_server_turns_into_a_refusal_not_a_hang(
        tmp_path: Path, server: ValkeyServer) -> None:
    store = _open(tmp_path / "s", server.url)
    try:
        await store.put(["a0"], [_blob("a0")])
        server.pause()
        try:
            with pytest.raises(BackendUnavailableError):
                await asyncio.wait_for(store.put(["b0"], [_blob("b0")]), CALL_LIMIT_S)
            assert await asyncio.wait_for(store.exists(["a0"]), CALL_LIMIT_S) == [True]
        finally:
            server.resume()
        await asyncio.sleep(0.6)
        await store.put(["b0"], [_blob("b0")])
        assert await store.exists(["a0", "b0"]) == [True, True]
    finally:
        await store.close()


async def test_a_restart_with_persistence_loses_nothing(
        tmp_path: Path, durable_server: ValkeyServer) -> None:
    root = tmp_path / "s"
    store = _open(root, durable_server.url, capacity_bytes=20 * 4096, capacity_counts="size")
    keys = [f"a{i:02d}" for i in range(10)]
    await store.put(keys, [b"x" * 4096] * 10)
    await store.retain(["a09"], Retention("pinner", None, pinned=True))  # the tail: first to go
    before = store._index.totals()
    await store.close()
    durable_server.kill()  # a crash: what the append-only file has is what it acknowledged
    durable_server.start()
    again = _open(root, durable_server.url, capacity_bytes=20 * 4096, capacity_counts="size")
    try:
        assert not again._index.rebuilt
        assert again._index.totals() == before
        assert await again.retention_of(["a09"]) == [(Retention("pinner", None, True),)]
        await again.put([f"b{i:02d}" for i in range(15)], [b"y" * 4096] * 15)  # evicts 5
        assert await again.exists(["a09"]) == [True]
    finally:
        await again.close()


async def test_a_writer_whose_lease_lapsed_cannot_settle_and_gc_removes_what_it_published(
        tmp_path: Path, server: ValkeyServer) -> None:
    """A stopped writer (its heartbeat stops renewing: what SIGSTOP does to it) is reclaimed
    by another; woken, its put in flight reports failure and the object it published after
    the reclaim is removed by the reconcile (gc)."""
    root = tmp_path / "s"
    sleeper = _open(root, server.url, index_lease_s=1.0)
    other = _open(root, server.url, index_lease_s=1.0)
    try:
        index = sleeper._index
        reservation = await asyncio.to_thread(index.reserve, ["a0"], [400], sleeper.capacity_bytes)
        index._stop.set()  # stopped: its lease is not renewed any more
        index._heart.join()
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(other._index.recover) == 0:
            assert time.monotonic() < deadline, "the lapsed writer was never reclaimed"
            await asyncio.sleep(0.2)
        # it wakes and publishes, then tries to settle
        await asyncio.to_thread(sleeper._engine.write, ["a0"], [memoryview(_blob("a0"))])
        with pytest.raises(WriterFencedError):
            await asyncio.to_thread(index.settle_put, reservation)
        assert await other.exists(["a0"]) == [False]
        assert sleeper.path_of("a0").exists()  # published, unaccounted
        check = await other.check_index(repair=True)  # what gc does first
        assert check is not None and check.removed == 1 and check.consistent
        assert not sleeper.path_of("a0").exists()
        assert other._index.reserved_bytes() == 0
    finally:
        await sleeper.close()
        await other.close()
