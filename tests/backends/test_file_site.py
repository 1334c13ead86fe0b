"""Where the file backend's shared index may be used (``backends/_file_site.py``): one host
(kernel) per root's index, recorded in ``index/host.json``, and no default index on a network
or FUSE filesystem.

"Another host" is a process in its own UTS and mount namespaces with another host name and,
bind-mounted over ``/proc/sys/kernel/random/boot_id``, another boot id: what a second machine
on a shared mount looks like to the root (we run as root; without ``unshare`` those tests skip).
A process in its own UTS namespace only (``unshare -u``: another host name, this kernel's boot
id) is a container of this kernel: another host by default, this host with
``index_hosts=kernel``.
A real FUSE mount comes from ``bindfs`` (Debian package ``bindfs``; skipped without it); other
network filesystems cannot be mounted here, so their ``statfs`` type is injected.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hicache_store.backends import UnsafeIndexError, open_backend
from hicache_store.backends import _file_site as site
from hicache_store.backends.file import FileBackend
from hicache_store.layout.errors import ConfigError

OTHER_BOOT_ID = "0badc0de-0000-4000-8000-000000000001"

OPEN_IN_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from hicache_store.backends import UnsafeIndexError, open_backend

    async def main(url):
        try:
            store = open_backend(url)
        except UnsafeIndexError as exc:
            print("REFUSED", exc)
            return
        await store.put(["aa11_c"], [b"from-child"])
        got = await store.get_bytes("aa11_c")
        hits = await store.exists(["aa11_b"])
        await store.close()
        print("OPENED", got.decode() if got else None, hits)

    asyncio.run(main(sys.argv[1]))
    """
)


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-m", "-u", "true"], capture_output=True, text=True,
                           check=False)
    if probe.returncode != 0:
        return f"unshare -m -u is not permitted here: {probe.stderr.strip()}"
    return None


NO_UNSHARE = _can_unshare()
needs_unshare = pytest.mark.skipif(NO_UNSHARE is not None, reason=NO_UNSHARE or "")


