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

**Parallel I/O and the engine.** A batch's I/O runs as jobs on a bounded thread pool
(``io_threads``); the system calls release the GIL, so a batch keeps that many requests in
flight on the device. The pool runs the jobs of the oldest call first (``_call_order``): a
put's later steps (write, settle) go before the first step of any put that began after it, so
many concurrent puts end in the order they began instead of all together; a put whose caller
gave up before its first step began is never begun. What moves the bytes is an engine chosen
once at open (``_file_io``; ``io_engine``): ``native``, the default where the C accelerator
``_fileio`` is built (``setup.py``), makes a run of reads, or a put's run of writes, in one
call that releases the GIL once (in a process whose other threads keep the interpreter busy, an
inference engine, each reacquisition waits up to the switch interval, and a read took five of
them), and can compute checksums of what it read in the same call (``native_reads``: XXH3 taken
from the ``xxhash`` package), so a reader of framed objects verifies a batch without taking the
GIL back per object; ``posix``, one Python system call at a time. Both read and write the same
files with the same misses, errors and read policy. ``hf3fs://`` adds a third (USRBIO). The
index, capacity, eviction and the buffer lifetime rule are this module's, whatever the engine:
the pool and its error edge are ``_file_jobs``, a put's steps ``_file_writes``.

**Index** (``backends.index``: the contract; ``_file_index``: the SQLite index, its design and
the modules of its protocol). A SQLite database
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
tail before its head; the objects of one page (every layer chunk and head group, whichever
call wrote them) are one unit: read or written, the whole page is recent, and evicted, it goes
whole (``backends.index``). The order is an on-disk index read a page at a time. An object that
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
import functools
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from hicache_store.layout.errors import ConfigError

from ._call_order import CallOrderPool, one_call
from ._file_index import DB_NAME, FileIndex
from ._file_io import (
    IO_ENGINES,
    FileEngine,
    NativePendingReads,
    Placement,
    ReadItem,
    open_engine,
    probe_direct_io,
)
from ._file_jobs import FileJobs
from ._file_noindex import NoIndex
from ._file_objects import CHARGES, Charge, FileObjects, list_dir
from ._file_root import index_id, prepare_root, remove_stale_temps, write_layout
from ._file_site import (
    RootSite,
    check_filesystem,
    check_index_hosts,
    filesystem_of,
    root_site,
)
from ._file_writes import FileWrites
from ._index_check import check_index
from ._valkey_index import ValkeyIndex
from .base import Backend, ReadCounts, ReadRanges, reads_are_uses
from .errors import NotSupportedError, translate_os_error
from .file_layout import object_path
from .index import IndexCheck, ObjectIndex, fleet_index_url
from .lifetime import gather_settled
from .protocols import ChangeFeed, PendingReads, PendingWrites, SummedReads
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
IndexKind = Literal["sqlite", "none", "valkey"]
IndexHosts = Literal["name", "kernel"]
DURABILITY_MODES: tuple[str, ...] = ("none", "data", "full")
DIRECT_IO_MODES: tuple[str, ...] = ("auto", "never")
PAGE_CACHE_MODES: tuple[str, ...] = ("second", "never", "always")
INDEX_KINDS: tuple[str, ...] = ("sqlite", "none")
_INLINE_EXISTS = 4096  # at most ~1 ms of lookups on the caller's thread

