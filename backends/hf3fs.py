"""``hf3fs:///mnt/3fs/prefix``: KV objects on 3FS, through USRBIO where it can, POSIX otherwise.

**Engines.** ``engine=auto`` (default) picks ``usrbio`` when ``hf3fs_fuse`` can be imported
*and* the root lies on a 3FS FUSE mount (``/proc/mounts`` fstype ``fuse.hf3fs``/``hf3fs``, and
``hf3fs_fuse.io.extract_mount_point`` agrees); anywhere else it picks ``posix``: the file
backend's own fast path (``os.preadv``/``pwrite``, O_DIRECT when aligned, a thread pool).
``engine=usrbio`` insists (and fails to open without the module or a mount point);
``engine=posix`` never touches USRBIO. The choice and its reason are in ``engine`` /
``engine_reason``, in ``stats`` (``usrbio_*`` counters) and in one INFO log line at open.

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

**USRBIO I/O.** A batch is one job: open every file, ``register_fd`` each, prepare one ring
entry per object (or per staging-sized piece), ``submit`` once, ``wait`` for all of them,
``deregister_fd``, close; reads and writes have their own rings. A caller buffer inside a
registered host region (``allocate_host_buffer``, ``register_host_buffer``) is read into /
written from directly; any other buffer is copied through a registered staging region.
Writes still go to a temp file, flushed per ``durability``, then renamed.

Options (besides the file backend's ``durability``, ``capacity_bytes``, ``io_threads``,
``direct_io``, ``page_cache``, ``create``, ``index``, ``lock_timeout``): ``engine`` (auto | usrbio | posix), ``ring_entries`` (default 1024),
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

from ._aligned import address_of, aligned_buffer
from ._hf3fs_usrbio import IoOp, UsrbioEngine, is_hf3fs_fstype, load_usrbio, mount_of, shm_buf
from .base import Backend, as_byte_view
from .errors import BackendError, InvalidRangeError, translate_os_error
from .file import FileBackend
from .types import BackendStats, BackendURL, ByteRange, convert_options, parse_size

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
        super().__init__(root, **file_options)
        self.stats = HF3FSStats(**self.stats.as_dict())
        self._usrbio: UsrbioEngine | None = None
        try:
            chosen, reason, io, mount = choose_engine(str(self.root), engine)
            if chosen == "usrbio":
                assert io is not None
                assert mount is not None
                self._usrbio = UsrbioEngine(
                    io, mount, entries=ring_entries, staging_bytes=staging,
                    timeout_s=float(usrbio_timeout),
                )
        except BaseException:
            self._pool.shutdown(wait=False)
            raise
        if self._usrbio is not None:
            # Zero-copy only into registered host regions; other buffers bounce via staging.
            self.capabilities = self.capabilities.replace(zero_copy_reads=False)
        self.engine: str = chosen
        self.engine_reason: str = reason
        self.mount_point: str | None = mount
        log.info("hf3fs backend at %s: engine=%s (%s)", self.root, chosen, reason)

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

    # -- host memory (zero-copy with USRBIO) ---------------------------------------------------

    async def allocate_host_buffer(self, nbytes: int) -> memoryview:
        """Memory for the cache tier's host pool that USRBIO reads into with no copy.

        USRBIO engine: a new ``/dev/shm`` region, registered as an iovec (freed at ``close``;
        the returned view must not be used after it). POSIX engine: page-aligned memory, so the
        file path can use O_DIRECT into it."""
        self._check_open("allocate_host_buffer")
        if self._usrbio is None:
            return aligned_buffer(nbytes, populate=True)  # reads land in it
        return await asyncio.to_thread(self._usrbio.allocate_region, nbytes)

    async def register_host_buffer(self, buffer: Any) -> bool:
        """Register existing host memory (a ``SharedMemory`` or a buffer mapped from
        ``/dev/shm``) for zero-copy USRBIO. Returns whether I/O on it is now zero-copy: always
        True in POSIX mode (reads land in caller buffers directly anyway); False for anonymous
        memory under USRBIO, which then bounces through the staging region."""
        self._check_open("register_host_buffer")
        if self._usrbio is None:
            return True
        target = buffer if isinstance(buffer, SharedMemory) else _extent(buffer)
        ok = await asyncio.to_thread(self._usrbio.register_region, target)
        if not ok:
            log.info("hf3fs: host buffer is not /dev/shm memory; its I/O uses the staging copy")
        return ok

    async def unregister_host_buffer(self, buffer: Any) -> None:
        """Undo ``register_host_buffer`` / ``allocate_host_buffer`` (no call may be using it)."""
        if self._usrbio is None:
            return
        view = shm_buf(buffer) if isinstance(buffer, SharedMemory) else as_byte_view(
            buffer, writable=False, what="host buffer")
        self._usrbio.unregister_region(address_of(view))

    # -- USRBIO reads --------------------------------------------------------------------------

    async def _get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        ranges: Sequence[ByteRange | None],
    ) -> list[int | None]:
        # docstring inherited
        if self._usrbio is None:
            return await super()._get_into(keys, buffers, ranges)
        results: list[int | None] = await self._run_io(
            self._translated, "get_into", None, self._usrbio_read,
            list(keys), list(buffers), list(ranges),
        )
        await self._after_reads(keys, results)
        return results

    async def _get_scatter(
        self, key: str, buffers: Sequence[memoryview], byte_range: ByteRange | None
    ) -> int | None:
        # docstring inherited. Under USRBIO: the generic one range per buffer, which
        # ``_get_into`` submits as one ring batch; the POSIX engine keeps the file backend's
        # single preadv.
        if self._usrbio is None:
            return await super()._get_scatter(key, buffers, byte_range)
        return await Backend._get_scatter(self, key, buffers, byte_range)

    def _read_one(self, key: str, view: memoryview, rng: ByteRange | None) -> int | None:
        if self._usrbio is None:
            return super()._read_one(key, view, rng)
        return self._usrbio_read([key], [view], [rng])[0]

    def _usrbio_read(
        self, keys: list[str], views: list[memoryview], ranges: list[ByteRange | None]
    ) -> list[int | None]:
        engine = self._usrbio
        assert engine is not None
        results: list[int | None] = [None] * len(keys)
        fds: list[int] = []
        registered: list[int] = []
        ops: list[tuple[int, IoOp]] = []
        try:
            for i, (key, view, rng) in enumerate(zip(keys, views, ranges, strict=True)):
                try:
                    fd = os.open(os.path.join(self._shard_dir(key), key), os.O_RDONLY | _O_CLOEXEC)
                except FileNotFoundError:
                    self._index.repair_missing(key)
                    continue
                fds.append(fd)
                size = os.fstat(fd).st_size
                if rng is None:
                    if size > len(view):
                        raise InvalidRangeError(
                            f"object of {size} bytes does not fit a {len(view)}-byte buffer",
                            backend=self.name, operation="get_into", key=key,
                        )
                    start, length = 0, size
                else:
                    rng.check_within(size, backend=self.name, key=key)
                    start, length = rng.start, rng.length
                results[i] = length
                if length:
                    engine.register_fd(fd)
                    registered.append(fd)
                    ops.append((i, IoOp(fd, start, view[:length])))
            if ops:
                engine.transfer(True, [op for _, op in ops])
            for i, op in ops:
                if op.error is not None:
                    raise self._op_error(op.error, "get_into", keys[i])
        finally:
            self._release_fds(registered, fds)
        return results

    # -- USRBIO writes -------------------------------------------------------------------------

    async def _write_batch(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> list[bool | BaseException]:
        # docstring inherited: one ring batch for the whole put under USRBIO
        if self._usrbio is None:
            return await super()._write_batch(keys, buffers)
        outcomes: list[bool | BaseException] = await self._run_io(
            self._usrbio_write, list(keys), list(buffers), False
        )
        return outcomes

    def _write_one(self, key: str, view: memoryview, exclusive: bool) -> bool:
        if self._usrbio is None:
            return super()._write_one(key, view, exclusive)
        outcome = self._usrbio_write([key], [view], exclusive)[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _usrbio_write(
        self, keys: list[str], views: list[memoryview], exclusive: bool
    ) -> list[bool | BaseException]:
        """Write each view to a temp file through one ring batch, flush, publish.

        Per-key outcome: True (published), False (exclusive and present), or the error."""
        engine = self._usrbio
        assert engine is not None
        outcomes: list[bool | BaseException] = [True] * len(keys)
        temps: list[str | None] = [None] * len(keys)
        fd_of: list[int | None] = [None] * len(keys)
        registered: list[int] = []
        ops: list[tuple[int, IoOp]] = []
        try:
            for i, (key, view) in enumerate(zip(keys, views, strict=True)):
                tmp = self._temp_path()
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
                    temps[i], fd_of[i] = tmp, fd
                    if len(view):
                        engine.register_fd(fd)
                        registered.append(fd)
                        ops.append((i, IoOp(fd, 0, view)))
                except OSError as exc:
                    outcomes[i] = self._op_error(exc, "put", key)
            if ops:
                engine.transfer(False, [op for _, op in ops])
            for i, op in ops:
                if op.error is not None:
                    outcomes[i] = self._op_error(op.error, "put", keys[i])
            while registered:
                engine.deregister_fd(registered.pop())
            for i, fd_or_none in enumerate(fd_of):
                if fd_or_none is None:
                    continue
                try:
                    if outcomes[i] is True and self.durability != "none":
                        (os.fdatasync if self.durability == "data" else os.fsync)(fd_or_none)
                except OSError as exc:
                    outcomes[i] = self._op_error(exc, "put", keys[i])
                finally:
                    fd_of[i] = None
                    os.close(fd_or_none)
            for i, key in enumerate(keys):
                staged = temps[i]
                if staged is None or outcomes[i] is not True:
                    continue
                try:
                    outcomes[i] = self._publish(key, staged, exclusive)
                    temps[i] = None
                except OSError as exc:
                    outcomes[i] = self._op_error(exc, "put", key)
        finally:
            self._release_fds(registered, [fd for fd in fd_of if fd is not None])
            for leftover in temps:
                if leftover is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(leftover)
        return outcomes

    # -- helpers -------------------------------------------------------------------------------

    def _release_fds(self, registered: list[int], fds: list[int]) -> None:
        engine = self._usrbio
        assert engine is not None
        for fd in registered:
            with contextlib.suppress(OSError):
                engine.deregister_fd(fd)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _op_error(self, exc: BaseException, operation: str, key: str) -> BaseException:
        if isinstance(exc, BackendError):
            if getattr(exc, "key", None) is None:
                exc.key = key
            return exc
        if isinstance(exc, OSError):
            err = translate_os_error(exc, backend=self.name, operation=operation, key=key)
            err.__cause__ = exc
            return err
        return exc

    def _sync_stats(self) -> None:
        engine = self._usrbio
        stats = self.stats
        if engine is not None and isinstance(stats, HF3FSStats):
            stats.usrbio_submissions = engine.submissions
            stats.usrbio_ios = engine.ios
            stats.usrbio_staged_bytes = engine.staged_bytes
            stats.usrbio_zero_copy_bytes = engine.zero_copy_bytes

    async def get_into(self, keys: Sequence[str], buffers: Sequence[Any],
                       ranges: Sequence[ByteRange | None] | None = None) -> list[int | None]:
        try:
            return await super().get_into(keys, buffers, ranges)
        finally:
            self._sync_stats()

    async def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> None:
        try:
            await super().put(keys, buffers)
        finally:
            self._sync_stats()

    async def _close(self) -> None:
        await super()._close()
        if self._usrbio is not None:
            self._usrbio.close()
            self._sync_stats()


__all__ = ["ENGINES", "HF3FSBackend", "HF3FSStats", "choose_engine"]


def _extent(buffer: Any) -> tuple[int, int]:
    """``(address, length)`` of a writable host buffer: what a registration thread gets in
    place of a view (``UsrbioEngine.register_region``)."""
    with as_byte_view(buffer, writable=True, what="host buffer") as view:
        return address_of(view), len(view)
