"""``fsspec+<protocol>://...``: any fsspec filesystem as L3 (GCS, Azure, HDFS, SFTP, ...).

URLs name the filesystem after the ``+``: ``fsspec+memory://scratch/kv``,
``fsspec+file:///var/cache/kv``, ``fsspec+s3://bucket/kv``, ``fsspec+gcs://bucket/kv``
(``fsspec://path?protocol=gcs`` works too). The location is the root directory; each object is
the file ``<root>/<key>``. Options: ``max_concurrency`` (threads, so requests in flight;
default 16, as for s3), ``atomic_write`` (auto | direct | rename), ``request_timeout``
(seconds one filesystem call may take from the caller's side, default 15),
``storage_options`` (a dict handed to ``fsspec.filesystem``), ``create`` (default true: make
the root directory at open; false: create nothing and raise ``NotFoundError`` when the root is
not a directory, what the read-only tools open with, ``Backend.creates_location``); every other
option is handed to the filesystem as a keyword (``endpoint_url``, ``key``, ``secret``,
``anon``, ... for s3fs; URL values arrive as strings).

**Deadlines and buffer lifetime.** Every filesystem call runs on the pool and is awaited at
most ``request_timeout``: a stopped or unreachable store fails a call with a retryable
``BackendTimeoutError``; the thread finishes under the filesystem's own timeouts. That is safe
for the caller's buffers by construction: reads return new ``bytes`` that the call copies into
the caller's buffer on the event loop (never once it has ended), and writes hand the
filesystem a copy made during the call.

**Calls.** Every request of a batch is its own job on a pool of ``max_concurrency`` threads:
reads are ``cat_file`` (with ``start``/``end``), writes ``pipe_file``, ``exists``/``stat`` are
``info``; each request gets ``request_timeout``, and the event loop never blocks. Reads are not
zero-copy (fsspec returns ``bytes``). Why this shape, on sync and async filesystems alike:
docs/design/object-stores.md.

**Ranges** are never clamped: fsspec returns short data for a range past the end, so a short
answer is an ``InvalidRangeError``.

**Atomic visibility** depends on the filesystem, so ``atomic_write=auto`` picks per protocol:
``direct`` (one ``pipe_file``) for object stores (s3, gcs, az/abfs, oss, ...) and ``memory``;
``rename`` for everything else (a hidden temp file beside the object, its name holding a ``.``,
then ``mv``), atomic where the filesystem's rename is. Where ``mv`` is copy-then-delete (FTP,
WebDAV, some FUSE mounts) a reader may see a partial object: use such stores only with framed
objects, whose checksums make a torn object corrupt, never served.

**put_if_absent** is check-then-write (not atomic: ``capabilities.atomic_put`` is false); racing
writers of one key write the same bytes, which is harmless for content-addressed keys.

**Delete** asks ``info`` first: several filesystems (s3fs) delete an absent key silently, and
the contract says whether it was there. **Listing** is one ``ls`` of the root (keys are flat),
bypassing listing caches.

**Capacity**: fsspec filesystems report no capacity; bound them with the store's own tools
(bucket lifecycle rules) or ``hicache-store gc``. ``capabilities.eviction`` is false.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hicache_store.layout.errors import ConfigError, InvalidKeyError
from hicache_store.layout.keys import validate_storage_key

from .aio import wait_for
from .base import Backend, ReadCounts, ReadRanges, removed_once
from .errors import (
    BackendError,
    BackendIOError,
    BackendTimeoutError,
    InvalidRangeError,
    NotFoundError,
    translate_os_error,
)
from .lifetime import abandonable, until_abandoned
from .types import BackendURL, ByteRange, Capabilities, ObjectStat, convert_options

T = TypeVar("T")

#: protocols whose single write is atomic (object stores, and the in-process dict).
DIRECT_WRITE_PROTOCOLS = frozenset({
    "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "b2",
})
#: protocols whose objects live only in this process.
PROCESS_LOCAL_PROTOCOLS = frozenset({"memory"})
ATOMIC_WRITE_MODES = ("auto", "direct", "rename")
#: seconds one filesystem call may take by default (docs/guide/backends/deadlines.md).
DEFAULT_REQUEST_TIMEOUT = 15.0


class FsspecBackend(Backend):
    """Objects as files ``<root>/<key>`` on any fsspec filesystem. See the module docstring."""

    name = "fsspec"
    creates_location = True  # makedirs of the root (and, on s3fs, of a missing bucket)
    capabilities = Capabilities(ranged_reads=True, listing=True, persistent=True, shared=True)

    def __init__(
        self,
        protocol: str,
        root: str,
        *,
        max_concurrency: int = 16,
        atomic_write: str = "auto",
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        storage_options: dict[str, Any] | None = None,
        create: bool = True,
        **filesystem_options: Any,
    ) -> None:
        super().__init__()
        import fsspec

        if atomic_write not in ATOMIC_WRITE_MODES:
            raise ConfigError(f"atomic_write must be one of {ATOMIC_WRITE_MODES}, got {atomic_write!r}")
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not request_timeout > 0:
            raise ConfigError(f"request_timeout must be > 0, got {request_timeout}")
        self.request_timeout = float(request_timeout)
        self.protocol = protocol
        options = {**(storage_options or {}), **filesystem_options}
        self.fs: Any = fsspec.filesystem(protocol, **options)
        stripped = self.fs._strip_protocol(root) if root else ""
        self.root = str(stripped).rstrip("/") or ("/" if protocol in ("file", "local") else "")
        if not self.root:
            raise ConfigError(f"fsspec+{protocol}:// needs a root directory")
        if atomic_write == "auto":
            atomic_write = "direct" if protocol in DIRECT_WRITE_PROTOCOLS else "rename"
        self.atomic_write = atomic_write
        local = protocol in PROCESS_LOCAL_PROTOCOLS
        self.capabilities = type(self).capabilities.replace(persistent=not local, shared=not local)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="hicache-fsspec")
        try:
            if create:
                self._translated("open", None, self.fs.makedirs, self.root, exist_ok=True)
            elif not self._translated("open", None, self.fs.isdir, self.root):
                raise NotFoundError(
                    f"no directory {protocol}://{self.root} (opened with create=False: "
                    "nothing was created)", backend=self.name, operation="open",
                )
        except BaseException:
            self._pool.shutdown(wait=False)
            raise

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> FsspecBackend:
        """``fsspec+<protocol>://<root>`` or ``fsspec://<root>?protocol=<protocol>``."""
        opts = dict(options)
        _, plus, protocol = url.scheme.partition("+")
        if not plus:
            protocol = str(opts.pop("protocol", ""))
        else:
            opts.pop("protocol", None)
        if not protocol:
            raise ConfigError("name the filesystem: fsspec+<protocol>://root (e.g. fsspec+gcs://b/kv)")
        opts = convert_options(opts, ints=("max_concurrency",), floats=("request_timeout",),
                               bools=("create",))
        return cls(protocol, url.location, **opts)

    def __repr__(self) -> str:
        return f"FsspecBackend({self.protocol}://{self.root}, atomic_write={self.atomic_write})"

    # -- plumbing -----------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{key}"

    def _translated(self, operation: str, key: str | None, fn: Callable[..., T], *args: Any,
                    **kwargs: Any) -> T:
        """Call the filesystem; translate its failure once, here."""
        try:
            return fn(*args, **kwargs)
        except BackendError:
            raise
        except OSError as exc:
            raise translate_os_error(exc, backend=self.name, operation=operation, key=key) from exc
        except Exception as exc:
            raise BackendIOError(
                f"{operation} failed: {type(exc).__name__}: {str(exc)[:200]}",
                backend=self.name, operation=operation, key=key,
            ) from exc

    async def _run(self, operation: str, key: str | None, fn: Callable[..., T], *args: Any) -> T:
        # The thread never touches caller memory (see "Deadlines and buffer lifetime"), so
        # the caller may stop waiting for it: at the deadline, or when it gives up.
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(
            self._pool, abandonable(lambda: self._translated(operation, key, fn, *args))
        )
        try:
            return await until_abandoned(wait_for(job, self.request_timeout))
        except TimeoutError as exc:
            raise BackendTimeoutError(
                f"{operation} took longer than {self.request_timeout}s",
                backend=self.name, operation=operation, key=key,
            ) from exc

    # -- exists / stat ------------------------------------------------------------------------

    def _info(self, key: str) -> ObjectStat | None:
        try:
            info = self.fs.info(self._path(key))
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        mtime = info.get("mtime", info.get("LastModified", info.get("created")))
        if hasattr(mtime, "timestamp"):
            mtime = mtime.timestamp()
        return ObjectStat(key, int(info.get("size") or 0), float(mtime) if mtime is not None else None)

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        # docstring inherited
        return list(await asyncio.gather(*(self._run("stat", k, self._info, k) for k in keys)))

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        return [st is not None for st in await self._stat(keys)]

    # -- reads --------------------------------------------------------------------------------

    def _cat(self, key: str, rng: ByteRange | None) -> bytes | None:
        path = self._path(key)
        # ``start=0`` for a whole object: one GET on object stores (without a range, s3fs
        # first asks for the size, to split objects over its 50 MiB block size).
        start, end = (0, None) if rng is None else (rng.start, rng.end)
        try:
            try:
                return bytes(self.fs.cat_file(path, start=start, end=end))
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                if rng is None:  # an empty object has no byte 0 (HTTP 416): no range
                    return bytes(self.fs.cat_file(path))
                # s3fs and friends answer HTTP 416 with EINVAL: a range past the end.
                raise InvalidRangeError(
                    f"range [{rng.start}, {rng.end}) is not satisfiable",
                    backend=self.name, operation="get_into", key=key,
                ) from exc
        except FileNotFoundError:
            return None

    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: ReadRanges
    ) -> ReadCounts:
        # docstring inherited. One pool job per key, as the s3 backend does: the batch runs
        # ``max_concurrency`` requests at a time whatever the filesystem (a single batch call
        # such as ``cat_ranges`` is serial on sync filesystems, and one job for a whole batch
        # would also hold the whole batch to one ``request_timeout``).
        datas = await asyncio.gather(*(
            self._run("get_into", key, self._cat, key, rng)
            for key, rng in zip(keys, ranges, strict=True)
        ))
        results: ReadCounts = []
        for key, buf, rng, data in zip(keys, buffers, ranges, datas, strict=True):
            if data is None:
                results.append(None)
                continue
            wanted = rng.length if rng is not None else len(data)
            if rng is not None and len(data) != wanted:
                raise InvalidRangeError(
                    f"range [{rng.start}, {rng.end}) reaches past the end of the object",
                    backend=self.name, operation="get_into", key=key,
                )
            if len(data) > len(buf):
                raise InvalidRangeError(
                    f"object of {len(data)} bytes does not fit a {len(buf)}-byte buffer",
                    backend=self.name, operation="get_into", key=key,
                )
            buf[:wanted] = data
            results.append(wanted)
        return results

    # -- writes -------------------------------------------------------------------------------

    def _write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if self.atomic_write == "direct":
            self.fs.pipe_file(path, data)
            return
        # Hidden temp beside the object (same directory, so the rename stays on one device);
        # its name holds '.', which no key can, so listings never report it.
        temp = f"{self.root.rstrip('/')}/.{key}.{secrets.token_hex(6)}.tmp"
        try:
            self.fs.pipe_file(temp, data)
            self.fs.mv(temp, path)
        except BaseException:
            # Already gone or never written: the original failure is what matters.
            with contextlib.suppress(OSError):
                self.fs.rm_file(temp)
            raise

    def _write_batch(self, items: Sequence[tuple[str, bytes]]) -> None:
        for key, data in items:
            self._translated("put", key, self._write, key, data)

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        # docstring inherited. ``bytes(view)`` is the one copy fsspec needs (pipe takes bytes);
        # it is made here, during the call, so the caller's buffer is never kept.
        latest = {k: bytes(v) for k, v in zip(keys, buffers, strict=True)}
        await asyncio.gather(*(
            self._run("put", k, self._write_batch, [(k, data)]) for k, data in latest.items()
        ))

    # -- delete / list --------------------------------------------------------------------------

    def _delete_one(self, key: str) -> bool:
        path = self._path(key)
        try:
            self.fs.info(path)
        except FileNotFoundError:
            return False
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False  # removed by someone else between the two calls
        return True

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited. A key repeated in a batch is removed once: True, then False.
        unique = list(dict.fromkeys(keys))
        found = await asyncio.gather(*(self._run("delete", k, self._delete_one, k) for k in unique))
        return removed_once(keys, {k for k, hit in zip(unique, found, strict=True) if hit})

    def _ls(self) -> list[str]:
        try:
            self.fs.invalidate_cache(self.root)
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        finally:
            # Never let a cached listing answer a later ``info``: other writers exist.
            self.fs.invalidate_cache(self.root)
        keys = []
        for name in names:
            key = str(name).rstrip("/").rsplit("/", 1)[-1]
            try:
                keys.append(validate_storage_key(key))
            except InvalidKeyError:
                continue  # temp files and foreign files are never keys
        return keys

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        # docstring inherited
        for key in await self._run("list_prefix", None, self._ls):
            if key.startswith(prefix):
                yield key

    async def _close(self) -> None:
        # docstring inherited
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
