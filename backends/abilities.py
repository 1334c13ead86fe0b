"""The optional abilities of a backend (``Backend`` mixes them in): for each ability a
``Capabilities`` flag, a public accessor that refuses with ``NotSupportedError`` unless the flag
is declared, the private hooks a declaring backend overrides, and the small object the accessor
hands out (the protocols in ``backends.protocols``), which validates as the core's public methods
do before calling the hooks::

    host_buffers()    -> HostBuffers     _register_host_buffer, _unregister_host_buffer
    inline_exists()   -> InlineExists    _exists_now, _exists_blocking
    native_reads()    -> NativeReads     _get_into_summed, _start_get_into_summed
    native_writes()   -> NativeWrites    _start_put
    change_feed()     -> ChangeFeed      _change_feed
    capacity_usage()  -> CapacityUsage   _usage
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from .errors import NotSupportedError
from .lifetime import guarded
from .protocols import (
    CapacityUsage,
    ChangeFeed,
    HostBuffers,
    InlineExists,
    NativeReads,
    NativeWrites,
    PendingReads,
    PendingWrites,
    SummedReads,
    SumSpans,
)
from .views import as_byte_view

if TYPE_CHECKING:
    from .types import BackendStats, Capabilities
    from .views import BufferLike


class Abilities:
    """The optional-ability accessors and default hooks of ``Backend`` (module docstring)."""

    if TYPE_CHECKING:  # the part of the core they are written on (``Backend``'s own)
        name: ClassVar[str]
        capabilities: Capabilities

        stats: BackendStats

        @property
        def closed(self) -> bool: ...
        def _check_open(self, operation: str) -> None: ...
        def _check_keys(self, keys: Sequence[str], operation: str) -> list[str]: ...
        def _count_reads(self, results: Sequence[int | None]) -> None: ...
        def _summed_plan(
            self, keys: Sequence[str], buffers: Sequence[BufferLike], spans: SumSpans,
        ) -> tuple[list[str], list[memoryview], list[list[tuple[int, int]]]]: ...


    def host_buffers(self) -> HostBuffers:
        """Registration of host memory for zero-copy I/O (``HostBuffers``).
        ``NotSupportedError`` unless ``capabilities.host_buffers``."""
        self._require("host_buffers", self.capabilities.host_buffers)
        return _HostBuffers(self)

    def inline_exists(self) -> InlineExists:
        """``exists`` on the caller's own thread (``InlineExists``). ``NotSupportedError``
        unless ``capabilities.inline_exists``."""
        self._require("inline_exists", self.capabilities.inline_exists)
        return _InlineExists(self)

    def native_reads(self) -> NativeReads:
        """Reads checksummed in native code, startable without a thread (``NativeReads``).
        ``NotSupportedError`` unless ``capabilities.native_reads``."""
        self._require("native_reads", self.capabilities.native_reads)
        return _NativeReads(self)

    def native_writes(self) -> NativeWrites:
        """Puts startable from the caller's thread (``NativeWrites``). ``NotSupportedError``
        unless ``capabilities.native_writes``."""
        self._require("native_writes", self.capabilities.native_writes)
        return _NativeWrites(self)

    def _start_put(self, keys: list[str], views: list[memoryview], start_by: float,
                   counted: Callable[[], None]) -> PendingWrites:
        """With ``capabilities.native_writes``: ``_put`` started off the loop (validated;
        ``counted``: the ``PendingWrites``' statistics)."""
        raise NotSupportedError("native writes", backend=self.name, operation="put")

    async def _get_into_summed(
        self, keys: list[str], views: list[memoryview], spans: list[list[tuple[int, int]]]
    ) -> SummedReads:
        """With ``capabilities.native_reads``: whole-object reads that checksum ``spans`` of
        each view read (a non-empty, validated batch; the buffer lifetime rule applies)."""
        raise NotSupportedError("native reads", backend=self.name, operation="get_into")

    def _start_get_into_summed(
        self, keys: list[str], views: list[memoryview], spans: list[list[tuple[int, int]]]
    ) -> PendingReads:
        """With ``capabilities.native_reads``: ``_get_into_summed`` started in native code,
        without the event loop or a Python thread (a non-empty, validated batch)."""
        raise NotSupportedError("native reads", backend=self.name, operation="get_into")

    def _require(self, ability: str, declared: bool) -> None:
        self._check_open(ability)
        if not declared:
            raise NotSupportedError(f"{self.name} does not offer {ability} (capability not "
                                    "declared)", backend=self.name, operation=ability)

    async def _register_host_buffer(self, buffer: BufferLike) -> bool:
        """With ``capabilities.host_buffers``: register ``buffer``; True when I/O on it is now
        zero-copy (``HostBuffers.register``)."""
        raise NotSupportedError("host buffers", backend=self.name, operation="host_buffers")

    async def _unregister_host_buffer(self, buffer: BufferLike) -> None:
        """With ``capabilities.host_buffers``: undo ``_register_host_buffer``."""
        raise NotSupportedError("host buffers", backend=self.name, operation="host_buffers")

    def _exists_now(self, keys: list[str], max_age_s: float) -> list[bool] | None:
        """With ``capabilities.inline_exists``: ``InlineExists.now`` of validated keys."""
        return None

    def _exists_blocking(self, keys: list[str]) -> list[bool]:
        """With ``capabilities.inline_exists``: ``InlineExists.blocking`` of validated keys."""
        raise NotSupportedError("inline exists", backend=self.name, operation="exists")

    def change_feed(self) -> ChangeFeed:
        """The store's feed of every change of presence, whoever made it (``ChangeFeed``;
        follow it with ``backends.feed.FeedFollower``). ``NotSupportedError`` unless
        ``capabilities.change_feed``."""
        self._require("change_feed", self.capabilities.change_feed)
        return self._change_feed()

    def _change_feed(self) -> ChangeFeed:
        """With ``capabilities.change_feed``: the store's ``ChangeFeed``."""
        raise NotSupportedError("change feed", backend=self.name, operation="change_feed")

    def capacity_usage(self) -> CapacityUsage:
        """The enforced capacity and the bytes held and reserved (``CapacityUsage``).
        ``NotSupportedError`` unless ``capabilities.capacity_usage``."""
        self._require("capacity_usage", self.capabilities.capacity_usage)
        return _CapacityUsage(self)

    def _usage(self) -> tuple[int, int]:
        """With ``capabilities.capacity_usage``: ``CapacityUsage.usage``."""
        raise NotSupportedError("capacity usage", backend=self.name, operation="capacity_usage")


# -- the objects the capability accessors hand out (``backends.protocols``) -------------------


class _HostBuffers:
    """``HostBuffers`` over a backend's ``_register_host_buffer`` / ``_unregister_host_buffer``."""

    def __init__(self, backend: Abilities) -> None:
        self._backend = backend

    async def register(self, buffer: BufferLike) -> bool:
        self._backend._check_open("register_host_buffer")
        return bool(await self._backend._register_host_buffer(buffer))

    async def unregister(self, buffer: BufferLike) -> None:
        # (closed: the backend released its registrations with everything else)
        if not self._backend.closed:
            await self._backend._unregister_host_buffer(buffer)


class _CapacityUsage:
    """``CapacityUsage`` over a backend's ``_usage``."""

    def __init__(self, backend: Abilities) -> None:
        self._backend = backend

    def usage(self) -> tuple[int, int]:
        self._backend._check_open("capacity_usage")
        return self._backend._usage()


class _InlineExists:
    """``InlineExists`` over a backend's ``_exists_now`` / ``_exists_blocking``."""

    def __init__(self, backend: Abilities) -> None:
        self._backend = backend

    def now(self, keys: Sequence[str], max_age_s: float = 0.0) -> list[bool] | None:
        backend = self._backend
        if backend.closed:
            return None  # no answer at once: ``exists`` says what is wrong
        checked = backend._check_keys(keys, "exists")
        return backend._exists_now(checked, max_age_s) if checked else []

    def blocking(self, keys: Sequence[str]) -> list[bool]:
        backend = self._backend
        backend._check_open("exists")
        checked = backend._check_keys(keys, "exists")
        return backend._exists_blocking(checked) if checked else []


class _NativeReads:
    """``NativeReads`` over a backend's ``_get_into_summed`` / ``_start_get_into_summed``."""

    def __init__(self, backend: Abilities) -> None:
        self._backend = backend

    async def get_into_summed(
        self, keys: Sequence[str], buffers: Sequence[BufferLike], spans: SumSpans
    ) -> SummedReads:
        backend = self._backend
        checked, views, plans = backend._summed_plan(keys, buffers, spans)
        if not checked:
            return [], []
        results, sums = await guarded(backend._get_into_summed(checked, views, plans))
        backend._count_reads(results)
        return results, sums

    def start(
        self, keys: Sequence[str], buffers: Sequence[BufferLike], spans: SumSpans
    ) -> PendingReads:
        backend = self._backend
        checked, views, plans = backend._summed_plan(keys, buffers, spans)
        if not checked:
            return _NoReads(backend._count_reads)
        return backend._start_get_into_summed(checked, views, plans)


class _NativeWrites:
    """``NativeWrites`` over a backend's ``_start_put`` (checked as ``put`` checks)."""

    def __init__(self, backend: Abilities) -> None:
        self._backend = backend

    def start(self, keys: Sequence[str], buffers: Sequence[BufferLike], *,
              start_by: float) -> PendingWrites:
        backend = self._backend
        backend._check_open("put")
        checked = backend._check_keys(keys, "put")
        if len(buffers) != len(checked):
            raise ValueError(f"put: {len(checked)} keys but {len(buffers)} buffers")
        if not checked:
            raise ValueError("put: an empty batch has nothing to start")
        views = [as_byte_view(b, writable=False) for b in buffers]
        stats = backend.stats

        def counted() -> None:
            stats.writes += len(checked)
            stats.bytes_written += sum(len(v) for v in views)

        return backend._start_put(checked, views, start_by, counted)


class _NoReads(PendingReads):
    """The reads of an empty batch: done from the start."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def _result(self) -> SummedReads:
        return [], []


