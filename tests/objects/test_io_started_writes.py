"""``ObjectIO.start_write_frames``: ``put_together`` handed to the backend's own job from the
caller's thread (the file backend's ``native_writes``), with ``put_together``'s contracts:
stored and readable, or all False (a failure, a deadline), capacity kept, nothing started on
a closed store or where the backend has no such path."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_io_frame_batches import HASHES, NS, PAYLOAD, frame_of, frames_for, key, payload

from hicache_store.backends import BackendClosedError, open_backend
from hicache_store.backends._file_io import StartedWrites
from hicache_store.backends.file import FileBackend
from hicache_store.layout.errors import CorruptObjectError
from hicache_store.layout.framing import ObjectHeader
from hicache_store.layout.keys import format_key
from hicache_store.objects import Frame, ObjectIO


def flip_byte(path: str, at: int) -> None:
    stored = bytearray(Path(path).read_bytes())
    stored[at] ^= 0xFF
    Path(path).write_bytes(stored)


def frames(io: ObjectIO, n: int, first: int = 0) -> list[Frame]:
    return [frame_of(io, payload(first + i), HASHES[first + i]) for i in range(n)]


async def test_started_writes_store_sealed_frames_that_read_back_verified(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}/s")
    io = ObjectIO(backend, NS)
    batch = frames(io, 3)
    pending = io.start_write_frames(batch)
    assert pending is not None
    pending.wait()
    assert pending.done() and pending.result() == [True] * 3
    assert backend.stats.writes == 3  # counted as ``put`` counts
    out = frames_for(io, 3)
    got = await io.read_frames([key(h) for h in HASHES[:3]], out)
    assert all(isinstance(g, ObjectHeader) for g in got)  # sealed: headers and checksums
    assert [bytes(o) for o in out] == [bytes(f.buffer) for f in batch]
    await backend.close()


async def test_without_native_writes_nothing_starts(tmp_path: Path) -> None:
    backend = open_backend("memory://")
    io = ObjectIO(backend, NS)
    assert io.start_write_frames(frames(io, 2)) is None
    assert await backend.exists([format_key(key(h)) for h in HASHES[:2]]) == [False, False]
    await backend.close()


@pytest.mark.parametrize("durability", ["none", "full"])  # its own thread / a pool job
async def test_a_failed_write_is_all_false_and_the_index_stays_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str
) -> None:
    backend = FileBackend(tmp_path / "s", durability=durability)
    io = ObjectIO(backend, NS)
    # a real failure of the C write: its temp file's directory does not exist (ENOENT)
    monkeypatch.setattr(backend._places, "temp_path", lambda: str(tmp_path / "gone" / "t.tmp"))
    pending = io.start_write_frames(frames(io, 2))
    assert pending is not None and pending.result() == [False, False]
    assert await backend.exists([format_key(key(h)) for h in HASHES[:2]]) == [False, False]
    assert backend._index.totals()[0] == 0  # the reservation was settled: nothing counted
    assert backend._index.reserved_bytes() == 0
    await backend.close()


async def test_a_put_not_begun_by_its_deadline_never_begins(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "s", durability="full")  # (a pool job)
    io = ObjectIO(backend, NS, io_timeout_s=0.05, min_bandwidth_mib_s=1e9)
    gate = threading.Event()
    # the pool's one thread is busy past the deadline: the put queued behind it never begins
    for _ in range(backend._jobs.pool._max):
        backend._jobs.pool.submit(gate.wait)
    pending = io.start_write_frames(frames(io, 2))
    assert pending is not None
    await asyncio.sleep(0.2)
    gate.set()
    assert pending.result() == [False, False]
    assert await backend.exists([format_key(key(h)) for h in HASHES[:2]]) == [False, False]
    assert backend._index.totals()[0] == 0  # nothing reserved
    await backend.close()


async def test_writes_on_their_own_thread_begun_late_write_nothing(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "s")
    io = ObjectIO(backend, NS)
    batch = frames(io, 2)
    names = [format_key(f.key) for f in batch]
    pending = backend.native_writes().start(names, [f.buffer for f in batch],
                                            start_by=time.monotonic() - 1.0)
    pending.wait()
    assert pending.began is None
    with pytest.raises(TimeoutError):
        pending.result()
    assert await backend.exists(names) == [False, False]
    assert backend._index.reserved_bytes() == 0 and backend._index.totals()[0] == 0
    assert backend.stats.writes == 0
    await backend.close()


def test_a_dropped_handle_still_settles_its_reservation(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "s")
    io = ObjectIO(backend, NS)
    pending = io.start_write_frames(frames(io, 2))
    assert pending is not None
    while not pending.done():  # (the writes' own thread: done without this thread's help)
        time.sleep(0.001)
    assert backend._index.reserved_bytes() > 0  # (settled by whoever takes the outcome)
    del pending
    gc.collect()
    assert backend._index.reserved_bytes() == 0
    assert backend._index.totals()[0] == 2 * (io.header_bytes(4) + PAYLOAD)
    asyncio.run(backend.close())


@pytest.mark.parametrize("durability", ["none", "full"])
async def test_a_put_that_ends_past_its_deadline_is_all_false(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str
) -> None:
    backend = FileBackend(tmp_path / "s", durability=durability)
    io = ObjectIO(backend, NS, io_timeout_s=0.05, min_bandwidth_mib_s=1e9)
    write, start_write = backend._engine.write, backend._engine.start_write

    def slow(keys: object, buffers: object) -> object:
        time.sleep(0.3)
        return write(keys, buffers)

    def slow_start(keys: Any, buffers: Any, start_by: float) -> StartedWrites:
        started = start_write(keys, buffers, start_by)
        wait = started.wait

        def late() -> Any:  # the writes as they ended, reported as ending 0.3 s later
            outcomes, began, ended = wait()
            return outcomes, began, None if ended is None else ended + 0.3

        return StartedWrites(started.keys, started.done, late)

    monkeypatch.setattr(backend._engine, "write", slow)
    monkeypatch.setattr(backend._engine, "start_write", slow_start)
    pending = io.start_write_frames(frames(io, 2))
    assert pending is not None and pending.result() == [False, False]  # (stored late: False)
    await backend.close()


async def test_started_writes_keep_the_capacity_bound(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "s", capacity_bytes=3 * (2 ** 20))
    io = ObjectIO(backend, NS)
    one = io.header_bytes(4) + PAYLOAD
    await backend.close()
    backend = FileBackend(tmp_path / "t", capacity_bytes=3 * one)
    io = ObjectIO(backend, NS)
    for i in range(6):
        pending = io.start_write_frames(frames(io, 1, first=i))
        assert pending is not None and pending.result() == [True]
        assert backend._index.totals()[0] <= 3 * one  # reserved before writing: never over
    assert backend.stats.evictions == 3
    assert await backend.exists([format_key(key(h)) for h in HASHES[3:6]]) == [True] * 3
    await backend.close()


async def test_a_closed_store_or_a_frame_without_payload_starts_nothing(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}/s")
    io = ObjectIO(backend, NS)
    empty = Frame(key(HASHES[1]), memoryview(bytearray(io.header_bytes(4))))
    with pytest.raises(ValueError, match="no payload"):
        io.start_write_frames([frames(io, 1)[0], empty])
    assert await backend.exists([format_key(key(HASHES[0]))]) == [False]
    await backend.close()
    with pytest.raises(BackendClosedError):
        io.start_write_frames(frames(io, 1))


async def test_bytes_changed_after_a_threaded_write_are_found_corrupt(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "s")  # (durability none: the writes' own thread)
    io = ObjectIO(backend, NS)
    pending = io.start_write_frames(frames(io, 2))
    assert pending is not None and pending.result() == [True, True]
    path = backend._places.final_path(io.storage_key(key(HASHES[1])))
    await asyncio.to_thread(flip_byte, path, io.header_bytes(4) + 7)  # a payload byte
    got = await io.read_frames([key(h) for h in HASHES[:2]], frames_for(io, 2))
    assert isinstance(got[0], ObjectHeader) and isinstance(got[1], CorruptObjectError)
    await backend.close()
