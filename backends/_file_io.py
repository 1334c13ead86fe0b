"""The file family's I/O engines: how an object's bytes move between its file and memory.

``FileBackend`` (``backends.file``) owns everything around the bytes: the layout (paths, temp
files, publishing), the index, capacity and eviction, the thread pool and the buffer lifetime
rule. The engine, chosen once at open, only moves bytes:

==========  =================================================  ================================
engine      reads / writes                                     chosen
==========  =================================================  ================================
``native``  a run of reads (or a put's run of writes) in one   the default where ``_fileio``
            call of the C accelerator ``_fileio`` that         is built (``io_engine=auto``)
            releases the GIL once; checksums in the same call
``posix``   ``os.preadv`` / ``os.pwrite`` from Python, one     ``io_engine=posix``, or
            system call per GIL hand-off                       ``_fileio`` not built
``usrbio``  3FS's user-space ring batches (``backends.hf3fs``) ``hf3fs://`` on a 3FS mount
==========  =================================================  ================================

Every engine reads and writes the same files, with the same misses, errors and results: a
miss is a missing file (its key added to ``missing``, whose index entry the backend repairs);
a write goes to a temp file, is flushed as ``durability`` says and is published by
``Placement.publish``, so readers see the old object or the new one, never a part. The read
policy of ``posix`` and ``native`` is one (``PosixEngine``): O_DIRECT for aligned cold reads,
buffered where the bytes are cached or ``page_cache`` admits them (``_pagecache``).

Engines run on the backend's pool threads (blocking calls), never on the event loop.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import importlib
import itertools
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NoReturn

import xxhash

from hicache_store.layout.errors import InvalidKeyError

from ._aligned import DIRECT_ALIGNMENT, aligned_buffer, is_aligned, scratch_block
from ._pagecache import SecondTouch, is_cached
from .errors import BackendError, BackendIOError, InvalidRangeError, translate_os_error
from .file_layout import shard_of
from .protocols import PendingReads, SummedReads
from .types import BackendStats, ByteRange
from .views import scatter_views

try:  # the optional C accelerator of batched reads and writes (setup.py)
    from . import _fileio
except ImportError:  # not built: the posix engine, one system call per GIL hand-off
    _fileio = None  # type: ignore[assignment]

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_MAX_IO = 0x7FFFF000  # Linux moves at most this many bytes per read/write call
_IOV_MAX = 1024  # Linux takes at most this many buffers per vectored call
#: the fewest objects one write job of a batch takes (below it the pool hand-off dominates).
_WRITE_JOB_MIN = 4
#: a batch's writes are spread over the pool when one object's write takes longer than this
#: (a pool hand-off costs 0.1-0.3 ms on a loaded 2-core machine).
_SPLIT_WRITES_ABOVE_S = 0.0005
#: ``_fileio`` flags: a read that was cold (not all cached) and aligned for O_DIRECT.
_COLD_ALIGNED = 2 | 4

#: one read of a run: the key, the buffers it fills in order, its range (None: all of it).
ReadItem = tuple[str, Sequence[memoryview], ByteRange | None]
#: per key of a write run: True (published), False (exclusive, and the key was present), or
#: the translated error.
WriteOutcome = bool | BaseException


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


#: ``_fileio`` computes checksums beside its reads (the native engine's summed reads).
SUMS_IN_C = _bind_xxh3()
#: the names ``io_engine`` takes.
IO_ENGINES: tuple[str, ...] = ("auto", "native", "posix")


class Placement:
    """Where a file backend's objects and temp files go, and the one way a written temp file
    becomes an object (``publish``); with the backend's I/O options, what an engine is handed.

    ``final_path(key)`` and ``shard_dir(key)`` take a validated key; ``temp_path()`` is a fresh
    temp file name in ``tmp/`` (same filesystem), named by this process and ``writer()``, so
    that an open can tell a dead writer's leftovers. ``durability``, ``direct_io`` (O_DIRECT
    works here and is wanted) and ``page_cache`` are the backend's options.
    """

    def __init__(
        self, backend: str, root: str | os.PathLike[str], *, durability: str, direct_io: bool,
        page_cache: str, writer: Callable[[], str],
    ) -> None:
        self.backend = backend
        self.objects = os.path.join(root, "objects")
        self.tmp = os.path.join(root, "tmp")
        self.durability = durability
        self.direct_io = direct_io
        self.page_cache = page_cache
        self._writer = writer
        self._seq = itertools.count()
        self._lock = threading.Lock()  # guards _known_dirs
        self._known_dirs: set[str] = set()

    def final_path(self, key: str) -> str:
        return os.path.join(self.shard_dir(key), key)

    def shard_dir(self, key: str) -> str:
        if os.sep in key or key in (".", "..") or "\x00" in key:  # defence in depth
            raise InvalidKeyError(f"key {key[:80]!r} would leave the store", backend=self.backend)
        return os.path.join(self.objects, *shard_of(key))

    def temp_path(self) -> str:
        return os.path.join(self.tmp, f"{os.getpid()}-{self._writer()}-{next(self._seq)}.tmp")

    def ensure_dir(self, directory: str) -> None:
        """Make a shard directory (and, ``durability=full``, its parents' entries durable)."""
        if directory in self._known_dirs:
            return
        os.makedirs(directory, exist_ok=True)
        if self.durability == "full":
            fsync_dir(os.path.dirname(directory))
            fsync_dir(os.path.dirname(os.path.dirname(directory)))
        with self._lock:
            self._known_dirs.add(directory)

    def publish(self, key: str, tmp: str, exclusive: bool) -> bool:
        """Make the written, flushed temp file ``tmp`` the object ``key`` in one step.

        ``rename`` over any previous object, or, ``exclusive``, ``link``, which refuses an
        existing name: then False, and the temp file is removed either way. Readers see the
        old object or the new one, never part of one; a crash before this leaves only a temp
        file (removed at the next open). The caller fsyncs the shard directory when
        ``durability`` is ``full``. Every writer of the file layout publishes through here.
        """
        directory = self.shard_dir(key)
        final = os.path.join(directory, key)
        self.ensure_dir(directory)
        try:
            try:
                return self._publish(tmp, final, exclusive)
            except FileNotFoundError:
                if os.path.isdir(directory) or not os.path.exists(tmp):
                    raise
            # the shard was emptied and removed since this process made it (an operator's
            # clean-up): made again, as the C writer does
            with self._lock:
                self._known_dirs.discard(directory)
            self.ensure_dir(directory)
            return self._publish(tmp, final, exclusive)
        finally:
            if exclusive:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    @staticmethod
    def _publish(tmp: str, final: str, exclusive: bool) -> bool:
        """``rename`` or ``link`` ``tmp`` onto ``final``: False where ``link`` found it."""
        if not exclusive:
            os.rename(tmp, final)
            return True
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        return True


class FileEngine(abc.ABC):
    """How a file backend moves bytes (see the module docstring). Blocking methods, called on
    the backend's pool threads; a read run or write run is one job."""

    #: the name ``FileBackend.io_engine`` reports.
    name: ClassVar[str]
    #: whether reads land in the caller's buffers with no copy (``zero_copy_reads``).
    zero_copy_reads: ClassVar[bool] = True
    #: whether ``start_write`` runs a put's writes on a thread of their own (no pool job).
    starts_writes: ClassVar[bool] = False

    def __init__(self, places: Placement) -> None:
        self.places = places
        #: whether ``read_summed`` / ``start_summed`` checksum inside the reads themselves.
        self.sums_reads = False

    # -- how a batch is split into jobs ---------------------------------------------------

    def read_run(self, count: int, threads: int) -> int:
        """How many reads of a batch of ``count`` one job makes: by default the batch spread
        over ``threads`` jobs (as many reads in flight as a job per key would keep, without
        a pool hand-off per key: 100-300 us each on a loaded 2-core machine)."""
        return max(1, -(-count // threads))

    def write_run(self, count: int, threads: int) -> int:
        """How many writes of a put of ``count`` objects one job makes (default: one each)."""
        return 1

    # -- the I/O --------------------------------------------------------------------------

    @abc.abstractmethod
    def read(self, items: Sequence[ReadItem], missing: list[str]) -> list[int | None]:
        """Read each item's object (its range, or all of it) into its buffers in order; per
        item the bytes read, or None for a missing file (its key appended to ``missing``).
        Raises the first error (translated) once no read of the run is in flight."""

    @abc.abstractmethod
    def write(self, keys: Sequence[str], views: Sequence[memoryview]) -> list[WriteOutcome]:
        """Write and publish each object (replacing any previous one); per key True or the
        translated error (its temp file removed)."""

    def start_write(self, keys: Sequence[str], views: Sequence[memoryview],
                    start_by: float) -> StartedWrites:
        """``write`` begun on a thread of its own that never takes the GIL, only if
        ``time.monotonic()`` there has not passed ``start_by`` (with ``starts_writes``)."""
        raise NotImplementedError(f"the {self.name} engine does not start writes")

    @abc.abstractmethod
    def write_exclusive(self, key: str, view: memoryview) -> bool:
        """Write ``key`` unless it exists (the publish refuses an existing name): True when
        this call published it. Raises the translated error."""

    # -- optional: summed reads (``capabilities.native_reads``) ---------------------------

    def read_summed(
        self, items: Sequence[ReadItem], spans: Sequence[Sequence[tuple[int, int]]],
        missing: list[str],
    ) -> SummedReads:
        """``read`` that also returns the xxh3_64 of each item's ``spans`` (``sums_reads``)."""
        raise NotImplementedError(f"the {self.name} engine does not sum its reads")

    def start_summed(
        self, items: Sequence[ReadItem], spans: Sequence[Sequence[tuple[int, int]]],
    ) -> tuple[Any, Callable[[Any, list[str]], SummedReads]]:
        """``read_summed`` started on a native thread: the running job (``done()``,
        ``wait()`` -> outcomes) and how its outcomes become the result (``judge(outcomes,
        missing)``)."""
        raise NotImplementedError(f"the {self.name} engine does not start reads")

    # -- host memory (``capabilities.host_buffers``) ---------------------------------------

    def allocate(self, nbytes: int) -> memoryview:
        """Host memory this engine reads into with no copy: page-aligned (O_DIRECT lands in
        it)."""
        return aligned_buffer(nbytes, populate=True)

    def register(self, buffer: Any) -> bool:
        """Register host memory; True when I/O on it is zero-copy (here always: reads land in
        the caller's buffers directly)."""
        return True

    def unregister(self, buffer: Any) -> None:  # noqa: B027 - optional, nothing by default
        """Undo ``register``."""

    # -- bookkeeping -----------------------------------------------------------------------

    def account(self, stats: BackendStats) -> None:  # noqa: B027 - optional
        """Copy what the engine counts into ``stats`` (after each job and at close)."""

    def close(self) -> None:  # noqa: B027 - optional, nothing by default
        """Release the engine's resources (the pool has ended every job)."""

    # -- shared by every engine --------------------------------------------------------------

    def translated(self, exc: BaseException, operation: str, key: str | None) -> BaseException:
        """``exc`` as the backend's error hierarchy says (``key`` filled in where missing)."""
        if isinstance(exc, BackendError):
            if exc.key is None:
                exc.key = key
            return exc
        if isinstance(exc, OSError):
            err = translate_os_error(exc, backend=self.places.backend, operation=operation,
                                     key=key)
            err.__cause__ = exc
            return err
        return exc

    def fail(self, exc: BaseException, operation: str, key: str | None) -> NoReturn:
        """Raise ``exc`` translated (``translated``), from the ``OSError`` it translates."""
        err = self.translated(exc, operation, key)
        if err is exc:
            raise err
        raise err from exc


class PosixEngine(FileEngine):
    """Python system calls: one open and vectored reads per object, one temp file write per
    object; the read policy of the file family (``_read_into``)."""

    name = "posix"

    def __init__(self, places: Placement) -> None:
        super().__init__(places)
        self._second_touch = SecondTouch()

    def read(self, items: Sequence[ReadItem], missing: list[str]) -> list[int | None]:
        # docstring inherited
        out: list[int | None] = []
        for key, views, rng in items:
            try:
                out.append(self._read_into(key, views, rng, missing))
            except (BackendError, OSError) as exc:
                self.fail(exc, "get_into", key)
        return out

    def _read_into(
        self, key: str, views: Sequence[memoryview], rng: ByteRange | None, missing: list[str]
    ) -> int | None:
        """Read the object (``rng`` of it, or all of it) into ``views`` in order: one open,
        vectored reads from that fd (so a rewrite of the key meanwhile is never seen half
        old, half new).

        O_DIRECT when the offset and every buffer's address are aligned, every buffer but the
        last is a whole number of blocks (the kernel's rule for each iovec), and the bytes are
        not in the page cache (nor admitted to it: ``_use_page_cache``); the last buffer's
        unaligned tail goes through the scratch block. Otherwise buffered."""
        start = 0 if rng is None else rng.start
        direct = (
            self.places.direct_io
            and start % DIRECT_ALIGNMENT == 0
            and all(is_aligned(v) for v in views)
            and all(len(v) % DIRECT_ALIGNMENT == 0 for v in views[:-1])
        )
        path = self.places.final_path(key)
        try:
            # O_NONBLOCK: a FIFO under a key's name must not block the open, and with it the
            # read, forever (a read waits for its I/O whatever its caller does); regular files
            # ignore the flag.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_CLOEXEC)
        except FileNotFoundError:
            missing.append(key)  # evicted or deleted by someone else: a miss
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BackendIOError(f"{path} is not a regular file", backend=self.places.backend,
                                     operation="get_into", key=key)
            size = st.st_size
            if rng is None:
                length = size
                capacity = sum(len(v) for v in views)
                if size > capacity:
                    raise InvalidRangeError(
                        f"object of {size} bytes does not fit a {capacity}-byte buffer",
                        backend=self.places.backend, operation="get_into", key=key,
                    )
            else:
                rng.check_within(size, backend=self.places.backend, key=key)
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
        if self.places.page_cache == "always" or is_cached(fd, start, length):
            return True
        if self.places.page_cache == "never":
            return False
        return self._second_touch.admit(xxhash.xxh3_64_intdigest(key.encode()))

    def write(self, keys: Sequence[str], views: Sequence[memoryview]) -> list[WriteOutcome]:
        # docstring inherited
        out: list[WriteOutcome] = []
        for key, view in zip(keys, views, strict=True):
            try:
                out.append(self.write_one(key, view, False))
            except (BackendError, OSError) as exc:
                out.append(self.translated(exc, "put", key))
        return out

    def write_exclusive(self, key: str, view: memoryview) -> bool:
        # docstring inherited
        try:
            return self.write_one(key, view, True)
        except (BackendError, OSError) as exc:
            self.fail(exc, "put_if_absent", key)

    def write_one(self, key: str, view: memoryview, exclusive: bool) -> bool:
        """Write ``view`` to a temp file, flush as ``durability`` says, publish it as ``key``.

        Returns False only for an exclusive publish that found the key present."""
        places = self.places
        tmp = places.temp_path()
        direct = places.direct_io and len(view) >= DIRECT_ALIGNMENT and is_aligned(view)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | (_O_DIRECT if direct else 0)
        fd = os.open(tmp, flags, 0o644)
        try:
            try:
                if direct:
                    _pwrite_direct(fd, view)
                else:
                    _pwrite_exact(fd, view, 0)
                if places.durability == "data":
                    os.fdatasync(fd)
                elif places.durability == "full":
                    os.fsync(fd)
            finally:
                os.close(fd)
            return places.publish(key, tmp, exclusive)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


class NativeEngine(PosixEngine):
    """The C accelerator (``_fileio``): a run's system calls in one call that releases the
    GIL once. In a process whose other threads keep the interpreter busy (an inference engine)
    each reacquisition waits up to the switch interval, and a read took five of them. Same
    bytes, misses, errors and read policy as ``PosixEngine``, except that an object whose
    length is not a multiple of 4096 is read buffered (the posix engine reads its aligned
    body O_DIRECT). Exclusive writes (``put_if_absent``: a ``link``) are the posix engine's."""

    name = "native"
    starts_writes = True

    def __init__(self, places: Placement) -> None:
        if _fileio is None:
            raise BackendError("io_engine=native but the C accelerator _fileio is not built "
                               "(setup.py)", backend=places.backend, operation="open")
        super().__init__(places)
        self.sums_reads = SUMS_IN_C
        #: recent seconds one small object's write takes (``write_run`` splits by it; None
        #: until a write was timed: split, since one thread writing a large batch of objects
        #: that are slow to make would take the whole batch's time alone).
        self.write_cost_s: float | None = None

    def write_run(self, count: int, threads: int) -> int:
        # docstring inherited. Where the filesystem makes a file slowly (~1 ms each on this
        # project's test machine's disk, which takes several at once) the batch is split over
        # up to ``threads`` jobs of at least ``_WRITE_JOB_MIN`` objects; where it is fast
        # (tmpfs: ~0.1 ms) one job, since each pool hand-off would cost more than the writes
        # it spreads (BENCHMARKS.md, "Backups in runs"). Split until measured.
        if self.write_cost_s is None or self.write_cost_s > _SPLIT_WRITES_ABOVE_S:
            return max(_WRITE_JOB_MIN, -(-count // threads))
        return max(1, count)

    def read(self, items: Sequence[ReadItem], missing: list[str]) -> list[int | None]:
        # docstring inherited. The run's reads in one C call, then each outcome judged here
        # as ``PosixEngine._read_into`` reports it; the read policy is the posix engine's
        # (asked before the read, recorded after it only for a read that was cold and
        # aligned, as ``_use_page_cache`` records it).
        return self._read_batch(items, None, missing)[0]

    def read_summed(
        self, items: Sequence[ReadItem], spans: Sequence[Sequence[tuple[int, int]]],
        missing: list[str],
    ) -> SummedReads:
        # docstring inherited
        return self._read_batch(items, spans, missing)

    def start_summed(
        self, items: Sequence[ReadItem], spans: Sequence[Sequence[tuple[int, int]]],
    ) -> tuple[Any, Callable[[Any, list[str]], SummedReads]]:
        # docstring inherited. On a thread of ``_fileio``'s own that never takes the GIL
        # (``start_read_files``).
        batch, hashes = self._c_batch(items, spans)

        def judge(outcomes: Any, missing: list[str]) -> SummedReads:
            return self._judged_batch(items, outcomes, hashes, missing)

        return _fileio.start_read_files(batch), judge

    def _read_batch(
        self, items: Sequence[ReadItem], spans: Sequence[Sequence[tuple[int, int]]] | None,
        missing: list[str],
    ) -> SummedReads:
        batch, hashes = self._c_batch(items, spans)
        return self._judged_batch(items, _fileio.read_files(batch), hashes, missing)

    def _c_batch(
        self, items: Sequence[ReadItem], spans: Sequence[Sequence[tuple[int, int]]] | None,
    ) -> tuple[list[Any], list[int]]:
        """The ``_fileio`` items of a run of reads, and (page cache ``second`` only) each
        key's hash for ``_second_touch``."""
        places = self.places
        second = places.direct_io and places.page_cache == "second"
        hashes = [xxhash.xxh3_64_intdigest(key.encode()) for key, _, _ in items] if second else []
        batch: list[Any] = []
        for i, (key, views, rng) in enumerate(items):
            direct = places.direct_io and places.page_cache != "always" and not (
                second and self._second_touch.seen(hashes[i]))
            start, length = (0, -1) if rng is None else (rng.start, rng.length)
            item = (places.final_path(key), list(views), start, length, direct)
            batch.append(item if spans is None else (*item, spans[i]))
        return batch, hashes

    def _judged_batch(
        self, items: Sequence[ReadItem],
        outcomes: Sequence[tuple[int, int, int, int, tuple[int, ...]]],
        hashes: list[int], missing: list[str],
    ) -> SummedReads:
        """The bytes read and sums of a run's ``_fileio`` outcomes (``_judged`` each; the
        first error raised once all are judged)."""
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

    def _judged(
        self, key: str, views: Sequence[memoryview], rng: ByteRange | None, status: int,
        value: int, size: int, missing: list[str],
    ) -> int | None:
        """One ``_fileio.read_files`` outcome as ``_read_into`` reports it (see ``_fileio.c``)."""
        backend = self.places.backend
        path = self.places.final_path(key)
        if status == 0:
            return value
        if status == 1:
            if value == errno.ENOENT:
                missing.append(key)  # evicted or deleted by someone else: a miss
                return None
            raise translate_os_error(OSError(value, os.strerror(value), path),
                                     backend=backend, operation="get_into", key=key)
        if status == 2:
            raise BackendIOError(f"{path} is not a regular file", backend=backend,
                                 operation="get_into", key=key)
        if status == 3:
            if rng is not None:
                rng.check_within(size, backend=backend, key=key)
            raise InvalidRangeError(
                f"object of {size} bytes does not fit a {sum(len(v) for v in views)}-byte "
                "buffer", backend=backend, operation="get_into", key=key,
            )
        raise BackendIOError(f"short read: {value} of {size} bytes of {path}",
                             backend=backend, operation="get_into", key=key)

    def write(self, keys: Sequence[str], views: Sequence[memoryview]) -> list[WriteOutcome]:
        """Each object (never exclusive) in one C call that releases the GIL
        (``_fileio.write_files``): the same temp file, O_DIRECT rule, flush and rename as
        ``write_one``, so the same files; per key True or the translated error (its temp file
        removed)."""
        batch = self._write_batch(keys, views)
        started = time.perf_counter()
        written = _fileio.write_files(batch)
        if batch:
            self._timed_writes((time.perf_counter() - started) / len(batch))
        return self._judged_writes(keys, batch, written)

    def start_write(self, keys: Sequence[str], views: Sequence[memoryview],
                    start_by: float) -> StartedWrites:
        # docstring inherited. ``_fileio.start_write_files``: the same items as ``write``'s.
        batch = self._write_batch(keys, views)
        job = _fileio.start_write_files(batch, start_by)

        def judged() -> tuple[list[WriteOutcome], float | None, float | None]:
            written, began, ended = job.wait()
            if began is not None and ended is not None and batch:
                self._timed_writes((ended - began) / len(batch))
            return self._judged_writes(keys, batch, written), began, ended

        return StartedWrites(list(keys), job.done, judged)

    def _write_batch(
        self, keys: Sequence[str], views: Sequence[memoryview]
    ) -> list[tuple[str, str, memoryview, bool, int]]:
        """The ``_fileio`` items of ``keys``' writes. The C writer makes a missing shard
        directory itself (durably with ``durability=full``, as ``Placement.ensure_dir``), off
        the caller's thread; an error making it is that key's outcome."""
        places = self.places
        flush = {"none": 0, "data": 1, "full": 2}[places.durability]
        return [(places.temp_path(), places.final_path(key), view, places.direct_io, flush)
                for key, view in zip(keys, views, strict=True)]

    def _timed_writes(self, per_object: float) -> None:
        # a benign race between threads: the estimate is only a hint
        cost = self.write_cost_s
        self.write_cost_s = per_object if cost is None else cost + (per_object - cost) * 0.1

    def _judged_writes(self, keys: Sequence[str],
                       batch: list[tuple[str, str, memoryview, bool, int]],
                       written: list[tuple[int, int]]) -> list[WriteOutcome]:
        """Each item's ``(status, errno)`` judged: True or the error."""
        places = self.places
        out: list[WriteOutcome] = []
        for key, (_, final, _, _, _), (status, err) in zip(keys, batch, written, strict=True):
            if status == 0:
                out.append(True)
            elif status == 2:  # (not attempted: the job began late; the caller fails it whole)
                out.append(TimeoutError("put not begun by its deadline"))
            else:
                out.append(translate_os_error(OSError(err, os.strerror(err), final),
                                              backend=places.backend, operation="put", key=key))
        return out


class StartedWrites:
    """A put's writes under way on their own thread (``FileEngine.start_write``): ``done()``
    never waits; ``wait()`` waits for them, then per key (of ``keys``) True or its error, and the
    ``time.monotonic()`` at which they began and ended (None, None: begun too late, nothing
    written, every key a ``TimeoutError``)."""

    def __init__(
        self, keys: list[str], done: Callable[[], bool],
        wait: Callable[[], tuple[list[WriteOutcome], float | None, float | None]],
    ) -> None:
        self.keys, self.done, self.wait = keys, done, wait


def open_engine(io_engine: str, places: Placement) -> FileEngine:
    """The engine ``io_engine`` names (``auto``: native where ``_fileio`` is built, else
    posix). ``ValueError`` for another name; ``BackendError`` for ``native`` unbuilt."""
    if io_engine not in IO_ENGINES:
        raise ValueError(f"io_engine must be one of {IO_ENGINES}, got {io_engine!r}")
    if io_engine == "native" or (io_engine == "auto" and _fileio is not None):
        return NativeEngine(places)
    return PosixEngine(places)


class NativePendingReads(PendingReads):
    """Reads started by ``FileEngine.start_summed``: ``job`` the running ``_fileio`` job,
    ``finish`` what makes the result of its outcomes (``PendingReads``)."""

    def __init__(
        self, counted: Callable[[list[int | None]], None], job: Any,
        finish: Callable[[Any], SummedReads],
    ) -> None:
        super().__init__(counted)
        self._job, self._finish = job, finish

    def done(self) -> bool:
        return bool(self._job.done())

    def wait(self) -> None:
        self._job.wait()

    def _result(self) -> SummedReads:
        return self._finish(self._job.wait())


# -- system calls (run on pool threads) -------------------------------------------------------


def probe_direct_io(tmp: str | os.PathLike[str], name: str) -> bool:
    """Whether O_DIRECT writes work in the directory ``tmp`` (a probe file ``name`` there,
    removed). False where the platform or the filesystem refuses it (older tmpfs)."""
    if not _O_DIRECT:
        return False
    probe = os.path.join(tmp, name)
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _set_direct(fd: int) -> bool:
    """Switch an open fd to O_DIRECT; False when the filesystem refuses (read buffered)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
    except OSError:
        return False
    return True


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
