"""The faulty wrapper: transparent with faults off (conformance), and each fault as promised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from hicache_store.backends import (
    Backend,
    BackendTimeoutError,
    BackendUnavailableError,
    ByteRange,
    OutOfSpaceError,
    open_backend,
)
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.backends.memory import MemoryBackend
from hicache_store.layout.errors import CorruptObjectError
from hicache_store.layout.framing import decode_header, verify_blocks
from hicache_store.layout.keys import format_key
from hicache_store.objects.io import ObjectIO
from hicache_store.testing import BackendTests, RetentionTests, framed_object


def _inner(backend: Backend) -> MemoryBackend:
    assert isinstance(backend, FaultyBackend) and isinstance(backend.inner, MemoryBackend)
    return backend.inner


class TestFaultyMemoryRetention(RetentionTests):
    """Retention calls reach the inner backend (with faults off, exactly as on it)."""

    async def open_retention_backend(
        self, where: Path, capacity_bytes: int, pin_fraction: float, clock: Callable[[], float]
    ) -> Backend:
        return FaultyBackend(MemoryBackend(capacity_bytes, pin_fraction, clock))


async def test_retention_calls_get_injected_errors() -> None:
    store = FaultyBackend(MemoryBackend(), FaultConfig(error_rate=1.0))
    with pytest.raises(BackendUnavailableError, match="injected"):
        await store.retention_of(["a0"])


class TestFaultyMemoryFaultsOff(BackendTests):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        store = open_backend("faulty://?seed=3", inner="memory://")
        yield store
        await store.close()

    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        return _inner(backend).raw_get(key)

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        _inner(backend).raw_set(key, data)

    async def reopen(self, backend: Backend) -> Backend | None:
        return None  # over a memory backend: not persistent


def _faulty(**faults: float) -> FaultyBackend:
    return FaultyBackend(MemoryBackend(), FaultConfig(seed=1, **faults))  # type: ignore[arg-type]


async def test_errors_are_retryable_and_seeded() -> None:
    outcomes = []
    errors: list[BackendUnavailableError] = []
    for _ in range(2):
        store = _faulty(error_rate=0.5)
        run = []
        for _ in range(20):
            try:
                await store.exists(["a0"])
                run.append(True)
            except BackendUnavailableError as exc:
                errors.append(exc)
                run.append(False)
        outcomes.append(run)
    assert outcomes[0] == outcomes[1]
    assert True in outcomes[0]
    assert False in outcomes[0]
    assert all(exc.retryable for exc in errors)


async def test_timeouts() -> None:
    store = _faulty(timeout_rate=1.0, timeout_s=0.001)
    with pytest.raises(BackendTimeoutError):
        await store.get_into(["a0"], [bytearray(1)])
    assert store.injected["timeout"] == 1


async def test_full_disk_fails_writes_while_reads_go_on() -> None:
    store = _faulty()
    await store.put(["a0"], [b"kept"])
    store.faults = FaultConfig(out_of_space_rate=1.0)
    with pytest.raises(OutOfSpaceError) as info:
        await store.put(["a1"], [b"lost"])
    assert isinstance(info.value, OSError)
    assert await store.get_bytes("a0") == b"kept"
    assert await store.exists(["a1"]) == [False]


async def test_torn_writes_are_caught_by_framing() -> None:
    store = _faulty(torn_write_rate=1.0)
    key, blob = framed_object()
    await store.put([format_key(key)], [blob])
    assert len(_inner(store).raw_get(format_key(key)) or b"") < len(blob)
    with pytest.raises(CorruptObjectError):
        await ObjectIO(store).read_object(format_key(key))


async def test_bit_flips_are_caught_by_framing_and_storage_stays_intact() -> None:
    store = _faulty()
    key, blob = framed_object()
    name = format_key(key)
    await store.put([name], [blob])
    store.faults = FaultConfig(seed=5, bit_flip_rate=1.0)
    with pytest.raises(CorruptObjectError):
        await ObjectIO(store).read_object(name)
    assert _inner(store).raw_get(name) == blob
    store.faults = FaultConfig()
    got = await ObjectIO(store).read_object(name)
    assert got is not None and bytes(got[1]) == blob[-4096:]


async def test_latency_is_added() -> None:
    store = _faulty(latency_s=0.0, latency_jitter_s=0.001)
    await store.put(["a0"], [b"x"])
    assert await store.get_bytes("a0") == b"x"


def test_bad_fault_config_is_refused() -> None:
    with pytest.raises(ValueError, match="error_rate"):
        FaultConfig(error_rate=2.0)
    with pytest.raises(ValueError, match="unknown fault option"):
        FaultConfig.from_options({"eror_rate": "0.1"})


def test_faulty_url_needs_an_inner_backend() -> None:
    with pytest.raises(ValueError, match="inner"):
        open_backend("faulty://")
    store = open_backend("faulty://?inner=memory%3A%2F%2F&error_rate=0.25")
    assert isinstance(store, FaultyBackend) and store.faults.error_rate == 0.25


async def test_scatter_reads_get_the_read_faults() -> None:
    store = _faulty()
    data = bytes(range(256)) * 40
    await store.put(["a0"], [data])
    # Faults off: forwarded to the inner backend's own scatter read (one read there).
    buffers = [bytearray(4096), bytearray(len(data) - 4096)]
    assert await store.get_scatter("a0", buffers, ByteRange(0, len(data))) == len(data)
    assert b"".join(buffers) == data
    assert _inner(store).stats.reads == 1
    store.faults = FaultConfig(read_error_rate=1.0)
    with pytest.raises(BackendUnavailableError):
        await store.get_scatter("a0", buffers, ByteRange(0, len(data)))
    store.faults = FaultConfig(timeout_rate=1.0, timeout_s=0.001)
    with pytest.raises(BackendTimeoutError):
        await store.get_scatter("a0", buffers, ByteRange(0, len(data)))
    assert store.injected["error"] == 1
    assert store.injected["timeout"] == 1


@pytest.mark.parametrize("seed", range(6))
async def test_scatter_bit_flips_land_in_one_buffer_and_storage_stays_intact(seed: int) -> None:
    store = _faulty()
    key, blob = framed_object()
    name = format_key(key)
    await store.put([name], [blob])
    store.faults = FaultConfig(seed=seed, bit_flip_rate=1.0)
    header, payload = bytearray(4096), bytearray(len(blob) - 4096)
    assert await store.get_scatter(name, [header, payload], ByteRange(0, len(blob))) == len(blob)
    got = bytes(header) + bytes(payload)
    assert sum(bin(a ^ b).count("1") for a, b in zip(got, blob, strict=True)) == 1
    assert store.injected["bit_flip"] == 1
    assert _inner(store).raw_get(name) == blob
    with pytest.raises(CorruptObjectError):  # what the cache tier's verification sees
        verify_blocks(decode_header(header, expected=key, object_length=len(blob)), payload, 0, 4)


#: how late the in-flight reads land (long against any scheduling hiccup of the test).
LANDING = 0.25


@pytest.mark.parametrize("scatter", [False, True])
async def test_inflight_reads_land_late_unless_the_contract_waits_for_them(scatter: bool) -> None:
    store = _faulty()
    data = bytes(range(1, 256)) * 64
    await store.put(["a0"], [data])
    store.faults = FaultConfig(inflight_latency_s=LANDING)

    def buffers() -> list[bytearray]:
        return [bytearray(100), bytearray(len(data) - 100)] if scatter else [bytearray(len(data))]

    async def read(bufs: list[bytearray], *, core: bool) -> object:
        if scatter:
            views = [memoryview(b) for b in bufs]
            if core:  # bypasses the public method, and with it the contract
                return await store._get_scatter("a0", views, ByteRange(0, len(data)))
            return await store.get_scatter("a0", bufs, ByteRange(0, len(data)))
        if core:
            return await store._get_into(["a0"], [memoryview(bufs[0])], [None])
        return await store.get_into(["a0"], bufs)

    # The core alone reproduces the bug: cancelled once its transfer is under way (the inner
    # read done, the landing armed in the same step), it ends at once; the bytes land later.
    bufs = buffers()
    reads = _inner(store).stats.reads
    task = asyncio.ensure_future(read(bufs, core=True))
    for _step in range(1000):  # a few loop steps: the guarded inner read, then the arming
        if _inner(store).stats.reads != reads:
            break
        await asyncio.sleep(0)
    assert _inner(store).stats.reads == reads + 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b"".join(bufs) == bytes(len(data)), "landed before the cancellation?"
    await asyncio.sleep(3 * LANDING)
    assert b"".join(bufs) == data, "the in-flight read never landed"
    # Through the public method the timeout is raised only once the bytes are in: after it,
    # the caller's buffer is its own (the contract of backends/base.py).
    bufs = buffers()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(read(bufs, core=False), 0.001)
    assert b"".join(bufs) == data
    for buf in bufs:
        buf[:] = b"\xa5" * len(buf)
    await asyncio.sleep(3 * LANDING)
    assert all(buf == b"\xa5" * len(buf) for buf in bufs)
    # Not given up on: an ordinary (slow) read.
    bufs = buffers()
    assert await read(bufs, core=False) in ([len(data)], len(data))
    assert b"".join(bufs) == data
    assert store.injected["inflight_read"] == 3


async def test_faulty_url_validates_fault_options_before_opening_the_inner_store(
    tmp_path: Path,
) -> None:
    root = tmp_path / "inner"
    with pytest.raises(ValueError, match="error_rate"):
        open_backend(f"faulty://?inner=file://{root}&error_rate=2")
    with pytest.raises(ValueError, match="unknown fault option"):
        open_backend(f"faulty://?inner=file://{root}&eror_rate=0.1")
    assert not root.exists(), "the inner store was created before the options were refused"
