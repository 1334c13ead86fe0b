"""The write queue of a backend (``objects/writes.py``): pages of every caller are written
oldest first, in runs of one backend call, a failed object fails only its own page, and a
caller that gives up takes its waiting pages out."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.layout.keys import ObjectCoords, ObjectKey
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.objects import Frame, ObjectIO
from hicache_store.objects.writes import WINDOW, queue_of

NS = Namespace.create("m", ModelShape.mha(4, 2, 8), "float16", 4, Grid(1, 2))
PAYLOAD = 2 * 4 * 2 * 8 * 2  # one layer of one head group: K/V x tokens x heads x dim x 2


def page(io: ObjectIO, number: int, objects: int = 2) -> list[Frame]:
    """The frames of page ``number``: ``objects`` layers of head group 0, payload bytes set
    to the page number."""
    frames = []
    for layer in range(objects):
        coords = ObjectCoords(layer, layer + 1, 0)
        header = io.header_bytes(1)
        buf = memoryview(bytearray(header + PAYLOAD))
        np.frombuffer(buf, dtype=np.uint8)[header:] = number % 251
        frames.append(Frame(ObjectKey(f"{number + 1:064x}", NS.digest, coords), buf))
    return frames


def record_puts(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The keys of each ``put`` call the backend gets, in order."""
    calls: list[list[str]] = []
    real = backend.put

    async def put(keys: Sequence[str], buffers: Sequence[Any]) -> None:
        calls.append(list(keys))
        await real(keys, buffers)

    monkeypatch.setattr(backend, "put", put)
    return calls


async def readable(io: ObjectIO, frames: list[Frame], number: int) -> bool:
    for frame in frames:
        out = np.zeros(PAYLOAD, dtype=np.uint8)
        header = await io.read_blocks(frame.key, out.data, payload_bytes=PAYLOAD)
        if header is None or not (out == number % 251).all():
            return False
    return True


async def test_pages_of_every_caller_go_oldest_first_in_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # While the window is full (a slow store), pages of many callers wait together and leave
    # as runs: one backend call for many small pages, the oldest first.
    store = FaultyBackend(open_backend("memory://"), FaultConfig(latency_s=0.05))
    calls = record_puts(store, monkeypatch)
    io = ObjectIO(store, NS)
    pages = [page(io, n) for n in range(40)]
    results = await asyncio.gather(*(io.put(frames) for frames in pages))
    assert all(r == [True, True] for r in results)
    written = [key for call in calls for key in call]
    assert written == [io.storage_key(f.key) for frames in pages for f in frames], "oldest first"
    assert len(calls) < len(pages) // 2, f"{len(calls)} backend calls for {len(pages)} pages"
    assert all(len(call) % 2 == 0 for call in calls), "a page's objects go together"
    reader = ObjectIO(store.inner, NS)  # without the latency
    for n, frames in enumerate(pages):
        assert await readable(reader, frames, n)
    await store.close()


async def test_a_failed_object_fails_only_its_own_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_backend(f"file://{tmp_path}/s")
    calls = record_puts(store, monkeypatch)
    io = ObjectIO(store, NS)
    queue_of(store).pace = 1e-12  # a fast store: the eight pages go as one run
    frames = [f for n in range(8) for f in page(io, n)]
    bad = io.storage_key(frames[7].key)  # page 3's second object
    store.path_of(bad).mkdir(parents=True)  # its rename fails (EISDIR)
    done = await io.put(frames)
    assert done == [True] * 6 + [False] * 2 + [True] * 8
    assert [len(c) for c in calls] == [16, 14], "one run, then the others again without it"
    for n in (0, 1, 2, 4, 5, 6, 7):
        assert await readable(io, frames[2 * n : 2 * n + 2], n)
    await store.close()


async def test_a_caller_that_gives_up_takes_its_waiting_pages_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = FaultyBackend(open_backend("memory://"), FaultConfig(latency_s=0.2))
    calls = record_puts(store, monkeypatch)
    io = ObjectIO(store, NS, max_inflight_bytes=io_frame_bytes())
    busy = [asyncio.ensure_future(io.put(page(io, n, objects=1))) for n in range(WINDOW)]
    await asyncio.sleep(0.01)  # every window slot taken
    waiting = page(io, 99)
    gives_up = asyncio.ensure_future(io.put(waiting))
    await asyncio.sleep(0.01)
    gives_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gives_up
    assert all(await asyncio.gather(*busy))
    # the next page written is not the abandoned one's
    assert await io.put(page(io, 100, objects=1)) == [True]
    written = {key for call in calls for key in call}
    assert not written & {io.storage_key(f.key) for f in waiting}
    await store.close()


def io_frame_bytes() -> int:
    return ObjectIO(open_backend("memory://"), NS).frame_bytes(1, PAYLOAD)


async def test_a_caller_cancelled_with_a_run_in_flight_returns_once_it_ended() -> None:
    # Buffer lifetime: the caller's frames are read by the run until it ends.
    store = FaultyBackend(open_backend("memory://"), FaultConfig(latency_s=0.2))
    io = ObjectIO(store, NS)
    put = asyncio.ensure_future(io.put(page(io, 1)))
    await asyncio.sleep(0.05)  # its run is in the backend
    put.cancel()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(asyncio.CancelledError):
        await put
    # The faulty latency gives way to the cancellation (nothing is in flight during it), so
    # the run ends at once; the point is that it has ended when the caller returns.
    assert not io.write_budget.used
    assert loop.time() - started < 5.0
    await store.close()
