"""Where the file backend's shared index may be used: one host, a local filesystem.

The index (``_file_index``: SQLite with a write-ahead log) is coherent only between the
processes of one running kernel, so a root several hosts use takes ``index=none``
(``_file_noindex``). Two checks at open enforce it, both before SQLite touches the database
(why, and the reasoning behind each rule: docs/design/file-backend.md):

**The filesystem** (``filesystem_of``): ``statfs(2)``'s ``f_type`` of the root. A root on a
network or FUSE filesystem (``NETWORK_FILESYSTEMS``) gets the default index only when the options
ask for it by name (``index=sqlite``: "only this host uses this root"); otherwise the open raises
``UnsafeIndexError``. Where ``statfs`` is not available (not Linux) nothing is refused.

**The host** (``HostClaim.claim``): ``index/host.json`` records the host that uses the index
(its kernel's boot id and boot time, and the host names of the processes that opened the root).
What a host is comes from the opener's ``index_hosts`` option (``INDEX_HOSTS``): ``name`` (the
default: a host name *and* a boot id) or ``kernel`` (a boot id: the containers of one kernel are
one host, and a host name not listed yet is added to the record). Every open reads the record:

- no record: writes one (temp file, then ``link``: of openers racing on a new root exactly
  one wins, the others read its record);
- the same boot id and this process's host name listed: this host's;
- the same boot id, this host name not listed: with ``index_hosts=kernel`` the name is added;
  by default, ``UnsafeIndexError`` naming ``index=none`` and ``index_hosts=kernel``;
- another boot id whose kernel booted before this one and whose host names include this
  process's: a previous boot of this host: replaced;
- anything else: ``UnsafeIndexError`` naming ``index=none`` and the host recorded.

**While open** (``HostClaim.check``: one ``stat`` before every commit of the index, at most once a
second): a record that no longer names this host fails this process's index call with
``UnsafeIndexError``, and from then on every call of this process on the root fails with it
(``raise_if_taken_over``), even if the record changes again.

A record is one file replaced atomically (temp in ``tmp/``, then ``rename`` or ``link``): a crash
leaves the old record or the new one. A record of a host that no longer uses the root stays
until removed by hand; the error names the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from hicache_store.layout.errors import ConfigError

from .errors import UnsafeIndexError

HOST_RECORD = "host.json"
#: values of the file backend's ``index_hosts`` option: what identifies a host in the record.
#: ``name``: host name and boot id (the default); ``kernel``: the boot id alone.
INDEX_HOSTS: tuple[str, ...] = ("name", "kernel")
DEFAULT_INDEX_HOSTS = "name"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
#: a kernel that booted this many seconds or less before another, with one host name, is not
#: taken for a previous boot of it (btime is wall-clock and moves a little with the clock).
_BOOT_TIME_SLACK = 2

#: ``statfs`` ``f_type`` of filesystems other hosts may mount too (``man 2 statfs``, the
#: kernel's ``magic.h``, and the out-of-tree ones' sources): the default index is refused on
#: them unless asked for by name.
NETWORK_FILESYSTEMS: dict[int, str] = {
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x517B: "smb",
    0x0BD00BD0: "lustre",
    0x65735546: "fuse",  # 3FS, GlusterFS, JuiceFS, s3fs, sshfs, ... (and fuseblk)
    0x01021997: "9p",
    0x00C36400: "ceph",
    0x5346414F: "afs",
    0x73757245: "coda",
    0x7461636F: "ocfs2",
    0x01161970: "gfs2",
    0x47504653: "gpfs",
    0x19830326: "beegfs",
}
#: names of common local filesystems, for messages and ``doctor``.
LOCAL_FILESYSTEMS: dict[int, str] = {
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlayfs",
    0x9FA0: "proc",
}


@dataclass(frozen=True)
class Filesystem:
    """A root's filesystem: ``statfs`` ``f_type``, its name, whether other hosts may mount it."""

    magic: int
    name: str
    network: bool

    def __str__(self) -> str:
        kind = "network or FUSE filesystem" if self.network else "local filesystem"
        return f"{self.name} (f_type {self.magic:#x}, {kind})"


