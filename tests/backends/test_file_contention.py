"""The file backend under contention: many concurrent small puts on a loaded disk.

Each put is a call of several steps on the backend's thread pool (reserve in the index, write,
settle in the index). Issued 1,500 at once, each under its caller's deadline, they must end in
the order they began, so that the oldest are stored in time and the rest give up: never every
put running late together and none stored, and never a put stuck behind the index's write
lock. The disk is loaded by competing writer processes (``_disk_load``), not by an injected
latency: fsyncs, the index's commits and the pool contend as on a shared machine.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _disk_load import competing_writers
from file_audit import audit

from hicache_store.backends.file import FileBackend

N = 1500
#: each put's deadline (its caller's ``asyncio.wait_for``), unless the loaded disk takes
#: longer than ``SLOW_PUTS`` puts one after another (then that long: no design stores a put
#: in a deadline shorter than one put takes; all 1,500 still need many times more)
DEADLINE_S = 3.0
SLOW_PUTS = 30


@pytest.mark.slow
async def test_concurrent_small_puts_on_a_loaded_disk_store_a_leading_run(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    store = FileBackend(root)  # durability "data": every object is fdatasync-ed
    keys = [f"{i:04x}" for i in range(N)]
    data = [os.urandom(8 << 10) for _ in range(N)]
    ended: list[int] = []  # put numbers, in the order their calls returned

    async def put(i: int, deadline: float) -> bool:
        try:
            await asyncio.wait_for(store.put([keys[i]], [data[i]]), deadline)
        except asyncio.TimeoutError:  # (on 3.10 not the builtin one)
            return False
        finally:
            ended.append(i)
        return True

    with competing_writers(tmp_path / "load"):
        alone = []
        for i in range(5):
            started = time.monotonic()
            await store.put([f"{N + i:04x}"], [data[i]])
            alone.append(time.monotonic() - started)
        deadline = max(DEADLINE_S, SLOW_PUTS * statistics.median(alone))
        reported = await asyncio.gather(*(put(i, deadline) for i in range(N)))
    leading = reported.index(False) if False in reported else N
    assert leading > 0, f"{sum(reported)} of {N} puts stored, the first not among them"
    # Calls end in the order they began, whatever the machine's speed: the first put ends
    # among the first (on a first-in-first-out pool every put's reserve ran before any put's
    # write, and every settle after every write: the first put ended with the last ones).
    assert ended.index(0) < 64, ended.index(0)
    # Every put reported stored reads back whole (one cut by its deadline may have landed
    # too: reported False, never the reverse).
    for key, chunk, ok in zip(keys, data, reported, strict=True):
        if ok:
            assert await store.get_bytes(key) == chunk, key
    # No convoy left behind: every reservation was settled (a call cut by its deadline ends
    # when its steps have), the index agrees with the files, and it takes the next put at once.
    await store.put(["ffff"], [b"after"])
    assert await store.get_bytes("ffff") == b"after"
    await store.close()
    found = audit(root)
    assert found.ok, found.problems
    assert found.pending == 0


async def test_a_put_given_up_before_its_turn_reserves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A put still waiting for a thread when its caller gives up never begins: no index
    # transaction is spent on it (with 1,500 puts given up, their reservations and settles
    # were thousands of transactions in the way of the puts still wanted).
    root = tmp_path / "kv"
    store = FileBackend(root, io_threads=1)
    reserved: list[Any] = []
    reserve = store._index.reserve
    monkeypatch.setattr(store._index, "reserve", lambda *a: reserved.append(a) or reserve(*a))
    release = threading.Event()
    held = store._pool.submit(release.wait)  # the one thread is busy
    put = asyncio.ensure_future(store.put(["aa"], [b"given up"]))
    await asyncio.sleep(0.01)  # its reservation waits for the thread
    put.cancel()
    await asyncio.sleep(0.01)  # the call is abandoned
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await put
    held.result(10)
    assert reserved == []
    assert await store.exists(["aa"]) == [False]
    await store.put(["bb"], [b"wanted"])
    assert [args[0] for args in reserved] == [["bb"]]
    await store.close()
    found = audit(root)
    assert found.ok and found.pending == 0
