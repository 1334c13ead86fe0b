"""Crash safety and full disks: a writer SIGKILLed mid-batch, and writes into a full filesystem."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from file_audit import audit

from hicache_store.backends import OutOfSpaceError
from hicache_store.backends.file import FileBackend
from hicache_store.objects.io import ObjectIO
from hicache_store.testing import framed_object

WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from hicache_store.backends.file import FileBackend
    from hicache_store.layout.keys import format_key
    from hicache_store.testing import framed_object

    async def main(root):
        store = FileBackend(root, durability="data", io_threads=8)
        page = 0
        while True:
            batch = [framed_object(page=page + i, layers=8, block=128 * 1024) for i in range(16)]
            page += 16
            await store.put([format_key(k) for k, _ in batch], [blob for _, blob in batch])
            print(page, flush=True)

    asyncio.run(main(sys.argv[1]))
    """
)


def _kill_writer_mid_batch(root: Path) -> int:
    """Start a writer, SIGKILL it while temp files exist; return how many were left behind."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # one batch published: the store is live
        tmp = root / "tmp"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if any(tmp.iterdir()):
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return sum(1 for _ in (root / "tmp").iterdir())


async def test_sigkilled_writer_leaves_only_whole_objects(tmp_path: Path) -> None:
    root = tmp_path / "store"
    left = 0
    for _attempt in range(3):  # the kill must land while a write is in flight
        left = _kill_writer_mid_batch(root)
        if left:
            break
    assert left > 0, "could not kill the writer mid-write in three attempts"
    store = FileBackend(root)
    try:
        assert store.removed_temp_files == left
        assert list((root / "tmp").iterdir()) == []
        keys = [k async for k in store.list_prefix("")]
        assert len(keys) >= 16
        io = ObjectIO(store)
        for key in keys:
            # read_object raises CorruptObjectError for an object that does not verify.
            verified = await io.read_object(key)
            assert verified is not None, f"{key} is visible but reads as a miss"
        assert await store.exists_prefix_length(keys) == len(keys)
    finally:
        await store.close()


def _mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a small tmpfs at ``path``; return why not when it cannot be done."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a tmpfs needs root and mount(8)"
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        return f"mount -t tmpfs is not permitted here: {done.stderr.strip()}"
    return None


async def test_full_tmpfs_fails_writes_cleanly_while_reads_go_on(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    reason = _mount_tmpfs(mnt, "2m")
    if reason:
        pytest.skip(reason)
    try:
        store = FileBackend(mnt, capacity_bytes=1 << 30)  # the disk, not the bound, must stop it
        key, blob = framed_object(page=1, layers=4, block=64 * 1024)
        first = str(key)
        await store.put([first], [blob])
        filled = 0
        for page in range(2, 200):
            k, b = framed_object(page=page, layers=4, block=64 * 1024)
            try:
                await store.put([str(k)], [b])
            except OutOfSpaceError:  # also an OSError with errno ENOSPC
                break
            filled += 1
        else:
            pytest.fail("a 2 MiB tmpfs took 200 objects of 260 KiB")
        assert filled > 0
        assert list((mnt / "tmp").iterdir()) == [], "a failed write left its temp file"
        io = ObjectIO(store)
        assert await io.read_object(first) is not None  # raises when it does not verify
        for name in [k async for k in store.list_prefix("")]:
            assert await io.read_object(name) is not None
        # After room is made, writes succeed again.
        await store.delete([first])
        await store.put(["a0"], [b"x" * 1000])
        await store.close()
    finally:
        await asyncio.to_thread(
            subprocess.run, ["umount", "-l", str(mnt)], check=False, capture_output=True
        )


# -- the shared index under concurrent writers and SIGKILL ---------------------------------------

CAPACITY = 150_000
CHURN = textwrap.dedent(
    """
    import asyncio, hashlib, random, sys
    from hicache_store.backends.file import FileBackend

    def blob(key, size):
        seed = hashlib.sha256(f"{key}-{size}".encode()).digest()
        return (seed * (size // len(seed) + 1))[:size]

    async def main(root, seed, ops, capacity):
        rng = random.Random(seed)
        store = FileBackend(root, durability="none", capacity_bytes=capacity, lock_timeout=60)
        keys = [f"{i:04x}" for i in range(120)]
        for n in range(1, ops + 1):
            op = rng.random()
            if op < 0.6:
                batch = rng.sample(keys, rng.randint(1, 8))
                size = rng.choice([1000, 3000, 9000])
                await store.put(batch, [blob(k, size) for k in batch])
            elif op < 0.8:
                await store.delete(rng.sample(keys, rng.randint(1, 4)))
            else:
                batch = rng.sample(keys, 4)
                bufs = [bytearray(9000) for _ in batch]
                for k, b, got in zip(batch, bufs, await store.get_into(batch, bufs)):
                    assert got is None or bytes(b[:got]) == blob(k, got), k
            if n % 10 == 0:
                print(n, flush=True)
        await store.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    """
)


def _churn(root: Path, seed: int, ops: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHURN, str(root), str(seed), str(ops), str(CAPACITY)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _blob(key: str, size: int) -> bytes:
    import hashlib

    seed = hashlib.sha256(f"{key}-{size}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _check_store(root: Path) -> None:
    """The index agrees with the files, and every stored object is whole."""
    report = audit(root)
    assert report.ok, report.problems
    assert report.total_bytes <= CAPACITY
    for key, size in report.files.items():
        path = next((root / "objects").glob(f"*/*/{key}"))
        assert path.read_bytes() == _blob(key, size), f"{key} is torn"


async def test_two_processes_writing_and_evicting_stay_consistent(tmp_path: Path) -> None:
    root = tmp_path / "s"
    FileBackend(root)  # create the root once (both children then open an existing one)
    procs = [_churn(root, seed, ops=150) for seed in (1, 2)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    _check_store(root)
    store = FileBackend(root)
    try:
        stored = sorted(audit(root).files)
        assert sorted([k async for k in store.list_prefix("")]) == stored
        assert await store.exists(stored) == [True] * len(stored)
        assert store.used_bytes == audit(root).total_bytes
    finally:
        await store.close()


@pytest.mark.slow
async def test_sigkill_during_index_updates_loses_and_invents_nothing(tmp_path: Path) -> None:
    import random

    root = tmp_path / "s"
    FileBackend(root)
    rng = random.Random(7)
    procs = [_churn(root, seed, ops=1_000_000) for seed in (1, 2)]
    killed_with_pending = 0
    try:
        for round_ in range(8):
            victim = procs[round_ % 2]
            assert victim.stdout is not None
            victim.stdout.readline()  # it has made progress since it started
            await asyncio.sleep(rng.uniform(0.05, 0.4))
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
            db = sqlite3.connect(f"file:{root / 'index' / 'index.sqlite3'}?mode=ro", uri=True)
            left = db.execute("SELECT COUNT(*) FROM pending WHERE pid = ?", (victim.pid,)
                              ).fetchone()[0]
            db.close()
            killed_with_pending += left > 0
            procs[round_ % 2] = _churn(root, 100 + round_, ops=1_000_000)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    assert killed_with_pending > 0, "no kill landed between the two halves of a change"
    store = FileBackend(root)  # recovery: dead writers' temp files and pending changes
    await store.close()
    _check_store(root)


DIE_IN_DELETE = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from hicache_store.backends.file import FileBackend

    async def main(root, key):
        store = FileBackend(root, durability="none", capacity_bytes=int(sys.argv[3]))
        # killed between the two halves of the delete: its row is gone, its file is not
        os.unlink = lambda path, *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        await store.delete([key])

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_a_delete_killed_before_its_unlink_is_finished_not_undone(tmp_path: Path) -> None:
    """A writer killed after a delete (or an eviction) removed its rows, before it unlinked the
    files: the room it freed may already be someone else's. Recovery finishes the delete (the
    file goes) instead of giving the row back, which would put the store over its bound."""
    root = tmp_path / "s"
    capacity = 20_000
    store = FileBackend(root, durability="none", capacity_bytes=capacity)
    await store.put(["00aa"], [_blob("00aa", 12_000)])
    # open while the child deletes: this process recovered at its open, before the kill
    child = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", DIE_IN_DELETE, str(root), "00aa", str(capacity)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert next((root / "objects").glob("*/*/00aa"))  # the file stayed
    try:
        # the freed room is taken (the dead deleter's row is gone, so nothing needs evicting)
        await store.put(["00bb"], [_blob("00bb", 12_000)])
        assert await store.exists(["00bb"]) == [True]
    finally:
        await store.close()
    store = FileBackend(root, durability="none", capacity_bytes=capacity)  # recovery at open
    try:
        assert await store.exists(["00aa", "00bb"]) == [False, True]
        assert store.used_bytes <= capacity
    finally:
        await store.close()
    report = audit(root)
    assert report.ok, report.problems
    assert report.total_bytes <= capacity
    assert sorted(report.files) == ["00bb"]