def statfs_type(path: str) -> int | None:
    """``f_type`` of ``statfs(2)`` for ``path``; None where the call is not available.

    Linux only: every Linux ABI's ``struct statfs`` starts with ``f_type``, a C ``long``
    (masked to 32 bits: the magics are 32-bit, and a 32-bit ABI would sign-extend them).
    Raises ``OSError`` when the call fails (no such path, ...)."""
    statfs = _statfs()
    if statfs is None:
        return None
    buffer = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux
    if statfs(os.fsencode(path), buffer) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


_STATFS: list[Any] = []  # the libc function once looked up (None: not available)


def _statfs() -> Any:
    if not _STATFS:
        function = None
        if sys.platform.startswith("linux"):
            try:  # libc is in the process already (no find_library: it runs ldconfig)
                libc = ctypes.CDLL(None, use_errno=True)
                function = libc.statfs
                function.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
                function.restype = ctypes.c_int
            except (OSError, AttributeError):
                function = None
        _STATFS.append(function)
    return _STATFS[0]


def describe_filesystem(magic: int) -> Filesystem:
    """The ``Filesystem`` of a ``statfs`` type (unknown types are local: nothing refused)."""
    if magic in NETWORK_FILESYSTEMS:
        return Filesystem(magic, NETWORK_FILESYSTEMS[magic], network=True)
    return Filesystem(magic, LOCAL_FILESYSTEMS.get(magic, f"{magic:#x}"), network=False)


def filesystem_of(path: str) -> Filesystem | None:
    """The filesystem ``path`` is on; None where ``statfs`` is not available."""
    magic = statfs_type(path)
    return None if magic is None else describe_filesystem(magic)


def check_filesystem(root: str, fs: Filesystem | None, *, explicit: bool) -> None:
    """Refuse the default index on a network or FUSE filesystem unless it was asked for by
    name (``explicit``: ``index=sqlite`` in the options)."""
    if fs is None or not fs.network or explicit:
        return
    raise UnsafeIndexError(
        f"{root} is on {fs}: the default index (SQLite with a write-ahead log, shared memory "
        "between the processes of one host) is not safe there. A root several hosts use takes "
        "index=none (file:///...?index=none, for every process of the root); a root only this "
        "host uses may keep the index by asking for it: index=sqlite",
        backend="file", operation="open",
    )


# -- the host ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    """This process's kernel: boot id, boot time (unix seconds), host name."""

    boot_id: str
    boot_time: int
    hostname: str


def this_host() -> Host:
    """The host this process runs on (boot id ``""`` where the kernel has none to give)."""
    try:
        with open(BOOT_ID_PATH) as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return Host(boot_id, _boot_time(), socket.gethostname())


def _boot_time() -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return int(line.split()[1])
    return 0


@dataclass(frozen=True)
class HostRecord:
    """The content of ``index/host.json``: the kernel that uses the index."""

    boot_id: str
    boot_time: int
    hostnames: tuple[str, ...]
    since: float  # when this kernel first opened the index (unix seconds)

    def to_json(self) -> dict[str, object]:
        return {"boot_id": self.boot_id, "boot_time": self.boot_time,
                "hostnames": list(self.hostnames), "since": self.since}

    @classmethod
    def from_json(cls, data: object) -> HostRecord:
        if not isinstance(data, dict):
            raise ValueError("not an object")
        names = data["hostnames"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("hostnames is not a list of strings")
        return cls(str(data["boot_id"]), int(data["boot_time"]), tuple(names),
                   float(data["since"]))

    def describe(self) -> str:
        booted = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.boot_time))
        return f"{', '.join(self.hostnames) or '?'} (boot id {self.boot_id}, booted {booted})"


def read_host_record(index_dir: str) -> HostRecord | None:
    """The record in ``index_dir``; None when there is none. An unreadable record raises
    ``UnsafeIndexError`` (it is never taken for an absent one: that would let any host in)."""
    path = os.path.join(index_dir, HOST_RECORD)
    try:
        with open(path, "rb") as f:
            text = f.read(65536)
    except FileNotFoundError:
        return None
    try:
        return HostRecord.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise UnsafeIndexError(
            f"{path} is unreadable ({exc}): it names the host that uses this root's index. "
            "Remove it once you know that one host only uses the root",
            backend="file", operation="open",
        ) from exc


