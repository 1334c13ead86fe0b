"""The optional abilities of a backend: one ``Capabilities`` flag and one small protocol each.

A caller asks the flag, then the backend for the protocol; never ``getattr`` or a concrete
type::

    if backend.capabilities.host_buffers:
        zero_copy = await backend.host_buffers().register(pool)

===================  ==========================  ==============================================
flag                 accessor                    what it offers
===================  ==========================  ==============================================
``host_buffers``     ``host_buffers()``          register host memory the backend then reads
                                                 into and writes from without a copy
``inline_exists``    ``inline_exists()``         ``exists`` answered on the caller's own
                                                 thread, without the library's event loop
``native_reads``     ``native_reads()``          reads that checksum what they read, in native
                                                 code, started without a Python thread
``native_writes``    ``native_writes()``         puts started from the caller's thread without
                                                 the library's loop, found done by polling
``change_feed``      ``change_feed()``           every change of presence of every object,
                                                 whoever made it, numbered in order
                                                 (followed by ``backends.feed.FeedFollower``)
``capacity_usage``   ``capacity_usage()``        the capacity the backend enforces and the
                                                 bytes it holds and has reserved, cheaply
===================  ==========================  ==============================================

Without its flag an accessor raises ``NotSupportedError``. A backend that declares a flag
implements the matching core hooks (``backends.base``); the accessor's object validates keys
and buffers and refuses a closed backend, as the public methods do.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from .index import FeedChanges
    from .views import BufferLike

#: per key the bytes read (None: a miss) and the xxh3_64 of each span asked (empty for a miss
#: or an object shorter than a span's end).
SummedReads = tuple[list[int | None], list[tuple[int, ...]]]
#: per buffer the ``(offset, length)`` byte spans to checksum (``NativeReads``).
SumSpans = Sequence[Sequence[tuple[int, int]]]

_Outcome = TypeVar("_Outcome")


class HostBuffers(Protocol):
    """Host memory registered with the backend (``capabilities.host_buffers``): Mooncake's
    transfer engine, 3FS's USRBIO iovecs. The cache tier offers its host pool at start and
    takes it back at close; best effort either way."""

    async def register(self, buffer: BufferLike) -> bool:
        """Register ``buffer`` (C-contiguous, writable, alive until ``unregister``). True when
        I/O on any slice of it is now zero-copy; False when the backend accepted it but still
        copies through memory of its own (3FS: memory outside ``/dev/shm``). Raises the
        backend's error when it cannot register at all."""
        ...

    async def unregister(self, buffer: BufferLike) -> None:
        """Undo ``register`` (a buffer never registered: nothing). No call may be using it."""
        ...


class InlineExists(Protocol):
    """``exists`` on the caller's own thread (``capabilities.inline_exists``: the file
    backend's index), for callers on an engine's threads, where every hand-off to the
    library's loop waits for the GIL behind the engine's busy scheduler."""

    def now(self, keys: Sequence[str], max_age_s: float = 0.0) -> list[bool] | None:
        """``exists`` answered at once, or None when the backend cannot answer without
        waiting (I/O, or a lock another thread holds): then call ``blocking`` or ``exists``.
        ``max_age_s`` > 0 accepts an answer that may miss the changes of the last
        ``max_age_s`` seconds: for a caller to whom a stale answer costs only a miss
        (recompute) or a failed read (then a miss)."""
        ...

    def blocking(self, keys: Sequence[str]) -> list[bool]:
        """``exists``, exact, on the caller's thread, which may wait for the backend's local
        I/O. Never call it on an event loop's thread. Raises what ``exists`` raises."""
        ...


class NativeReads(Protocol):
    """Whole-object reads that also checksum byte spans of what they read, in native code
    that never takes the GIL (``capabilities.native_reads``: the file backend's C reads).
    For readers of checksummed objects (``objects.ObjectIO``): the hashing costs no pass over
    the bytes and no thread hand-off of its own."""

    async def get_into_summed(
        self, keys: Sequence[str], buffers: Sequence[BufferLike], spans: SumSpans
    ) -> SummedReads:
        """``get_into`` of whole objects, and the xxh3_64 of byte spans of each buffer read.

        ``spans[i]`` lists ``(offset, length)`` pairs inside ``buffers[i]`` (``ValueError``
        otherwise, before anything is read). Raises, and keeps the buffer lifetime rule, as
        ``get_into``."""
        ...

    def start(
        self, keys: Sequence[str], buffers: Sequence[BufferLike], spans: SumSpans
    ) -> PendingReads:
        """Start ``get_into_summed`` without the library's loop and without a Python thread.
        Its checks raise here, before anything is read. The buffers are written until
        ``done()`` is True, ``wait()`` or ``result()`` has returned, or the dropped handle has
        been collected (which waits for the reads). No deadline applies: for a caller that
        polls from a thread holding the GIL (vLLM's scheduler)."""
        ...


