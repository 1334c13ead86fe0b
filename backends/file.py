"""``file:///path``: objects as files on a local (or POSIX-mounted) filesystem.

On-disk layout under the root::

    layout.json            format marker (refuses a root written with another layout)
    objects/ab/cd/<key>    one file per object; ``ab/cd`` = first 4 hex of xxh3_64(key)
    tmp/<pid>-<token>-<n>.tmp   files being written (never visible as objects)

**Sharding.** Two levels of 256 directories, chosen by a hash of the key (not by the key's own
characters, so any key spreads evenly): a million objects are about 15 per directory, far from
any filesystem's limits, and a lookup is one ``stat`` of a known path, never a scan.

**Atomic publish.** A write goes to a temp file in ``tmp/`` (same filesystem), then
``rename`` onto the final path (``link`` for ``put_if_absent``, which fails if the key exists).
Readers therefore see the old object, the new one, or nothing; never a part. A reader that
opened the old file keeps reading the old inode, unchanged, after a rewrite or an eviction.

**Durability** (``durability=``): ``none`` (no flush; fastest, an object may vanish or, on
a filesystem without ordered data, be torn after a power loss), ``data`` (default: the temp
file is ``fdatasync``-ed before the rename, so after a crash an object is whole or absent),
``full`` (also ``fsync`` of the shard directory after the rename, so a returned ``put`` is
on the device under its name).

**Zero-copy, O_DIRECT and the page cache.** Reads go straight into the caller's buffer with
``os.preadv``; writes come straight from it with ``os.pwrite``. A scatter read (``get_scatter``:
a framed object's header and payload into separate buffers) is one open and one ``preadv`` with
one iovec per buffer. When the caller's buffer addresses and the file offset are 4096-aligned
(``direct_io=auto``, the default), writes and cold reads use O_DIRECT and bypass the page
cache; an unaligned tail (< 4 KiB) goes through a per-thread aligned block.
Why O_DIRECT by default: a buffered write or a cold buffered read needs fresh page-cache pages,
which can cost more than the device transfer, and an fdatasync after a buffered write still has
all the data to flush, after an O_DIRECT write almost nothing (figures: BENCHMARKS.md,
"Backends" and "Design figures behind the file backend's index and read policy").
Buffered I/O wins re-reads of bytes already in the page cache, so a read first asks the kernel whether its range is cached (``_pagecache.is_cached``: ``cachestat``, no
side effects) and reads warm bytes buffered. A key read cold a second time within a window is
read buffered too, so that its later reads are warm (``page_cache=second``, the default;
``never`` keeps every cold read O_DIRECT, ``always`` reads cold bytes buffered: see
``_pagecache``). ``direct_io=never`` makes every read and write buffered. Unaligned buffers
always go buffered.

**Parallel I/O.** Each object's I/O is one job on a bounded thread pool (``io_threads``);
the syscalls release the GIL, so a batch keeps that many requests in flight on the device.
The pool runs the jobs of the oldest call first (``_call_order``): a put's later steps
(write, settle) go before the first step of any put that began after it, so many concurrent
puts end in the order they began instead of all together; a put whose caller gave up before
its first step began is never begun.
With the C accelerator built (``_fileio``, optional: ``setup.py``), a read job (a run of a
batch's reads, or one scatter read) makes all its system calls inside one call that releases
the GIL: in a process whose other threads keep the interpreter busy (an inference engine)
each reacquisition waits up to the switch interval, and a read took five of them. Same bytes,
misses, errors and read policy as the Python path, except that an object whose length is not
a multiple of 4096 is read buffered (the Python path reads its aligned body O_DIRECT). The
same call can also compute checksums of what it read (``get_into_summed``: XXH3 taken from
the ``xxhash`` package), so a reader of framed objects verifies a batch without taking the
GIL back per object. A put's writes are likewise one job and one such call
(``_fileio.write_files``: the same temp files, O_DIRECT rule, flushes and renames as
``_write_one``), where the Python path runs one job per object.

**Index** (``_file_index``; its docstring has the design and the protocol). A SQLite database
in ``index/`` lists every object with its size and eviction rank, shared by every process
that opens the root on one host; ``exists`` reads a memory-mapped set of key fingerprints kept
up to date from the database's change feed. Open costs the same at any store size, no
per-object state lives in process memory, and objects other processes wrote a moment ago are
found at index speed. Reads and stats go to the files themselves (a read that finds no file is
a miss, and fixes the index). All processes using one root must run on one host (SQLite's
write-ahead log shares memory between them), and the open checks it (``_file_site``): a
process on another host than the one recorded in ``index/host.json`` is refused (a host is a
host name and boot id; ``index_hosts=kernel`` makes the containers of one kernel one host),
and so is the default index on a network or FUSE filesystem unless ``index=sqlite`` is given
by name.
A root written before the index existed gets one at its first open (one walk of
``objects/``).

**Capacity and eviction.** ``capacity_bytes`` (default: 90% of what the filesystem could hold
for the store at open) bounds the bytes of the whole store, counted in the shared index
(objects plus writes in flight, whichever process makes them). Before a batch is written, room
is made by deleting objects in rank order: least recently written or read first, and within one
call's keys (a chain in order) the deepest first (``_lru.chain_ranks``), so a chain loses its
tail before its head. The order is an on-disk index read a page at a time. An object that
cannot be deleted is counted (``stats.eviction_failures``), moved to the back of the line, and
eviction goes on with the next one; if no room can be made the write raises ``CapacityError``.

**Retention** (``backends.retention``; kept in the index, ``_file_retention``). Pins and
retained objects are entries of the shared index, so every process of the root honours them
and they outlive the process that made them: eviction takes unretained objects first (in the
order above), then retained ones by ascending priority, never an object whose pin holds; room
that only a pin could give raises ``CapacityError``. Pins may hold at most ``pin_fraction`` of
``capacity_bytes`` (``PinBudgetError`` otherwise, nothing applied). A delete or an eviction
drops the key's entries; an entry past its deadline is ordinary data. ``index=none`` keeps no
entries: the capability is not declared there.

**Crash safety.** A writer killed mid-batch leaves temp files and pending index rows. At open,
temp files whose writer process is gone (or older than an hour) are removed, and the keys of a
dead process's pending changes are reconciled with their files: no object is lost or invented.
A put that is cancelled finishes its bookkeeping (and its reads of the caller's buffers) before
the cancellation propagates.

**Keys** are validated before any path is built; a key cannot contain ``/``, ``.`` or NUL, so
every path stays under ``objects/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import importlib
import itertools
import json
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import xxhash

from hicache_store.layout.errors import ConfigError, InvalidKeyError
from hicache_store.layout.keys import validate_storage_key

from ._aligned import DIRECT_ALIGNMENT, aligned_buffer, is_aligned, scratch_block
from ._call_order import CallOrderPool, one_call
from ._file_index import DB_NAME, FileIndex, ObjectIndex, Reservation, pid_alive
from ._file_noindex import NoIndex
from ._file_site import (
    RootSite,
    check_filesystem,
    check_index_hosts,
    filesystem_of,
    root_site,
)
from ._pagecache import SecondTouch, is_cached
from .base import Backend, PendingReads, abandonable, gather_settled, reads_are_uses, scatter_views
from .errors import (
    BackendError,
    BackendIOError,
    InvalidRangeError,
    NotSupportedError,
    translate_os_error,
)
from .retention import DEFAULT_PIN_FRACTION, Retention, pin_budget_bytes
from .types import (
    BackendURL,
    ByteRange,
    Capabilities,
    DeletedUntilHeld,
    ObjectStat,
    convert_options,
    parse_size,
)

Durability = Literal["none", "data", "full"]
DirectIO = Literal["auto", "never"]
PageCache = Literal["second", "never", "always"]
IndexKind = Literal["sqlite", "none"]
IndexHosts = Literal["name", "kernel"]
DURABILITY_MODES: tuple[str, ...] = ("none", "data", "full")
DIRECT_IO_MODES: tuple[str, ...] = ("auto", "never")
PAGE_CACHE_MODES: tuple[str, ...] = ("second", "never", "always")
INDEX_KINDS: tuple[str, ...] = ("sqlite", "none")
LAYOUT_FORMAT = "hicache-store/file"
#: 2: objects plus the shared index in ``index/``. A version-1 root (objects only) is upgraded
#: at its first open by building the index.
LAYOUT_VERSION = 2
_LAYOUT_V1 = {"format": LAYOUT_FORMAT, "version": 1, "shard_levels": 2}


def _layout(index: str) -> dict[str, object]:
    """The marker of a version-2 root: every process of a root must use the same index."""
    return {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "shard_levels": 2, "index": index}
#: temp files older than this are stale whoever wrote them (no write lasts an hour).
STALE_TEMP_SECONDS = 3600.0
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_MAX_IO = 0x7FFFF000  # Linux moves at most this many bytes per read/write call
_IOV_MAX = 1024  # Linux takes at most this many buffers per vectored call
_INLINE_EXISTS = 4096  # at most ~1 ms of lookups on the caller's thread
#: the fewest objects one write job of a batch takes (below it the pool hand-off dominates).
_WRITE_JOB_MIN = 4
#: a batch's writes are spread over the pool when one object's write takes longer than this
#: (a pool hand-off costs 0.1-0.3 ms on a loaded 2-core machine).
_SPLIT_WRITES_ABOVE_S = 0.0005
#: ``_fileio`` flags: a read that was cold (not all cached) and aligned for O_DIRECT.
_COLD_ALIGNED = 2 | 4

try:  # the optional C accelerator of batched reads and writes (setup.py)
    from . import _fileio
except ImportError:  # not built: the same reads, one system call per GIL hand-off
    _fileio = None  # type: ignore[assignment]


def _bind_xxh3() -> bool:
    """Whether ``_fileio`` hashes with the ``xxhash`` package's own XXH3 (its extension is
    loaded: ``xxhash`` is imported above)."""
    if _fileio is None:
        return False
    try:
        ext = importlib.import_module("xxhash._xxhash")
    except ImportError:
        return False
    path = getattr(ext, "__file__", None)
    return isinstance(path, str) and _fileio.bind_xxh3(path)


#: ``_fileio`` computes checksums beside its reads (``get_into_summed``).
_SUMS_IN_C = _bind_xxh3()

T = TypeVar("T")
log = logging.getLogger(__name__)


def shard_of(key: str) -> tuple[str, str]:
    """The two shard directory names of a key (4 hex digits of xxh3_64(key))."""
    digest = xxhash.xxh3_64_hexdigest(key.encode())
    return digest[:2], digest[2:4]


class FileBackend(Backend):
    """Objects as files under ``root``. See the module docstring for every guarantee.

    Options: ``durability`` (none | data | full, default data), ``capacity_bytes`` (int or
    size string; default 90% of the space available at open), ``io_threads`` (default 16),
    ``direct_io`` (auto | never), ``page_cache`` (second | never | always: when a cold read
    fills the page cache), ``create`` (make the root if missing, default True),
    ``lock_timeout`` (seconds to wait for the shared index or a key busy in another process
    before ``BackendUnavailableError``, default 30), ``index`` (``sqlite``: the shared index,
    processes on one host; ``none``: no index, for a root several hosts write, see
    ``_file_noindex``; given as ``sqlite`` explicitly, it is also taken on a network or FUSE
    filesystem, which the default refuses: ``_file_site``), ``index_hosts`` (what the shared
    index takes for one host, ``_file_site``: ``name``, the default, a host name and boot id,
    so a process with another host name is refused even on the same kernel, such as another
    container; ``kernel``, the boot id alone: containers of one kernel share the index, each
    host name added to ``index/host.json``; another kernel is refused either way),
    ``pin_fraction`` (share of ``capacity_bytes`` pins may hold, default 0.25; this process's
    budget, over every process's pins), ``clock`` (unix seconds for retention deadlines,
    default ``time.time``; every process of a root must agree on it), ``read_only`` (default
    False: open a store that exists and write nothing to it, at open or later: no temp files,
    no layout marker, no host record, the index read through a read-only SQLite connection
    (which, as any reader, may make the index's empty log and shared-memory files where no
    process has them), or the files themselves where the root has no index yet; writes raise
    ``NotSupportedError``, reads are not recorded as uses and no retention is reported. What
    ``inspect`` and ``doctor`` open, so they work on a full filesystem).
    """

    #: the index a root gets when ``index`` is not given.
    default_index: ClassVar[IndexKind] = "sqlite"

    name = "file"
    creates_location = True
    opens_read_only = True
    capabilities = Capabilities(
        ranged_reads=True,
        zero_copy_reads=True,
        listing=True,
        atomic_put=True,
        eviction=True,
        persistent=True,
        shared=True,
        mtime=True,
        retention=True,
    )

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        durability: Durability = "data",
        capacity_bytes: int | str | None = None,
        io_threads: int = 16,
        direct_io: DirectIO = "auto",
        page_cache: PageCache = "second",
        create: bool = True,
        lock_timeout: float = 30.0,
        index: IndexKind | None = None,
        index_hosts: IndexHosts = "name",
        pin_fraction: float | str = DEFAULT_PIN_FRACTION,
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
    ) -> None:
        super().__init__()
        explicit_index = index is not None
        index = self.default_index if index is None else index
        if index not in INDEX_KINDS:
            raise ConfigError(f"index must be one of {INDEX_KINDS}, got {index!r}")
        check_index_hosts(index_hosts)
        if durability not in DURABILITY_MODES:
            raise ConfigError(f"durability must be one of {DURABILITY_MODES}, got {durability!r}")
        if direct_io not in DIRECT_IO_MODES:
            raise ConfigError(f"direct_io must be one of {DIRECT_IO_MODES}, got {direct_io!r}")
        if page_cache not in PAGE_CACHE_MODES:
            raise ConfigError(f"page_cache must be one of {PAGE_CACHE_MODES}, got {page_cache!r}")
        if io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {io_threads}")
        if lock_timeout <= 0:
            raise ConfigError(f"lock_timeout must be > 0, got {lock_timeout}")
        # Every option is checked before the root is touched: a refused store creates nothing.
        capacity = None if capacity_bytes is None else parse_size(capacity_bytes, option="capacity_bytes")
        pin_budget_bytes(0, float(pin_fraction))  # checks the fraction
        self.root = Path(root).expanduser().resolve()
        self.durability: Durability = durability
        self.io_threads = io_threads
        #: recent seconds one small object's write takes (``_write_batch`` splits by it;
        #: None until a write was timed: split, since one thread writing a large batch of
        #: objects that are slow to make would take the whole batch's time alone).
        self._write_cost_s: float | None = None
        self.page_cache: PageCache = page_cache
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._token = secrets.token_hex(4)
        self._seq = itertools.count()
        self._lock = threading.Lock()  # guards _known_dirs and the stats counters
        self._known_dirs: set[str] = set()
        self._second_touch = SecondTouch()
        try:
            #: the filesystem of the root (None where ``statfs`` is unavailable), checked
            #: before anything is created: the default index is refused on a network or FUSE
            #: filesystem unless asked for by name (``_file_site``).
            self.filesystem = filesystem_of(_existing_ancestor(self.root))
            if index == "sqlite":
                check_filesystem(str(self.root), self.filesystem, explicit=explicit_index)
            self.read_only = read_only
            upgrade = self._prepare_root(create and not read_only, index)
            self.direct_io = (direct_io == "auto" and not read_only
                              and self._probe_direct_io())
            self.removed_temp_files = 0 if read_only else self._remove_stale_temps()
            self.index_kind: IndexKind = index
            self._index: ObjectIndex
            #: the shared index, where retention lives (None: ``index=none``, no retention).
            self._holds: FileIndex | None = None
            unindexed = upgrade or not (self.root / "index" / DB_NAME).exists()
            if index == "none" or (read_only and unindexed):  # (read-only: a root not
                # indexed, or whose index/ was removed, is read from its files, never indexed)
                self._index = NoIndex(str(self._objects), self._final_path, _list_dir)
                self.capabilities = type(self).capabilities.replace(retention=False)
            elif read_only:
                self._index = FileIndex(
                    str(self.root), str(self._objects), self._final_path, token=self._token,
                    lock_timeout=lock_timeout, index_hosts=index_hosts, clock=clock,
                    read_only=True,
                )
                self.capabilities = type(self).capabilities.replace(retention=False)
            else:
                self._index = self._holds = FileIndex(
                    str(self.root), str(self._objects), self._final_path, token=self._token,
                    durable=durability == "full", lock_timeout=lock_timeout, walk=self._walk,
                    index_hosts=index_hosts, clock=clock,
                )
            if upgrade and not read_only:
                self._write_layout()
        except OSError as exc:
            raise translate_os_error(exc, backend=self.name, operation="open") from exc
        if capacity is None:
            usage = shutil.disk_usage(self.root)
            capacity = int(0.9 * (usage.free + self._index.totals()[0]))
        self.capacity_bytes = capacity
        self.pin_budget_bytes = pin_budget_bytes(capacity, float(pin_fraction))
        self._pool = CallOrderPool(io_threads, "hicache-file")

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> FileBackend:
        """``file:///abs/path`` plus the options of ``__init__`` (``BackendURL.local_path``)."""
        return cls(url.local_path(), **cls._typed_options(options))

    @staticmethod
    def _typed_options(options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with the file backend's URL-query strings converted to their types."""
        return convert_options(
            options, ints=("io_threads",), floats=("lock_timeout", "pin_fraction"),
            sizes=("capacity_bytes",),
            bools=("create", "read_only"),
        )

    @staticmethod
    def site(root: str | os.PathLike[str], index_hosts: str = "name") -> RootSite:
        """Where ``root`` lives, read without opening it (nothing is created or claimed): its
        filesystem, the index its marker names, the host its index records and whether that
        is this host by ``index_hosts``' rule (``_file_site``; ``hicache-store doctor``
        reports it)."""
        return root_site(str(root), index_hosts)

    def __repr__(self) -> str:
        return f"FileBackend({str(self.root)!r}, durability={self.durability!r})"

    # -- open ---------------------------------------------------------------------------------

    def _prepare_root(self, create: bool, index: str) -> bool:
        """Make (or check) the root; True when its layout marker is to be written once the
        index is ready (a new root, or a version-1 root being upgraded). A root marked for the
        other index is refused: processes that disagree would each miss the other's objects."""
        if create:
            self._objects.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(exist_ok=True)
        elif not self._objects.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no hicache-store file layout here", str(self.root))
        if not self.read_only:
            self._tmp.mkdir(exist_ok=True)
        marker = self.root / "layout.json"
        try:
            found = json.loads(marker.read_text())
        except FileNotFoundError:
            return True
        except ValueError:
            found = None
        if found == _layout(index):
            return False
        if found == _LAYOUT_V1:
            return True
        if isinstance(found, dict) and found == {**_layout(index), "index": found.get("index")}:
            raise BackendError(
                f"{self.root} is used with index={found['index']}; open it with that index "
                f"(every process of a root must use the same one), not index={index}",
                backend=self.name, operation="open",
            )
        raise BackendError(
            f"{marker} describes another layout ({found!r}); refusing to use {self.root}",
            backend=self.name, operation="open",
        )

    def _write_layout(self) -> None:
        tmp = self._tmp / f"{os.getpid()}-{self._token}-layout.tmp"
        tmp.write_text(json.dumps(_layout(self.index_kind)))
        os.replace(tmp, self.root / "layout.json")  # racing openers write the same content

    def _probe_direct_io(self) -> bool:
        if not _O_DIRECT:
            return False
        probe = self._tmp / f"{os.getpid()}-{self._token}-probe.tmp"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT | _O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False  # e.g. older tmpfs: buffered only
            raise
        try:
            os.pwrite(fd, aligned_buffer(DIRECT_ALIGNMENT), 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

    def _remove_stale_temps(self) -> int:
        """Delete temp files left by dead writers; return how many. Live writers' stay."""
        removed = 0
        now = time.time()
        with os.scandir(self._tmp) as entries:
            for entry in entries:
                owner = entry.name.split("-", 1)[0]
                alive = owner.isdigit() and pid_alive(int(owner))
                try:
                    fresh = now - entry.stat(follow_symlinks=False).st_mtime < STALE_TEMP_SECONDS
                except FileNotFoundError:
                    continue  # its writer published or removed it meanwhile
                if alive and fresh:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def _walk(self) -> Iterator[tuple[str, int, float]]:
        """``(key, size, mtime)`` of every object file: what a new index is built from."""
        for top in _scandir_dirs(self._objects):
            for sub in _scandir_dirs(top.path):
                yield from _list_dir(sub.path)

    # -- paths --------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """The final path of a (validated) key. Public for tests and tools."""
        return Path(self._shard_dir(validate_storage_key(key)), key)

    def _final_path(self, key: str) -> str:
        return os.path.join(self._shard_dir(key), key)

    def _shard_dir(self, key: str) -> str:
        if os.sep in key or key in (".", "..") or "\x00" in key:  # defence in depth
            raise InvalidKeyError(f"key {key[:80]!r} would leave the store", backend=self.name)
        top, sub = shard_of(key)
        return os.path.join(self._objects, top, sub)

    def _temp_path(self) -> str:
        return os.path.join(self._tmp, f"{os.getpid()}-{self._token}-{next(self._seq)}.tmp")

    def _ensure_dir(self, directory: str) -> None:
        if directory in self._known_dirs:
            return
        os.makedirs(directory, exist_ok=True)
        if self.durability == "full":
            _fsync_dir(os.path.dirname(directory))
            _fsync_dir(os.path.dirname(os.path.dirname(directory)))
        with self._lock:
            self._known_dirs.add(directory)

    # -- running blocking work -----------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def _run_io(self, fn: Callable[..., T], *args: Any) -> T:
        """``_run`` for a job that reads into or writes from the caller's buffers.

        Buffer lifetime (base module docstring): such a job whose caller gave up before a
        thread picked it up does not start (``abandonable``); one already in its ``preadv`` /
        ``pwrite`` runs to the end, and the public method waits for it (one object's syscalls
        on a local or mounted filesystem), so the caller's memory is never touched after the
        call ended. Waiting, not staging: reads keep landing straight in the caller's buffer
        with O_DIRECT (BENCHMARKS.md "Buffer lifetime"). Bookkeeping jobs (the index) use
        ``_run``: they must run even for an abandoned call.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, abandonable(fn), *args)

    def _check_open(self, operation: str) -> None:
        # Also refused once another host has taken the root's index over (``_file_site``):
        # every call of this process fails from then on, reads included.
        super()._check_open(operation)
        if self._holds is not None:
            self._holds.host.raise_if_taken_over()

    def _check_writable(self, operation: str) -> None:
        if self.read_only:
            raise NotSupportedError(f"{self.root} is open read-only: {operation} writes",
                                    backend=self.name, operation=operation)

    def _translated(self, operation: str, key: str | None, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except BackendError:
            raise  # already ours (some of ours are also OSErrors)
        except OSError as exc:
            raise translate_os_error(exc, backend=self.name, operation=operation, key=key) from exc

    # -- core: exists / stat -------------------------------------------------------------------

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited. The index answers (other processes' writes included); exists
        # does not count as a use for eviction (reads do), so probes stay read-only. A small
        # batch on an up-to-date fingerprint set is answered inline: a pool hand-off costs
        # more than the lookup (~0.25 us a key).
        if len(keys) <= _INLINE_EXISTS:
            hits = self._index.exists_if_current(keys)
            if hits is not None:
                return hits
        return await self._run(self._translated, "exists", None, self._index.exists, keys)

    def exists_now(self, keys: Sequence[str], max_age_s: float = 0.0) -> list[bool] | None:
        # docstring inherited. The index's fingerprint set when it is recent enough, else when
        # it is current, and free (a memory lookup; neither ``exists_recent`` nor
        # ``exists_if_current`` waits on I/O or a lock, and the first makes no SQLite call).
        if self._closed or len(keys) > _INLINE_EXISTS:
            return None
        checked = self._check_keys(keys, "exists")
        if max_age_s > 0:
            recent = self._index.exists_recent(checked, max_age_s)
            if recent is not None:
                return recent
        return self._index.exists_if_current(checked)

    def exists_blocking(self, keys: Sequence[str]) -> list[bool] | None:
        # docstring inherited. The index's ``exists`` on the caller's thread (thread-safe: each
        # thread has its own SQLite connection), as the pool would run it.
        self._check_open("exists")
        checked = self._check_keys(keys, "exists")
        return self._translated("exists", None, self._index.exists, checked) if checked else []

    def _stat_paths(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        out: list[ObjectStat | None] = []
        for key in keys:
            try:
                st = os.stat(self._final_path(key))
            except FileNotFoundError:
                out.append(None)
                continue
            out.append(ObjectStat(key, st.st_size, st.st_mtime))
        return out

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        # docstring inherited. From the files themselves (the truth for sizes and mtimes).
        return await self._run(self._translated, "stat", None, self._stat_paths, keys)

    async def adopt(self, keys: Sequence[str]) -> int:
        """Index objects placed under ``objects/`` by other means (a restore, a copy, a test
        oracle): each key's index entry is set from its file (present with its size, or
        absent). Returns how many of ``keys`` are indexed now."""
        self._check_open("adopt")
        self._check_writable("adopt")
        checked = self._check_keys(keys, "adopt")
        return await self._run(self._translated, "adopt", None, self._index.adopt, checked)

    # -- core: reads ---------------------------------------------------------------------------

    async def _get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        ranges: Sequence[ByteRange | None],
    ) -> list[int | None]:
        # docstring inherited. At most ``io_threads`` jobs, each reading a run of the batch in
        # turn: as many reads in flight as one job per key would keep, without a pool hand-off
        # per key (100-300 us each on a loaded 2-core machine: most of the time of a batch of
        # small reads, such as gc's 4 KiB headers). All jobs end before the call does, even
        # when one fails (buffer lifetime).
        items = list(zip(keys, buffers, ranges, strict=True))
        per_job = max(1, -(-len(items) // self.io_threads))
        jobs = [self._run_io(self._read_run, items[i : i + per_job])
                for i in range(0, len(items), per_job)]
        results: list[int | None] = [
            n for run in await gather_settled(*jobs) for n in run]
        await self._after_reads(keys, results)
        return results

    def _read_run(
        self, items: Sequence[tuple[str, memoryview, ByteRange | None]]
    ) -> list[int | None]:
        if not self._released_reads:
            return [self._translated("get_into", key, self._read_one, key, view, rng)
                    for key, view, rng in items]
        return self._read_run_released([(key, [view], rng) for key, view, rng in items])

    @property
    def _released_reads(self) -> bool:
        """Whether reads go through the C accelerator (built, and no subclass reads its own
        way: ``hf3fs`` overrides ``_read_one``)."""
        return _fileio is not None and type(self)._read_one is FileBackend._read_one

    def _read_run_released(
        self, items: Sequence[tuple[str, Sequence[memoryview], ByteRange | None]]
    ) -> list[int | None]:
        """``_read_run`` through the C accelerator: the whole run's system calls in one call
        that releases the GIL (``_fileio``), then each item's outcome judged here exactly as
        ``_read_into`` judges it (a miss repairs the index; the first error of the run is
        raised once every item has been read). The read policy is ``_read_into``'s: O_DIRECT
        for aligned cold reads unless ``page_cache`` admits the key (asked before the read,
        recorded after it only for a read that was cold and aligned, as ``_read_into``
        records it)."""
        return self._released_batch(items, None)[0]

    def _released_batch(
        self,
        items: Sequence[tuple[str, Sequence[memoryview], ByteRange | None]],
        spans: Sequence[Sequence[tuple[int, int]]] | None,
    ) -> tuple[list[int | None], list[tuple[int, ...]]]:
        """``_read_run_released``, and with ``spans`` (per item, ``_SUMS_IN_C`` only) the
        checksums of those spans of each item's bytes, computed in the same GIL-free call."""
        batch, hashes = self._c_batch(items, spans)
        return self._judged_batch(items, _fileio.read_files(batch), hashes)

    def _c_batch(
        self,
        items: Sequence[tuple[str, Sequence[memoryview], ByteRange | None]],
        spans: Sequence[Sequence[tuple[int, int]]] | None,
    ) -> tuple[list[Any], list[int]]:
        """The ``_fileio`` items of a run of reads, and (page cache ``second`` only) each
        key's hash for ``_second_touch``."""
        second = self.direct_io and self.page_cache == "second"
        hashes = [xxhash.xxh3_64_intdigest(key.encode()) for key, _, _ in items] if second else []
        batch: list[Any] = []
        for i, (key, views, rng) in enumerate(items):
            direct = self.direct_io and self.page_cache != "always" and not (
                second and self._second_touch.seen(hashes[i]))
            start, length = (0, -1) if rng is None else (rng.start, rng.length)
            item = (self._final_path(key), list(views), start, length, direct)
            batch.append(item if spans is None else (*item, spans[i]))
        return batch, hashes

    def _judged_batch(
        self,
        items: Sequence[tuple[str, Sequence[memoryview], ByteRange | None]],
        outcomes: Sequence[tuple[int, int, int, int, tuple[int, ...]]],
        hashes: list[int],
        missing: list[str] | None = None,
    ) -> tuple[list[int | None], list[tuple[int, ...]]]:
        """The bytes read and sums of a run's ``_fileio`` outcomes (``_judged`` each; the
        first error raised once all are judged); ``missing`` collects the keys whose index
        entry needs repair instead of repairing them here."""
        results: list[int | None] = []
        sums: list[tuple[int, ...]] = []
        error: BaseException | None = None
        for i, ((key, views, rng), (status, value, size, flags, item_sums)) in enumerate(
            zip(items, outcomes, strict=True)
        ):
            if hashes and flags & _COLD_ALIGNED == _COLD_ALIGNED:
                self._second_touch.admit(hashes[i])  # a cold read, as _use_page_cache counts it
            sums.append(item_sums)
            try:
                results.append(self._judged(key, views, rng, status, value, size, missing))
            except BaseException as exc:
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        return results, sums

    @property
    def sums_reads(self) -> bool:
        # docstring inherited
        return self._released_reads and _SUMS_IN_C

    async def _get_into_summed(
        self, keys: list[str], views: list[memoryview], spans: list[list[tuple[int, int]]]
    ) -> tuple[list[int | None], list[tuple[int, ...]]]:
        # docstring inherited. One job on the pool, one C call for the batch's reads and
        # checksums (a batch of a few objects: vLLM's secondary tier reads a job's chunk rows
        # this way): one hand-off and one GIL reacquisition for all, where ``get_into`` makes
        # a job per object and the reader hashes each after it.
        if not self.sums_reads:
            return await super()._get_into_summed(keys, views, spans)
        items = [(key, [view], None) for key, view in zip(keys, views, strict=True)]
        results, sums = await self._run_io(self._released_batch, items, spans)
        await self._after_reads(keys, results)
        return results, sums

    def _start_get_into_summed(
        self, keys: list[str], views: list[memoryview], spans: list[list[tuple[int, int]]]
    ) -> PendingReads | None:
        # docstring inherited. The C call of ``_get_into_summed`` on a thread of its own that
        # never takes the GIL (``_fileio.start_read_files``): a caller polling from a thread
        # that holds the GIL (vLLM's scheduler loop) finds it done with no thread hand-off.
        if not self.sums_reads:
            return None
        items: list[tuple[str, Sequence[memoryview], ByteRange | None]] = [
            (key, [view], None) for key, view in zip(keys, views, strict=True)]
        batch, hashes = self._c_batch(items, spans)
        return _FilePendingReads(self, _fileio.start_read_files(batch),
                                 functools.partial(self._finish_reads, items, hashes=hashes))

    def _finish_reads(
        self,
        items: Sequence[tuple[str, Sequence[memoryview], ByteRange | None]],
        outcomes: Sequence[tuple[int, int, int, int, tuple[int, ...]]],
        *,
        hashes: list[int],
    ) -> tuple[list[int | None], list[tuple[int, ...]]]:
        """``_judged_batch`` for a caller that must not wait for the index (a scheduler
        thread): repairs of missing objects' entries and the due write of the reads'
        recency go to the pool (each SQLite call waits for the GIL: tens of ms on a thread
        racing an engine's busy loop for it)."""
        missing: list[str] = []
        try:
            results, sums = self._judged_batch(items, outcomes, hashes, missing)
        finally:
            if missing:
                self._to_pool(self._repair_quietly, missing)
        if self._touched([key for key, _, _ in items], results):
            self._to_pool(self._flush_touches_quietly)
        return results, sums

    def _to_pool(self, fn: Callable[..., object], *args: Any) -> None:
        """Run bookkeeping on the pool without waiting for it (closing: the pool refuses it,
        and close() writes the buffered touches itself; a repair not made is made by the
        next read of that key)."""
        with contextlib.suppress(RuntimeError):
            self._pool.submit(fn, *args)

    def _repair_quietly(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self._index.repair_missing(key)
            except Exception as exc:
                log.warning("%s: repairing the index entry of %s failed: %r", self.name, key, exc)

    def _flush_touches_quietly(self) -> None:
        """``flush_touches`` on the pool for a caller that does not wait: recency is best
        effort (the next flush writes what this one could not)."""
        try:
            self._index.flush_touches()
        except Exception as exc:
            log.warning("%s: writing read recency to the index failed: %r", self.name, exc)

    def _judged(
        self, key: str, views: Sequence[memoryview], rng: ByteRange | None, status: int,
        value: int, size: int, missing: list[str] | None = None,
    ) -> int | None:
        """One ``_fileio.read_files`` outcome as ``_read_into`` reports it (see ``_fileio.c``);
        a missing file's index entry is repaired here, or its key added to ``missing``."""
        path = self._final_path(key)
        if status == 0:
            return value
        if status == 1:
            if value == errno.ENOENT:
                # evicted or deleted by someone else: a miss
                if missing is None:
                    self._index.repair_missing(key)
                else:
                    missing.append(key)
                return None
            raise translate_os_error(OSError(value, os.strerror(value), path),
                                     backend=self.name, operation="get_into", key=key)
        if status == 2:
            raise BackendIOError(f"{path} is not a regular file", backend=self.name,
                                 operation="get_into", key=key)
        if status == 3:
            if rng is not None:
                rng.check_within(size, backend=self.name, key=key)
            raise InvalidRangeError(
                f"object of {size} bytes does not fit a {sum(len(v) for v in views)}-byte "
                "buffer", backend=self.name, operation="get_into", key=key,
            )
        raise BackendIOError(f"short read: {value} of {size} bytes of {path}",
                             backend=self.name, operation="get_into", key=key)

    async def _get_scatter(
        self, key: str, buffers: Sequence[memoryview], byte_range: ByteRange | None
    ) -> int | None:
        # docstring inherited. One open and one preadv for all the buffers: a framed object's
        # header and payload cost one request, not two opens and two reads.
        n: int | None
        if self._released_reads:
            (n,) = await self._run_io(self._read_run_released, [(key, list(buffers), byte_range)])
        else:
            n = await self._run_io(self._translated, "get_scatter", key, self._read_into, key,
                                   list(buffers), byte_range)
        await self._after_reads([key], [n])
        return n

    async def _after_reads(self, keys: Sequence[str], results: Sequence[int | None]) -> None:
        """Count the hits as uses (eviction order), writing them to the index now and then."""
        if self._touched(keys, results):
            await self._run(self._translated, "get_into", None, self._index.flush_touches)

    def _touched(self, keys: Sequence[str], results: Sequence[int | None]) -> bool:
        """Record the hits among ``keys`` as uses (not inside ``reads_not_counted``: an operator
        tool's reads); True when the buffered uses are due for ``flush_touches``."""
        if not reads_are_uses() or self.read_only:
            return False
        hits = [key for key, n in zip(keys, results, strict=True) if n is not None]
        return bool(hits) and self._index.touch(hits)

    def _read_one(self, key: str, view: memoryview, rng: ByteRange | None) -> int | None:
        return self._read_into(key, [view], rng)

    def _read_into(
        self, key: str, views: Sequence[memoryview], rng: ByteRange | None
    ) -> int | None:
        """Read the object (``rng`` of it, or all of it) into ``views`` in order; the one read
        path of ``get_into`` and ``get_scatter``: one open, vectored reads from that fd (so a
        rewrite of the key meanwhile is never seen half old, half new).

        O_DIRECT when the offset and every buffer's address are aligned, every buffer but the
        last is a whole number of blocks (the kernel's rule for each iovec), and the bytes are
        not in the page cache (nor admitted to it: ``_use_page_cache``); the last buffer's
        unaligned tail goes through the scratch block. Otherwise buffered."""
        start = 0 if rng is None else rng.start
        direct = (
            self.direct_io
            and start % DIRECT_ALIGNMENT == 0
            and all(is_aligned(v) for v in views)
            and all(len(v) % DIRECT_ALIGNMENT == 0 for v in views[:-1])
        )
        path = self._final_path(key)
        try:
            # O_NONBLOCK: a FIFO under a key's name must not block the open, and with it the
            # read, forever (a read waits for its I/O whatever its caller does); regular files
            # ignore the flag.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_CLOEXEC)
        except FileNotFoundError:
            self._index.repair_missing(key)  # evicted or deleted by someone else: a miss
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BackendIOError(f"{path} is not a regular file", backend=self.name,
                                     operation="get_into", key=key)
            size = st.st_size
            if rng is None:
                length = size
                capacity = sum(len(v) for v in views)
                if size > capacity:
                    raise InvalidRangeError(
                        f"object of {size} bytes does not fit a {capacity}-byte buffer",
                        backend=self.name,
                        operation="get_into",
                        key=key,
                    )
            else:
                rng.check_within(size, backend=self.name, key=key)
                length = rng.length
            parts = scatter_views(views, length)
            if direct and not self._use_page_cache(key, fd, start, length) and _set_direct(fd):
                _pread_direct(fd, parts, start, length)
            else:
                _pread_exact(fd, parts, start)
        finally:
            os.close(fd)
        return length

    def _use_page_cache(self, key: str, fd: int, start: int, length: int) -> bool:
        """Whether a read that could go O_DIRECT should be buffered: its bytes are all in the
        page cache already, or the ``page_cache`` policy admits them (see ``_pagecache``)."""
        if self.page_cache == "always" or is_cached(fd, start, length):
            return True
        if self.page_cache == "never":
            return False
        return self._second_touch.admit(xxhash.xxh3_64_intdigest(key.encode()))

    # -- core: writes --------------------------------------------------------------------------

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        # docstring inherited. One call on the pool: its steps run before those of any put
        # that began after it (``_call_order``).
        self._check_writable("put")
        with one_call():
            await _to_completion(self._put_batch(keys, buffers))

    async def _put_batch(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        """Reserve (evicting if needed), write, settle: the index stays exact whatever fails."""
        sizes = [len(view) for view in buffers]
        # Not begun when the caller has given up by then (``abandonable``): nothing reserved,
        # nothing to settle, no transaction spent on a put nobody waits for.
        reservation = await self._run(
            abandonable(self._translated), "put", None, self._index.reserve, keys, sizes,
            self.capacity_bytes, self.pin_budget_bytes,
        )
        outcomes: list[bool | BaseException] = []
        try:
            await self._make_room(reservation)
            outcomes = await self._write_batch(keys, buffers)
            if self.durability == "full" and any(o is True for o in outcomes):
                dirs = sorted({self._shard_dir(k) for k, o in zip(keys, outcomes, strict=True) if o is True})
                await self._run(self._translated, "put", None, _fsync_dirs, dirs)
        finally:
            await self._run(self._translated, "put", None, self._index.settle_put, reservation)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _make_room(self, reservation: Reservation) -> None:
        counts = await self._run(
            self._translated, "put", None, self._index.make_room, self.capacity_bytes, reservation
        )
        with self._lock:
            self.stats.evictions += counts.evicted
            self.stats.eviction_failures += counts.failed

    async def _write_batch(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> list[bool | BaseException]:
        """Write and publish each object; per key True (published) or the error it raised.

        The I/O step of ``_put``, which keeps the reservation, eviction, directory fsyncs and
        the index around it; backends with another I/O engine (``hf3fs``) override only this.
        """
        if self._released_writes:
            # Where the filesystem makes a file slowly (~1 ms each on this project's test
            # machine's disk, which takes several at once) the batch is split over up to
            # ``io_threads`` jobs of at least ``_WRITE_JOB_MIN`` objects; where it is fast
            # (tmpfs: ~0.1 ms) one job, since each pool hand-off would cost more than the
            # writes it spreads (BENCHMARKS.md, "Backups in runs"). Split until measured.
            per_job = max(1, len(keys))
            if self._write_cost_s is None or self._write_cost_s > _SPLIT_WRITES_ABOVE_S:
                per_job = max(_WRITE_JOB_MIN, -(-len(keys) // self.io_threads))
            starts = range(0, len(keys), per_job)
            runs = [self._run_io(self._write_run_released, keys[i : i + per_job],
                                 buffers[i : i + per_job]) for i in starts]
            out: list[bool | BaseException] = []
            ended = await asyncio.gather(*runs, return_exceptions=True)
            for start, run in zip(starts, ended, strict=True):
                count = len(keys[start : start + per_job])
                # A job that failed as a whole failed each of its objects.
                out.extend([run] * count if isinstance(run, BaseException) else run)
            return out
        jobs = [
            self._run_io(self._translated, "put", key, self._write_one, key, view, False)
            for key, view in zip(keys, buffers, strict=True)
        ]
        return list(await asyncio.gather(*jobs, return_exceptions=True))

    @property
    def _released_writes(self) -> bool:
        """Whether writes go through the C accelerator (built, and no subclass writes or
        publishes its own way)."""
        write_one = getattr(self._write_one, "__func__", None)
        return (_fileio is not None and write_one is FileBackend._write_one
                and type(self)._publish is FileBackend._publish)

    def _write_run_released(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> list[bool | BaseException]:
        """``_write_one`` of each object (never exclusive) in one C call that releases the GIL
        (``_fileio.write_files``): the same temp file, O_DIRECT rule, flush and rename, so
        the same files; per key True or the translated error (its temp file removed)."""
        flush = {"none": 0, "data": 1, "full": 2}[self.durability]
        out: list[bool | BaseException] = []
        batch: list[tuple[str, str, memoryview, bool, int]] = []
        slots: list[int] = []
        for key, view in zip(keys, buffers, strict=True):
            directory = self._shard_dir(key)
            try:
                self._ensure_dir(directory)
            except OSError as exc:
                out.append(translate_os_error(exc, backend=self.name, operation="put", key=key))
                continue
            slots.append(len(out))
            out.append(True)
            batch.append((self._temp_path(), os.path.join(directory, key), view,
                          self.direct_io, flush))
        started = time.perf_counter()
        written = _fileio.write_files(batch)
        if batch:  # a benign race between pool threads: the estimate is only a hint
            per_object = (time.perf_counter() - started) / len(batch)
            cost = self._write_cost_s
            self._write_cost_s = per_object if cost is None else cost + (per_object - cost) * 0.1
        for slot, (_, final, _, _, _), (status, err) in zip(slots, batch, written, strict=True):
            if status != 0:
                out[slot] = translate_os_error(OSError(err, os.strerror(err), final),
                                               backend=self.name, operation="put",
                                               key=keys[slot])
        return out

    async def _put_if_absent(self, key: str, buffer: memoryview) -> bool:
        self._check_writable("put_if_absent")
        # Atomic across threads and processes: link() refuses an existing name.
        with one_call():
            return await _to_completion(self._put_one_if_absent(key, buffer))

    async def _put_one_if_absent(self, key: str, buffer: memoryview) -> bool:
        reservation = await self._run(
            self._translated, "put_if_absent", key, self._index.reserve, [key], [len(buffer)],
            self.capacity_bytes, self.pin_budget_bytes,
        )
        try:
            await self._make_room(reservation)
            wrote = bool(await self._run_io(
                self._translated, "put_if_absent", key, self._write_one, key, buffer, True
            ))
            if wrote and self.durability == "full":
                await self._run(_fsync_dir, self._shard_dir(key))
        finally:
            await self._run(self._translated, "put_if_absent", None, self._index.settle_put,
                            reservation)
        return wrote

    def _write_one(self, key: str, view: memoryview, exclusive: bool) -> bool:
        """Write ``view`` to a temp file, flush as ``durability`` says, publish it as ``key``.

        Returns False only for an exclusive publish that found the key present."""
        tmp = self._temp_path()
        direct = self.direct_io and len(view) >= DIRECT_ALIGNMENT and is_aligned(view)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | (_O_DIRECT if direct else 0)
        fd = os.open(tmp, flags, 0o644)
        try:
            try:
                if direct:
                    _pwrite_direct(fd, view)
                else:
                    _pwrite_exact(fd, view, 0)
                if self.durability == "data":
                    os.fdatasync(fd)
                elif self.durability == "full":
                    os.fsync(fd)
            finally:
                os.close(fd)
            return self._publish(key, tmp, exclusive)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _publish(self, key: str, tmp: str, exclusive: bool) -> bool:
        """Make the written, flushed temp file ``tmp`` the object ``key`` in one step.

        ``rename`` over any previous object, or, ``exclusive``, ``link``, which refuses an
        existing name: then False, and the temp file is removed either way. Readers see the
        old object or the new one, never part of one; a crash before this leaves only a temp
        file (removed at the next open). The caller fsyncs the shard directory when
        ``durability`` is ``full``. Every writer of the file layout publishes through here.
        """
        directory = self._shard_dir(key)
        final = os.path.join(directory, key)
        self._ensure_dir(directory)
        if not exclusive:
            os.rename(tmp, final)
            return True
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True

    def change_feed(self) -> FileIndex:
        """The shared index, for readers of its named change feed (``FileIndex.changes_after``
        and ``listing``: the store-wide KV events). ``NotSupportedError`` with ``index=none``
        (no index, no feed)."""
        if not isinstance(self._index, FileIndex):
            raise NotSupportedError(
                "the change feed needs the shared index; this store was opened with index=none",
                backend=self.name, operation="change_feed",
            )
        return self._index

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects in the store (the shared index's count, all processes')."""
        return self._index.totals()[0]

    # -- retention (``_file_retention``: in the shared index) ------------------------------------

    async def _retain(self, keys: Sequence[str], retention: Retention) -> None:
        # docstring inherited
        await self._run(self._translated, "retain", None, self._shared_index().retain, keys,
                        retention, self.pin_budget_bytes)

    async def _release(self, keys: Sequence[str], owner: str) -> None:
        # docstring inherited
        await self._run(self._translated, "release", None, self._shared_index().release, keys,
                        owner)

    async def _retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        # docstring inherited
        return await self._run(self._translated, "retention_of", None,
                               self._shared_index().retention_of, keys)

    def pinned_bytes(self) -> int:
        """Bytes of the store's objects pinned now (every process's pins); 0 with
        ``index=none``."""
        return 0 if self._holds is None else self._holds.pinned_bytes()

    def _check_retention(self, operation: str) -> None:
        if self._holds is None:
            raise NotSupportedError(
                f"{self.root} is open with index=none: retention is kept in the shared index "
                "(index=sqlite), so this store cannot pin or retain objects",
                backend=self.name, operation=operation,
            )
        super()._check_retention(operation)

    def _shared_index(self) -> FileIndex:
        assert self._holds is not None  # capabilities.retention is False without it
        return self._holds

    # -- core: delete / list / close ---------------------------------------------------------

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        self._check_writable("delete")
        return await _to_completion(
            self._run(self._translated, "delete", None, self._index.delete, keys)
        )

    async def _delete_until_held(self, groups: list[list[str]]) -> DeletedUntilHeld:
        # docstring inherited. The holds are checked inside the index's write transaction
        # that removes the rows (``FileIndex.delete_until_held``).
        done, removed = await _to_completion(self._run(
            self._translated, "delete_until_held", None, self._shared_index().delete_until_held,
            groups))
        return DeletedUntilHeld(done, tuple(removed))

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        # docstring inherited. From the index in key order, a page at a time (no walk); with
        # index=none, one shard directory at a time.
        async for page in self._pages("list_prefix", self._index.key_pages(prefix)):
            for key in page:
                yield key

    async def _list_entries(self, prefix: str) -> AsyncIterator[ObjectStat]:
        # docstring inherited. From the index in key order, a page at a time (no walk, no
        # stat): ``mtime`` is the object's last write or read (its eviction rank's time, ms
        # resolution), what an age-based gc of a cache wants. With index=none, one shard
        # directory at a time, the files' own times.
        async for page in self._pages("list_entries", self._index.entry_pages(prefix)):
            for key, size, mtime in page:
                yield ObjectStat(key, size, mtime)

    async def _pages(self, operation: str, pages: Iterator[list[T]]) -> AsyncIterator[list[T]]:
        """Each page of a blocking page iterator, fetched on the pool (one job per page)."""
        while True:
            page = await self._run(self._translated, operation, None, next, pages, None)
            if page is None:
                return
            yield page

    async def _close(self) -> None:
        # Running jobs finish (they own their file descriptors); nothing new starts.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._pool.shutdown, True)
        await loop.run_in_executor(None, self._index.close)


async def _to_completion(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even when the caller is cancelled, then re-raise the
    cancellation: a put's threads read the caller's buffers and its index entries must be
    settled, so neither may be left running behind a returned call."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return result


# -- small blocking helpers (run on pool threads) --------------------------------------------


def _is_storage_key(name: str) -> bool:
    try:
        validate_storage_key(name)
    except InvalidKeyError:
        return False
    return True


def _list_dir(directory: str) -> Iterator[tuple[str, int, float]]:
    """``(key, size, mtime)`` of the object files in one shard directory (foreign files, never
    ours to index or evict, are skipped; so is anything but a regular file under a key's name:
    a directory or a symlink is not an object, and reading it fails instead of missing)."""
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if not _is_storage_key(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield entry.name, st.st_size, st.st_mtime


def _existing_ancestor(path: Path) -> str:
    """``path``, or its nearest ancestor that exists (a root about to be created lives on
    that one's filesystem)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return str(candidate)
    return "/"


def _scandir_dirs(path: str | os.PathLike[str]) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            dirs = [e for e in entries if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return iter(())
    return iter(dirs)


def _set_direct(fd: int) -> bool:
    """Switch an open fd to O_DIRECT; False when the filesystem refuses (read buffered)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
    except OSError:
        return False
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dirs(paths: Sequence[str]) -> None:
    for path in paths:
        _fsync_dir(path)


def _pread_exact(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Fill ``views`` in order with the bytes from ``offset`` on: vectored reads, resumed after
    a short count (the kernel moves at most ``_MAX_IO`` bytes per call), until all are in."""
    pending = [v for v in views if len(v)]
    total = sum(len(v) for v in pending)
    done = 0
    while pending:
        n = os.preadv(fd, pending[:_IOV_MAX], offset + done)
        if n == 0:
            raise BackendIOError(f"short read: {done} of {total} bytes at offset {offset}")
        done += n
        pending = _consumed(pending, n)


def _consumed(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` less their first ``n`` bytes."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest


def _pwrite_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + _MAX_IO], offset + done)


def _pread_direct(fd: int, views: Sequence[memoryview], offset: int, length: int) -> None:
    """O_DIRECT read of ``length`` bytes at an aligned ``offset`` into aligned ``views``.

    ``views`` cover exactly ``length`` bytes and all but the last are whole blocks. The aligned
    body lands in the caller's buffers directly; a tail shorter than one block (in the last
    view) goes through an aligned scratch block, so no byte past ``length`` is written."""
    tail = length % DIRECT_ALIGNMENT
    body = list(views)
    if tail:
        last = body.pop()
        if len(last) > tail:
            body.append(last[: len(last) - tail])
    if body:
        _pread_exact(fd, body, offset)
    if tail:
        block = scratch_block()
        n = os.preadv(fd, [block], offset + length - tail)
        if n < tail:
            raise BackendIOError(
                f"short read: {length - tail + n} of {length} bytes at offset {offset}"
            )
        views[-1][len(views[-1]) - tail :] = block[:tail]


def _pwrite_direct(fd: int, view: memoryview) -> None:
    """O_DIRECT write of an aligned ``view`` from offset 0; the unaligned tail is written as
    one zero-padded block, then the file is truncated to its true length."""
    length = len(view)
    body = length - length % DIRECT_ALIGNMENT
    _pwrite_exact(fd, view[:body], 0)
    tail = length - body
    if tail:
        block = scratch_block()
        block[:tail] = view[body:]
        block[tail:] = bytes(DIRECT_ALIGNMENT - tail)
        _pwrite_exact(fd, block, body)
        os.ftruncate(fd, length)


class _FilePendingReads(PendingReads):
    """A ``FileBackend`` run of reads on ``_fileio``'s own thread (``start_get_into_summed``):
    ``job`` a ``_fileio.ReadJob``, ``finish`` what makes the result of its outcomes."""

    def __init__(
        self, backend: FileBackend, job: Any,
        finish: Callable[[list[tuple[int, int, int, int, tuple[int, ...]]]],
                         tuple[list[int | None], list[tuple[int, ...]]]],
    ) -> None:
        super().__init__(backend)
        self._job, self._finish = job, finish

    def done(self) -> bool:
        return bool(self._job.done())

    def wait(self) -> None:
        self._job.wait()

    def _result(self) -> tuple[list[int | None], list[tuple[int, ...]]]:
        return self._finish(self._job.wait())
