"""What only the ``s3`` backend promises, against the real SeaweedFS server: credentials errors
without secrets, a server that dies and comes back, range reads that move only the bytes asked
for, coalescing, multipart uploads, URL options."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_store.backends import (
    Backend,
    BackendTimeoutError,
    BackendUnavailableError,
    ByteRange,
    InvalidRangeError,
    open_backend,
)
from hicache_store.backends._s3_errors import S3AccessDeniedError
from hicache_store.backends._s3_io import plan_fetches
from hicache_store.backends.s3 import DEFAULT_REQUEST_TIMEOUT, S3Backend
from hicache_store.testing import CapacityUsageTests, pattern

from .seaweed import SeaweedServer, weed_or_skip

pytestmark = pytest.mark.s3


@pytest.fixture
async def store(seaweed: SeaweedServer, s3_prefix: str) -> AsyncIterator[S3Backend]:
    backend = open_backend(f"s3://{seaweed.bucket}/{s3_prefix}", **seaweed.options)
    assert isinstance(backend, S3Backend)
    yield backend
    await backend.close()


def _rendered(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


# -- credentials ---------------------------------------------------------------------------------


def test_wrong_secret_fails_at_open_without_the_secret(
    seaweed: SeaweedServer, caplog: pytest.LogCaptureFixture
) -> None:
    from botocore.exceptions import ClientError  # here: the module collects without boto3

    secret = "wrong-secret-" + "Z" * 24
    caplog.set_level(logging.DEBUG)
    with pytest.raises(S3AccessDeniedError) as info:
        open_backend(f"s3://{seaweed.bucket}/x", **{**seaweed.options,
                                                    "aws_secret_access_key": secret})
    # A credential error is not retried: the SDK's answer says the one request was the only
    # attempt (its retry count, not the time it took: that depends on the machine's load).
    cause = info.value.__cause__
    assert isinstance(cause, ClientError)
    assert cause.response["ResponseMetadata"]["RetryAttempts"] == 0
    assert info.value.retryable is False
    assert "access denied" in str(info.value)
    for text in (str(info.value), repr(info.value), _rendered(info.value), caplog.text):
        assert secret not in text
        assert seaweed.secret_key not in text


def test_unknown_access_key_fails_at_open(seaweed: SeaweedServer) -> None:
    with pytest.raises(S3AccessDeniedError) as info:
        open_backend(f"s3://{seaweed.bucket}/x",
                     **{**seaweed.options, "aws_access_key_id": "AKNOBODY00000000"})
    assert info.value.retryable is False


async def test_wrong_secret_on_a_call_is_not_retryable(seaweed: SeaweedServer) -> None:
    secret = "another-wrong-" + "Q" * 20
    store = open_backend(f"s3://{seaweed.bucket}/x", check_bucket=False,
                         **{**seaweed.options, "aws_secret_access_key": secret})
    try:
        for call in (store.exists(["a0"]), store.get_into(["a0"], [bytearray(4)]),
                     store.put(["a0"], [b"x"])):
            with pytest.raises(S3AccessDeniedError) as info:
                await call
            assert secret not in _rendered(info.value)
        assert secret not in repr(store)
    finally:
        await store.close()


def test_missing_bucket_is_a_clear_error(seaweed: SeaweedServer) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        open_backend("s3://no-such-bucket-here/x", **seaweed.options)
    assert info.value.retryable is False


# -- ranges ----------------------------------------------------------------------------------------


async def test_range_reads_move_only_the_bytes_asked_for(store: S3Backend) -> None:
    data = pattern(1 << 20, 1)
    await store.put(["a0"], [data])
    before = store.s3_stats.bytes_received
    buf = bytearray(4096)
    assert await store.get_into(["a0"], [buf], [ByteRange(65536, 65536 + 4096)]) == [4096]
    assert bytes(buf) == data[65536 : 65536 + 4096]
    assert store.s3_stats.bytes_received - before == 4096


async def test_ranges_of_one_key_are_coalesced(store: S3Backend) -> None:
    data = pattern(100_000, 2)
    await store.put(["a0"], [data])
    ranges = [ByteRange(0, 1000), ByteRange(1000, 5000), ByteRange(3000, 4000),
              ByteRange(50_000, 50_100)]
    bufs = [bytearray(r.length) for r in ranges]
    requests = store.s3_stats.requests
    wire = store.s3_stats.bytes_received
    assert await store.get_into(["a0"] * 4, bufs, ranges) == [r.length for r in ranges]
    assert [bytes(b) for b in bufs] == [data[r.start : r.end] for r in ranges]
    assert store.s3_stats.requests - requests == 2  # [0, 5000) and [50000, 50100)
    assert store.s3_stats.bytes_received - wire == 5000 + 100


def test_plan_fetches_gap() -> None:
    ranges = [ByteRange(0, 10), ByteRange(20, 30), None, ByteRange(100, 110)]
    tight = plan_fetches(["k", "k", "k", "k"], ranges, gap=0)
    assert len(tight) == 4
    loose = plan_fetches(["k", "k", "k", "k"], ranges, gap=10)
    assert sorted((f.rng.start, f.rng.end) if f.rng else (-1, -1) for f in loose) == [
        (-1, -1), (0, 30), (100, 110)]


async def test_clamped_range_is_refused(store: S3Backend) -> None:
    await store.put(["a0"], [b"\x01" * 100])
    with pytest.raises(InvalidRangeError):
        await store.get_into(["a0"], [bytearray(200)], [ByteRange(50, 250)])
    with pytest.raises(InvalidRangeError):
        await store.get_into(["a0"], [bytearray(10)], [ByteRange(100, 110)])


# -- multipart, URL options -----------------------------------------------------------------------


async def test_multipart_upload_above_the_threshold(seaweed: SeaweedServer, s3_prefix: str) -> None:
    store = open_backend(
        f"s3://{seaweed.bucket}/{s3_prefix}?multipart_threshold=5MiB&multipart_chunksize=5MiB",
        **seaweed.options,
    )
    assert isinstance(store, S3Backend)
    try:
        data = pattern((11 << 20) + 123, 3)
        await store.put(["a0", "a1"], [data, b"small"])
        assert store.s3_stats.multipart_uploads == 1
        assert await store.get_bytes("a0") == data
        assert await store.get_bytes("a1") == b"small"
        listed = seaweed.client().list_multipart_uploads(Bucket=seaweed.bucket, Prefix=s3_prefix)
        assert not listed.get("Uploads"), "a finished upload was left open"
    finally:
        await store.close()


def test_url_options_are_parsed(seaweed: SeaweedServer) -> None:
    store = open_backend(
        f"s3://{seaweed.bucket}/deep/prefix/?max_concurrency=4&multipart_threshold=32MiB"
        "&connect_timeout=1.5&read_timeout=2&max_attempts=2&check_bucket=no&conditional_put=0"
        "&region_name=us-east-1",
        **{k: v for k, v in seaweed.options.items() if k != "region"},
    )
    assert isinstance(store, S3Backend)
    assert (store.bucket, store.prefix) == (seaweed.bucket, "deep/prefix")
    assert store.max_concurrency == 4
    assert store.multipart_threshold == 32 << 20
    assert store.request_timeout == DEFAULT_REQUEST_TIMEOUT  # not derived from the others
    assert store.capabilities.atomic_put is False
    assert seaweed.secret_key not in repr(store)
    asyncio.run(store.close())


class TestS3CapacityUsage(CapacityUsageTests):
    """The local bound (``capacity_bytes`` without a fleet's index)."""

    @pytest.fixture(autouse=True)
    def _server(self, seaweed: SeaweedServer, s3_prefix: str) -> None:
        self.seaweed, self.prefix = seaweed, s3_prefix

    async def open_bounded_backend(self, where: Path, capacity_bytes: int) -> Backend:
        return open_backend(f"s3://{self.seaweed.bucket}/{self.prefix}/{where.name}",
                            capacity_bytes=capacity_bytes, **self.seaweed.options)


async def test_capacity_evicts_chain_tails_first(seaweed: SeaweedServer, s3_prefix: str) -> None:
    store = open_backend(f"s3://{seaweed.bucket}/{s3_prefix}", capacity_bytes=10_000,
                         **seaweed.options)
    try:
        chain = [f"c{i}" for i in range(5)]
        await store.put(chain, [b"x" * 2000] * 5)
        await store.put(["d0"], [b"y" * 2000])  # over by 2000: the chain's tail goes
        assert await store.exists([*chain, "d0"]) == [True, True, True, True, False, True]
        assert store.stats.evictions == 1
        # A reopened backend learns what is there and keeps enforcing the bound.
        again = open_backend(f"s3://{seaweed.bucket}/{s3_prefix}", capacity_bytes=6_000,
                             **seaweed.options)
        assert isinstance(again, S3Backend)
        assert again.used_bytes == 10_000
        await again.put(["e0"], [b"z" * 2000])
        assert again.used_bytes <= 6_000
        await again.close()
    finally:
        await store.close()


# -- a server that dies and comes back ------------------------------------------------------------


@pytest.mark.slow
async def test_server_death_fails_fast_and_the_backend_recovers(tmp_path: Path) -> None:
    weed = weed_or_skip()
    server = SeaweedServer(weed=weed, root=tmp_path)
    server.start()
    try:
        store = open_backend(
            f"s3://{server.bucket}/kv?connect_timeout=1&read_timeout=2&max_attempts=2",
            **server.options,
        )
        keys = [f"a{i}" for i in range(8)]
        await store.put(keys, [pattern(50_000, i) for i in range(8)])

        async def batches() -> None:
            while True:
                await store.get_into(keys, [bytearray(50_000) for _ in keys])
                await store.put(keys[:2], [pattern(50_000, 0), pattern(50_000, 1)])

        load = asyncio.create_task(batches())
        await asyncio.sleep(0.3)
        server.kill()  # mid-batch, no goodbye
        start = time.monotonic()
        with pytest.raises(BackendUnavailableError) as info:
            await asyncio.wait_for(load, 30)
        assert info.value.retryable is True
        for call in (store.exists(keys), store.put(["b0"], [b"x"])):
            with pytest.raises(BackendUnavailableError) as info:
                await call
            assert info.value.retryable is True
        # a hang detector (a refused connection fails at once; a busy machine is slow to say so)
        assert time.monotonic() - start < 120, "calls on a dead server must fail, not hang"

        server.start()  # same ports, same data
        assert await store.exists(keys) == [True] * 8
        # Right after a restart SeaweedFS may answer GETs with HTTP 500 for a moment (its
        # volume server is still loading; seen on main about 1 run in 4), and on a loaded
        # machine its first PUTs may pass the 2 s read timeout: retryable errors, and the same
        # backend object must get through once the server does.
        deadline = time.monotonic() + 30

        async def once_recovered(call: Callable[[], Awaitable[Any]]) -> Any:
            while True:
                try:
                    return await call()
                except BackendUnavailableError as exc:
                    if not exc.retryable or time.monotonic() > deadline:
                        raise  # not the restart hiccup, or no recovery after it
                    await asyncio.sleep(0.25)

        assert await once_recovered(lambda: store.get_bytes("a5")) == pattern(50_000, 5)
        await once_recovered(lambda: store.put(["b0"], [b"back"]))
        assert await once_recovered(lambda: store.get_bytes("b0")) == b"back"
        await store.close()
    finally:
        server.stop()


# -- a server that stops answering (SIGSTOP) ------------------------------------------------------


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[SeaweedServer]:
    """A server of this test's own (the session's shared one is never stopped)."""
    weed = weed_or_skip()
    server = SeaweedServer(weed=weed, root=tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


def _pause(server: SeaweedServer) -> None:
    """SIGSTOP, and wait until every thread of the server is stopped: the signal is taken
    asynchronously, and on a loaded machine a thread could still answer a request first."""
    assert server.process is not None
    pid = server.process.pid
    os.kill(pid, signal.SIGSTOP)
    for _ in range(1000):  # a hang detector (10 s)
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError), \
                    open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(state in "tT" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"the server did not stop: thread states {states}")


def _resume(server: SeaweedServer) -> None:
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGCONT)


