"""The file backend on a full filesystem: a real tmpfs of a few MiB (``mount -t tmpfs -o
size=``) in a mount namespace of its own (``unshare -m``; the tests skip where that is not
permitted), filled by another process. Every failure the store reports is the documented
``OutOfSpaceError``, the index's included, and its message names the root and what to do."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _can_mount_tmpfs() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}"
    return None


NO_MOUNT = _can_mount_tmpfs()
needs_tmpfs = pytest.mark.skipif(NO_MOUNT is not None, reason=NO_MOUNT or "")


def on_small_filesystem(where: Path, size: str, script: str, *args: str
                        ) -> subprocess.CompletedProcess[str]:
    """Run the Python ``script`` with ``where`` a fresh tmpfs of ``size`` (visible to the
    script and the processes it starts only); ``script`` gets ``where`` and ``args``."""
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"', "sh", size,
         str(where), sys.executable, "-c", script, str(where), *args],
        capture_output=True, text=True, timeout=300, check=False,
    )


#: Fills the filesystem of ``argv[1]`` with one file, in another process, until ENOSPC.
FILL = textwrap.dedent(
    """
    import os, sys
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"f" * 4096)
    except OSError:
        pass
    os.close(fd)
    """
)


PUT_ON_A_FULL_DISK = textwrap.dedent(
    """
    import asyncio, os, subprocess, sys
    from hicache_store.backends.file import FileBackend

    async def main(where, fill):
        root = os.path.join(where, "store")
        # the capacity does not bound the store here: the filesystem does
        store = FileBackend(root, durability="none", direct_io="never", capacity_bytes=1 << 30)
        await store.put(["aa00_b"], [b"s" * 4096])
        subprocess.run([sys.executable, "-c", fill, os.path.join(where, "other-process")],
                       check=True)
        errors = []
        for i in range(64):  # puts whose index writes need new pages of the log
            try:
                await store.put([f"{i:04x}_c"], [b""])
            except Exception as exc:
                errors.append(exc)
        for exc in errors:
            print(type(exc).__name__, exc.errno if isinstance(exc, OSError) else "-", exc)
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)


@needs_tmpfs
def test_a_disk_filled_by_another_process_is_out_of_space_in_the_index_too(
        tmp_path: Path) -> None:
    done = on_small_filesystem(tmp_path / "mnt", "2m", PUT_ON_A_FULL_DISK, FILL)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    index = [line for line in lines if "cannot commit" in line]
    assert index, done.stdout  # the index's own writes failed on the full filesystem
    assert all(line.startswith("OutOfSpaceError 28 ") for line in lines), done.stdout
    assert "hicache-store gc file://" in index[0] and f"{tmp_path}/mnt/store" in index[0]
