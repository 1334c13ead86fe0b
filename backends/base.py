"""The async ``Backend`` ABC: a small core each backend implements, helpers written once on top.

Public API (what callers use; implemented here, once, for every backend)::

    exists(keys)                      -> list[bool]
    get_into(keys, buffers, ranges)   -> list[int | None]   bytes read, None = miss
    get_scatter(key, buffers, range)  -> int | None         one range into several buffers
    put(keys, buffers)                -> None
    delete(keys)                      -> list[bool]         False = was absent
    delete_until_held(groups)         -> DeletedUntilHeld   stops at the first held group
    stat(keys)                        -> list[ObjectStat | None]
    list_prefix(prefix)               -> async iterator of keys
    list_entries(prefix)              -> async iterator of ObjectStat (key, size, mtime)
    close()
    retain(keys, retention) / release(keys, owner) / retention_of(keys)   (``retention``)

    helpers: exists_prefix_length, exists_prefix_pages, get_ranges, put_if_absent, get_bytes,
             put_bytes
    exists_now(keys, max_age_s)       -> list[bool] | None  at once, or None (then exists)
    exists_blocking(keys)             -> list[bool] | None  on the caller's own thread, or None
    get_into_summed(keys, buffers, spans) -> (bytes read, xxh3_64 of each span) per key
    start_get_into_summed(...)        -> PendingReads (done / wait / result), or None

Core (what a backend implements; the public method has already validated everything):
``_exists``, ``_get_into``, ``_put``, ``_delete``, ``_stat``; optionally ``_list_prefix``,
``_list_entries``, ``_put_if_absent``, ``_get_scatter``, ``_get_into_summed``, ``_close``;
with ``capabilities.retention``, ``_retain``, ``_release``, ``_retention_of`` and
``_delete_until_held`` (its hold check and delete one atomic step).

Contracts every backend keeps (the conformance suite in ``hicache_store.testing`` checks them):

- **Keys** are validated against the storage-key grammar by the public methods *before* the
  core runs, so no invalid key ever reaches storage (no path traversal, no URL injection).
  An invalid key anywhere in a batch refuses the whole batch.
- **A miss is a result**: ``False`` / ``None``; exceptions mean something is broken.
- **Whole-object visibility**: no reader ever observes a partially written object (temp +
  rename, a single PUT, or the store's own atomic put). Writing the same key again is harmless:
  readers see the old or the new object, never a mix. Within a batch, each object is all or
  nothing on its own; when ``put`` raises, some objects of the batch may have been written and
  ``exists`` tells which.
- **Buffers belong to the caller.** ``put`` only reads its buffers during the call and never
  keeps them; ``get_into`` writes only bytes ``[0, n)`` of each buffer, where ``n`` is the
  returned count, and never keeps a reference after returning.
- **Buffer lifetime.** Once ``get_into`` / ``get_scatter`` returns, raises, times out or is
  cancelled, no byte is written into the caller's buffers any more; once ``put`` /
  ``put_if_absent`` ends the same way, they are not read any more. Callers (the cache tier)
  hand that memory to the next page the moment a call ends, so a late read landing there would
  serve another page's KV. Enforced here once for cancellation (``_guarded``): the public
  methods run the core in a task of its own and, when the caller is cancelled (an
  ``asyncio.wait_for`` deadline included), flag the call abandoned and return only once the
  core has ended, so I/O already running in a thread or a request finishes first (I/O not
  yet started is skipped: ``abandonable``). A cancelled call may therefore outlast the
  caller's deadline by the time the I/O in flight takes; each backend bounds that time (see
  its docstring). A backend whose core gives up early on a deadline of its own (a request
  timeout) must not leave I/O aimed at the caller's memory behind: it lands such I/O in
  memory of its own and copies out only while the caller still waits (``Handoff``), or waits
  for the I/O to end. The conformance suite checks every backend
  (``hicache_store.testing.lifetime``).
- **Ranges** are ``ByteRange`` (end exclusive). A range reaching past the object's end, or a
  buffer too small for the object or range, raises ``InvalidRangeError``; nothing is clamped.
- **Scatter reads** (``get_scatter``) fill several buffers, in order, from one contiguous range
  of one object (e.g. a framed object's header and payload, landing in separate memory), with
  the same range, miss and buffer rules as ``get_into``. The default issues one ranged read per
  buffer; a backend that can do it in one request (the file backend: one ``preadv``) overrides
  ``_get_scatter``.
- **Loops and threads**: a backend binds no event-loop object at construction, so it may be
  used from any loop (the sync bridge runs its own). Calls may overlap; backends synchronise
  what they share.
- **Errors** are translated once at the backend's edge into ``hicache_store.backends.errors``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import xxhash

from hicache_store.layout.errors import ConfigError, InvalidKeyError
from hicache_store.layout.keys import validate_storage_keys

from .errors import BackendClosedError, InvalidRangeError, NotSupportedError
from .prefix import DEFAULT_FANOUT, search_prefix
from .retention import Retention
from .types import (
    BackendStats,
    BackendURL,
    ByteRange,
    Capabilities,
    DeletedUntilHeld,
    ObjectStat,
    validate_prefix,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    from typing_extensions import Buffer, Self

    #: what callers may pass as a buffer: anything exporting the buffer protocol.
    BufferLike: TypeAlias = Buffer | np.ndarray[Any, Any]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: keys ``stat``-ed per call by the default ``_list_entries``.
LIST_STAT_BATCH = 1000

class _Call:
    """One buffer-touching call whose caller may give up (see ``Backend._guarded``).

    ``flag`` is read by worker threads (``abandonable``); ``waiters`` are the event-loop waits
    that give way at once when the caller gives up (``until_abandoned``).
    """

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.waiters: set[asyncio.Future[None]] = set()

    def abandon(self) -> None:
        self.flag.set()
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)


#: the call whose core runs in this context (``Backend._guarded``), if any.
_CURRENT_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "hicache_store_current_call", default=None
)


#: False inside ``reads_not_counted``: reads there are not uses (see that function).
_READS_ARE_USES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hicache_store_reads_are_uses", default=True
)


@contextlib.contextmanager
def reads_not_counted() -> Iterator[None]:
    """Reads made inside (by this task and the tasks it starts) are not *uses* of the objects.

    A backend that keeps a recency order or a last-use time (file: its eviction rank, which
    ``list_entries`` reports as ``mtime``) leaves both as they were for these reads. For operator
    tools that read every object's header (``gc``, ``inspect``): counted, one run would make the
    whole store look just used, so an age-based gc would age nothing out until long after and
    capacity eviction would lose its order. Backends check ``reads_are_uses()`` on the event
    loop (the context does not follow work handed to threads)."""
    token = _READS_ARE_USES.set(False)
    try:
        yield
    finally:
        _READS_ARE_USES.reset(token)


def reads_are_uses() -> bool:
    """Whether a read made now counts as a use (False inside ``reads_not_counted``)."""
    return _READS_ARE_USES.get()


class CallAbandoned(Exception):
    """Raised instead of starting I/O for a call whose caller already gave up.

    Only the core of an abandoned call sees it; the public method drops the core's outcome and
    raises ``CancelledError`` to its caller.
    """


def abandonable(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` wrapped for a worker thread: it raises ``CallAbandoned`` instead of running when
    the caller of the current call has given up by the time a thread picks it up.

    Call it on the event loop, in the core of a public read or write (it captures that call's
    flag from the context); outside one it returns ``fn`` itself. This is how a cancelled
    batch skips the I/O it has not started, while the public method waits for the I/O that
    has: a thread's ``preadv`` cannot be interrupted, only not started.
    """
    call = _CURRENT_CALL.get()
    if call is None:
        return fn
    flag = call.flag

    def job(*args: Any, **kwargs: Any) -> T:
        if flag.is_set():
            raise CallAbandoned
        return fn(*args, **kwargs)

    return job