T = TypeVar("T")
log = logging.getLogger(__name__)


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
    ``inspect`` and ``doctor`` open, so they work on a full filesystem), ``io_engine`` (the
    engine that moves the bytes, ``_file_io``: ``auto``, the default, ``native`` where the C
    accelerator is built, else ``posix``; ``native``; ``posix``, Python system calls).
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
        change_feed=True,
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
        index: str | None = None,
        index_hosts: IndexHosts = "name",
        pin_fraction: float | str = DEFAULT_PIN_FRACTION,
        clock: Callable[[], float] | None = None,
        read_only: bool = False,
        io_engine: str = "auto",
        index_lease_s: float = 10.0,
        index_timeout_s: float = 2.0,
        capacity_counts: Charge | None = None,
    ) -> None:
        super().__init__()
        explicit_index = index is not None
        index = self.default_index if index is None else index
        fleet_url = fleet_index_url(index)
        if fleet_url is None and index not in INDEX_KINDS:
            raise ConfigError(f"index must be one of sqlite, none or a server URL "
                              f"(valkey://host:port/N, redis://...), got {index!r}")
        kind: IndexKind = "valkey" if fleet_url is not None else index  # type: ignore[assignment]
        check_index_hosts(index_hosts)
        if capacity_counts not in (None, *CHARGES):
            raise ConfigError(f"capacity_counts must be one of {CHARGES}, got {capacity_counts!r}")
        if index_lease_s <= 0 or index_timeout_s <= 0:
            raise ConfigError("index_lease_s and index_timeout_s must be > 0")
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
        if io_engine not in IO_ENGINES:
            raise ConfigError(f"io_engine must be one of {IO_ENGINES}, got {io_engine!r}")
        # Every option is checked before the root is touched: a refused store creates nothing.
        capacity = None if capacity_bytes is None else parse_size(capacity_bytes, option="capacity_bytes")
        pin_budget_bytes(0, float(pin_fraction))  # checks the fraction
        self.root = Path(root).expanduser().resolve()
        self.durability: Durability = durability
        self.io_threads = io_threads
        self.page_cache: PageCache = page_cache
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._token = secrets.token_hex(8)
        self._lock = threading.Lock()  # guards the stats counters
        try:
            #: the filesystem of the root (None where ``statfs`` is unavailable), checked
            #: before anything is created: the default index is refused on a network or FUSE
            #: filesystem unless asked for by name (``_file_site``).
            self.filesystem = filesystem_of(_existing_ancestor(self.root))
            if kind == "sqlite":
                check_filesystem(str(self.root), self.filesystem, explicit=explicit_index)
            self.read_only = read_only
            upgrade = prepare_root(self.root, create=create and not read_only,
                                   read_only=read_only, index=kind, backend=self.name)
            self.direct_io = (direct_io == "auto" and not read_only and probe_direct_io(
                self._tmp, f"{os.getpid()}-{self._token}-probe.tmp"))
            # A fleet's temp files are another host's as often as this one's: only age tells
            # (a lapsed writer's are removed by whoever reclaims it).
            self.removed_temp_files = 0 if read_only else remove_stale_temps(
                self._tmp, by_pid=kind != "valkey")
            #: where objects and temp files go, and how a temp file becomes an object; temp
            #: files are named by the index's writer (a fleet's writer changes when its lease
            #: lapses: the temp files of the lapsed one are then a reclaimer's to remove)
            self._places = Placement(self.name, self.root, durability=durability,
                                     direct_io=self.direct_io, page_cache=page_cache,
                                     writer=lambda: self._index.writer or self._token)
            self._final_path = self._places.final_path
            self.index_kind: IndexKind = kind
            #: the objects as the index sees them (``index.ObjectSite``): the bound counts
            #: allocated blocks with a fleet's index, the files' sizes otherwise.
            charge: Charge = capacity_counts or ("allocated" if kind == "valkey" else "size")
            self._site = FileObjects(str(self._objects), str(self._tmp), self._final_path,
                                     charge=charge)
            self._index: ObjectIndex
            unindexed = upgrade or not (self.root / "index" / DB_NAME).exists()
            if kind == "none" or (read_only and kind == "sqlite" and unindexed):  # (read-only:
                # a root not indexed, or whose index/ was removed, is read from its files)
                self._index = NoIndex(str(self._objects), self._final_path, list_dir)
            elif fleet_url is not None:
                root_id = index_id(self.root, f"{os.getpid()}-{self._token}-layout.tmp")
                self._index = ValkeyIndex(
                    fleet_url, root_id, self._site, writer=self._token, lease_s=index_lease_s,
                    timeout_s=index_timeout_s, lock_timeout=lock_timeout, clock=clock,
                    connections=max(16, 2 * io_threads),
                )
            else:
                self._index = FileIndex(
                    str(self.root), self._site, token=self._token,
                    durable=durability == "full", lock_timeout=lock_timeout,
                    index_hosts=index_hosts, clock=clock or time.time, read_only=read_only,
                )
            # (read-only: no retention is reported)
            # (an index counts the bytes it holds and reserves; without one, only an estimate)
            self.capabilities = type(self).capabilities.replace(
                retention=self._index.features.retention and not read_only,
                change_feed=self._index.features.change_feed,
                capacity_usage=not isinstance(self._index, NoIndex))
            try:
                #: the engine that moves the bytes (``_file_io``), chosen once, here.
                self._engine = self._open_engine(io_engine, self._places)
            except BaseException:
                self._index.close()
                raise
            if upgrade and not read_only and kind != "valkey":  # (a fleet's: by ``index_id``)
                write_layout(self.root, f"{os.getpid()}-{self._token}-layout.tmp", kind)
        except OSError as exc:
            raise translate_os_error(exc, backend=self.name, operation="open") from exc
        #: the name of the engine in use (``posix``, ``native``, ``usrbio``).
        self.io_engine: str = self._engine.name
        self.capabilities = self.capabilities.replace(
            inline_exists=True, native_reads=self._engine.sums_reads,
            native_writes=not self.read_only,
            zero_copy_reads=self.capabilities.zero_copy_reads and self._engine.zero_copy_reads)
        if capacity is None:
            usage = shutil.disk_usage(self.root)
            capacity = int(0.9 * (usage.free + self._index.totals()[0]))
        self.capacity_bytes = capacity
        self.pin_budget_bytes = pin_budget_bytes(capacity, float(pin_fraction))
        #: the pool every blocking step runs on (``_file_jobs``).
        self._jobs = FileJobs(self.name, io_threads)
        self._pool = self._jobs.pool
        self._upkeep = _ReadUpkeep(self.name, self._index, self._pool, counted=not read_only)
        #: the put protocol (``_file_writes``).
        self._writes = FileWrites(self._engine, self._index, self._places, self._jobs,
                                  io_threads=io_threads, capacity_bytes=capacity,
                                  pin_budget_bytes=self.pin_budget_bytes, lock=self._lock)

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> FileBackend:
        """``file:///abs/path`` plus the options of ``__init__`` (``BackendURL.local_path``)."""
        return cls(url.local_path(), **cls._typed_options(options))

    def _open_engine(self, io_engine: str, places: Placement) -> FileEngine:
        """The engine of this store (``_file_io.open_engine``; ``hf3fs`` adds USRBIO)."""
        return open_engine(io_engine, places)

    @staticmethod
    def _typed_options(options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with the file backend's URL-query strings converted to their types."""
        return convert_options(
            options, ints=("io_threads",),
            floats=("lock_timeout", "pin_fraction", "index_lease_s", "index_timeout_s"),
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

    @classmethod
    def root_site(cls, url: BackendURL) -> RootSite | None:
        # docstring inherited
        return cls.site(url.local_path(), url.query.get("index_hosts", "name"))

    def __repr__(self) -> str:
        return f"FileBackend({str(self.root)!r}, durability={self.durability!r})"

    def path_of(self, key: str) -> Path:
        """The final path of a (validated) key (``object_path``). Public for tests and tools."""
        return object_path(self.root, key)

    # -- running blocking work (``_file_jobs``) --------------------------------------------------

    async def _run_io(self, fn: Callable[..., T], *args: Any) -> T:
        """A job that reads into or writes from the caller's buffers (``FileJobs.run_io``)."""
        return await self._jobs.run_io(fn, *args)

    def _check_open(self, operation: str) -> None:
        # Also refused once another host has taken the root's index over (``_file_site``):
        # every call of this process fails from then on, reads included.
        super()._check_open(operation)
        self._index.check()

    def _check_writable(self, operation: str) -> None:
        if self.read_only:
            raise NotSupportedError(f"{self.root} is open read-only: {operation} writes",
                                    backend=self.name, operation=operation)

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
        return await self._jobs.call("exists", self._index.exists, keys)

    def _exists_now(self, keys: list[str], max_age_s: float) -> list[bool] | None:
        # docstring inherited. The index's fingerprint set when it is recent enough, else when
        # it is current, and free (a memory lookup; neither ``exists_recent`` nor
        # ``exists_if_current`` waits on I/O or a lock, and the first makes no SQLite call).
        if len(keys) > _INLINE_EXISTS:
            return None
        if max_age_s > 0:
            recent = self._index.exists_recent(keys, max_age_s)
            if recent is not None:
                return recent
        return self._index.exists_if_current(keys)

    def _exists_blocking(self, keys: list[str]) -> list[bool]:
        # docstring inherited. The index's ``exists`` on the caller's thread (thread-safe: each
        # thread has its own SQLite connection), as the pool would run it.
        return self._jobs.translated("exists", None, self._index.exists, keys)

    def _stat_paths(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        return [None if found is None else ObjectStat(key, found.size, found.mtime)
                for key, found in zip(keys, self._site.measure(keys), strict=True)]

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        # docstring inherited. From the files themselves (the truth for sizes and mtimes).
        return await self._jobs.call("stat", self._stat_paths, keys)

    async def adopt(self, keys: Sequence[str]) -> int:
        """Index objects placed under ``objects/`` by other means (a restore, a copy, a test
        oracle): each key's index entry is set from its file (present with its size, or
        absent). Returns how many of ``keys`` are indexed now."""
        self._check_open("adopt")
        self._check_writable("adopt")
        checked = self._check_keys(keys, "adopt")
        return await self._jobs.call("adopt", self._index.adopt, checked)

    # -- core: reads (the engine's runs, ``_file_io``) -----------------------------------------

    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: ReadRanges
    ) -> ReadCounts:
        # docstring inherited. Jobs of the engine's runs (``FileEngine.read_run``: the batch
        # spread over at most ``io_threads`` jobs, or one ring batch). All jobs end before the
        # call does, even when one fails (buffer lifetime).
        items: list[ReadItem] = [(key, [view], rng)
                                 for key, view, rng in zip(keys, buffers, ranges, strict=True)]
        per_job = self._engine.read_run(len(items), self.io_threads)
        jobs = [self._run_io(self._read_run, items[i : i + per_job])
                for i in range(0, len(items), per_job)]
        results: ReadCounts = [
            n for run in await gather_settled(*jobs) for n in run]
        await self._after_reads(keys, results)
        return results

    async def _get_scatter(
        self, key: str, buffers: Sequence[memoryview], byte_range: ByteRange | None
    ) -> int | None:
        # docstring inherited. One item of the engine: a framed object's header and payload
        # cost one open and one vectored read (posix, native) or one ring batch (usrbio).
        (n,) = await self._run_io(self._read_run, [(key, list(buffers), byte_range)])
        await self._after_reads([key], [n])
        return n

    def _read_run(self, items: Sequence[ReadItem]) -> list[int | None]:
        """One job: the engine's reads of ``items``, then the index entries of the objects
        found missing repaired (evicted or deleted by someone else: misses)."""
        missing: list[str] = []
        try:
            return self._engine.read(items, missing)
        finally:
            self._repair(missing)

    async def _get_into_summed(
        self, keys: list[str], views: list[memoryview], spans: list[list[tuple[int, int]]]
    ) -> SummedReads:
        # docstring inherited. One job, one engine call for the batch's reads and checksums
        # (a batch of a few objects: vLLM's secondary tier reads a job's chunk rows this
        # way): one hand-off and one GIL reacquisition for all.
        items: list[ReadItem] = [(key, [view], None) for key, view in zip(keys, views, strict=True)]
        results, sums = await self._run_io(self._summed_run, items, spans)
        await self._after_reads(keys, results)
        return results, sums

    def _summed_run(
        self, items: Sequence[ReadItem], spans: Sequence[Sequence[tuple[int, int]]]
    ) -> SummedReads:
        missing: list[str] = []
        try:
            return self._engine.read_summed(items, spans, missing)
        finally:
            self._repair(missing)

    def _start_get_into_summed(
        self, keys: list[str], views: list[memoryview], spans: list[list[tuple[int, int]]]
    ) -> PendingReads:
        # docstring inherited. The engine's reads on a thread of its own that never takes the
        # GIL: a caller polling from a thread that holds the GIL (vLLM's scheduler loop) finds
        # them done with no thread hand-off.
        items: list[ReadItem] = [(key, [view], None) for key, view in zip(keys, views, strict=True)]
        job, judge = self._engine.start_summed(items, spans)
        return NativePendingReads(self._count_reads, job,
                                  functools.partial(self._finish_reads, keys, judge))

    def _finish_reads(
        self, keys: list[str], judge: Callable[[Any, list[str]], SummedReads], outcomes: Any,
    ) -> SummedReads:
        """The result of started reads, for a caller that must not wait for the index (a
        scheduler thread): the index's upkeep goes to the pool (``_ReadUpkeep.later``)."""
        missing: list[str] = []
        try:
            results, sums = judge(outcomes, missing)
        finally:
            self._upkeep.later(missing, due=False)
        self._upkeep.later([], due=self._upkeep.touched(keys, results))
        return results, sums

    def _repair(self, missing: list[str]) -> None:
        self._jobs.translated("get_into", None, self._upkeep.repair, missing)

    async def _after_reads(self, keys: Sequence[str], results: Sequence[int | None]) -> None:
        """Count the hits as uses (eviction order), writing them to the index now and then."""
        self._engine.account(self.stats)
        if self._upkeep.touched(keys, results):
            await self._jobs.call("get_into", self._index.flush_touches)

    # -- host memory (``capabilities.host_buffers``: the engine's) -------------------------------

    async def _register_host_buffer(self, buffer: Any) -> bool:
        # docstring inherited
        return await asyncio.to_thread(self._engine.register, buffer)

    async def _unregister_host_buffer(self, buffer: Any) -> None:
        # docstring inherited
        self._engine.unregister(buffer)

    # -- core: writes --------------------------------------------------------------------------

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        # docstring inherited. One call on the pool: its steps run before those of any put
        # that began after it (``_call_order``).
        self._check_writable("put")
        with one_call():
            await _to_completion(self._writes.put(keys, buffers, self.stats))

    def _start_put(self, keys: list[str], views: list[memoryview], start_by: float,
                   counted: Callable[[], None]) -> PendingWrites:
        # docstring inherited. Handed over from the caller's thread (``FileWrites.start``: the
        # writes on a thread that never takes the GIL where the engine can, else one pool
        # job): no hand-off to the event loop and back, each a wait for the GIL behind a busy
        # engine loop (vLLM's scheduler).
        self._check_writable("put")
        return self._writes.start(keys, views, start_by, counted, self.stats)

    async def _put_if_absent(self, key: str, buffer: memoryview) -> bool:
        self._check_writable("put_if_absent")
        # Atomic across threads and processes: link() refuses an existing name.
        with one_call():
            return await _to_completion(self._writes.put_if_absent(key, buffer, self.stats))

    async def check_index(self, *, repair: bool = False,
                          rebuild: bool = False) -> IndexCheck | None:
        # docstring inherited
        self._check_open("check_index")
        return await self._jobs.call("check_index", functools.partial(
            check_index, self._index, self._site, self.index_kind, repair=repair,
            rebuild=rebuild))

    def change_feed(self) -> ChangeFeed:
        # docstring inherited. The index's feed (``changes_after``, ``listing``); the
        # capability is declared by an index that keeps one (not ``index=none``).
        if not self._closed and not self.capabilities.change_feed:
            raise NotSupportedError(
                "the change feed needs the shared index; this store was opened with index=none",
                backend=self.name, operation="change_feed",
            )
        return super().change_feed()

    def _change_feed(self) -> ChangeFeed:
        return self._index

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects in the store (the shared index's count, all processes')."""
        return self._index.totals()[0]

    def _usage(self) -> tuple[int, int]:
        # docstring inherited: the index's counters (two reads of its totals, no listing)
        return self.capacity_bytes, self._index.totals()[0] + self._index.reserved_bytes()

    # -- retention (kept in the index: ``_file_retention``) --------------------------------------

    async def _retain(self, keys: Sequence[str], retention: Retention) -> None:
        # docstring inherited
        await self._jobs.call("retain", self._index.retain, keys, retention,
                              self.pin_budget_bytes)

    async def _release(self, keys: Sequence[str], owner: str) -> None:
        # docstring inherited
        await self._jobs.call("release", self._index.release, keys, owner)

    async def _retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        # docstring inherited
        return await self._jobs.call("retention_of", self._index.retention_of, keys)

    def pinned_bytes(self) -> int:
        """Bytes of the store's objects pinned now (every process's pins); 0 with
        ``index=none``."""
        return self._index.pinned_bytes()

    def _check_retention(self, operation: str) -> None:
        if not self._index.features.retention:
            raise NotSupportedError(
                f"{self.root} is open with index=none: retention is kept in the shared index "
                "(index=sqlite), so this store cannot pin or retain objects",
                backend=self.name, operation=operation,
            )
        super()._check_retention(operation)

    # -- core: delete / list / close ---------------------------------------------------------

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        self._check_writable("delete")
        return await _to_completion(self._jobs.call("delete", self._index.delete, keys))

    async def _delete_until_held(self, groups: list[list[str]]) -> DeletedUntilHeld:
        # docstring inherited. The holds are checked inside the index's write transaction
        # that removes the rows (``FileIndex.delete_until_held``).
        done, removed = await _to_completion(self._jobs.call(
            "delete_until_held", self._index.delete_until_held, groups))
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
            page = await self._jobs.call(operation, next, pages, None)
            if page is None:
                return
            yield page

    async def _close(self) -> None:
        # Running jobs finish (they own their file descriptors); nothing new starts.
        await self._jobs.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, self._index.close)
        self._engine.close()
        self._engine.account(self.stats)


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


class _ReadUpkeep:
    """What reads tell the index: the entry of an object found missing is repaired (evicted
    or deleted by someone else: a miss), and hits are uses (the eviction order), buffered
    and written now and then. ``counted`` False: no use is recorded (a read-only store)."""

    def __init__(self, name: str, index: ObjectIndex, pool: CallOrderPool, *,
                 counted: bool) -> None:
        self._name, self._index, self._pool, self._counted = name, index, pool, counted

    def repair(self, missing: Sequence[str]) -> None:
        """Repair the entries of ``missing`` (on a pool thread; raises the index's error)."""
        for key in missing:
            self._index.repair_missing(key)

    def touched(self, keys: Sequence[str], results: Sequence[int | None]) -> bool:
        """Record the hits among ``keys`` as uses (not inside ``reads_not_counted``: an
        operator tool's reads); True when the buffered uses are due for ``flush_touches``."""
        if not reads_are_uses() or not self._counted:
            return False
        hits = [key for key, n in zip(keys, results, strict=True) if n is not None]
        return bool(hits) and self._index.touch(hits)

    def later(self, missing: list[str], *, due: bool) -> None:
        """Repair ``missing`` and (``due``) write the buffered uses on the pool, not waiting:
        for a caller that must not wait for the index (each SQLite call waits for the GIL:
        tens of ms on a thread racing an engine's busy loop for it). Best effort: closing,
        the pool refuses it, and close() writes the buffered uses itself; a repair not made
        is made by the next read of that key."""
        with contextlib.suppress(RuntimeError):
            if missing:
                self._pool.submit(self._quietly, "repairing index entries", self.repair,
                                  missing)
            if due:
                self._pool.submit(self._quietly, "writing read recency to the index",
                                  self._index.flush_touches)

    def _quietly(self, what: str, fn: Callable[..., object], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            log.warning("%s: %s failed: %r", self._name, what, exc)


# -- small blocking helpers (run on pool threads) --------------------------------------------


def _existing_ancestor(path: Path) -> str:
    """``path``, or its nearest ancestor that exists (a root about to be created lives on
    that one's filesystem)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return str(candidate)
    return "/"