async def test_a_read_past_its_deadline_never_lands_later(own_server: SeaweedServer) -> None:
    # Issue 17's minimal form: the request outlives the call (the server is stopped, then
    # resumed); its answer must never reach the caller's buffer once the call has failed.
    store = open_backend(
        f"s3://{own_server.bucket}/kv?request_timeout=1.5&max_attempts=1", **own_server.options
    )
    payload = pattern(3 << 20, 1)
    await store.put(["a0"], [payload])
    whole, ranged = bytearray(len(payload)), bytearray(1 << 20)
    _pause(own_server)
    try:
        for buf, rng in ((whole, None), (ranged, ByteRange(4096, 4096 + (1 << 20)))):
            with pytest.raises(BackendTimeoutError) as info:
                await store.get_into(["a0"], [buf], None if rng is None else [rng])
            assert info.value.retryable
            buf[:] = b"\xa5" * len(buf)
    finally:
        _resume(own_server)
    await asyncio.sleep(3)  # the abandoned requests get their answers now
    assert whole == b"\xa5" * len(whole), "a late answer landed in the caller's buffer"
    assert ranged == b"\xa5" * len(ranged)
    assert await store.get_bytes("a0") == payload  # and the backend works on
    await store.close()


@pytest.mark.slow
async def test_a_stopped_server_fails_default_calls_within_the_bound(
    own_server: SeaweedServer,
) -> None:
    # Default options only. Every kind of call fails with a retryable error within the
    # documented bound (docs/guide/backends/deadlines.md: request_timeout, 15 s), not in botocore's 110 s.
    store = open_backend(f"s3://{own_server.bucket}/kv", **own_server.options)
    await store.put(["a0"], [b"x" * 100_000])
    _pause(own_server)
    try:
        start = time.monotonic()
        calls = [
            store.get_into(["a0"], [bytearray(100_000)]),
            store.exists(["a0"]),
            store.put(["a1"], [b"y" * 1000]),
            store.stat(["a0"]),
        ]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        elapsed = time.monotonic() - start
        for outcome in outcomes:
            assert isinstance(outcome, BackendUnavailableError), outcome
            assert outcome.retryable
        # Bounded by request_timeout, not botocore's 110 s: the slack is a busy machine's
        # (scheduling, retries' backoff), well short of botocore's bound.
        assert elapsed < DEFAULT_REQUEST_TIMEOUT + 45, f"calls took {elapsed:.1f} s"
        with pytest.raises(BackendUnavailableError) as info:  # opening one, too
            await asyncio.to_thread(open_backend, f"s3://{own_server.bucket}/kv", **own_server.options)
        assert info.value.retryable
        assert time.monotonic() - start < 2 * (DEFAULT_REQUEST_TIMEOUT + 45)
    finally:
        _resume(own_server)
    await store.close()
