"""``hf3fs:///mnt/3fs/prefix``: KV objects on 3FS, through USRBIO where it can, POSIX otherwise.

**The file backend, configured.** ``HF3FSBackend`` is ``FileBackend`` with another default
index and one more I/O engine (``backends._file_io``); it overrides no read or write of the
file backend, only the choice of the engine at open.

**Engines.** ``engine=auto`` (default) picks ``usrbio`` when ``hf3fs_fuse`` can be imported
*and* the root lies on a 3FS FUSE mount (``/proc/mounts`` fstype ``fuse.hf3fs``/``hf3fs``, and
``hf3fs_fuse.io.extract_mount_point`` agrees); anywhere else it picks ``posix``: the file
backend's own engine (``io_engine``: the C accelerator where it is built, O_DIRECT when
aligned, a thread pool), so a 3FS root read through FUSE is exactly a ``file://`` root.
``engine=usrbio`` insists (and fails to open without the module or a mount point);
``engine=posix`` never touches USRBIO. The choice and its reason are in ``engine`` /
``engine_reason`` (the file engine in use in ``io_engine``), in ``stats`` (``usrbio_*``
counters) and in one INFO log line at open.

**On-disk organisation: one file per object in hash-sharded directories** (the file backend's
layout, reused as is: ``layout.json``, ``objects/ab/cd/<key>``, ``tmp/``). Why not slot files in
a few big preallocated files with an index, as SGLang's hf3fs backend does:

- our objects are the unified, framed objects (all layers of a page range: typically 1-16 MiB),
  so each file is already one large I/O that 3FS stripes over its chunks; a slot file would
  save metadata operations but not bytes;
- the metadata cost per object is small and bounded: a write is create + rename (+ unlink on
  eviction), a read is one open, ``exists`` one ``stat``, and a directory never holds more than
  a few hundred entries;
- atomic visibility, crash safety, sharing between ranks and nodes, and eviction are then the
  file system's own transactions (3FS metadata lives in FoundationDB: rename is atomic), with
  no index of ours that a crash could tear or that several writers would have to agree on.

**No index by default** (``index=none``, ``_file_noindex``): a 3FS root is written by several
hosts, and the file backend's shared index keeps its lock state in memory shared by the
processes of one host. So ``exists`` is one ``stat`` per key, and the capacity bound and the
eviction order are sampled (approximate). A root only one host uses may take ``index=sqlite``
(constant-time open, ``exists`` without metadata lookups, exact chain-aware eviction).

Everything else the file backend guarantees holds unchanged: temp + rename publish (``link`` for
``put_if_absent``), ``durability`` modes, eviction that goes on past an object it cannot
delete, stale temp cleanup at open.

**USRBIO I/O** (``UsrbioFiles``). A batch is one job: open every file, ``register_fd`` each,
prepare one ring entry per object (or per buffer of a scatter read, or per staging-sized
piece), ``submit`` once, ``wait`` for all of them,
``deregister_fd``, close; reads and writes have their own rings. A caller buffer inside a
registered host region (``allocate_host_buffer``, ``register_host_buffer``) is read into /
written from directly; any other buffer is copied through a registered staging region.
Writes still go to a temp file, flushed per ``durability``, then renamed.

Options (besides the file backend's ``durability``, ``capacity_bytes``, ``io_threads``,
``direct_io``, ``page_cache``, ``create``, ``index``, ``lock_timeout``, ``io_engine``):
``engine`` (auto | usrbio | posix), ``ring_entries`` (default 1024),
``staging_bytes`` (per direction, default 256 MiB), ``usrbio_timeout`` (seconds, default 60: a
ring wait longer than this fails the call, retryably, and the ring is not used again; I/O that
reads into or writes from registered caller memory is waited for past it instead, since it
would otherwise land after the call ended: the ``Backend`` buffer-lifetime contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Literal

from hicache_store.layout.errors import ConfigError

from ._aligned import address_of
from ._file_io import FileEngine, Placement, ReadItem, WriteOutcome
from ._hf3fs_usrbio import IoOp, UsrbioEngine, is_hf3fs_fstype, load_usrbio, mount_of, shm_buf
from .errors import BackendError, InvalidRangeError
from .file import FileBackend
from .types import BackendStats, BackendURL, convert_options, parse_size
from .views import as_byte_view, scatter_views

log = logging.getLogger(__name__)

Engine = Literal["auto", "usrbio", "posix"]
ENGINES: tuple[str, ...] = ("auto", "usrbio", "posix")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass
class HF3FSStats(BackendStats):
    """``BackendStats`` plus what the USRBIO engine did (all zero in POSIX mode)."""

    usrbio_submissions: int = 0
    usrbio_ios: int = 0
    usrbio_staged_bytes: int = 0
    usrbio_zero_copy_bytes: int = 0


def choose_engine(root: str, wanted: str) -> tuple[str, str, Any, str | None]:
    """``(engine, reason, hf3fs_fuse.io module or None, mount point or None)``."""
    if wanted == "posix":
        return "posix", "engine=posix requested", None, None
    io = load_usrbio()
    if io is None:
        reason = "hf3fs_fuse is not importable"
        if wanted == "usrbio":
            raise BackendError(
                f"engine=usrbio but {reason} (pip install hf3fs-py-usrbio from a 3FS build)",
                backend="hf3fs", operation="open",
            )
        return "posix", reason, None, None
    mount: str | None = None
    try:
        found = io.extract_mount_point(root)
        mount = str(found) if found else None
    except OSError:
        mount = None
    if wanted == "auto":
        info = mount_of(root)
        if mount is None or info is None or not is_hf3fs_fstype(info[1]):
            fstype = info[1] if info else "unknown"
            return "posix", f"{root} is not on a 3FS FUSE mount (fstype {fstype})", None, None
    if mount is None:
        raise BackendError(
            f"engine=usrbio but {root} is not under a 3FS mount point",
            backend="hf3fs", operation="open",
        )
    return "usrbio", f"hf3fs_fuse.io on mount {mount}", io, mount


class HF3FSBackend(FileBackend):
    """The file backend's layout and guarantees, with USRBIO batch I/O on a 3FS mount.

    See the module docstring for the engines, the layout decision and the options.
    """

    name = "hf3fs"
    default_index = "none"
    # The cache tier offers its host pool: registered with USRBIO (zero-copy), accepted as is
    # by the file engines (their reads land in caller memory anyway).
    capabilities = FileBackend.capabilities.replace(host_buffers=True)

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        engine: Engine = "auto",
        ring_entries: int = 1024,
        staging_bytes: int | str = "256MiB",
        usrbio_timeout: float = 60.0,
        **file_options: Any,
    ) -> None:
        if engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, got {engine!r}")
        if ring_entries < 1:
            raise ConfigError(f"ring_entries must be >= 1, got {ring_entries}")
        staging = parse_size(staging_bytes, option="staging_bytes")
        if staging < 4096:
            raise ConfigError(f"staging_bytes must be at least 4096, got {staging}")
        self._wanted = (engine, ring_entries, staging, float(usrbio_timeout))
        #: ``usrbio`` or ``posix`` (the file backend's own engine, ``io_engine``), and why.
        self.engine: str = "posix"
        self.engine_reason: str = ""
        self.mount_point: str | None = None
        super().__init__(root, **file_options)  # opens the engine (``_open_engine``)
        self.stats = HF3FSStats(**self.stats.as_dict())
        log.info("hf3fs backend at %s: engine=%s (%s)", self.root, self.engine, self.engine_reason)

    def _open_engine(self, io_engine: str, places: Placement) -> FileEngine:
        # docstring inherited: USRBIO where ``engine`` chooses it, else the file engine.
        wanted, ring_entries, staging, timeout = self._wanted
        chosen, self.engine_reason, io, mount = choose_engine(str(self.root), wanted)
        self.engine, self.mount_point = chosen, mount
        if chosen != "usrbio":
            return super()._open_engine(io_engine, places)
        if io_engine != "auto":
            raise ConfigError(f"io_engine={io_engine} is the file engine; engine=usrbio "
                              "moves this store's bytes")
        assert io is not None
        assert mount is not None
        return UsrbioFiles(places, UsrbioEngine(io, mount, entries=ring_entries,
                                                staging_bytes=staging, timeout_s=timeout))

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> HF3FSBackend:
        """``hf3fs:///mnt/3fs/prefix`` plus the options of ``__init__``."""
        root = url.local_path()
        opts = convert_options(  # the file backend's options, then hf3fs's own
            cls._typed_options(options), ints=("ring_entries",), floats=("usrbio_timeout",)
        )
        return cls(root, **opts)

    def __repr__(self) -> str:
        return f"HF3FSBackend({str(self.root)!r}, engine={self.engine!r})"

    # -- host memory (zero-copy with USRBIO; ``host_buffers()`` is the generic way) ----------

    async def allocate_host_buffer(self, nbytes: int) -> memoryview:
        """Memory for the cache tier's host pool that this store reads into with no copy.

        USRBIO engine: a new ``/dev/shm`` region, registered as an iovec (freed at ``close``;
        the returned view must not be used after it). POSIX engine: page-aligned memory, so the
        file path can use O_DIRECT into it."""
        self._check_open("allocate_host_buffer")
        return await asyncio.to_thread(self._engine.allocate, nbytes)

    async def register_host_buffer(self, buffer: Any) -> bool:
        """``host_buffers().register``: existing host memory (a ``SharedMemory`` or a buffer
        mapped from ``/dev/shm``) for zero-copy USRBIO. True in POSIX mode (reads land in
        caller buffers directly anyway); False for anonymous memory under USRBIO, which then
        bounces through the staging region."""
        self._check_open("register_host_buffer")
        return await self._register_host_buffer(buffer)

    async def unregister_host_buffer(self, buffer: Any) -> None:
        """``host_buffers().unregister`` (no call may be using the buffer)."""
        if not self.closed:
            await self._unregister_host_buffer(buffer)


