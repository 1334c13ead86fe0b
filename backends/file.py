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

**Zero-copy and O_DIRECT.** Reads go straight into the caller's buffer with ``os.preadv``;
writes come straight from it with ``os.pwrite``. A scatter read (``get_scatter``: a framed
object's header and payload into separate buffers) is one open and one ``preadv`` with one
iovec per buffer. When the caller's buffer addresses and the file offset are 4096-aligned
(``direct_io=auto``, the default) the file is opened with O_DIRECT and the page cache is
bypassed; an unaligned tail (< 4 KiB) goes through a per-thread aligned block.
Why O_DIRECT by default, measured on this project's VM (BENCHMARKS.md "Backends", 512 x 8 MiB
in one run): a buffered write or a cold buffered read needs fresh page-cache pages, and on this
VM allocating them costs more than the device transfer. O_DIRECT gave 2.23 GB/s durable write
and 2.44 GB/s cold read against 0.34 and 1.47 GB/s buffered (an fdatasync after a buffered
write has all the data still to flush; after an O_DIRECT write almost nothing). Buffered I/O
wins only re-reads of data already in the page cache (5.7 against 2.2 GB/s): ``direct_io=never``
selects it for stores that fit in RAM. Unaligned buffers always go buffered.

**Parallel I/O.** Each object's I/O is one job on a bounded thread pool (``io_threads``);
the syscalls release the GIL, so a batch keeps that many requests in flight on the device.

**Index.** ``exists`` never scans: an in-memory index (key -> size, in eviction order) is
rebuilt at open from one walk of ``objects/``. A key in the index is reported present without
touching the disk (if another process deleted it, the next read is a miss and fixes the index);
a key not in the index costs one ``stat``, so objects written by another process or after a
restart are found. Index updates are guarded by a lock: the pool threads and any number of
event loops may use one backend.

**Capacity and eviction.** ``capacity_bytes`` (default: 90% of what the filesystem could hold
for us at open) bounds the bytes this process accounts for (objects it wrote or has seen).
Before a batch is written, room is made by deleting objects in chain-aware LRU order
(``_lru.ChainLRU``: untouched chain tails go first). An object that cannot be deleted is
counted (``stats.eviction_failures``), moved to the back of the line, and eviction goes on with
the next one; if no room can be made the write raises ``CapacityError``. Several processes
sharing a root each account for what they know: bound each one accordingly.

**Crash safety.** A writer killed mid-batch leaves temp files only. At open, temp files whose
writer process is gone (or older than an hour) are removed; a live writer's are left alone.

**Keys** are validated before any path is built; a key cannot contain ``/``, ``.`` or NUL, so
every path stays under ``objects/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

import xxhash

from hicache_store.layout.errors import InvalidKeyError
from hicache_store.layout.keys import validate_storage_key

from ._aligned import DIRECT_ALIGNMENT, aligned_buffer, is_aligned, scratch_block
from ._lru import ChainLRU
from .base import Backend, scatter_views
from .errors import (
    BackendError,
    BackendIOError,
    CapacityError,
    InvalidRangeError,
    translate_os_error,
)
from .types import BackendURL, ByteRange, Capabilities, ObjectStat, parse_bool, parse_size

Durability = Literal["none", "data", "full"]
DirectIO = Literal["auto", "never"]
DURABILITY_MODES: tuple[str, ...] = ("none", "data", "full")
DIRECT_IO_MODES: tuple[str, ...] = ("auto", "never")
LAYOUT_FORMAT = "hicache-store/file"
LAYOUT_VERSION = 1
#: temp files older than this are stale whoever wrote them (no write lasts an hour).
STALE_TEMP_SECONDS = 3600.0
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_MAX_IO = 0x7FFFF000  # Linux moves at most this many bytes per read/write call
_IOV_MAX = 1024  # Linux takes at most this many buffers per vectored call

T = TypeVar("T")


def shard_of(key: str) -> tuple[str, str]:
    """The two shard directory names of a key (4 hex digits of xxh3_64(key))."""
    digest = xxhash.xxh3_64_hexdigest(key.encode())
    return digest[:2], digest[2:4]


