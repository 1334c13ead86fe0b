"""``ObjectIO.read_frames`` and ``put_together``: a batch of whole objects in one backend call.
Reads: each object verified on its own, a damaged one fails only its key (file backend, whose
batched reads go through the C accelerator when it is built, and memory backend). Writes: all
stored, or all reported failed when the call fails or runs late, never a buffer read after."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hicache_store.backends import Backend, InvalidRangeError, open_backend
from hicache_store.backends._file_io import SUMS_IN_C
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.layout.errors import (
    CorruptObjectError,
    PayloadChecksumError,
    TruncatedObjectError,
)
from hicache_store.layout.framing import ObjectHeader
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.objects import Frame, ObjectIO

NS = Namespace.create("m", ModelShape.mha(4, 2, 8), "float16", 4, Grid(4, 2))
PAYLOAD = 4 * 2 * 4 * 2 * 8 * 2  # 4 layers of K/V x tokens x heads x dim x 2 bytes


def key(page_hash: str = f"{1:064x}") -> ObjectKey:
    return ObjectKey(page_hash, NS.digest, ObjectCoords(0, 4, 0))


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, PAYLOAD, dtype=np.uint8)


def frame_of(io: ObjectIO, data: np.ndarray, page_hash: str) -> Frame:
    header = io.header_bytes(4)
    buf = memoryview(bytearray(header + PAYLOAD))
    np.frombuffer(buf, dtype=np.uint8)[header:] = data
    return Frame(key(page_hash), buf)


HASHES = [f"{i + 1:064x}" for i in range(6)]


async def store_intact(io: ObjectIO, n: int) -> list[bytes]:
    """Store the first ``n`` of ``HASHES`` intact; their objects' bytes."""
    stored = [frame_of(io, payload(i), h) for i, h in enumerate(HASHES[:n])]
    assert await io.put(stored) == [True] * n
    return [bytes(f.buffer) for f in stored]


async def store_as_is(backend: Backend, objects: dict[int, bytes]) -> None:
    """Store raw bytes under the names of ``HASHES[i]`` (damaged objects)."""
    for i, data in objects.items():
        name = format_key(key(HASHES[i]))
        await backend.delete([name])
        await backend.put([name], [data])


def flipped(data: bytes) -> bytes:
    """``data`` with one payload bit flipped (near its end)."""
    return data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]