def on_host(tmp_path: Path, argv: list[str], *, hostname: str,
            boot_id: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as a process of another host: its own host name and (unless None, for a
    container of this kernel) its own boot id."""
    script = 'hostname "$1" && shift && exec "$@"'
    args = [hostname]
    if boot_id is not None:
        boot = tmp_path / f"boot-{boot_id}"
        boot.write_text(boot_id + "\n")
        script = 'mount --bind "$1" /proc/sys/kernel/random/boot_id && shift && ' + script
        args = [str(boot), *args]
    return subprocess.run(
        ["unshare", "-m", "-u", "sh", "-c", script, "sh", *args, *argv],
        capture_output=True, text=True, timeout=120, check=False,
    )


def open_on_host(tmp_path: Path, url: str, **where: str | None) -> str:
    where.setdefault("hostname", "other-host")
    where.setdefault("boot_id", OTHER_BOOT_ID)
    done = on_host(tmp_path, [sys.executable, "-c", OPEN_IN_CHILD, url], **where)  # type: ignore[arg-type]
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def make_root(root: Path, **options: object) -> None:
    async def go() -> None:
        store = FileBackend(root, **options)  # type: ignore[arg-type]
        await store.put(["aa11_b"], [b"from-parent"])
        await store.close()
    asyncio.run(go())


def record(root: Path) -> dict[str, object]:
    return json.loads((root / "index" / "host.json").read_text())  # type: ignore[no-any-return]


# -- the host -----------------------------------------------------------------------------------


@needs_unshare
def test_a_process_of_another_host_is_refused_and_index_none_works_from_it(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    make_root(root)
    out = open_on_host(tmp_path, f"file://{root}")
    assert out.startswith("REFUSED"), out
    me = site.this_host()
    assert "index=none" in out
    assert me.hostname in out and me.boot_id in out  # the host recorded
    assert "other-host" in out and OTHER_BOOT_ID in out  # and the one refused
    assert record(root)["boot_id"] == me.boot_id  # the refused process recorded nothing
    # A root that several hosts use with index=none: both write and read, nothing is refused.
    loose = tmp_path / "loose"
    make_root(loose, index="none")
    out = open_on_host(tmp_path, f"file://{loose}?index=none")
    assert out == "OPENED from-child [True]", out
    assert not (loose / "index").exists()

    async def check() -> None:
        store = FileBackend(loose, index="none")
        assert await store.get_bytes("aa11_c") == b"from-child"
        await store.close()
    asyncio.run(check())


@needs_unshare
def test_another_host_name_on_this_kernel_is_refused_by_default(tmp_path: Path) -> None:
    """A second UTS namespace (``unshare -u``: another host name, the same boot id, as a
    container has) opening the same root with the default options is another host: refused,
    with the error naming index=none and the opt-in for containers of one kernel."""
    root = tmp_path / "s"
    make_root(root)
    me = site.this_host()
    out = open_on_host(tmp_path, f"file://{root}", hostname="pod-7", boot_id=None)
    assert out.startswith("REFUSED"), out
    assert "index=none" in out and "index_hosts=kernel" in out
    assert f"pod-7 (boot id {me.boot_id})" in out  # the process refused: this kernel's
    assert me.hostname in out  # the host recorded
    assert record(root)["hostnames"] == [me.hostname]  # the refused process recorded nothing
    assert record(root)["boot_id"] == me.boot_id


@needs_unshare
def test_with_index_hosts_kernel_a_container_of_this_kernel_shares_the_index(
    tmp_path: Path,
) -> None:
    """``index_hosts=kernel``: the boot id alone is the host. A second UTS namespace opens the
    root the first process has open, its name is recorded beside the first one, and both read
    and write one store (the same shared index: each finds the other's writes)."""
    root = tmp_path / "s"

    async def go() -> None:
        store = FileBackend(root, index_hosts="kernel")
        try:
            await store.put(["aa11_b"], [b"from-parent"])
            done = await asyncio.to_thread(
                open_on_host, tmp_path, f"file://{root}?index_hosts=kernel",
                hostname="pod-7", boot_id=None)
            assert done == "OPENED from-child [True]", done  # read the parent's, wrote its own
            await asyncio.sleep(1.1)  # the host record is looked at again at most once a second
            assert await store.exists(["aa11_c", "aa11_b"]) == [True, True]
            assert await store.get_bytes("aa11_c") == b"from-child"
            await store.put(["aa11_d"], [b"after"])
        finally:
            await store.close()
    asyncio.run(go())
    found = record(root)
    assert found["hostnames"] == [socket.gethostname(), "pod-7"]
    assert found["boot_id"] == site.this_host().boot_id
    # Another kernel is refused all the same: the option is about host names only.
    out = open_on_host(tmp_path, f"file://{root}?index_hosts=kernel", hostname="pod-7")
    assert out.startswith("REFUSED") and "index=none" in out, out
    assert "index_hosts=kernel" not in out  # it would not help there


def test_another_host_name_of_this_boot_in_the_record(tmp_path: Path) -> None:
    """The rule without namespaces: a record of this boot id listing only another host name
    refuses a default open (index=none and index_hosts=kernel named), and is this host's with
    index_hosts=kernel, which adds this process's name."""
    root = tmp_path / "s"
    make_root(root)
    me = site.this_host()
    _write_record(root, boot_id=me.boot_id, hostnames=["pod-x"])
    with pytest.raises(UnsafeIndexError, match="index=none") as caught:
        make_root(root)
    assert "index_hosts=kernel" in str(caught.value)
    assert "pod-x" in str(caught.value)
    assert record(root)["hostnames"] == ["pod-x"]  # left as it was
    asyncio.run(open_backend(f"file://{root}?index_hosts=kernel").close())
    assert record(root)["hostnames"] == ["pod-x", me.hostname]
    assert record(root)["boot_id"] == me.boot_id
    make_root(root)  # listed now: the default rule finds this host too


def test_index_hosts_is_validated(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with pytest.raises(ConfigError, match="index_hosts must be one of"):
        open_backend(f"file://{root}?index_hosts=boot")
    assert not root.exists()  # refused before anything was created
    with pytest.raises(ConfigError, match="index_hosts"):
        FileBackend(root, index_hosts="hostname")  # type: ignore[arg-type]
    assert not root.exists()


def test_the_same_host_reopens_without_writing_its_record(tmp_path: Path) -> None:
    root = tmp_path / "s"
    make_root(root)
    path = root / "index" / "host.json"
    before = os.stat(path)
    for _ in range(3):
        make_root(root)
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    me = site.this_host()
    assert record(root)["hostnames"] == [me.hostname]
    assert record(root)["boot_id"] == me.boot_id
    assert os.listdir(root / "tmp") == []  # no temp file left behind


def _write_record(root: Path, **fields: object) -> None:
    me = site.this_host()
    data = {"boot_id": OTHER_BOOT_ID, "boot_time": me.boot_time, "hostnames": [me.hostname],
            "since": time.time(), **fields}
    (root / "index" / "host.json").write_text(json.dumps(data))


def test_a_record_of_a_previous_boot_of_this_host_is_replaced(tmp_path: Path) -> None:
    """Same host name, another boot id of a kernel that booted before this one: the host
    rebooted, its processes are gone, the record becomes this boot's."""
    root = tmp_path / "s"
    make_root(root)
    me = site.this_host()
    _write_record(root, boot_time=me.boot_time - 86400)
    make_root(root)
    assert record(root)["boot_id"] == me.boot_id
    assert record(root)["hostnames"] == [me.hostname]


def test_a_later_boot_with_this_host_name_is_another_host(tmp_path: Path) -> None:
    """Same host name, a kernel that booted after this one: not a previous boot of it but a
    second machine with the same name (a container image's fixed host name): refused, with
    index_hosts=kernel too (another kernel)."""
    root = tmp_path / "s"
    make_root(root)
    _write_record(root, boot_time=site.this_host().boot_time + 3600)
    with pytest.raises(UnsafeIndexError, match="index=none") as caught:
        make_root(root)
    assert OTHER_BOOT_ID in str(caught.value)
    assert "index_hosts=kernel" not in str(caught.value)
    with pytest.raises(UnsafeIndexError, match="index=none"):
        make_root(root, index_hosts="kernel")
    assert record(root)["boot_id"] == OTHER_BOOT_ID  # left as it was


def test_a_previous_boot_is_replaced_with_index_hosts_kernel_too(tmp_path: Path) -> None:
    root = tmp_path / "s"
    make_root(root)
    me = site.this_host()
    _write_record(root, boot_time=me.boot_time - 86400, hostnames=[me.hostname, "pod-x"])
    make_root(root, index_hosts="kernel")
    assert record(root)["boot_id"] == me.boot_id
    assert record(root)["hostnames"] == [me.hostname]


def test_an_unreadable_record_is_refused_not_taken_for_none(tmp_path: Path) -> None:
    root = tmp_path / "s"
    make_root(root)
    (root / "index" / "host.json").write_text("{not json")
    with pytest.raises(UnsafeIndexError, match="host.json is unreadable"):
        make_root(root)


async def test_a_record_taken_over_while_open_fails_the_next_index_call(tmp_path: Path) -> None:
    """Another kernel's record replacing this one's while a process has the index open (a
    second machine with the same host name opened it): that process's next index call fails,
    instead of going on with a database another host now writes."""
    root = tmp_path / "s"
    store = FileBackend(root)
    try:
        await store.put(["aa11_b"], [b"x"])
        _write_record(root, boot_time=site.this_host().boot_time + 3600)
        await asyncio.sleep(1.1)  # the index looks again at most once a second
        with pytest.raises(UnsafeIndexError, match="taken over"):
            await store.exists(["aa11_b"])
    finally:
        await store.close()


WRITE_UNTIL_REFUSED = textwrap.dedent(
    """
    import asyncio, sys
    from hicache_store.backends import UnsafeIndexError
    from hicache_store.backends.file import FileBackend

    async def main(root, after):
        store = FileBackend(root, durability="none", direct_io="never")
        refused_at = None
        i = 0
        while refused_at is None or i < refused_at + int(after):
            if i > 100_000:
                sys.exit(3)  # never refused: the other host's claim went unnoticed
            try:
                await store.put([f"{i:08x}_b"], [b"w" * 100])
                print("stored", i, flush=True)
            except UnsafeIndexError:
                print("refused", i, flush=True)
                refused_at = i if refused_at is None else refused_at
            i += 1
            await asyncio.sleep(0.01)
        for name, call in (("exists", store.exists(["aa11_b"])),
                           ("get", store.get_bytes("aa11_b"))):
            try:
                await call
                print(name, "answered", flush=True)
            except UnsafeIndexError:
                print(name, "refused", flush=True)
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)

TAKE_OVER = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from hicache_store.backends import open_backend
    from hicache_store.backends._file_site import HostRecord, this_host

    async def main(root):
        # this host's record replaces the other one in one step, as the first open of a
        # machine that takes the root for a previous boot of its own does
        me = this_host()
        record = HostRecord(me.boot_id, me.boot_time, (me.hostname,), time.time())
        tmp = os.path.join(root, "tmp", "takeover.tmp")
        with open(tmp, "w") as f:
            json.dump(record.to_json(), f)
        os.replace(tmp, os.path.join(root, "index", "host.json"))
        store = open_backend(f"file://{root}")
        await store.put(["bb22_c"], [b"other-host"])
        await store.close()
        print("TOOK OVER")

    asyncio.run(main(sys.argv[1]))
    """
)


@needs_unshare
def test_a_writer_whose_root_another_host_took_over_stores_nothing_more(tmp_path: Path) -> None:
    """A process of this host writes in a loop; another host (its own host name and boot id)
    replaces ``index/host.json`` with its own record and opens the root. From the writer's first
    refused call on, every call of that process fails: no put is stored any more (a check
    at most once a second used to refuse one put a second and store the rest), and reads
    and lookups are refused too."""
    root = tmp_path / "shared"
    make_root(root)
    writer = subprocess.Popen([sys.executable, "-c", WRITE_UNTIL_REFUSED, str(root), "150"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().split() == ["stored", "0"]
        other = on_host(tmp_path, [sys.executable, "-c", TAKE_OVER, str(root)],
                        hostname="other-host", boot_id=OTHER_BOOT_ID)
        assert other.stdout.strip() == "TOOK OVER", other.stderr
        out, err = writer.communicate(timeout=300)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert writer.returncode == 0, err
    lines = [line.split() for line in out.splitlines()]
    calls = [(word, int(i)) for word, i in (line for line in lines if line[0] in ("stored",
                                                                                  "refused"))]
    first = next(i for word, i in calls if word == "refused")
    after = [word for word, i in calls if i >= first]
    assert after == ["refused"] * 150, (
        f"{after.count('stored')} of {len(after)} puts stored after the takeover")
    assert ["exists", "refused"] in lines and ["get", "refused"] in lines
    assert record(root)["hostnames"] == ["other-host"]
    # (the first refused put may have written its object before its last index commit
    # found the takeover: a whole object, which the index of the other host does not list)
    names = {p.name for p in (root / "objects").rglob("*_b")}
    assert not {f"{i:08x}_b" for i in range(first + 1, first + 150)} & names


async def test_a_record_of_this_kernel_without_this_host_name_fails_the_next_index_call(
    tmp_path: Path,
) -> None:
    """By default a record replaced, while open, by one of this boot id that does not list
    this host name (index/ rebuilt from another container) is another host's; with
    index_hosts=kernel this process's name is added to it and the call goes on."""
    me = site.this_host()
    for index_hosts, fails in (("name", True), ("kernel", False)):
        root = tmp_path / index_hosts
        store = FileBackend(root, index_hosts=index_hosts)  # type: ignore[arg-type]
        try:
            await store.put(["aa11_b"], [b"x"])
            _write_record(root, boot_id=me.boot_id, hostnames=["pod-x"])
            await asyncio.sleep(1.1)
            if fails:
                with pytest.raises(UnsafeIndexError, match="taken over") as caught:
                    await store.exists(["aa11_b"])
                assert "index_hosts=kernel" in str(caught.value)
            else:
                assert await store.exists(["aa11_b"]) == [True]
                assert record(root)["hostnames"] == ["pod-x", me.hostname]
        finally:
            await store.close()


async def test_a_removed_index_is_claimed_again_when_rebuilt(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = FileBackend(root)
    try:
        await store.put(["aa11_b"], [b"x"])
        shutil.rmtree(root / "index")
        await asyncio.sleep(1.1)
        assert await store.exists(["aa11_b"]) == [True]
        assert record(root)["boot_id"] == site.this_host().boot_id
    finally:
        await store.close()


# -- the filesystem -----------------------------------------------------------------------------


def _mountinfo_type(mount_point: str) -> str | None:
    """The fs type of the mount at exactly ``mount_point``, from /proc/self/mountinfo (an
    oracle independent of statfs)."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[4] == mount_point:
                found = fields[sep + 1]  # the last mount there is the visible one
    return found


def test_statfs_type_of_real_mounts(tmp_path: Path) -> None:
    assert _mountinfo_type("/proc") == "proc"
    fs = site.filesystem_of("/proc")
    assert fs == site.Filesystem(0x9FA0, "proc", network=False)
    if _mountinfo_type("/dev/shm") == "tmpfs":
        assert site.filesystem_of("/dev/shm") == site.Filesystem(0x01021994, "tmpfs", False)
    # Any path, against coreutils' own statfs (stat -f): the same type.
    shown = subprocess.run(["stat", "-f", "-c", "%t", str(tmp_path)], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert site.statfs_type(str(tmp_path)) == int(shown, 16)
    with pytest.raises(FileNotFoundError):
        site.statfs_type(str(tmp_path / "missing"))


@needs_unshare
def test_statfs_type_of_a_fresh_tmpfs_mount(tmp_path: Path) -> None:
    """A tmpfs mounted for the test (in a mount namespace of its own): the root on it, not
    the filesystem of the directory it was mounted on, is what is found."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = ("import sys; from hicache_store.backends import _file_site as s; "
            "print(hex(s.statfs_type(sys.argv[1] + '/deep/er')))")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs none "$1" && mkdir -p "$1/deep/er" && exec "$2" -c "$3" "$1"',
         "sh", str(mnt), sys.executable, code],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0x1021994"
    assert site.statfs_type(str(mnt)) == site.statfs_type(str(tmp_path))  # not here: its own


FUSE_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from hicache_store.backends import UnsafeIndexError, open_backend
    from hicache_store.backends import _file_site as site

    async def main(mnt):
        print(hex(site.statfs_type(mnt)))
        try:
            open_backend(f"file://{mnt}/kv")
        except UnsafeIndexError as exc:
            print("REFUSED", exc)
        store = open_backend(f"file://{mnt}/loose?index=none")
        await store.put(["aa11_b"], [b"on-fuse"])
        print("READ", (await store.get_bytes("aa11_b")).decode())
        await store.close()

    asyncio.run(main(sys.argv[1]))
    """
)


@pytest.mark.skipif(shutil.which("bindfs") is None or NO_UNSHARE is not None,
                    reason="needs bindfs (Debian package bindfs: a FUSE mount) and unshare -m")
def test_a_real_fuse_mount_refuses_the_default_index(tmp_path: Path) -> None:
    """bindfs mounts a directory through FUSE (as a 3FS, JuiceFS or sshfs mount would be):
    the detection sees FUSE, the default index is refused there, index=none works."""
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'bindfs "$1" "$2" || exit 99; "$3" -c "$4" "$2"; rc=$?; umount "$2"; exit $rc',
         "sh", str(src), str(mnt), sys.executable, FUSE_CHILD],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "0x65735546", lines
    assert lines[1].startswith(f"REFUSED {mnt}/kv is on fuse (f_type 0x65735546"), lines
    assert "index=none" in lines[1]
    assert lines[2] == "READ on-fuse"
    assert not (src / "kv").exists()  # refused before anything was created
    assert (src / "loose" / "layout.json").exists()  # written through the mount


@pytest.mark.parametrize(("magic", "name"), [
    (0x6969, "nfs"), (0x65735546, "fuse"), (0x0BD00BD0, "lustre"), (0xFE534D42, "smb2"),
    (0xFF534D42, "cifs"), (0x01021997, "9p"), (0x00C36400, "ceph"), (0x517B, "smb"),
])
def test_the_default_index_is_refused_on_a_network_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, magic: int, name: str
) -> None:
    """The refusal, with the ``statfs`` type injected (no network filesystem mounts here)."""
    monkeypatch.setattr(site, "statfs_type", lambda path: magic)
    root = tmp_path / "nfs" / "kv"
    with pytest.raises(UnsafeIndexError, match="index=none") as caught:
        open_backend(f"file://{root}")
    assert f"{name} (f_type {magic:#x}, network or FUSE filesystem)" in str(caught.value)
    assert not root.parent.exists()  # refused before anything was created
    # Asked for by name, the index is taken (one host); index=none always.
    asyncio.run(open_backend(f"file://{root}?index=sqlite").close())
    asyncio.run(open_backend(f"file://{tmp_path / 'other'}?index=none").close())
    # A root already indexed is refused all the same when reopened with the default.
    with pytest.raises(UnsafeIndexError):
        open_backend(f"file://{root}")


def test_local_and_unknown_filesystems_are_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for magic in (0xEF53, 0x58465342, 0x01021994, 0x12345678):
        assert not site.describe_filesystem(magic).network
        monkeypatch.setattr(site, "statfs_type", lambda path, m=magic: m)
        asyncio.run(FileBackend(tmp_path / f"r{magic:x}").close())
    site.check_filesystem("/x", None, explicit=False)  # no statfs: nothing to refuse on


def test_hf3fs_keeps_index_none_by_default_on_fuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(site, "statfs_type", lambda path: 0x65735546)
    store = open_backend(f"hf3fs://{tmp_path / 'kv'}?engine=posix")
    assert store.index_kind == "none"  # type: ignore[attr-defined]
    asyncio.run(store.close())