class FileBackend(Backend):
    """Objects as files under ``root``. See the module docstring for every guarantee.

    Options: ``durability`` (none | data | full, default data), ``capacity_bytes`` (int or
    size string; default 90% of the space available at open), ``io_threads`` (default 16),
    ``direct_io`` (auto | never), ``create`` (make the root if missing, default True).
    """

    name = "file"
    capabilities = Capabilities(
        ranged_reads=True,
        zero_copy_reads=True,
        listing=True,
        atomic_put=True,
        eviction=True,
        persistent=True,
        shared=True,
        mtime=True,
    )

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        durability: Durability = "data",
        capacity_bytes: int | str | None = None,
        io_threads: int = 16,
        direct_io: DirectIO = "auto",
        create: bool = True,
    ) -> None:
        super().__init__()
        if durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {DURABILITY_MODES}, got {durability!r}")
        if direct_io not in DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {DIRECT_IO_MODES}, got {direct_io!r}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.root = Path(root).expanduser().resolve()
        self.durability: Durability = durability
        self.io_threads = io_threads
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._token = secrets.token_hex(4)
        self._seq = itertools.count()
        self._lock = threading.Lock()  # guards _lru, _reserved, _known_dirs, stats counters
        self._evict_lock = threading.Lock()  # one eviction pass at a time
        self._lru = ChainLRU()
        self._reserved = 0
        self._known_dirs: set[str] = set()
        try:
            self._prepare_root(create)
            self.direct_io = direct_io == "auto" and self._probe_direct_io()
            self.removed_temp_files = self._remove_stale_temps()
            self._rebuild_index()
        except OSError as exc:
            raise translate_os_error(exc, backend=self.name, operation="open") from exc
        if capacity_bytes is None:
            usage = shutil.disk_usage(self.root)
            capacity_bytes = int(0.9 * (usage.free + self._lru.total_bytes))
        self.capacity_bytes = parse_size(capacity_bytes)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hicache-file")

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> FileBackend:
        """``file:///abs/path`` plus the options of ``__init__`` (``BackendURL.local_path``)."""
        return cls(url.local_path(), **cls._typed_options(options))

    @staticmethod
    def _typed_options(options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with the file backend's URL-query strings converted to their types."""
        opts = dict(options)
        if "io_threads" in opts:
            opts["io_threads"] = int(opts["io_threads"])
        if "create" in opts:
            opts["create"] = parse_bool(opts["create"])
        if opts.get("capacity_bytes") is not None:
            opts["capacity_bytes"] = parse_size(opts["capacity_bytes"])
        return opts

    def __repr__(self) -> str:
        return f"FileBackend({str(self.root)!r}, durability={self.durability!r})"

    # -- open ---------------------------------------------------------------------------------

    def _prepare_root(self, create: bool) -> None:
        if create:
            self._objects.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(exist_ok=True)
        elif not self._objects.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no hicache-store file layout here", str(self.root))
        marker = self.root / "layout.json"
        wanted = {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "shard_levels": 2}
        try:
            found = json.loads(marker.read_text())
        except FileNotFoundError:
            tmp = self._tmp / f"{os.getpid()}-{self._token}-layout.tmp"
            tmp.write_text(json.dumps(wanted))
            os.replace(tmp, marker)  # racing openers write the same content
            return
        except ValueError:
            found = None
        if found != wanted:
            raise BackendError(
                f"{marker} describes another layout ({found!r}); refusing to use {self.root}",
                backend=self.name, operation="open",
            )

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
                alive = owner.isdigit() and _pid_alive(int(owner))
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

    def _rebuild_index(self) -> None:
        """One walk of ``objects/``: every valid key with its size, oldest mtime first."""
        found: list[tuple[float, str, int]] = []
        for top in _scandir_dirs(self._objects):
            for sub in _scandir_dirs(top.path):
                self._known_dirs.add(sub.path)
                with os.scandir(sub.path) as entries:
                    for entry in entries:
                        if not _is_storage_key(entry.name):
                            continue  # a foreign file: never ours to index or evict
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        for _mtime, key, size in found:
            self._lru.add(key, size)

    # -- paths --------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """The final path of a (validated) key. Public for tests and tools."""
        return Path(self._shard_dir(validate_storage_key(key)), key)

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

    def _translated(self, operation: str, key: str | None, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except BackendError:
            raise  # already ours (some of ours are also OSErrors)
        except OSError as exc:
            raise translate_os_error(exc, backend=self.name, operation=operation, key=key) from exc

    # -- core: exists / stat -------------------------------------------------------------------

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        with self._lock:
            hits = [key in self._lru for key in keys]
        missing = [key for key, hit in zip(keys, hits, strict=True) if not hit]
        if missing:
            # One job for all unknown keys: a stat is a few microseconds, so splitting the
            # batch over threads only adds GIL hand-offs (measured slower on 2 cores).
            found = await self._run(self._translated, "exists", None, self._probe, missing)
            hits = [hit or key in found for key, hit in zip(keys, hits, strict=True)]
        with self._lock:
            self._lru.touch_batch([key for key, hit in zip(keys, hits, strict=True) if hit])
        return hits

    def _probe(self, keys: Sequence[str]) -> set[str]:
        """One ``stat`` per key not in the index (objects another process wrote, or written
        before a restart and not yet seen); found ones join the index."""
        found: list[tuple[str, int]] = []
        stat, join, shard_dir = os.stat, os.path.join, self._shard_dir
        for key in keys:
            try:
                found.append((key, stat(join(shard_dir(key), key)).st_size))
            except FileNotFoundError:
                continue
        with self._lock:
            for key, size in found:
                if key not in self._lru:
                    self._lru.add(key, size)
        return {key for key, _ in found}

    def _stat_paths(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        out: list[ObjectStat | None] = []
        for key in keys:
            try:
                st = os.stat(os.path.join(self._shard_dir(key), key))
            except FileNotFoundError:
                out.append(None)
                with self._lock:
                    self._lru.discard(key)
                continue
            out.append(ObjectStat(key, st.st_size, st.st_mtime))
            with self._lock:
                if self._lru.size_of(key) != st.st_size:
                    # Written by another process (or rewritten): account for it from now on.
                    self._lru.add(key, st.st_size)
        return out

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        # docstring inherited
        return await self._run(self._translated, "stat", None, self._stat_paths, keys)

    # -- core: reads ---------------------------------------------------------------------------

    async def _get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        ranges: Sequence[ByteRange | None],
    ) -> list[int | None]:
        # docstring inherited
        jobs = [
            self._run(self._translated, "get_into", key, self._read_one, key, buf, rng)
            for key, buf, rng in zip(keys, buffers, ranges, strict=True)
        ]
        results: list[int | None] = list(await asyncio.gather(*jobs))
        with self._lock:
            self._lru.touch_batch([k for k, n in zip(keys, results, strict=True) if n is not None])
        return results

    async def _get_scatter(
        self, key: str, buffers: Sequence[memoryview], byte_range: ByteRange
    ) -> int | None:
        # docstring inherited. One open and one preadv for all the buffers: a framed object's
        # header and payload cost one request, not two opens and two reads (measured figure
        # at the cache tier's call, ``L3Link._read_object``).
        n: int | None = await self._run(
            self._translated, "get_scatter", key, self._read_into, key, list(buffers), byte_range
        )
        if n is not None:
            with self._lock:
                self._lru.touch_batch([key])
        return n

    def _read_one(self, key: str, view: memoryview, rng: ByteRange | None) -> int | None:
        return self._read_into(key, [view], rng)

    def _read_into(
        self, key: str, views: Sequence[memoryview], rng: ByteRange | None
    ) -> int | None:
        """Read the object (``rng`` of it, or all of it) into ``views`` in order; the one read
        path of ``get_into`` and ``get_scatter``: one open, vectored reads from that fd (so a
        rewrite of the key meanwhile is never seen half old, half new).

        O_DIRECT when the offset and every buffer's address are aligned and every buffer but
        the last is a whole number of blocks (the kernel's rule for each iovec); the last
        buffer's unaligned tail goes through the scratch block. Otherwise buffered."""
        start = 0 if rng is None else rng.start
        direct = (
            self.direct_io
            and start % DIRECT_ALIGNMENT == 0
            and all(is_aligned(v) for v in views)
            and all(len(v) % DIRECT_ALIGNMENT == 0 for v in views[:-1])
        )
        path = os.path.join(self._shard_dir(key), key)
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | (_O_DIRECT if direct else 0))
        except FileNotFoundError:
            with self._lock:
                self._lru.discard(key)  # evicted or deleted by someone else: a miss
            return None
        try:
            size = os.fstat(fd).st_size
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
            if direct:
                _pread_direct(fd, parts, start, length)
            else:
                _pread_exact(fd, parts, start)
        finally:
            os.close(fd)
        return length

    # -- core: writes --------------------------------------------------------------------------

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        # docstring inherited
        sizes = [len(view) for view in buffers]
        await self._reserve(keys, sum(sizes))
        try:
            outcomes = await self._write_batch(keys, buffers)
            written = [
                (key, size)
                for key, size, outcome in zip(keys, sizes, outcomes, strict=True)
                if outcome is True
            ]
            if self.durability == "full" and written:
                dirs = sorted({self._shard_dir(key) for key, _ in written})
                await self._run(self._translated, "put", None, _fsync_dirs, dirs)
        finally:
            with self._lock:
                self._reserved -= sum(sizes)
        with self._lock:
            self._lru.add_batch(written)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _write_batch(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> list[bool | BaseException]:
        """Write and publish each object; per key True (published) or the error it raised.

        The I/O step of ``_put``, which keeps the capacity reservation, directory fsyncs and
        the LRU bookkeeping around it; backends with another I/O engine (``hf3fs``) override
        only this.
        """
        jobs = [
            self._run(self._translated, "put", key, self._write_one, key, view, False)
            for key, view in zip(keys, buffers, strict=True)
        ]
        return list(await asyncio.gather(*jobs, return_exceptions=True))

    async def _put_if_absent(self, key: str, buffer: memoryview) -> bool:
        # Atomic across threads and processes: link() refuses an existing name.
        await self._reserve([key], len(buffer))
        try:
            wrote = bool(await self._run(
                self._translated, "put_if_absent", key, self._write_one, key, buffer, True
            ))
            if wrote and self.durability == "full":
                await self._run(_fsync_dir, self._shard_dir(key))
        finally:
            with self._lock:
                self._reserved -= len(buffer)
        with self._lock:
            if wrote:
                self._lru.add(key, len(buffer))
            else:
                self._lru.touch_batch([key])
        return wrote

    def _write_one(self, key: str, view: memoryview, exclusive: bool) -> bool:
        """Write ``view`` to a temp file, flush as ``durability`` says, publish it as ``key``.

        Returns False only for an exclusive publish that found the key present."""
        directory = self._shard_dir(key)
        final = os.path.join(directory, key)
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
            self._ensure_dir(directory)
            if exclusive:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp)
            else:
                os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return True

    # -- capacity ------------------------------------------------------------------------------

    async def _reserve(self, keys: Sequence[str], incoming: int) -> None:
        """Count ``incoming`` bytes as in flight, evicting first if the bound needs it."""
        if incoming > self.capacity_bytes:
            raise CapacityError(
                f"{incoming} bytes cannot fit a capacity of {self.capacity_bytes} bytes",
                backend=self.name, operation="put", key=keys[0] if len(keys) == 1 else None,
            )
        with self._lock:
            self._reserved += incoming
            over = self._lru.total_bytes + self._reserved > self.capacity_bytes
        if not over:
            return
        try:
            room = await self._run(self._evict, frozenset(keys))
        except BaseException:
            with self._lock:
                self._reserved -= incoming
            raise
        if not room:
            with self._lock:
                self._reserved -= incoming
            raise CapacityError(
                f"no room for {incoming} bytes: capacity {self.capacity_bytes} bytes, "
                f"{self.stats.eviction_failures} eviction failures so far",
                backend=self.name, operation="put",
            )

    def _evict(self, protected: frozenset[str]) -> bool:
        """Delete objects in eviction order until the reservation fits; True if it does.

        An object that cannot be deleted is counted, moved to the back of the line (it is
        still stored and readable) and skipped; eviction goes on with the next one.
        """
        with self._evict_lock:
            skip = set(protected)
            while True:
                with self._lock:
                    if self._lru.total_bytes + self._reserved <= self.capacity_bytes:
                        return True
                    victim = self._lru.oldest(excluding=skip)
                    if victim is None:
                        return False
                    self._lru.discard(victim[0])
                key, size = victim
                try:
                    os.unlink(os.path.join(self._shard_dir(key), key))
                except FileNotFoundError:
                    pass  # someone else removed it: the room is ours anyway
                except OSError:
                    # Still stored and readable: account for it again, at the back of the line.
                    skip.add(key)
                    with self._lock:
                        self._lru.add(key, size)
                        self.stats.eviction_failures += 1
                    continue
                with self._lock:
                    self.stats.evictions += 1

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects this process accounts for."""
        with self._lock:
            return self._lru.total_bytes

    # -- core: delete / list / close ---------------------------------------------------------

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        return await self._run(self._translated, "delete", None, self._delete_paths, keys)

    def _delete_paths(self, keys: Sequence[str]) -> list[bool]:
        out = []
        for key in keys:
            with self._lock:
                self._lru.discard(key)
            try:
                os.unlink(os.path.join(self._shard_dir(key), key))
            except FileNotFoundError:
                out.append(False)
            else:
                out.append(True)
        return out

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        # docstring inherited. Keys are sharded by hash, so a listing walks every directory.
        for top in await self._run(lambda: [e.path for e in _scandir_dirs(self._objects)]):
            names = await self._run(self._translated, "list_prefix", None, _list_tree, top)
            for name in names:
                if name.startswith(prefix) and _is_storage_key(name):
                    yield name

    async def _close(self) -> None:
        # Running jobs finish (they own their file descriptors); nothing new starts.
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)


# -- small blocking helpers (run on pool threads) --------------------------------------------


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _is_storage_key(name: str) -> bool:
    try:
        validate_storage_key(name)
    except InvalidKeyError:
        return False
    return True


def _scandir_dirs(path: str | os.PathLike[str]) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            dirs = [e for e in entries if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return iter(())
    return iter(dirs)


def _list_tree(top: str) -> list[str]:
    names: list[str] = []
    for sub in _scandir_dirs(top):
        with contextlib.suppress(FileNotFoundError), os.scandir(sub.path) as entries:
            names.extend(e.name for e in entries if e.is_file(follow_symlinks=False))
    return names


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