def backend_for(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Backend:
    """``file`` (its C reads where built), ``file-python`` (without them) or a memory URL."""
    if url == "file-python":
        return open_backend(f"file://{tmp_path}/s?io_engine=posix")
    return open_backend(f"file://{tmp_path}/s" if url.startswith("file") else url)


def frames_for(io: ObjectIO, n: int) -> list[memoryview]:
    size = io.header_bytes(4) + PAYLOAD
    return [memoryview(bytearray(size)) for _ in range(n)]


@pytest.mark.parametrize("url", ["file", "file-python", "memory://"])
async def test_every_kind_of_object_gets_its_own_outcome(
    tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "file": reads and checksums in one C call where the accelerator is built
    # (``native_reads``); "file-python": the pure-Python reads, verified after.
    backend = backend_for(url, tmp_path, monkeypatch)
    assert backend.capabilities.native_reads == (url == "file" and SUMS_IN_C)
    io = ObjectIO(backend, NS)
    originals = await store_intact(io, 5)
    # 0 intact, 1 truncated, 2 one payload byte flipped, 3 stored longer than its frame,
    # 4 intact, 5 never stored.
    await store_as_is(backend, {1: originals[1][:-1], 2: flipped(originals[2]),
                                3: originals[3] + b"\0" * 16})
    frames = frames_for(io, 6)
    got = await io.read_frames([key(h) for h in HASHES], frames)
    assert isinstance(got[0], ObjectHeader) and isinstance(got[4], ObjectHeader)
    assert bytes(frames[0]) == originals[0] and bytes(frames[4]) == originals[4]
    assert isinstance(got[1], TruncatedObjectError)
    assert isinstance(got[2], PayloadChecksumError)
    assert isinstance(got[3], CorruptObjectError)
    assert got[5] is None
    await backend.close()


async def test_a_header_of_another_key_is_corrupt_not_served(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}/s")
    io = ObjectIO(backend, NS)
    frame = frame_of(io, payload(3), HASHES[0])
    assert await io.put([frame]) == [True]
    await backend.put([format_key(key(HASHES[1]))], [bytes(frame.buffer)])  # under another name
    got = await io.read_frames([key(HASHES[0]), key(HASHES[1])], frames_for(io, 2))
    assert isinstance(got[0], ObjectHeader)
    assert isinstance(got[1], CorruptObjectError)
    await backend.close()


async def test_a_failing_backend_raises_for_the_batch(tmp_path: Path) -> None:
    inner = open_backend(f"file://{tmp_path}/s")
    io = ObjectIO(inner, NS)
    assert await io.put([frame_of(io, payload(1), HASHES[0])]) == [True]
    faulty = FaultyBackend(inner, FaultConfig(read_error_rate=1.0, seed=0))
    with pytest.raises(Exception) as raised:
        await ObjectIO(faulty, NS).read_frames([key(HASHES[0])], frames_for(io, 1))
    assert not isinstance(raised.value, CorruptObjectError)
    await inner.close()


async def test_frames_without_payload_or_mismatched_counts_are_refused(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}/s")
    io = ObjectIO(backend, NS)
    with pytest.raises(ValueError, match="no payload"):
        await io.read_frames([key()], [memoryview(bytearray(io.header_bytes(4)))])
    with pytest.raises(ValueError, match="frames"):
        await io.read_frames([key()], [])
    assert await io.read_frames([], []) == []
    await backend.close()


async def test_put_together_stores_every_frame_and_reads_back(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}/s")
    io = ObjectIO(backend, NS)
    frames = [frame_of(io, payload(i), h) for i, h in enumerate(HASHES[:4])]
    assert await io.put_together(frames) == [True] * 4
    out = frames_for(io, 4)
    got = await io.read_frames([key(h) for h in HASHES[:4]], out)
    assert all(isinstance(g, ObjectHeader) for g in got)
    assert [bytes(o) for o in out] == [bytes(f.buffer) for f in frames]
    assert await io.put_together([]) == []
    await backend.close()


async def test_put_together_reports_a_failed_call_as_all_false(tmp_path: Path) -> None:
    inner = open_backend(f"file://{tmp_path}/s")
    io = ObjectIO(FaultyBackend(inner, FaultConfig(write_error_rate=1.0, seed=0)), NS)
    frames = [frame_of(io, payload(i), h) for i, h in enumerate(HASHES[:3])]
    assert await io.put_together(frames) == [False] * 3
    assert await inner.exists([format_key(key(h)) for h in HASHES[:3]]) == [False] * 3
    await inner.close()


async def test_put_together_past_its_deadline_is_all_false_after_the_call_ended(
    tmp_path: Path,
) -> None:
    inner = open_backend(f"file://{tmp_path}/s")
    slow = FaultyBackend(inner, FaultConfig(latency_s=0.5, seed=0))
    io = ObjectIO(slow, NS, io_timeout_s=0.1, min_bandwidth_mib_s=1e6)
    frames = [frame_of(io, payload(i), h) for i, h in enumerate(HASHES[:2])]
    assert await io.put_together(frames) == [False, False]
    assert io.write_budget.used == 0
    await inner.close()


async def test_put_together_refuses_a_frame_without_payload_before_storing(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}/s")
    io = ObjectIO(backend, NS)
    good = frame_of(io, payload(1), HASHES[0])
    empty = Frame(key(HASHES[1]), memoryview(bytearray(io.header_bytes(4))))
    with pytest.raises(ValueError, match="no payload"):
        await io.put_together([good, empty])
    assert await backend.exists([format_key(key(HASHES[0]))]) == [False]
    await backend.close()


@pytest.mark.parametrize("url", ["file", "file-python", "memory://"])
async def test_started_reads_give_read_frames_outcomes_or_do_not_start(
    tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``start_read_frames`` (the file backend's C reads on their own thread): per key the
    # outcome ``read_frames`` gives (intact, truncated, a flipped byte, another key's header,
    # never stored); an object stored larger than its frame raises for the batch, which
    # ``read_frames`` then sorts out. Elsewhere it starts nothing and says so (None).
    backend = backend_for(url, tmp_path, monkeypatch)
    io = ObjectIO(backend, NS)
    originals = await store_intact(io, 4)
    # 1 truncated, 2 one payload bit flipped, 3 key 0's object under key 3's name
    await store_as_is(backend, {1: originals[1][:-1], 2: flipped(originals[2]), 3: originals[0]})
    keys = [key(h) for h in HASHES[:4]] + [key(HASHES[5])]
    expected_frames = frames_for(io, 5)
    expected = await io.read_frames(keys, expected_frames)
    frames = frames_for(io, 5)
    pending = io.start_read_frames(keys, frames)
    if url != "file" or not SUMS_IN_C:
        assert pending is None
        assert all(bytes(f) == bytes(len(f)) for f in frames)  # nothing read
        await backend.close()
        return
    assert pending is not None
    pending.wait()
    assert pending.done()
    got = pending.result()
    assert [type(g) for g in got] == [type(g) for g in expected]
    assert isinstance(got[0], ObjectHeader) and bytes(frames[0]) == originals[0]
    assert isinstance(got[1], TruncatedObjectError)
    assert isinstance(got[2], PayloadChecksumError)
    assert isinstance(got[3], CorruptObjectError) and got[4] is None
    await store_as_is(backend, {4: originals[0] + b"\0" * 16})
    pending = io.start_read_frames([key(HASHES[0]), key(HASHES[4])], frames_for(io, 2))
    assert pending is not None
    with pytest.raises(InvalidRangeError):
        pending.result()
    with pytest.raises(ValueError, match="no payload"):
        io.start_read_frames([key()], [memoryview(bytearray(io.header_bytes(4)))])
    await backend.close()