def is_this_host(record: HostRecord, host: Host, index_hosts: str = DEFAULT_INDEX_HOSTS) -> bool:
    """Whether ``record`` names ``host`` as it stands: its boot id and, unless ``index_hosts``
    is ``kernel``, its host name too."""
    return record.boot_id == host.boot_id and (
        index_hosts == "kernel" or host.hostname in record.hostnames)


def check_index_hosts(index_hosts: str) -> None:
    """Raise ``ConfigError`` unless ``index_hosts`` is one of ``INDEX_HOSTS``."""
    if index_hosts not in INDEX_HOSTS:
        raise ConfigError(
            f"index_hosts must be one of {INDEX_HOSTS} (name: a host is its host name and boot "
            f"id; kernel: the containers of one kernel are one host), got {index_hosts!r}")


class HostClaim:
    """This process's claim on a root's index for its host (see the module docstring)."""

    def __init__(self, index_dir: str, tmp_dir: str, token: str, host: Host | None = None,
                 index_hosts: str = DEFAULT_INDEX_HOSTS, read_only: bool = False) -> None:
        check_index_hosts(index_hosts)
        #: a reader that writes nothing: the record is checked, never written (no record, a
        #: previous boot's, or one that lacks this name under ``kernel``: read as they are).
        self.read_only = read_only
        self.index_dir = index_dir
        self.path = os.path.join(index_dir, HOST_RECORD)
        self._tmp_dir = tmp_dir
        self._token = token
        self.host = this_host() if host is None else host
        self.index_hosts = index_hosts
        self.record: HostRecord | None = None
        self._file: tuple[int, int, int] | None = None
        #: set once another host took the record over while this process had the index
        #: open: every later call fails with it (the module docstring, "While open").
        self.taken_over: UnsafeIndexError | None = None

    def claim(self) -> HostRecord | None:
        """Make sure the record names this host (writing it if needed) or raise
        ``UnsafeIndexError``. One read of the record when it is this host's already.
        Read-only: the record as found (None: there is none), unless another host's."""
        for _ in range(8):  # a lost race for a write re-reads; only writers race
            found = read_host_record(self.index_dir)
            if self.read_only:
                if found is not None and not (is_this_host(found, self.host, self.index_hosts)
                                              or self._previous_boot(found)):
                    raise self._foreign(found)
                self.record, self._file = found, _file_id(self.path)
                return found
            if found is None:
                if self._publish(self._new_record(), replace=False):
                    continue  # read back what won
            elif found.boot_id == self.host.boot_id:
                if self.host.hostname in found.hostnames:
                    self.record, self._file = found, _file_id(self.path)
                    return found
                if self.index_hosts != "kernel":
                    raise self._foreign(found)
                names = (*found.hostnames, self.host.hostname)
                self._publish(HostRecord(found.boot_id, found.boot_time, names, found.since),
                              replace=True)
            elif self._previous_boot(found):
                self._publish(self._new_record(), replace=True)
            else:
                raise self._foreign(found)
        raise UnsafeIndexError(
            f"{self.path} kept changing while this process opened the index: processes of "
            "more than one host are opening this root", backend="file", operation="open",
        )

    def check(self, *, reclaim: bool = True) -> None:
        """While open: the record is still this host's (one ``stat`` when it is unchanged).
        A replaced record is read again; one of another kernel raises ``UnsafeIndexError``,
        whatever its host names (this kernel is running, so it is no previous boot), and so,
        unless ``index_hosts`` is ``kernel``, does one of this kernel without this host name.
        Once raised, it is raised again by every later call (``taken_over``). A record removed
        (with ``index/`` or by hand), or one another container added its name to, is claimed
        again, unless ``reclaim`` is False (the check before a commit: the index's periodic
        check does it)."""
        self.raise_if_taken_over()
        if _file_id(self.path) == self._file:
            return
        try:
            found = read_host_record(self.index_dir)
            if found is not None and not is_this_host(found, self.host, self.index_hosts):
                raise self._foreign(found, took_over=True)
            if reclaim:
                self.claim()
        except UnsafeIndexError as exc:
            self.taken_over = exc
            raise

    def raise_if_taken_over(self) -> None:
        """``UnsafeIndexError`` if another host took the record over (no I/O)."""
        if self.taken_over is not None:
            raise self.taken_over

    def _previous_boot(self, found: HostRecord) -> bool:
        return (self.host.hostname in found.hostnames
                and found.boot_time + _BOOT_TIME_SLACK < self.host.boot_time)

    def _new_record(self) -> HostRecord:
        return HostRecord(self.host.boot_id, self.host.boot_time, (self.host.hostname,),
                          time.time())

    def _publish(self, record: HostRecord, *, replace: bool) -> bool:
        """Write ``record`` as the record: ``rename`` over it (``replace``) or ``link``
        (created only if there is none; False when another opener's is there)."""
        tmp = os.path.join(self._tmp_dir, f"{os.getpid()}-{self._token}-host.tmp")
        with open(tmp, "w") as f:
            json.dump(record.to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        try:
            if replace:
                os.rename(tmp, self.path)
                return True
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _foreign(self, found: HostRecord, *, took_over: bool = False) -> UnsafeIndexError:
        me = f"{self.host.hostname} (boot id {self.host.boot_id})"
        when = ("was taken over, since this process opened it, by" if took_over
                else "is used by")
        root = os.path.dirname(self.index_dir)
        kernel = ""
        if found.boot_id == self.host.boot_id:  # another host name on this kernel
            kernel = (
                " That host runs on this kernel (same boot id) under another host name (a "
                "container or another UTS namespace): if the containers of this kernel share "
                "this root, open it in every one of them with index_hosts=kernel "
                "(file:///...?index_hosts=kernel: the boot id alone identifies a host).")
        return UnsafeIndexError(
            f"the index of {root} {when} another host: {found.describe()}; this process runs "
            f"on {me}. The default index serves the processes of one host only; a root "
            "several hosts use takes index=none (file:///...?index=none, for every process "
            f"of the root: stop them, remove {self.index_dir} and {root}/layout.json, then "
            f"open with index=none).{kernel} If that host no longer uses this root, remove "
            f"{self.path} and open again",
            backend="file", operation="open",
        )


@dataclass(frozen=True)
class RootSite:
    """Where a file-layout root lives, read without opening it (``hicache-store doctor``):
    its filesystem, the index its layout marker names, the host its index records."""

    root: str
    filesystem: Filesystem | None
    index: str | None  # from layout.json; None: no marker (a new root)
    host_record: HostRecord | None
    record_error: str | None  # the record exists but cannot be read
    this_host: Host
    index_hosts: str = DEFAULT_INDEX_HOSTS  # the rule the open would apply (``INDEX_HOSTS``)

    @property
    def this_host_recorded(self) -> bool:
        """Whether the record names this host by ``index_hosts``' rule (by default its host
        name and boot id; with ``kernel``, its boot id)."""
        return self.host_record is not None and is_this_host(
            self.host_record, self.this_host, self.index_hosts)


def root_site(root: str, index_hosts: str = DEFAULT_INDEX_HOSTS) -> RootSite:
    """Look at ``root`` (or, for a root not made yet, the directory it would be made in), for
    an opener with ``index_hosts`` (``ConfigError`` for a value not in ``INDEX_HOSTS``)."""
    check_index_hosts(index_hosts)
    path = os.path.abspath(os.path.expanduser(root))
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        fs = filesystem_of(probe)
    except OSError:
        fs = None
    index: str | None = None
    with contextlib.suppress(OSError, ValueError), open(os.path.join(path, "layout.json")) as f:
        marker = json.load(f)
        if isinstance(marker, dict):
            index = str(marker.get("index", "sqlite"))  # version 1 had none: indexed at open
    record, error = None, None
    try:
        record = read_host_record(os.path.join(path, "index"))
    except UnsafeIndexError as exc:
        error = exc.message
    except OSError as exc:
        error = str(exc)
    return RootSite(path, fs, index, record, error, this_host(), index_hosts)


def _file_id(path: str) -> tuple[int, int, int] | None:
    """``(device, inode, mtime)`` of a file (a replaced record is a new inode); None if none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


__all__ = [
    "DEFAULT_INDEX_HOSTS", "INDEX_HOSTS", "NETWORK_FILESYSTEMS", "Filesystem", "Host",
    "HostClaim", "HostRecord", "RootSite", "UnsafeIndexError", "check_filesystem",
    "check_index_hosts", "describe_filesystem", "filesystem_of", "is_this_host",
    "read_host_record", "root_site", "statfs_type", "this_host",
]
