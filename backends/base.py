"""The async ``Backend`` ABC: the contract every backend keeps, a small core it implements.

Public API (validated here, once, for every backend)::

    exists(keys)                      -> list[bool]
    get_into(keys, buffers, ranges)   -> list[int | None]   bytes read, None = miss
    get_scatter(key, buffers, range)  -> int | None         one range into several buffers
    put(keys, buffers)                -> None
    put_if_absent(key, buffer)        -> bool               True = this call wrote it
    delete(keys)                      -> list[bool]         False = was absent
    delete_until_held(groups)         -> DeletedUntilHeld   stops at the first held group
    stat(keys)                        -> list[ObjectStat | None]
    list_prefix(prefix)               -> async iterator of keys
    list_entries(prefix)              -> async iterator of ObjectStat (key, size, mtime)
    close()
    retain(keys, retention) / release(keys, owner) / retention_of(keys)   (``retention``)

    helpers (``backends.helpers``, written once on the core): exists_prefix_length,
    exists_prefix_pages, get_ranges, get_bytes
    optional abilities (``backends.abilities``; protocols in ``backends.protocols``: a flag and
    an accessor each):
    host_buffers(), inline_exists(), native_reads(), native_writes(), change_feed(),
    capacity_usage()

Core (what a backend implements; the public method has already validated everything):
``_exists``, ``_get_into``, ``_put``, ``_delete``, ``_stat``; optionally ``_list_prefix``,
``_list_entries``, ``_put_if_absent``, ``_get_scatter``, ``_close``; with
``capabilities.retention``, ``_retain``, ``_release``, ``_retention_of`` and
``_delete_until_held`` (its hold check and delete one atomic step); with
``capabilities.host_buffers``, ``_register_host_buffer`` and ``_unregister_host_buffer``; with
``capabilities.inline_exists``, ``_exists_now`` and ``_exists_blocking``; with
``capabilities.native_reads``, ``_get_into_summed`` and ``_start_get_into_summed``; with
``capabilities.native_writes``, ``_start_put``; with
``capabilities.change_feed``, ``_change_feed``; with ``capabilities.capacity_usage``, ``_usage``.

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
  ``put_if_absent`` ends the same way, they are not read any more. Kept here once, for every
  backend, by the machinery of ``backends.lifetime`` (its docstring says how, and what a
  backend whose core gives up early on a deadline of its own must do). The conformance suite
  checks every backend (``hicache_store.testing.lifetime``).
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
import contextlib
import contextvars
from collections.abc import AsyncIterator, Iterator, Sequence, Set
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from hicache_store.layout.errors import ConfigError, InvalidKeyError
from hicache_store.layout.keys import validate_storage_keys

from .abilities import Abilities
from .errors import BackendClosedError, InvalidRangeError, NotSupportedError
from .helpers import Helpers

# The lifetime machinery and the buffer views, re-exported where backends long found them.
from .lifetime import (
    CallAbandoned,
    Handoff,
    abandonable,
    gather_settled,
    guarded,
    outlast,
    until_abandoned,
)
from .protocols import (
    PendingReads,
    SumSpans,
)
from .retention import Retention
from .types import (
    BackendStats,
    BackendURL,
    ByteRange,
    Capabilities,
    DeletedUntilHeld,
    ObjectStat,
    ReadCounts,
    ReadRanges,
    validate_prefix,
)
from .views import as_byte_view, is_buffer, scatter_views

if TYPE_CHECKING:
    from typing_extensions import Self

    from ._file_site import RootSite
    from .index import IndexCheck
    from .views import BufferLike

T = TypeVar("T")

#: keys ``stat``-ed per call by the default ``_list_entries``.
LIST_STAT_BATCH = 1000

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


def removed_once(keys: Sequence[str], removed: Set[str]) -> list[bool]:
    """``_delete``'s answer for a batch whose keys in ``removed`` were removed: a key repeated
    in the batch was removed once, so True for its first place and False for the others."""
    seen: set[str] = set()
    out = []
    for key in keys:
        out.append(key in removed and key not in seen)
        seen.add(key)
    return out


class Backend(Helpers, Abilities, abc.ABC):
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

    @classmethod
    def root_site(cls, url: BackendURL) -> RootSite | None:
        """Where the store at ``url`` keeps its objects on this host, read without opening it
        (nothing created or claimed): its filesystem, its index and the host recorded, for
        ``hicache-store doctor``. None for a backend that keeps no root on a filesystem."""
        return None

    # -- the core each backend implements -----------------------------------------------------

    @abc.abstractmethod
    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored. Keys are already validated."""

    @abc.abstractmethod
    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: ReadRanges
    ) -> ReadCounts:
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

    async def _close(self) -> None:
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

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a miss is False)."""
        self._check_open("exists")
        checked = self._check_keys(keys, "exists")
        return await self._exists(checked) if checked else []

    async def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[BufferLike],
        ranges: ReadRanges | None = None,
    ) -> ReadCounts:
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
        results = await guarded(self._fetch_into(checked, views, list(ranges)))
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
        if isinstance(buffers, str) or is_buffer(buffers):
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
        n = await guarded(self._get_scatter(checked, parts, byte_range))
        self.stats.reads += 1
        if n is not None:
            self.stats.read_hits += 1
            self.stats.bytes_read += n
        return n

    async def _fetch_into(
        self, keys: list[str], views: list[memoryview], ranges: ReadRanges
    ) -> ReadCounts:
        # Native ranges where the backend has them, else emulated on whole-object reads.
        if self.capabilities.ranged_reads or all(r is None for r in ranges):
            return await self._get_into(keys, views, ranges)
        return await self._emulated_ranges(keys, views, ranges)

    async def _emulated_ranges(
        self, keys: list[str], views: list[memoryview], ranges: ReadRanges
    ) -> ReadCounts:
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
        results: ReadCounts = []
        for key, view, rng, scratch, n in zip(keys, views, ranges, scratch_views, got, strict=True):
            if rng is None or n is None:
                results.append(n)
                continue
            # The object may have been replaced between stat and read: check again.
            rng.check_within(n, backend=self.name, key=key)
            view[: rng.length] = scratch[rng.start : rng.end]
            results.append(rng.length)
        return results

    def _summed_plan(
        self,
        keys: Sequence[str],
        buffers: Sequence[BufferLike],
        spans: SumSpans,
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
        await guarded(self._put(checked, views))
        self.stats.writes += len(checked)
        self.stats.bytes_written += sum(len(v) for v in views)

    async def put_if_absent(self, key: str, buffer: BufferLike) -> bool:
        """Store unless the key exists; True when this call wrote it.

        Atomic (exactly one racing caller wins) when ``capabilities.atomic_put``; otherwise
        two racing callers may both write, which is harmless for content-addressed keys.
        Buffer lifetime as ``put``.
        """
        self._check_open("put_if_absent")
        (checked,) = self._check_keys([key], "put_if_absent")
        view = as_byte_view(buffer, writable=False)
        wrote = await guarded(self._put_if_absent(checked, view))
        if wrote:
            self.stats.writes += 1
            self.stats.bytes_written += len(view)
        return wrote

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

    async def check_index(self, *, repair: bool = False,
                          rebuild: bool = False) -> IndexCheck | None:
        """What the store's index (``backends.index``) holds against a listing of the store
        (``IndexCheck``: ``doctor``); ``repair`` removes objects the index does not account
        for and unindexes keys whose object is gone (``gc``'s reconcile); ``rebuild`` builds
        the index anew from the listing (``gc --rebuild-index``). None for a store without an
        index of its own."""
        self._check_open("check_index")
        return None

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



__all__ = [
    "LIST_STAT_BATCH",
    "Backend",
    "CallAbandoned",
    "Handoff",
    "PendingReads",
    "ReadCounts",
    "ReadRanges",
    "abandonable",
    "as_byte_view",
    "gather_settled",
    "outlast",
    "reads_are_uses",
    "reads_not_counted",
    "scatter_views",
    "until_abandoned",
]
