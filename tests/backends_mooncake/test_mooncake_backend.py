"""Mooncake-specific behaviour against real servers: zero-copy through registered memory,
return codes, a segment holder killed mid-batch and restarted, deadlines, eviction."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from hicache_store.backends import open_backend
from hicache_store.backends._mooncake_client import SharedClient
from hicache_store.backends._mooncake_config import DEFAULT_TIMEOUT
from hicache_store.backends.errors import (
    BackendTimeoutError,
    BackendUnavailableError,
    InvalidRangeError,
)
from hicache_store.backends.mooncake import MooncakeBackend
from hicache_store.backends.mooncake_local import LocalMooncake
from hicache_store.backends.types import ByteRange

pytestmark = pytest.mark.mooncake
MiB = 1 << 20


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


def open_mooncake(url: str, **options: Any) -> MooncakeBackend:
    store = open_backend(url, **options)
    assert isinstance(store, MooncakeBackend)
    return store


@pytest.fixture(scope="module")
def own_deployment() -> Iterator[LocalMooncake]:
    """A deployment of this module's own: these tests kill its holder."""
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    with LocalMooncake(segment="256 MB", client_ttl=2) as deployment:
        yield deployment


# -- zero-copy --------------------------------------------------------------------------------


async def test_registered_host_buffer_is_zero_copy(
    mooncake_url: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_mooncake(mooncake_url(), timeout=20)
    pool = np.zeros(16 * MiB, dtype=np.uint8)
    assert await store.host_buffers().register(pool) is True  # zero-copy from now on
    try:
        src = np.random.default_rng(1).integers(0, 256, 8 * MiB, dtype=np.uint8)
        pool[: 8 * MiB] = src

        def no_staging(*_a: object, **_k: object) -> None:
            raise AssertionError("a registered buffer went through a staging slab")

        monkeypatch.setattr(SharedClient, "staging", no_staging)
        ks = keys("ZC", 8)
        await store.put(ks, [memoryview(pool)[i * MiB : (i + 1) * MiB] for i in range(8)])
        dest = memoryview(pool)[8 * MiB :]
        got = await store.get_into(ks, [dest[i * MiB : (i + 1) * MiB] for i in range(8)])
        assert got == [MiB] * 8
        assert np.array_equal(pool[8 * MiB :], src)
        (n,) = await store.get_into([ks[3]], [dest[:100]], [ByteRange(500, 600)])
        assert n == 100 and np.array_equal(pool[8 * MiB : 8 * MiB + 100], src[3 * MiB + 500 : 3 * MiB + 600])
    finally:
        monkeypatch.undo()
        await store.host_buffers().unregister(pool)
        await store.close()


async def test_overlapping_registration_is_refused(mooncake_url: Callable[..., str]) -> None:
    store = open_mooncake(mooncake_url(), timeout=20)
    pool = np.zeros(MiB, dtype=np.uint8)
    await store.host_buffers().register(pool)
    try:
        with pytest.raises(ValueError, match="overlaps"):
            await store.host_buffers().register(pool[4096:])
    finally:
        await store.close()


# -- return codes -------------------------------------------------------------------------------


# -- calls on one key ------------------------------------------------------------------------


class OverlapProbe:
    """The real store with every data call on a key held open a while (``hold_s``), recording
    when a write or remove of a key was in flight together with any other call on that key."""

    def __init__(self, store: Any, hold_s: float) -> None:
        self._store, self._hold_s = store, hold_s
        self._lock = threading.Lock()
        self._in_flight: list[tuple[str, frozenset[str]]] = []
        self.overlaps: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _tracked(self, kind: str, keys: list[str], call: Callable[[], Any]) -> Any:
        entry = (kind, frozenset(keys))
        with self._lock:
            for other_kind, other_keys in self._in_flight:
                if (other_kind, kind) != ("read", "read") and entry[1] & other_keys:
                    self.overlaps.append((other_kind, kind))
            self._in_flight.append(entry)
        try:
            time.sleep(self._hold_s)  # a wide window: a racing call on the key lands in it
            return call()
        finally:
            with self._lock:
                self._in_flight.remove(entry)

    def batch_upsert_from(self, keys: list[str], *args: Any) -> Any:
        return self._tracked("write", keys, lambda: self._store.batch_upsert_from(keys, *args))

    def batch_get_into(self, keys: list[str], *args: Any) -> Any:
        return self._tracked("read", keys, lambda: self._store.batch_get_into(keys, *args))

    def batch_remove(self, keys: list[str], force: bool) -> Any:
        return self._tracked("remove", keys, lambda: self._store.batch_remove(keys, force))


async def test_a_write_or_delete_of_a_key_never_overlaps_another_call_on_it(
    mooncake_url: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mooncake's master lets two upserts of a key from one client (every backend of the
    # process shares it) race into a reader getting stale memory at the new length, rewrites
    # same-size objects in place and frees force-removed ones under a reader. So a write or
    # delete of a key must be alone on it within the process; reads may share. Four threads,
    # all calls on one key issued at once, each held open 0.3 s: without the per-key locks
    # they all overlap.
    store = open_mooncake(mooncake_url(threads=4, timeout=20), threads=4, timeout=20)
    client = store._client_sync()
    try:
        await store.put(["ONE0"], [b"a" * 5000])
        probe = OverlapProbe(client.store, hold_s=0.3)
        monkeypatch.setattr(client, "store", probe)
        reads = [bytearray(8000) for _ in range(3)]
        outcomes = await asyncio.gather(
            store.put(["ONE0"], [b"b" * 6000]), store.put(["ONE0"], [b"c" * 7000]),
            *(store.get_into(["ONE0"], [buf]) for buf in reads), store.delete(["ONE0", "ONE1"]))
        assert probe.overlaps == []
        for (n,), buf in zip(outcomes[2:5], reads, strict=True):
            assert n is None or bytes(buf[:n]) in (b"a" * 5000, b"b" * 6000, b"c" * 7000)
    finally:
        monkeypatch.undo()
        await store.close()


async def test_racing_rewrites_of_one_key_never_serve_mixed_bytes(
    mooncake_url: Callable[..., str]
) -> None:
    # The race itself on the real master (conformance's overlapping-keys test hit it once):
    # rewrites of one key at sizes that differ call by call, from several threads, with reads
    # in between. Every read is a miss or exactly one of the versions.
    store = open_mooncake(mooncake_url(threads=4, timeout=20), threads=4, timeout=20)
    versions = [os.urandom(20_000 + 512 * v) for v in range(4)]
    try:
        async def writer(seed: int) -> None:
            for i in range(40):
                await store.put(["RACE0"], [versions[(seed + i) % 4]])

        async def reader() -> None:
            for _ in range(80):
                buf = bytearray(30_000)
                (n,) = await store.get_into(["RACE0"], [buf])
                assert n is None or bytes(buf[:n]) in versions, "mixed bytes"

        await asyncio.gather(*(writer(s) for s in range(3)), reader(), reader())
    finally:
        await store.close()


async def test_leased_object_is_still_deleted(mooncake_url: Callable[..., str]) -> None:
    # A read grants the reader a lease; a plain remove then fails with -706. Ours forces.
    store = open_mooncake(mooncake_url(), timeout=20)
    try:
        await store.put(["LEASE0"], [b"x" * 4096])
        assert (await store.get_into(["LEASE0"], [bytearray(4096)])) == [4096]
        assert store._client_sync().store.remove("LEASE0") == -706
        assert await store.delete(["LEASE0"]) == [True]
        assert await store.exists(["LEASE0"]) == [False]
    finally:
        await store.close()


async def test_put_does_not_keep_old_value_and_put_if_absent_does(
    mooncake_url: Callable[..., str]
) -> None:
    store = open_mooncake(mooncake_url(), timeout=20)
    try:
        raw = store._client_sync().store
        await store.put(["OW0"], [b"old"])
        assert raw.put("OW0", b"new") == 0 and bytes(raw.get("OW0")) == b"old"  # Mooncake's put
        await store.put(["OW0"], [b"new"])  # ours replaces (upsert)
        assert await store.get_bytes("OW0") == b"new"
        assert await store.put_if_absent("OW0", b"other") is False
        assert await store.get_bytes("OW0") == b"new"
    finally:
        await store.close()


async def test_too_small_buffer_and_range_past_end(mooncake_url: Callable[..., str]) -> None:
    store = open_mooncake(mooncake_url(), timeout=20)
    try:
        await store.put(["SZ0"], [b"y" * 5000])
        with pytest.raises(InvalidRangeError):  # Mooncake's -600
            await store.get_into(["SZ0"], [bytearray(100)])
        with pytest.raises(InvalidRangeError):
            await store.get_into(["SZ0"], [bytearray(100)], [ByteRange(4950, 5050)])
        assert await store.get_into(["SZ9"], [bytearray(10)]) == [None]  # -704
    finally:
        await store.close()


async def test_unreachable_master_fails_fast() -> None:
    from hicache_store.backends.mooncake_local import free_port

    # Fast: the refused connection fails the call, long before its 600 s timeout (the hang
    # detector, 120 s, fails the test if the call waited for it instead).
    store = open_mooncake(f"mooncake://127.0.0.1:{free_port()}", timeout=600)
    with pytest.raises(BackendUnavailableError) as info:
        await asyncio.wait_for(store.exists(["a0"]), 120)
    assert info.value.retryable
    await store.close()


# -- failures of the deployment ---------------------------------------------------------------


@pytest.mark.slow
async def test_holder_killed_mid_batch_then_restarted(own_deployment: LocalMooncake) -> None:
    store = open_mooncake(own_deployment.url, timeout=15, bounce="16MiB", threads=2)
    try:
        data = [os.urandom(MiB) for _ in range(32)]
        ks = keys("KILL", 32)
        await store.put(ks, data)

        async def reads() -> list[object]:
            outcomes: list[object] = []
            for _ in range(10):
                bufs = [bytearray(MiB) for _ in ks]
                try:
                    got = await store.get_into(ks, bufs)
                except BackendUnavailableError as exc:
                    outcomes.append("retryable" if exc.retryable else exc)
                    continue
                for n, buf, want in zip(got, bufs, data, strict=True):
                    assert n is None or bytes(buf[:n]) == want  # a miss or the right bytes
                outcomes.append(got)
            assert not any(isinstance(o, Exception) for o in outcomes), outcomes
            return outcomes

        task = asyncio.create_task(reads())
        await asyncio.sleep(0.05)
        own_deployment.kill_holder()
        start = time.monotonic()
        await asyncio.wait_for(task, 60)  # never hangs
        assert time.monotonic() - start < 60
        # With the holder gone, writes fail retryably (no segment space) and reads miss.
        await asyncio.sleep(own_deployment.client_ttl + 1.5)
        with pytest.raises(BackendUnavailableError) as info:
            await store.put(["KILL-NEW"], [b"z" * MiB])
        assert info.value.retryable
        assert await store.get_into(ks[:2], [bytearray(MiB), bytearray(MiB)]) == [None, None]
        # A new holder: the same backend object recovers without being recreated.
        own_deployment.start_holder()
        deadline = time.monotonic() + 120  # a hang detector: recovery takes a heartbeat or two
        while True:
            try:
                await store.put(["KILL-NEW"], [b"z" * MiB])
                break
            except BackendUnavailableError:
                assert time.monotonic() < deadline, "no recovery after the holder restarted"
                await asyncio.sleep(0.25)
        assert await store.get_bytes("KILL-NEW") == b"z" * MiB
    finally:
        await store.close()


async def test_deadline_raises_and_late_put_is_undone(own_deployment: LocalMooncake) -> None:
    store = open_mooncake(own_deployment.url, timeout=0.001, bounce="64MiB", threads=1)
    try:
        ks = keys("LATE", 32)
        with pytest.raises(BackendTimeoutError) as info:
            await store.put(ks, [os.urandom(MiB) for _ in ks])
        assert info.value.retryable
        await store.drain()
        store.config.__dict__["timeout"] = 20.0  # frozen dataclass: tests only
        assert await store.exists(ks) == [False] * len(ks)
    finally:
        await store.close()


async def test_eviction_shows_up_as_misses(tmp_path: Any) -> None:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    with LocalMooncake(segment="64 MB", client_ttl=2) as small:
        store = open_mooncake(small.url, timeout=20, bounce="16MiB", threads=2)
        try:
            ks = keys("EV", 160)
            data = {k: os.urandom(MiB) for k in ks}
            errors = 0
            for i in range(0, len(ks), 8):
                batch = ks[i : i + 8]
                try:
                    await store.put(batch, [data[k] for k in batch])
                except BackendUnavailableError as exc:  # pool full before eviction caught up
                    errors += 1 if exc.retryable else 1000
            hits = 0
            for k in ks:
                buf = bytearray(MiB)
                (n,) = await store.get_into([k], [buf])
                if n is not None:
                    assert bytes(buf) == data[k], "evicted or overwritten object read back wrong"
                    hits += 1
            assert errors < 1000, "a non-retryable error under memory pressure"
            assert 0 < hits < len(ks)  # some evicted, none wrong
        finally:
            await store.close()


# -- servers that stop answering (SIGSTOP) ----------------------------------------------------


@pytest.mark.slow
async def test_stopped_master_or_holder_fails_default_calls_within_the_bound(
    own_deployment: LocalMooncake,
) -> None:
    # Default options only: a stopped master, then a stopped segment holder, fails every call
    # with a retryable error within the documented bound (docs/guide/backends/deadlines.md: 15 s), reads
    # into registered memory included (those cannot be abandoned: Mooncake's own timeouts,
    # lowered at setup, end them).
    store = open_mooncake(own_deployment.url)
    pinned = np.zeros(MiB, dtype=np.uint8)
    try:
        await store.host_buffers().register(pinned)
        await store.put(["STOP0"], [b"s" * MiB])
        for who in ("master", "holder"):
            proc = getattr(own_deployment, who)
            assert proc is not None
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                calls = [store.get_into(["STOP0"], [bytearray(MiB)]),
                         store.get_into(["STOP0"], [pinned])]
                if who == "master":
                    calls += [store.exists(["STOP0"]), store.put(["STOP1"], [b"t" * 1000])]
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
                elapsed = time.monotonic() - start
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            for outcome in outcomes:
                if who == "holder" and outcome == [None]:
                    continue  # the master already dropped the unreachable replica: a miss
                assert isinstance(outcome, BackendUnavailableError), (who, outcome)
                assert outcome.retryable
            # bounded by their deadline, not hung (the slack is a hang detector's: a loaded
            # machine is slow to deliver the timeout, never minutes slow)
            assert elapsed < DEFAULT_TIMEOUT + 60, f"{who} stopped: calls took {elapsed:.1f} s"
            await store.drain()
            await asyncio.sleep(own_deployment.client_ttl + 2)  # heartbeats resume
    finally:
        await store.host_buffers().unregister(pinned)
        await store.close()