async def until_abandoned(aw: Awaitable[T]) -> T:
    """Await ``aw``, unless the caller of the current call gives up first: then ``aw`` is
    cancelled and ``CallAbandoned`` raised at once.

    The public methods wait for a core to end after its caller gave up (``_guarded``); this is
    how a core says that a wait may end early because nothing aimed at the caller's buffers is
    in flight during it: injected latency, queueing, a request whose answer lands in memory of
    the backend's own and reaches the caller only through a ``Handoff``. Never around I/O into
    (or out of) caller memory. Outside a guarded call it is a plain ``await``.
    """
    call = _CURRENT_CALL.get()
    if call is None:
        return await aw
    task = asyncio.ensure_future(aw)
    if call.flag.is_set():
        task.cancel()
        await _outlast(task)
        raise CallAbandoned
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    call.waiters.add(gone)
    try:
        either: list[asyncio.Future[Any]] = [task, gone]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        await _outlast(task)
        raise
    finally:
        call.waiters.discard(gone)
    if not task.done():
        task.cancel()
        await _outlast(task)
        raise CallAbandoned
    return task.result()


async def gather_settled(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` that ends only when every awaitable has: results in order, or the
    first exception (by position) once all are done.

    Plain ``gather`` raises the first failure at once and leaves the others running: for reads
    into caller memory that would end a call while sibling I/O still writes (the buffer
    lifetime contract). Use it wherever a call fans out I/O that touches caller buffers.
    """
    outcomes = await asyncio.gather(*aws, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes  # type: ignore[return-value]  # no exception left: every item is a T


class Handoff:
    """Caller memory touched from a worker thread only while the caller still waits.

    For backends whose core gives up on a deadline of its own while a thread is still busy
    (a request that cannot be interrupted): the thread lands its I/O in memory of its own and
    copies between that memory and the caller's buffers only inside ``deliver``; the event
    loop calls ``close`` before raising. ``close`` waits for a copy already running (one
    ``memcpy``, never I/O), and every later ``deliver`` is refused, so nothing touches the
    caller's buffers after the call ended.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True

    def deliver(self, copy: Callable[[], None]) -> bool:
        """Run ``copy`` (a worker thread's copy to or from caller memory) unless the caller
        has gone; True when it ran."""
        with self._lock:
            if not self._open:
                return False
            copy()
            return True

    def close(self) -> None:
        """The caller stops waiting: wait for a copy in progress, refuse every later one."""
        with self._lock:
            self._open = False


async def _outlast(task: asyncio.Future[Any]) -> None:
    """Wait until ``task`` is done, through any number of cancellations of the waiter."""
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            continue  # cancelled again: the I/O is still running, keep waiting for it
    if not task.cancelled():
        task.exception()  # the caller gave up: its outcome is dropped (and marked retrieved)


def as_byte_view(buffer: BufferLike, *, writable: bool, what: str = "buffer") -> memoryview:
    """A flat byte view of a caller's buffer (no copy). Refuses non-contiguous memory."""
    view = memoryview(buffer)  # type: ignore[arg-type]  # ndarray exports the buffer protocol
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise ValueError(f"{what} is read-only; reads need writable memory")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def scatter_views(views: Sequence[memoryview], length: int) -> list[memoryview]:
    """The leading ``length`` bytes of ``views`` taken in order, as non-empty views.

    Later views are cut or dropped so the result covers exactly ``length`` bytes (raises
    ``ValueError`` when the views hold fewer). What a scatter read fills, and nothing more.
    """
    parts: list[memoryview] = []
    left = length
    for view in views:
        if left == 0:
            break
        take = min(left, len(view))
        if take:
            parts.append(view[:take])
            left -= take
    if left:
        raise ValueError(f"buffers hold {length - left} of the {length} bytes to scatter")
    return parts


def span_sums(view: memoryview, spans: Sequence[tuple[int, int]], n: int | None) -> tuple[int, ...]:
    """The xxh3_64 of each ``(offset, length)`` span of ``view``, of which ``n`` bytes were
    read: empty for a miss (``n`` None) or a span past ``n`` (``Backend.get_into_summed``)."""
    if n is None or any(off + length > n for off, length in spans):
        return ()
    return tuple(xxhash.xxh3_64_intdigest(view[off : off + length]) for off, length in spans)


def _is_buffer(obj: object) -> bool:
    """Whether ``obj`` itself exports the buffer protocol (a numpy array, an mmap...)."""
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


class PendingReads(abc.ABC):
    """A ``get_into_summed`` under way in native code (``Backend.start_get_into_summed``).

    ``done()`` never waits; ``wait()`` waits for the reads (the buffers are not written
    after it returns); ``result()`` waits, then returns the bytes read and sums per key, or
    raises what ``get_into_summed`` raises, the same each time it is called. Dropping the
    handle waits for the reads before the buffers are let go."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._outcome: tuple[list[int | None], list[tuple[int, ...]]] | BaseException | None = None

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether every read has ended (never waits)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Wait for every read to end."""

    @abc.abstractmethod
    def _result(self) -> tuple[list[int | None], list[tuple[int, ...]]]:
        """Wait, then the outcome of the reads (raising as ``get_into_summed``)."""

    def result(self) -> tuple[list[int | None], list[tuple[int, ...]]]:
        if self._outcome is None:
            try:
                self._outcome = self._result()
                self._backend._count_reads(self._outcome[0])
            except BaseException as exc:
                self._outcome = exc
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome


class Backend(abc.ABC):
    """An async key-value object store holding KV-cache objects. See the module docstring.

    Subclasses set ``name`` (the registry name) and ``capabilities``, call
    ``super().__init__()``, and implement the core methods. Build one with
    ``hicache_store.backends.open_backend(url, **options)``, which calls ``from_url``.
    Backends are async context managers (``async with open_backend(...) as store``).
    """

    name: ClassVar[str] = "backend"
    capabilities: Capabilities = Capabilities()
    #: True when opening may create the store's location (a directory). Such a backend takes
    #: the option ``create`` (default True); with ``create=False`` it creates nothing and
    #: raises ``NotFoundError`` when no store is there (what read-only tools open with).
    creates_location: ClassVar[bool] = False
    #: True when the backend takes the option ``read_only`` (default False): opened with
    #: ``read_only=True`` it writes nothing to the store, neither at open nor later (every
    #: write raises ``NotSupportedError``), so a tool that only reads works on a store whose
    #: filesystem is full (``inspect``, ``doctor``).
    opens_read_only: ClassVar[bool] = False

    def __init__(self) -> None:
        self.stats = BackendStats()
        self._closed = False

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> Self:
        """Build from a parsed URL plus options (URL query merged with keyword options).

        The default takes no location and passes the options as keyword arguments; backends
        that address something (a path, a bucket, a server) override this. Option values from
        a URL arrive as strings: overrides convert them (see ``types.parse_size``).
        """
        if url.location:
            raise ConfigError(f"the {cls.name} backend takes no location, got {url.location!r}")
        return cls(**options)

    # -- the core each backend implements -----------------------------------------------------

    @abc.abstractmethod
    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored. Keys are already validated."""

    @abc.abstractmethod
    async def _get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        ranges: Sequence[ByteRange | None],
    ) -> list[int | None]:
        """Read each object (or its range) into its buffer; return bytes read or None (miss).

        Buffers are writable flat byte views; for a range, ``len(buffer) >= range.length`` is
        already checked. A ``None`` range means the whole object: raise ``InvalidRangeError``
        if it does not fit the buffer. A range past the object's end raises
        ``InvalidRangeError``. Ranges only arrive here when ``capabilities.ranged_reads``.
        """

    @abc.abstractmethod
    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        """Store each buffer under its key, each object atomically visible. Keys validated;
        the buffers are read-only views the backend must not keep after returning."""

    @abc.abstractmethod
    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key; True when it was present."""

    @abc.abstractmethod
    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        """Size (and mtime when known) of each object, None for a miss."""

    def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Yield every stored key starting with ``prefix``, in any order, each once."""
        raise NotSupportedError(
            "this backend cannot list keys", backend=self.name, operation="list_prefix"
        )

    async def _list_entries(self, prefix: str) -> AsyncIterator[ObjectStat]:
        """Yield the ``ObjectStat`` of every stored key starting with ``prefix``, each once.

        This default lists keys and ``stat``-s them in batches of ``LIST_STAT_BATCH`` (memory
        bounded by one batch); a key removed between the two is skipped. Backends whose
        listing already carries sizes and times (S3, a directory walk) override it.
        """
        batch: list[str] = []
        async for key in self._list_prefix(prefix):
            batch.append(key)
            if len(batch) >= LIST_STAT_BATCH:
                for st in await self._stat(batch):
                    if st is not None:
                        yield st
                batch = []
        if batch:
            for st in await self._stat(batch):
                if st is not None:
                    yield st

    async def _put_if_absent(self, key: str, buffer: memoryview) -> bool:
        """Store unless present. This default checks, then writes: two racing callers may both
        return True; harmless, because equal keys carry equal bytes. Backends that can do it
        atomically override it and set ``capabilities.atomic_put``."""
        if (await self._exists([key]))[0]:
            return False
        await self._put([key], [buffer])
        return True

    async def _get_scatter(
        self, key: str, buffers: Sequence[memoryview], byte_range: ByteRange | None
    ) -> int | None:
        """Read ``byte_range`` of one object into ``buffers`` in order; bytes read or None.

        ``buffers`` are writable flat byte views that together cover exactly
        ``byte_range.length`` bytes (the public method trims them), none empty. A range past
        the object's end raises ``InvalidRangeError``. ``byte_range=None``: the whole object,
        its size returned; ``InvalidRangeError`` when it is larger than the buffers together.
        This default reads each buffer's sub-range in one ``_get_into`` batch (ranges emulated
        as ``get_into`` does when the backend has no ranged reads), a whole object into
        several buffers through one buffer of its own and a copy; backends that can read it
        all in one request override it. A concurrent rewrite of the key may then be seen part
        old, part new: callers verify what they read (framed objects carry checksums), as for
        two ``get_into`` ranges.
        """
        if byte_range is None:
            return await self._whole_scatter(key, buffers)
        ranges: list[ByteRange | None] = []
        offset = byte_range.start
        for view in buffers:
            ranges.append(ByteRange(offset, offset + len(view)))
            offset += len(view)
        got = await self._fetch_into([key] * len(buffers), list(buffers), ranges)
        return None if any(n is None for n in got) else byte_range.length

    async def _whole_scatter(self, key: str, buffers: Sequence[memoryview]) -> int | None:
        # Only the whole-object read sees the stored size, so it lands in one buffer: the
        # caller's own when there is one, else a buffer of this call's, copied out after.
        if len(buffers) == 1:
            (n,) = await self._fetch_into([key], [buffers[0]], [None])
            return n
        whole = bytearray(sum(len(view) for view in buffers))
        (n,) = await self._fetch_into([key], [memoryview(whole)], [None])
        if n is not None:
            offset = 0
            for part in scatter_views(buffers, n):
                part[:] = whole[offset : offset + len(part)]
                offset += len(part)
        return n

    async def _close(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Release resources. Called once."""

    # -- public API: validation here, once --------------------------------------------------

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise BackendClosedError(backend=self.name, operation=operation)

    def _check_keys(self, keys: Sequence[str], operation: str) -> list[str]:
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"{operation}: keys must be a sequence of str, not a single string")
        try:
            return validate_storage_keys(keys)
        except InvalidKeyError as exc:
            exc.backend, exc.operation = self.name, operation
            raise

    async def _guarded(self, core: Coroutine[Any, Any, T]) -> T:
        """Run the core of a call that touches caller buffers; the call ends when the core has.

        The core runs as a task of its own, shielded from the caller's cancellation. When the
        caller is cancelled (or its ``wait_for`` deadline passes), the call is flagged
        abandoned, then this waits for the core to end before re-raising ``CancelledError``:
        no I/O of the call is left running against the caller's buffers. An abandoned core
        skips what it has not started (``abandonable`` thread jobs) and its waits that touch
        no caller memory end at once (``until_abandoned``), so the wait is only for I/O
        already in flight. Nested calls (a wrapper backend forwarding to another) share the
        outermost call.
        """
        call = _CURRENT_CALL.get() or _Call()
        token = _CURRENT_CALL.set(call)
        try:
            task = asyncio.ensure_future(core)  # the task copies the context: it sees ``call``
        finally:
            _CURRENT_CALL.reset(token)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            call.abandon()
            await _outlast(task)
            raise

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a miss is False)."""
        self._check_open("exists")
        checked = self._check_keys(keys, "exists")
        return await self._exists(checked) if checked else []

    def exists_now(self, keys: Sequence[str], max_age_s: float = 0.0) -> list[bool] | None:
        """``exists`` answered at once on the caller's thread, or None when this backend
        cannot answer without waiting (I/O, or a lock another thread holds): then call
        ``exists``. For callers that must not block but gain from an answer now (a
        scheduler deciding whether a request waits a step for its lookup). ``max_age_s`` > 0
        accepts an answer that may miss the changes of the last ``max_age_s`` seconds (the
        file backend's in-memory index as last brought up to date, with no database call
        at all): for a caller to whom a stale answer costs only a miss (recompute) or a
        failed read (then a miss). The default answers None."""
        return None

    def exists_blocking(self, keys: Sequence[str]) -> list[bool] | None:
        """``exists`` answered on the caller's thread, which may wait for this backend's local
        I/O (an index on the local disk), or None when this backend cannot answer without its
        event loop: then call ``exists``. For a thread of the caller's own that may block but
        should not hand each check to the library's loop and back (vLLM's lookup thread,
        where every hand-off waits for the GIL behind the engine's busy scheduler loop).
        Never call it on an event loop's thread. Raises what ``exists`` raises (a closed
        backend, an invalid key). The default answers None."""
        return None

    async def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[BufferLike],
        ranges: Sequence[ByteRange | None] | None = None,
    ) -> list[int | None]:
        """Read objects (or byte ranges of them) into caller-owned buffers.

        Returns, per key, the number of bytes written at the start of its buffer (the object
        size, or the range length), or None for a miss. Raises ``InvalidRangeError`` when a
        range reaches past its object or a buffer is too small. The buffers stay the caller's:
        nothing is kept after the call, and nothing is written into them once it has returned,
        raised or been cancelled (a cancelled call ends when its I/O in flight has ended; see
        "Buffer lifetime" in the module docstring). Zero-copy when
        ``capabilities.zero_copy_reads``.
        """
        self._check_open("get_into")
        checked = self._check_keys(keys, "get_into")
        if len(buffers) != len(checked):
            raise ValueError(f"get_into: {len(checked)} keys but {len(buffers)} buffers")
        if ranges is None:
            ranges = [None] * len(checked)
        elif len(ranges) != len(checked):
            raise ValueError(f"get_into: {len(checked)} keys but {len(ranges)} ranges")
        views = [as_byte_view(b, writable=True) for b in buffers]
        for key, view, rng in zip(checked, views, ranges, strict=True):
            if rng is None:
                continue
            if not isinstance(rng, ByteRange):
                raise TypeError(f"get_into: ranges must be ByteRange or None, got {rng!r}")
            if len(view) < rng.length:
                raise InvalidRangeError(
                    f"buffer of {len(view)} bytes is smaller than range [{rng.start}, {rng.end})",
                    backend=self.name, operation="get_into", key=key,
                )
        if not checked:
            return []
        results = await self._guarded(self._fetch_into(checked, views, list(ranges)))
        self._count_reads(results)
        return results

    async def get_scatter(
        self, key: str, buffers: Sequence[BufferLike], byte_range: ByteRange | None
    ) -> int | None:
        """Read bytes ``byte_range`` of one object into several buffers, filling them in order.

        Returns the number of bytes read (``byte_range.length``) or None for a miss. The first
        buffer receives the first bytes of the range, the next one continues where it ends,
        and so on; bytes past the range's length are not written (a last buffer may be partly
        filled, later ones untouched). Raises ``InvalidRangeError`` when the range reaches past
        the object's end or the buffers together are smaller than the range, ``ValueError``
        for a read-only buffer, ``TypeError`` for a single buffer instead of a sequence.
        ``byte_range=None`` reads the whole object, as ``get_into`` without a range: returns
        its size, ``InvalidRangeError`` when it is larger than the buffers together. That is
        the read that sees the stored size (a reader that knows an object's exact size checks
        the result: bytes appended to an object are corruption a range cannot see).
        On a miss the buffers hold no bytes of the object, unless it vanished during the
        read (then they may hold some: a None result means "do not use the buffers").
        Typical use: a framed object's header into one buffer and its payload straight into
        its destination, in one request where the backend can (``_get_scatter``).
        """
        self._check_open("get_scatter")
        (checked,) = self._check_keys([key], "get_scatter")
        if isinstance(buffers, str) or _is_buffer(buffers):
            raise TypeError("get_scatter: buffers must be a sequence of buffers, not one buffer")
        if byte_range is not None and not isinstance(byte_range, ByteRange):
            raise TypeError(f"get_scatter: byte_range must be a ByteRange or None, got {byte_range!r}")
        views = [as_byte_view(b, writable=True) for b in buffers]
        capacity = sum(len(v) for v in views)
        if byte_range is None:
            if capacity == 0:
                raise InvalidRangeError("get_scatter: no buffer to read into", backend=self.name,
                                        operation="get_scatter", key=checked)
            parts = [v for v in views if len(v)]
        elif capacity < byte_range.length:
            raise InvalidRangeError(
                f"buffers of {capacity} bytes in all are smaller than range "
                f"[{byte_range.start}, {byte_range.end})",
                backend=self.name,
                operation="get_scatter",
                key=checked,
            )
        else:
            parts = scatter_views(views, byte_range.length)
        n = await self._guarded(self._get_scatter(checked, parts, byte_range))
        self.stats.reads += 1
        if n is not None:
            self.stats.read_hits += 1
            self.stats.bytes_read += n
        return n

    async def _fetch_into(
        self, keys: list[str], views: list[memoryview], ranges: list[ByteRange | None]
    ) -> list[int | None]:
        # Native ranges where the backend has them, else emulated on whole-object reads.
        if self.capabilities.ranged_reads or all(r is None for r in ranges):
            return await self._get_into(keys, views, ranges)
        return await self._emulated_ranges(keys, views, ranges)

    async def _emulated_ranges(
        self, keys: list[str], views: list[memoryview], ranges: list[ByteRange | None]
    ) -> list[int | None]:
        # Whole-object reads into scratch memory, then a copy of the range: correct for any
        # backend, but not zero-copy (hence the ``ranged_reads`` flag).
        stats = await self._stat(keys)
        scratch_views: list[memoryview] = []
        for key, view, rng, st in zip(keys, views, ranges, stats, strict=True):
            if rng is None or st is None:
                scratch_views.append(view)
            else:
                rng.check_within(st.size, backend=self.name, key=key)
                scratch_views.append(memoryview(bytearray(st.size)))
        got = await self._get_into(keys, scratch_views, [None] * len(keys))
        results: list[int | None] = []
        for key, view, rng, scratch, n in zip(keys, views, ranges, scratch_views, got, strict=True):
            if rng is None or n is None:
                results.append(n)
                continue
            # The object may have been replaced between stat and read: check again.
            rng.check_within(n, backend=self.name, key=key)
            view[: rng.length] = scratch[rng.start : rng.end]
            results.append(rng.length)
        return results

    #: whether ``get_into_summed`` hashes inside the read itself (the file backend's C reads),
    #: with no pass over the bytes and no thread hand-off of its own: then a reader of
    #: checksummed objects should prefer it to ``get_into`` followed by its own hashing.
    @property
    def sums_reads(self) -> bool:
        return False

    async def get_into_summed(
        self,
        keys: Sequence[str],
        buffers: Sequence[BufferLike],
        spans: Sequence[Sequence[tuple[int, int]]],
    ) -> tuple[list[int | None], list[tuple[int, ...]]]:
        """``get_into`` of whole objects, and the xxh3_64 of byte spans of each buffer read.

        ``spans[i]`` lists ``(offset, length)`` pairs inside ``buffers[i]`` (``ValueError``
        otherwise, before anything is read). Returns per key the bytes read (None: a miss),
        and per key the checksums of its spans in order: empty for a miss, or when the object
        is shorter than a span's end. Raises, and keeps the buffer lifetime rule, as
        ``get_into``. For readers that verify checksummed objects (``objects.ObjectIO``):
        where ``sums_reads`` is True the hashing costs no pass and no hand-off of its own.
        """
        checked, views, plans = self._summed_plan(keys, buffers, spans)
        if not checked:
            return [], []
        results, sums = await self._guarded(self._get_into_summed(checked, views, plans))
        self._count_reads(results)
        return results, sums

    def start_get_into_summed(
        self,
        keys: Sequence[str],
        buffers: Sequence[BufferLike],
        spans: Sequence[Sequence[tuple[int, int]]],
    ) -> PendingReads | None:
        """Start ``get_into_summed`` without the library's loop and without a Python thread
        (the reads run in native code that never takes the GIL), or return None, having read
        nothing, where this backend cannot (then call ``get_into_summed``). The handle's
        ``done()`` answers at once, ``result()`` waits for the reads and returns or raises what
        ``get_into_summed`` would (its checks, raised here before anything is read, too). The
        buffers are written until ``done()`` is True, ``wait()`` or ``result()`` has returned,
        or the dropped handle has been collected (which waits for the reads). No deadline
        applies: for a caller that polls from a thread holding the GIL (vLLM's scheduler: a
        load job of a few local objects found done with no thread hand-off). Statistics count
        the reads when the result is taken."""
        checked, views, plans = self._summed_plan(keys, buffers, spans)
        return self._start_get_into_summed(checked, views, plans) if checked else None

    def _summed_plan(
        self,
        keys: Sequence[str],
        buffers: Sequence[BufferLike],
        spans: Sequence[Sequence[tuple[int, int]]],
    ) -> tuple[list[str], list[memoryview], list[list[tuple[int, int]]]]:
        """The checked keys, byte views and spans of a ``get_into_summed`` call."""
        self._check_open("get_into")
        checked = self._check_keys(keys, "get_into")
        if not len(buffers) == len(spans) == len(checked):
            raise ValueError(f"get_into_summed: {len(checked)} keys, {len(buffers)} buffers "
                             f"and {len(spans)} span lists")
        views = [as_byte_view(b, writable=True) for b in buffers]
        plans = [[(int(off), int(n)) for off, n in item] for item in spans]
        for view, plan in zip(views, plans, strict=True):
            for off, length in plan:
                if off < 0 or length < 0 or off + length > len(view):
                    raise ValueError(f"get_into_summed: span ({off}, {length}) outside a buffer "
                                     f"of {len(view)} bytes")
        return checked, views, plans

    def _count_reads(self, results: Sequence[int | None]) -> None:
        self.stats.reads += len(results)
        for n in results:
            if n is not None:
                self.stats.read_hits += 1
                self.stats.bytes_read += n

    async def _get_into_summed(
        self, keys: list[str], views: list[memoryview], spans: list[list[tuple[int, int]]]
    ) -> tuple[list[int | None], list[tuple[int, ...]]]:
        """Whole-object reads (``_fetch_into``), then each span hashed here; backends that can
        hash inside their reads override this (``sums_reads``)."""
        results = await self._fetch_into(keys, views, [None] * len(keys))
        sums = [span_sums(view, plan, n) for view, plan, n in zip(views, spans, results, strict=True)]
        return results, sums

    def _start_get_into_summed(
        self, keys: list[str], views: list[memoryview], spans: list[list[tuple[int, int]]]
    ) -> PendingReads | None:
        """The core of ``start_get_into_summed`` (a non-empty batch): None unless overridden."""
        return None

    async def put(self, keys: Sequence[str], buffers: Sequence[BufferLike]) -> None:
        """Store each buffer under its key; each object becomes visible all at once.

        Rewriting a key replaces it atomically. On failure the error is raised and each object
        of the batch is either fully written or absent. Buffers are read during the call only
        (a cancelled call ends when its I/O in flight has ended).
        """
        self._check_open("put")
        checked = self._check_keys(keys, "put")
        if len(buffers) != len(checked):
            raise ValueError(f"put: {len(checked)} keys but {len(buffers)} buffers")
        views = [as_byte_view(b, writable=False) for b in buffers]
        if not checked:
            return
        await self._guarded(self._put(checked, views))
        self.stats.writes += len(checked)
        self.stats.bytes_written += sum(len(v) for v in views)

    async def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key; True when it was present, False for a miss."""
        self._check_open("delete")
        checked = self._check_keys(keys, "delete")
        if not checked:
            return []
        removed = await self._delete(checked)
        self.stats.deletes += sum(removed)
        return removed

    async def delete_until_held(self, groups: Sequence[Sequence[str]]) -> DeletedUntilHeld:
        """Delete ``groups`` of keys in order, each group whole, up to the first group with a
        key that a retention entry holds (``backends.retention``: a pin or a retention that
        holds now); that group and every later one are left as they are.

        The hold check and the delete are one atomic step against ``retain``: an entry that
        exists when the step runs keeps its object, and a ``retain`` after it finds the object
        gone (a hold is on an object, never on a name). So a caller that deletes what it
        planned earlier (gc) never deletes what was pinned meanwhile; one that orders each
        chain's groups children first (gc does) stops before the ancestors of a held group.
        Without ``capabilities.retention`` nothing is held and every group is deleted. Errors
        are ``delete``'s (what could not be deleted stays, the first error is raised); an
        empty group is a ``ValueError``.
        """
        self._check_open("delete_until_held")
        checked = [self._check_keys(group, "delete_until_held") for group in groups]
        if any(not group for group in checked):
            raise ValueError("delete_until_held: every group needs at least one key")
        if not checked:
            return DeletedUntilHeld(0, ())
        if self.capabilities.retention:
            done = await self._delete_until_held(checked)
        else:
            removed = await self._delete([key for group in checked for key in group])
            done = DeletedUntilHeld(len(checked), tuple(removed))
        self.stats.deletes += sum(done.removed)
        return done

    async def stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        """Size and mtime of each object; None for a miss."""
        self._check_open("stat")
        checked = self._check_keys(keys, "stat")
        return await self._stat(checked) if checked else []

    async def list_prefix(self, prefix: str = "") -> AsyncIterator[str]:
        """Yield every stored key that starts with ``prefix`` (any order, each key once).

        Raises ``NotSupportedError`` unless ``capabilities.listing``. Keys written or deleted
        while the listing runs may or may not appear.
        """
        self._check_open("list_prefix")
        validate_prefix(prefix)
        async for key in self._list_prefix(prefix):
            yield key

    async def list_entries(self, prefix: str = "") -> AsyncIterator[ObjectStat]:
        """Yield ``ObjectStat(key, size, mtime)`` for every stored key starting with ``prefix``.

        What operator tools stream (``hicache-store inspect`` / ``gc``): memory stays bounded
        whatever the store's size. ``mtime`` is None where the backend does not know it. Any
        order, each key once; keys written or deleted meanwhile may or may not appear. Raises
        ``NotSupportedError`` unless ``capabilities.listing``.
        """
        self._check_open("list_entries")
        validate_prefix(prefix)
        async for st in self._list_entries(prefix):
            yield st

    async def retain(self, keys: Sequence[str], retention: Retention) -> None:
        """Hold each stored key of ``keys`` as ``retention`` says (see ``backends.retention``).

        Replaces ``retention.owner``'s own entry on each key, beside other owners' entries.
        Keys not stored are ignored (``retention_of`` reports ``()`` for them): a hold is on
        an object, never on a name. A pin past the pin budget raises ``PinBudgetError`` and
        applies nothing. ``NotSupportedError`` unless ``capabilities.retention``.
        """
        self._check_open("retain")
        keys = self._check_keys(keys, "retain")
        if not isinstance(retention, Retention):
            raise TypeError(f"retain: retention must be a Retention, not {type(retention)!r}")
        self._check_retention("retain")
        await self._retain(keys, retention)

    async def release(self, keys: Sequence[str], owner: str) -> None:
        """Drop ``owner``'s entry on each key (others' entries stay; absent ones: nothing)."""
        self._check_open("release")
        keys = self._check_keys(keys, "release")
        self._check_retention("release")
        await self._release(keys, owner)

    async def retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        """The entries holding on each key now, ordered by owner (``()``: none, or absent)."""
        self._check_open("retention_of")
        keys = self._check_keys(keys, "retention_of")
        self._check_retention("retention_of")
        return await self._retention_of(keys)

    def _check_retention(self, operation: str) -> None:
        if not self.capabilities.retention:
            raise NotSupportedError(
                f"{self.name} does not support retention (capability not declared)",
                backend=self.name, operation=operation,
            )

    async def _retain(self, keys: Sequence[str], retention: Retention) -> None:
        raise NotSupportedError("retain", backend=self.name, operation="retain")

    async def _release(self, keys: Sequence[str], owner: str) -> None:
        raise NotSupportedError("release", backend=self.name, operation="release")

    async def _retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        raise NotSupportedError("retention_of", backend=self.name, operation="retention_of")

    async def _delete_until_held(self, groups: list[list[str]]) -> DeletedUntilHeld:
        """The core of ``delete_until_held`` for a backend that declares retention: check and
        delete in one step that no ``retain`` can come between."""
        raise NotSupportedError(
            f"{self.name} declares retention but has no atomic delete_until_held",
            backend=self.name, operation="delete_until_held")

    async def close(self) -> None:
        """Release resources. Idempotent; every other call afterwards raises
        ``BackendClosedError``."""
        if self._closed:
            return
        self._closed = True
        await self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- helpers, written once ----------------------------------------------------------------

    async def exists_prefix_length(self, keys: Sequence[str], *, chunk: int = 1024) -> int:
        """How many keys from the start exist consecutively (what engines' ``batch_exists``
        returns). Probes ``chunk`` keys at a time and stops at the first miss."""
        self._check_open("exists")
        checked = self._check_keys(keys, "exists")
        count = 0
        for start in range(0, len(checked), max(1, chunk)):
            hits = await self._exists(checked[start : start + chunk])
            for hit in hits:
                if not hit:
                    return count
                count += 1
        return count

    async def exists_prefix_pages(
        self,
        count: int,
        keys_of: Callable[[int], Sequence[str]],
        *,
        ordered: bool = True,
        fanout: int = DEFAULT_FANOUT,
    ) -> int:
        """How many leading pages of ``count`` have every one of their keys stored.

        ``keys_of(i)`` gives the keys page ``i`` needs; it is called only for the pages
        probed. With ``ordered`` (the store is written parent-first and evicted tails-first,
        as this library does), the boundary is searched for in O(log count) round trips of
        at most ``fanout`` pages each, then verified; otherwise pages are probed in order
        and the probe stops at the first missing one. The search, its cost and its exact
        guarantee are in ``hicache_store.backends.prefix``. One ``exists`` call per round trip.
        """
        self._check_open("exists")

        async def probe(pages: Sequence[int]) -> list[bool]:
            groups = [self._check_keys(keys_of(page), "exists") for page in pages]
            flat = [key for group in groups for key in group]
            hits = await self._exists(flat) if flat else []
            ends = list(itertools.accumulate(len(group) for group in groups))
            return [all(hits[end - len(group) : end]) for group, end in zip(groups, ends, strict=True)]

        return await search_prefix(count, probe, ordered=ordered, fanout=fanout)

    async def get_ranges(
        self,
        key: str,
        ranges: Sequence[ByteRange],
        *,
        coalesce_bytes: int = 1 << 20,
        max_concurrency: int = 8,
    ) -> list[memoryview] | None:
        """Fetch several ranges of one object; None on a miss.

        Ranges less than ``coalesce_bytes`` apart are merged into one read, and at most
        ``max_concurrency`` merged reads run at once. Returns one read-only view per range, in
        the order given (views may share memory with each other).
        """
        if not ranges:
            return [] if (await self.exists([key]))[0] else None
        order = sorted(range(len(ranges)), key=lambda i: ranges[i].start)
        groups: list[tuple[ByteRange, list[int]]] = []
        for i in order:
            rng = ranges[i]
            if groups and rng.start <= groups[-1][0].end + coalesce_bytes:
                merged, members = groups[-1]
                groups[-1] = (ByteRange(merged.start, max(merged.end, rng.end)), [*members, i])
            else:
                groups.append((rng, [i]))
        limit = asyncio.Semaphore(max(1, max_concurrency))

        async def fetch(rng: ByteRange) -> memoryview | None:
            async with limit:
                buf = bytearray(rng.length)
                got = await self.get_into([key], [buf], [rng])
                return memoryview(buf).toreadonly() if got[0] is not None else None

        datas = await asyncio.gather(*(fetch(rng) for rng, _ in groups))
        out: list[memoryview | None] = [None] * len(ranges)
        for (merged, members), data in zip(groups, datas, strict=True):
            if data is None:
                return None
            for i in members:
                rng = ranges[i]
                out[i] = data[rng.start - merged.start : rng.end - merged.start]
        return [view for view in out if view is not None]

    async def put_if_absent(self, key: str, buffer: BufferLike) -> bool:
        """Store unless the key exists; True when this call wrote it.

        Atomic (exactly one racing caller wins) when ``capabilities.atomic_put``; otherwise
        two racing callers may both write, which is harmless for content-addressed keys.
        """
        self._check_open("put_if_absent")
        (checked,) = self._check_keys([key], "put_if_absent")
        view = as_byte_view(buffer, writable=False)
        wrote = await self._guarded(self._put_if_absent(checked, view))
        if wrote:
            self.stats.writes += 1
            self.stats.bytes_written += len(view)
        return wrote

    async def get_bytes(self, key: str, byte_range: ByteRange | None = None) -> bytes | None:
        """A whole object (or range) as new ``bytes``; None on a miss. For small objects and
        tools: it costs a ``stat`` and a copy. Hot paths use ``get_into``."""
        if byte_range is not None:
            buf = bytearray(byte_range.length)
            got = await self.get_into([key], [buf], [byte_range])
            return bytes(buf) if got[0] is not None else None
        for _attempt in range(3):
            (st,) = await self.stat([key])
            if st is None:
                return None
            buf = bytearray(st.size)
            try:
                (n,) = await self.get_into([key], [buf])
            except InvalidRangeError:
                continue  # replaced by a larger object between stat and read: try again
            return None if n is None else bytes(buf[:n])
        return None

    async def put_bytes(self, key: str, data: BufferLike) -> None:
        """Store one object (a one-key ``put``)."""
        await self.put([key], [data])
