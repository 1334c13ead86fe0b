"""Crash safety and full disks: a writer SIGKILLed mid-batch, and writes into a full filesystem."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hicache_store.backends import OutOfSpaceError
from hicache_store.backends.file import FileBackend
from hicache_store.layout.keys import parse_key
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
        for key in keys:
            verified = await store.get_object(key, expected=parse_key(key))
            assert verified is not None, f"{key} is visible but does not verify"
        assert store.stats.corruptions == 0
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
        assert await store.get_object(first, expected=key) is not None
        for name in [k async for k in store.list_prefix("")]:
            assert await store.get_object(name, expected=parse_key(name)) is not None
        # After room is made, writes succeed again.
        await store.delete([first])
        await store.put(["a0"], [b"x" * 1000])
        await store.close()
    finally:
        await asyncio.to_thread(
            subprocess.run, ["umount", "-l", str(mnt)], check=False, capture_output=True
        )
