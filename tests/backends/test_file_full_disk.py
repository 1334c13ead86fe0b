"""The file backend on a full filesystem: a real tmpfs of a few MiB (``mount -t tmpfs -o
size=``) in a mount namespace of its own (``unshare -m``; the tests skip where that is not
permitted), filled by another process. Every failure the store reports is the documented
``OutOfSpaceError``, the index's included, and its message names the root and what to do;
the read-only tools still work, gc frees the space, and a run whose every put fails logs a
few failures and one line for the rest."""

from __future__ import annotations

import json
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


#: Fills the filesystem of ``argv[1]`` with one file, in another process, until ENOSPC;
#: then gives back ``argv[2]`` bytes (0 when not given).
FILL = textwrap.dedent(
    """
    import os, sys
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"f" * 4096)
    except OSError:
        pass
    leave = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
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


TOOLS_ON_A_FULL_DISK = textwrap.dedent(
    """
    import asyncio, json, os, shutil, subprocess, sys
    from hicache_store.backends.file import FileBackend
    from hicache_store.testing.chains import write_chains

    KILLED_WRITER = (
        "import os, signal, sys\\n"
        "from hicache_store.backends.file import FileBackend\\n"
        "store = FileBackend(sys.argv[1])\\n"
        "store._index.reserve(['ab00_b'], [4096], store.capacity_bytes)  # T1 of a put\\n"
        "os.kill(os.getpid(), signal.SIGKILL)\\n")

    def files(root):
        return sorted((os.path.relpath(os.path.join(d, n), root),
                       os.path.getsize(os.path.join(d, n)))
                      for d, _, names in os.walk(root) for n in names)

    def tool(*args):
        done = subprocess.run([sys.executable, "-m", "hicache_store", *args,
                               "--no-progress"] if args[0] != "doctor" else
                              [sys.executable, "-m", "hicache_store", *args],
                              capture_output=True, text=True)
        return {"rc": done.returncode, "out": done.stdout, "err": done.stderr}

    async def fill_store(root, chains):
        store = FileBackend(root, capacity_bytes=1 << 30)
        await write_chains(store, chains, 8)
        await store.close()

    async def main(where, fill, state):
        busy, clean = os.path.join(where, "busy"), os.path.join(where, "clean")
        await fill_store(busy, 8)  # 128 objects of 5 KiB
        await fill_store(clean, 2)
        # a writer killed after its reservation (recovering it is an index write), which
        # leaves the log and the shared memory behind as a running writer keeps them
        subprocess.run([sys.executable, "-c", KILLED_WRITER, busy])
        subprocess.run([sys.executable, "-c", fill, os.path.join(where, "other-process")],
                       check=True)
        out = {"free_before": shutil.disk_usage(where).free}
        before = files(busy), files(clean)
        for name, root in (("busy", busy), ("clean", clean)):
            out[name + "_inspect"] = tool("inspect", f"file://{root}", "--json")
            out[name + "_doctor"] = tool("doctor", f"file://{root}", "--json")
        after = files(busy), files(clean)
        out["changed"] = [sorted(set(a) - set(b)) for a, b in zip(after, before)]
        out["gc"] = tool("gc", f"file://{busy}", "--max-bytes", "100KiB", "--yes",
                         "--state-dir", state, "--json")
        out["free_after"] = shutil.disk_usage(where).free
        try:
            store = FileBackend(busy)
            await store.put(["cd00_b"], [b"after" * 1000])  # room again
            out["put_after"] = await store.get_bytes("cd00_b") == b"after" * 1000
            await store.close()
        except Exception as exc:
            out["put_after"] = repr(exc)
        print(json.dumps(out))

    asyncio.run(main(*sys.argv[1:]))
    """
)


@needs_tmpfs
def test_the_tools_work_on_a_full_filesystem_and_gc_frees_it(tmp_path: Path) -> None:
    """A full 3 MiB filesystem holding two stores: one with a writer killed after its
    reservation (its recovery is an index write), one closed cleanly (no ``-shm``: a reader
    must not make one). ``inspect`` and ``doctor`` open both read-only, report them and
    change no file; ``gc`` deletes and frees the space though its index cannot commit at
    first; a put works afterwards."""
    done = on_small_filesystem(tmp_path / "mnt", "3m", TOOLS_ON_A_FULL_DISK, FILL,
                               str(tmp_path / "gc-state"))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["free_before"] == 0
    for name, objects in (("busy", 128), ("clean", 32)):
        inspect = out[f"{name}_inspect"]
        assert inspect["rc"] == 0, inspect["err"]
        assert json.loads(inspect["out"])["objects"] == objects
        doctor = out[f"{name}_doctor"]
        assert doctor["rc"] == 0, doctor["err"]
    # no file changed; only the log and shared-memory files a SQLite reader makes where
    # there are none (a clean close removed them) may appear, as empty as the full disk
    # left them
    busy, clean = out["changed"]
    assert busy == []
    assert {name for name, _ in clean} <= {"index/index.sqlite3-shm", "index/index.sqlite3-wal"}
    assert all(size < 4096 for _, size in clean), clean
    gc = out["gc"]
    assert gc["rc"] == 0, gc["err"]
    report = json.loads(gc["out"])
    assert report["deleted"] > 100 and report["failures"] == 0
    assert out["free_after"] >= report["deleted_bytes"] // 2
    assert out["put_after"] is True


PREPOPULATE_ON_A_FULL_DISK = textwrap.dedent(
    """
    import json, os, subprocess, sys

    def prepopulate(url, prompts):
        return subprocess.run(
            [sys.executable, "-m", "hicache_store", "prepopulate", url, "--mini-engine", "tiny",
             "--prompts", prompts, "--page-size", "4", "--no-progress"],
            capture_output=True, text=True)

    def main(where, fill):
        url = f"file://{os.path.join(where, 'store')}"
        first, more = os.path.join(where, "first.jsonl"), os.path.join(where, "more.jsonl")
        with open(first, "w") as f:
            f.write(json.dumps({"input_ids": list(range(1, 17))}) + "\\n")
        with open(more, "w") as f:
            for p in range(40):
                f.write(json.dumps({"input_ids": [100 + p] + list(range(2, 50))}) + "\\n")
        done = prepopulate(url, first)  # the store and its manifest
        assert done.returncode == 0, done.stderr
        # another process fills the disk, but for 200 KiB: the run stores its first
        # objects, then every put fails
        subprocess.run([sys.executable, "-c", fill, os.path.join(where, "other-process"),
                        str(200 << 10)], check=True)
        done = prepopulate(url, more)
        print(json.dumps({"rc": done.returncode, "out": done.stdout, "err": done.stderr}))

    main(*sys.argv[1:])
    """
)


@needs_tmpfs
def test_a_full_disk_under_prepopulate_logs_a_few_failures_and_one_summary(
        tmp_path: Path) -> None:
    """Every put of a prepopulate run fails on a full filesystem: the first few failures are
    logged with their whole keys, the rest as one line with the count, the store and the
    cause (not one line per object, with the keys cut where they differ)."""
    done = on_small_filesystem(tmp_path / "mnt", "8m", PREPOPULATE_ON_A_FULL_DISK, FILL)
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)
    assert run["rc"] == 1, run  # failed writes: counted, exit 1
    lines = run["err"].strip().splitlines()
    root = f"{tmp_path}/mnt/store"
    failed = [line for line in lines if line.startswith("put of ")]
    summary = [line for line in lines if line.startswith("put: ")]
    # An object that still fits between failures ends an episode and the next one logs its
    # first failures whole again: a few episodes at most on a filesystem filling up, each
    # at most FIRST_LOGGED whole lines, the long one closed by one summary line.
    assert len(lines) == len(failed) + len(summary) and len(lines) <= 10, run["err"]
    assert 1 <= len(summary) <= 2 and 3 <= len(failed) <= 3 * (len(summary) + 1), run["err"]
    for line in failed:
        key = line.split()[2]
        assert len(key.split("_")[0]) == 64 and key.split("_")[1] != ""  # the whole key
        assert f"FileBackend('{root}'" in line and "OutOfSpaceError" in line
    assert len({line.split()[2] for line in failed}) == len(failed)
    count = sum(int(line.split()[1]) for line in summary)
    assert count > 20, summary
    for line in summary:
        assert f"FileBackend('{root}'" in line and "OutOfSpaceError" in line