class _Pending(abc.ABC, Generic[_Outcome]):
    """Work under way whose outcome is taken once (``PendingReads``, ``PendingWrites``):
    ``result()`` waits for ``_result()``, hands a success to ``_took`` the first time, and
    returns or raises the same outcome on every call."""

    def __init__(self) -> None:
        self._outcome: tuple[_Outcome] | BaseException | None = None

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the work has ended (never waits)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Wait for the work to end."""

    @abc.abstractmethod
    def _result(self) -> _Outcome:
        """Wait, then the work's outcome (raising what it raised)."""

    @abc.abstractmethod
    def _took(self, outcome: _Outcome) -> None:
        """A success's outcome, when it is first taken (the backend's statistics)."""

    def result(self) -> _Outcome:
        if self._outcome is None:
            try:
                outcome = self._result()
                self._took(outcome)
                self._outcome = (outcome,)
            except BaseException as exc:
                self._outcome = exc
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome[0]


class PendingReads(_Pending[SummedReads]):
    """Reads under way in native code (``NativeReads.start``).

    ``done()`` never waits; ``wait()`` waits for the reads (the buffers are not written after
    it returns); ``result()`` waits, then returns the bytes read and sums per key, or raises
    what ``get_into_summed`` raises, the same each time it is called. ``counted`` is told the
    results once, when they are first taken (the backend's statistics). Dropping the handle
    waits for the reads before the buffers are let go."""

    def __init__(self, counted: Callable[[list[int | None]], None]) -> None:
        super().__init__()
        self._counted = counted

    def _took(self, outcome: SummedReads) -> None:
        self._counted(outcome[0])


class NativeWrites(Protocol):
    """``put`` started from the caller's own thread, without the library's event loop
    (``capabilities.native_writes``: the file backend reserves on the caller's thread, writes
    on a thread that never takes the GIL and settles when the outcome is taken, or hands the
    whole put to its pool as one job). For a caller that polls from a thread holding the GIL
    (vLLM's scheduler), where each hand-off to another Python thread waits for the GIL."""

    def start(self, keys: Sequence[str], buffers: Sequence[BufferLike], *,
              start_by: float) -> PendingWrites:
        """Start ``put(keys, buffers)``: each object all or nothing, as ``put``. Its checks
        raise here, before anything is written (and may a refused reservation: capacity, an
        index that cannot be reached). Not begun once ``time.monotonic()`` is past
        ``start_by`` (``result()`` then raises ``TimeoutError``; nothing reserved, nothing
        written). The buffers are read until
        ``done()`` is True or ``wait()`` / ``result()`` has returned."""
        ...


class PendingWrites(_Pending[None]):
    """A put under way (``NativeWrites.start``).

    ``done()`` never waits; ``wait()`` waits for the put to end (its buffers are not read after
    it returns); ``result()`` waits, then returns None or raises what ``put`` raises (or
    ``TimeoutError`` for a put never begun), the same each time; ``began`` and ``ended`` are
    the ``time.monotonic()`` at which the put began and ended (None: not yet). ``counted`` is told the
    bytes once, when a put that succeeded is first taken (the backend's statistics)."""

    def __init__(self, counted: Callable[[], None]) -> None:
        super().__init__()
        self._counted = counted
        self.began: float | None = None
        self.ended: float | None = None

    def _took(self, outcome: None) -> None:
        self._counted()


class ChangeFeed(Protocol):
    """The store's change feed (``capabilities.change_feed``: a store with an index that
    names every change, ``backends.index``). Calls block (a database or a network round trip):
    call them off an event loop.

    ``changes_after(seq, limit)``: the named changes after number ``seq`` (``FeedChanges``:
    ``(key, present)`` in order through ``upto``, and ``last``, the number of the last
    change); ``complete`` is False when the feed cannot name every one of them (pruned by a
    compaction, or numbered anew by a rebuilt index). ``listing()``: ``(last, keys)``, every
    key present as of change ``last``."""

    def changes_after(self, seq: int, limit: int = 64) -> FeedChanges: ...

    def listing(self) -> tuple[int, list[str]]: ...


class CapacityUsage(Protocol):
    """The bound a backend enforces and how full it is (``capabilities.capacity_usage``: a
    backend that evicts to keep ``capacity_bytes`` and counts what it holds: memory, the file
    backend with an index, S3 with ``capacity_bytes``). For writers that decide whether a
    write fits before making it (the vLLM routes' write admission): cheap enough to ask before
    each write (memory, an index's counters: one read, no listing), never exact against other
    writers racing it."""

    def usage(self) -> tuple[int, int]:
        """``(capacity, used)``: the bytes the backend keeps at most, and the bytes of the
        objects it holds plus those the puts in flight reserved (every process's where the
        store is shared); ``used`` may pass ``capacity`` only while a put in flight waits for
        its evictions. Raises the backend's error when its counters cannot be read."""
        ...


__all__ = ["CapacityUsage", "ChangeFeed", "HostBuffers", "InlineExists", "NativeReads", "NativeWrites",
           "PendingReads", "PendingWrites", "SummedReads"]