class UsrbioFiles(FileEngine):
    """The ``usrbio`` engine: a batch of reads or of writes is one job and one ring batch
    (``_hf3fs_usrbio.UsrbioEngine``); the files are the file backend's own."""

    name = "usrbio"
    # Zero-copy only into registered host regions; other buffers bounce via staging.
    zero_copy_reads = False

    def __init__(self, places: Placement, usrbio: UsrbioEngine) -> None:
        super().__init__(places)
        self.usrbio = usrbio

    def read_run(self, count: int, threads: int) -> int:
        # docstring inherited: the whole batch in one ring batch
        return max(1, count)

    def write_run(self, count: int, threads: int) -> int:
        # docstring inherited: the whole put in one ring batch
        return max(1, count)

    def read(self, items: Sequence[ReadItem], missing: list[str]) -> list[int | None]:
        # docstring inherited. One ring entry per buffer an item fills.
        engine = self.usrbio
        backend = self.places.backend
        results: list[int | None] = [None] * len(items)
        fds: list[int] = []
        registered: list[int] = []
        ops: list[tuple[int, IoOp]] = []
        try:
            for i, (key, views, rng) in enumerate(items):
                try:
                    fd = os.open(self.places.final_path(key), os.O_RDONLY | _O_CLOEXEC)
                except FileNotFoundError:
                    missing.append(key)
                    continue
                except OSError as exc:
                    self.fail(exc, "get_into", key)
                fds.append(fd)
                size = os.fstat(fd).st_size
                if rng is None:
                    capacity = sum(len(v) for v in views)
                    if size > capacity:
                        raise InvalidRangeError(
                            f"object of {size} bytes does not fit a {capacity}-byte buffer",
                            backend=backend, operation="get_into", key=key,
                        )
                    start, length = 0, size
                else:
                    rng.check_within(size, backend=backend, key=key)
                    start, length = rng.start, rng.length
                results[i] = length
                if length:
                    engine.register_fd(fd)
                    registered.append(fd)
                    offset = start
                    for part in scatter_views(views, length):
                        ops.append((i, IoOp(fd, offset, part)))
                        offset += len(part)
            if ops:
                engine.transfer(True, [op for _, op in ops])
            for i, op in ops:
                if op.error is not None:
                    self.fail(op.error, "get_into", items[i][0])
        finally:
            self._release_fds(registered, fds)
        return results

    def write(self, keys: Sequence[str], views: Sequence[memoryview]) -> list[WriteOutcome]:
        # docstring inherited
        return self._write(keys, views, False)

    def write_exclusive(self, key: str, view: memoryview) -> bool:
        # docstring inherited
        outcome = self._write([key], [view], True)[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _write(
        self, keys: Sequence[str], views: Sequence[memoryview], exclusive: bool
    ) -> list[WriteOutcome]:
        """Write each view to a temp file through one ring batch, flush, publish.

        Per-key outcome: True (published), False (exclusive and present), or the error."""
        engine = self.usrbio
        places = self.places
        outcomes: list[WriteOutcome] = [True] * len(keys)
        temps: list[str | None] = [None] * len(keys)
        fd_of: list[int | None] = [None] * len(keys)
        registered: list[int] = []
        ops: list[tuple[int, IoOp]] = []
        try:
            for i, (key, view) in enumerate(zip(keys, views, strict=True)):
                tmp = places.temp_path()
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
                    temps[i], fd_of[i] = tmp, fd
                    if len(view):
                        engine.register_fd(fd)
                        registered.append(fd)
                        ops.append((i, IoOp(fd, 0, view)))
                except OSError as exc:
                    outcomes[i] = self.translated(exc, "put", key)
            if ops:
                engine.transfer(False, [op for _, op in ops])
            for i, op in ops:
                if op.error is not None:
                    outcomes[i] = self.translated(op.error, "put", keys[i])
            while registered:
                engine.deregister_fd(registered.pop())
            for i, fd_or_none in enumerate(fd_of):
                if fd_or_none is None:
                    continue
                try:
                    if outcomes[i] is True and places.durability != "none":
                        (os.fdatasync if places.durability == "data" else os.fsync)(fd_or_none)
                except OSError as exc:
                    outcomes[i] = self.translated(exc, "put", keys[i])
                finally:
                    fd_of[i] = None
                    os.close(fd_or_none)
            for i, key in enumerate(keys):
                staged = temps[i]
                if staged is None or outcomes[i] is not True:
                    continue
                try:
                    outcomes[i] = places.publish(key, staged, exclusive)
                    temps[i] = None
                except OSError as exc:
                    outcomes[i] = self.translated(exc, "put", key)
        finally:
            self._release_fds(registered, [fd for fd in fd_of if fd is not None])
            for leftover in temps:
                if leftover is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(leftover)
        return outcomes

    def _release_fds(self, registered: list[int], fds: list[int]) -> None:
        for fd in registered:
            with contextlib.suppress(OSError):
                self.usrbio.deregister_fd(fd)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- host memory --------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> memoryview:
        # docstring inherited: a new ``/dev/shm`` region, registered as an iovec
        return self.usrbio.allocate_region(nbytes)

    def register(self, buffer: Any) -> bool:
        # docstring inherited: False for memory outside ``/dev/shm`` (staged)
        target = buffer if isinstance(buffer, SharedMemory) else _extent(buffer)
        ok = self.usrbio.register_region(target)
        if not ok:
            log.info("hf3fs: host buffer is not /dev/shm memory; its I/O uses the staging copy")
        return ok

    def unregister(self, buffer: Any) -> None:
        # docstring inherited
        view = shm_buf(buffer) if isinstance(buffer, SharedMemory) else as_byte_view(
            buffer, writable=False, what="host buffer")
        self.usrbio.unregister_region(address_of(view))

    # -- bookkeeping --------------------------------------------------------------------------

    def account(self, stats: BackendStats) -> None:
        # docstring inherited
        usrbio = self.usrbio
        if isinstance(stats, HF3FSStats):
            stats.usrbio_submissions = usrbio.submissions
            stats.usrbio_ios = usrbio.ios
            stats.usrbio_staged_bytes = usrbio.staged_bytes
            stats.usrbio_zero_copy_bytes = usrbio.zero_copy_bytes

    def close(self) -> None:
        # docstring inherited
        self.usrbio.close()


__all__ = ["ENGINES", "HF3FSBackend", "HF3FSStats", "UsrbioFiles", "choose_engine"]


def _extent(buffer: Any) -> tuple[int, int]:
    """``(address, length)`` of a writable host buffer: what ``UsrbioEngine.register_region``
    takes in place of a view (no export of the buffer outlives the call)."""
    with as_byte_view(buffer, writable=True, what="host buffer") as view:
        return address_of(view), len(view)
