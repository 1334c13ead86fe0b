"""``ObjectIO``: the one write path and the one verified read path of stored objects.

Everything that stores or fetches a framed object goes through here: the cache tier's pages
(``objects.pages.L3Link``), cache components' state, the SGLang adapter, and the operator tools.
What it guarantees, once:

* **Writes frame in place.** The caller lays out each object as a *frame*: ``header_bytes``
  reserved, then the payload, in its own (reused, page-aligned) staging. ``put`` seals the
  header into the reserved bytes (``ObjectFormat.seal``) and stores the frame as it is: no copy,
  no mapping per object.
* **Reads are verified** before a byte counts: the header is checked against the key asked for
  and the size the reader expects, then every layer block read (``ObjectFormat.open_header`` /
  ``open_blocks``). A read of a whole object (``read_frames``, ``read_blocks`` of every layer)
  also checks the stored size: an object longer or shorter than the frame is corrupt (a read
  of some layers cannot see bytes after them). Layer ranges (``read_blocks``) land straight in
  the caller's memory; headers land in slots of a reused arena.
* **Off the loop.** Sealing and verifying (checksums, or AES-GCM in a sealed namespace) of a
  large payload run on worker threads (``objects.offload``), overlapping other objects' I/O.
* **Bounded.** Bytes in flight per direction are limited by a ``ByteBudget`` (a write of one
  frame larger than the limit waits for all of it). Time is bounded by one rule,
  ``Deadline``: a call or batch that moves ``n`` bytes may take ``io_timeout_s + n /
  min_bandwidth`` (``TimeoutError`` past it), so a large batch on a slow device is not
  failed by a deadline sized for one object.
* **Writes in order.** ``put`` and ``put_together`` hand their pages to the backend's one
  write queue (``objects.writes``): pages of every caller are written oldest first, in runs
  of one backend call each, and a page's deadline counts from when its run is handed to the
  backend. When a batch's deadline passes it ends with what it stored: a leading run of its
  pages is ``True``, the rest ``False``. A slow store keeps the leading pages of a backup (an
  engine resumes from the longest stored prefix) instead of every page running late together
  and none of them being kept.

Outcomes: a write reports ``True``/``False`` per frame (failures are logged, never raised: a
failed backup is a lost copy, not an error of the engine's path; ``objects.failures`` logs the
first few of a store's failures whole and counts the rest into one line). A read returns the header on
success, ``None`` on a miss, and raises ``CorruptObjectError`` for a corrupt object (callers
count it and treat it as a miss) and the backend's errors or ``TimeoutError`` for failures.

Coroutines run on the sync bridge's loop (``hicache_store._sync``) or any other loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from hicache_store.backends.aio import wait_for
from hicache_store.backends.base import Backend
from hicache_store.backends.errors import InvalidRangeError
from hicache_store.backends.lifetime import gather_settled
from hicache_store.backends.protocols import PendingReads, PendingWrites
from hicache_store.backends.types import ByteRange
from hicache_store.layout.errors import (
    CorruptObjectError,
    InvalidKeyError,
    MissingKeyError,
    TruncatedObjectError,
)
from hicache_store.layout.framing import (
    ObjectHeader,
    check_block_sums,
    decode_header,
    payload_offset,
    verify_blocks,
)
from hicache_store.layout.keys import ObjectKey, is_page_hash, parse_key, validate_storage_key
from hicache_store.layout.namespace import MAX_LAYERS_PER_OBJECT, Namespace
from hicache_store.tenant import KeyRing

from .arena import Arenas
from .format import FRAMED, FramedFormat, ObjectFormat, format_for
from .offload import off_loop
from .writes import Outcome, PageOut, queue_of

log = logging.getLogger(__name__)
T = TypeVar("T")

#: seconds one backend call of the object path may take (``ObjectIO``, the tier, the SGLang
#: adapter). Above every built-in backend's own bound for a stopped server (15 s: S3 request,
#: Mooncake call, fsspec call; docs/guide/backends/deadlines.md), so such a server shows up as the backend's
#: own retryable error; this deadline catches backends without one of their own.
DEFAULT_IO_TIMEOUT_S = 20.0

#: the slowest transfer rate (MiB/s) a batch is given time for, beyond ``io_timeout_s``
#: (``Deadline``): below it a batch ends with what it stored. A shared or throttled disk
#: does 60 MiB/s and more; 16 leaves room for one loaded by other tenants.
DEFAULT_MIN_BANDWIDTH_MIB_S = 16.0

@dataclass(frozen=True)
class Deadline:
    """How long a transfer may take: ``floor_s + nbytes / min_bandwidth`` (``seconds``).

    The one rule for every call and batch of the object path (``ObjectIO``'s backend calls
    and ``put`` batches, the SGLang adapter's ``batch_set`` / ``batch_get``): a floor for the
    round trips and a minimum bandwidth for the bytes, so a deadline sized for one object
    does not fail a batch of a hundred on a slow device, and a batch still ends in bounded
    time on a hung one. ``min_bandwidth_mib_s`` is in MiB/s.
    """

    floor_s: float = DEFAULT_IO_TIMEOUT_S
    min_bandwidth_mib_s: float = DEFAULT_MIN_BANDWIDTH_MIB_S

    def __post_init__(self) -> None:
        if not self.floor_s > 0:
            raise ValueError(f"io_timeout_s {self.floor_s} must be positive")
        if not self.min_bandwidth_mib_s > 0:
            raise ValueError(f"min_bandwidth_mib_s {self.min_bandwidth_mib_s} must be positive")

    def seconds(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` bytes may take."""
        if nbytes < 0:
            raise ValueError(f"a transfer of {nbytes} bytes")
        return self.floor_s + nbytes / (self.min_bandwidth_mib_s * (1 << 20))

    def end(self, nbytes: int) -> float:
        """The ``time.monotonic()`` by which a transfer of ``nbytes`` starting now must end
        (the event loop's clock: ``loop.time()`` is ``time.monotonic()``)."""
        return time.monotonic() + self.seconds(nbytes)


class ByteBudget:
    """An async limit on bytes in flight (a request larger than the limit waits for all)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"byte budget: limit {limit} must be positive")
        self.limit = limit
        self.used = 0
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        # Created lazily so it belongs to the loop that uses it.
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def acquire(self, nbytes: int) -> int:
        """Wait until ``nbytes`` (at most the limit) fit; returns what to ``release``."""
        take = min(nbytes, self.limit)
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self.used + take <= self.limit)
            self.used += take
        return take

    async def release(self, taken: int) -> None:
        cond = self._condition()
        async with cond:
            self.used -= taken
            cond.notify_all()


@dataclass
class IOStats:
    """Outcome counters of a batch of transfers (merged into metrics by their owner).

    ``bytes_moved``: bytes that crossed to or from the backend (headers included).
    ``bytes_fetched`` / ``bytes_needed``: payload bytes read and payload bytes the reader
    needed (their ratio is the read amplification of head subsets).
    """

    bytes_moved: int = 0
    bytes_fetched: int = 0
    bytes_needed: int = 0
    corruptions: int = 0
    #: storage keys of the objects counted in ``corruptions`` (where the reader knows them):
    #: what a caller deletes or overwrites so that the next write replaces them.
    corrupt_keys: list[str] = field(default_factory=list)
    #: objects of a sealed namespace that failed a check: forged, swapped, replayed, another
    #: tenant's (counted apart from ``corruptions``).
    tampered: int = 0
    #: reads that ended in an error (a backend failure, a deadline), not a miss or a check.
    errors: int = 0


@dataclass(frozen=True)
class Frame:
    """One object to write: ``buffer`` is ``header_bytes`` reserved, then the payload."""

    key: ObjectKey
    buffer: memoryview
    parent_hash: str | None = None


class ObjectIO:
    """Stored objects of one namespace on one backend. See the module docstring.

    ``namespace`` may be None for tools that only read (writes then raise ``ValueError``).
    """

    def __init__(
        self,
        backend: Backend,
        namespace: Namespace | None = None,
        *,
        fmt: ObjectFormat | None = None,
        max_inflight_bytes: int = 256 << 20,
        io_timeout_s: float = DEFAULT_IO_TIMEOUT_S,
        min_bandwidth_mib_s: float = DEFAULT_MIN_BANDWIDTH_MIB_S,
    ) -> None:
        #: how long each call and batch may take (``io_timeout_s`` is its floor)
        self.deadline = Deadline(io_timeout_s, min_bandwidth_mib_s)
        #: the namespace's own format (``format_for``) unless one is given
        self.format = fmt or (FRAMED if namespace is None else format_for(namespace))
        if namespace is not None and namespace.sealed != self.format.sealed:
            # Never plain objects into a sealed namespace (nor the reverse): every path that
            # stores or reads objects comes through here.
            raise MissingKeyError(
                f"namespace {namespace.digest} is {'' if namespace.sealed else 'not '}sealed "
                f"but the object format {self.format.name} is "
                f"{'' if self.format.sealed else 'not '}: a sealed namespace needs its tenant "
                "key ring (tenant_key_file)"
            )
        self.backend = backend
        self.namespace = namespace
        self.io_timeout_s = io_timeout_s
        self.read_budget = ByteBudget(max_inflight_bytes)
        self.write_budget = ByteBudget(max_inflight_bytes)
        # by header size (objects of more layers have longer headers)
        self._headers = Arenas(block_slots=32)

    # -- sizes ------------------------------------------------------------------------------

    def header_bytes(self, num_layers: int) -> int:
        """Bytes reserved before the payload of an object of ``num_layers`` layers."""
        return self.format.header_bytes(num_layers)

    def frame_bytes(self, num_layers: int, payload_bytes: int) -> int:
        """The stored size of an object: header, then payload."""
        return self.header_bytes(num_layers) + payload_bytes

    def storage_key(self, key: ObjectKey) -> str:
        return self.format.storage_key(key)

    # -- writes -----------------------------------------------------------------------------

    async def put(self, frames: Sequence[Frame], *, end: float | None = None) -> list[bool]:
        """Seal each frame in place and store it; ``True`` per object stored.

        Frames go as pages: consecutive frames of one page hash are stored or not together.
        The pages join this backend's write queue (``objects.writes``) behind every page
        queued before them, by any caller, and are written oldest first, in runs of one
        backend call each; each frame's bytes count against the write budget while it is
        sealed and stored. A page not started by ``end`` (a ``time.monotonic()`` value;
        default: ``deadline.end`` of the frames' bytes, from now) is not started; a started
        run has its own deadline, from the bytes the backend has to move for it. A page not
        stored by then is ``False`` (never ``True`` for an object that is not stored and
        visible; one cut in flight may still become visible, reported ``False``), and so is
        every page after it: what a slow store keeps of a batch, and what is reported, is a
        leading run of its pages. A page whose put failed is ``False`` alone. A frame whose
        buffer cannot hold a payload raises ``ValueError`` (a caller bug) before anything is
        sealed or stored. Returns once every frame's work has ended (nothing reads the
        buffers afterwards).
        """
        namespace = self._writable(frames)
        if not frames:
            return []
        if end is None:
            end = self.deadline.end(sum(len(f.buffer) for f in frames))
        pages = _pages(frames)
        outcomes = await queue_of(self.backend).write(
            [self._page_out(page, namespace) for page in pages],
            budget=self.write_budget, rule=self.deadline, start_by=end,
        )
        done: list[bool] = []
        late = 0
        for page, outcome in zip(pages, outcomes, strict=True):
            if outcome is Outcome.LATE or (late and outcome is Outcome.STORED):
                late += len(page)
            done += [outcome is Outcome.STORED and not late] * len(page)
        if late:
            first = next(f for f, ok in zip(frames, done, strict=True) if not ok)
            log.warning(
                "put: %d of %d objects not stored by the batch's deadline (io_timeout_s %.1f "
                "+ bytes at %.0f MiB/s; the first: %s)",
                late, len(frames), self.deadline.floor_s,
                self.deadline.min_bandwidth_mib_s, self.storage_key(first.key)[:24],
            )
        return done

    def _writable(self, frames: Sequence[Frame]) -> Namespace:
        """The namespace frames are sealed in; ``ValueError`` (a caller bug, before anything
        is sealed or stored) without one, or for a frame whose buffer cannot hold a payload."""
        if self.namespace is None:
            raise ValueError("ObjectIO without a namespace cannot write")
        for frame in frames:
            if len(frame.buffer) <= self.header_bytes(frame.key.coords.num_layers):
                raise ValueError(f"{frame.key}: a frame of {len(frame.buffer)} bytes has no payload")
        return self.namespace

    def _page_out(self, frames: Sequence[Frame], namespace: Namespace) -> PageOut:
        """``frames`` as one page of the write queue: sealed in place when it is stored."""
        planes = namespace.kv_planes

        def seal() -> None:
            for frame in frames:
                self.format.seal(frame.key, frame.buffer, kv_planes=planes,
                                 parent_hash=frame.parent_hash)

        return PageOut([self.storage_key(f.key) for f in frames], [f.buffer for f in frames], seal)

    async def put_together(self, frames: Sequence[Frame]) -> list[bool]:
        """``put`` of a small batch as one page of the write queue: every frame sealed in
        place, then all stored by one backend call (on the file backend one reservation, one
        index update and one run of writes for the batch), stored or not as a whole.

        For batches whose objects are kept or lost together (vLLM's secondary tier: one
        job's chunk rows; the tier's runs of a chain). Like ``put``'s pages, the batch is not
        started past ``deadline.end`` of its bytes from now, and once started has its own
        deadline and the write budget. When the backend call fails or runs late every frame
        is ``False`` (one may still be stored and visible: never ``True`` for one that is
        not). A frame whose buffer cannot hold a payload raises ``ValueError`` before
        anything is stored. Returns once the backend call has ended (nothing reads the
        buffers afterwards).
        """
        namespace = self._writable(frames)
        if not frames:
            return []
        total = sum(len(frame.buffer) for frame in frames)
        (outcome,) = await queue_of(self.backend).write(
            [self._page_out(frames, namespace)],
            budget=self.write_budget, rule=self.deadline, start_by=self.deadline.end(total),
        )
        if outcome is Outcome.LATE:
            log.warning("put of %d objects (the first: %s) not stored by its deadline",
                        len(frames), self.storage_key(frames[0].key)[:24])
        return [outcome is Outcome.STORED] * len(frames)

    def start_write_frames(self, frames: Sequence[Frame]) -> PendingFrameWrites | None:
        """``put_together`` started from the caller's thread (``NativeWrites.start``): the
        frames sealed here, then stored by one backend job, without the event loop and the
        write queue; else None, having stored nothing (no native writes; a sealed namespace,
        whose AES-GCM the caller's thread should not run). ``result()`` is ``put_together``'s:
        all True only when the put ended stored within the deadline (not begun past
        ``deadline.end`` of the bytes, ``deadline.seconds`` of them once begun). No write
        budget: the caller bounds its bytes in flight. ``ValueError`` as ``put_together``."""
        return start_write_together([(self, frames)])

    # -- reads ------------------------------------------------------------------------------

    async def read_frames(
        self, keys: Sequence[ObjectKey], frames: Sequence[memoryview]
    ) -> list[ObjectHeader | CorruptObjectError | None]:
        """Read whole objects into ``frames`` (each its object's exact stored size) in one
        backend call, then verify every frame: per key the checked header, ``None`` on a miss,
        or the ``CorruptObjectError`` (returned, not raised: a corrupt object fails only its
        own key), including a stored size other than the frame's.

        One backend call (``get_into``, or ``native_reads().get_into_summed`` where the
        backend checksums inside its reads) for a batch of objects read together (vLLM's
        secondary tier: one job of chunk rows), where a call, a budget wait and a
        verification per object would cost a thread hand-off each. A backend that refuses the
        batch because an object is larger than its frame (``InvalidRangeError``) has the batch
        read again key by key, so that only that object is corrupt. A frame that cannot hold
        a payload is a ``ValueError``; a backend failure or the batch's deadline
        (``deadline.seconds`` of all the frames' bytes) raises.
        """
        headers = self._frame_headers(keys, frames)
        if not keys:
            return []
        total = sum(len(frame) for frame in frames)
        storage_keys = [self.storage_key(k) for k in keys]
        spans = self._block_spans(keys, frames, headers)
        sums: Sequence[tuple[int, ...]] | None = None
        taken = await self.read_budget.acquire(total)
        try:
            got: Sequence[int | None] | None
            if spans is not None:
                got, sums = await self._bounded(self.backend.native_reads().get_into_summed(
                    storage_keys, list(frames), spans), total)
            else:
                got = await self._bounded(self.backend.get_into(storage_keys, list(frames)), total)
        except InvalidRangeError as exc:
            if len(keys) == 1:
                larger = CorruptObjectError(f"{storage_keys[0]}: stored larger than its frame: {exc}")
                larger.__cause__ = exc
                return [larger]
            got = None  # one is stored larger than its frame: find it key by key
        finally:
            await self.read_budget.release(taken)
        if got is None:
            singles = await gather_settled(*(self.read_frames([k], [f])
                                             for k, f in zip(keys, frames, strict=True)))
            return [one for (one,) in singles]
        out = self._verified(keys, frames, headers, storage_keys, got, sums)
        if sums is None:  # the blocks were not summed in the read: open each payload
            for i, (key, frame, header_len) in enumerate(zip(keys, frames, headers, strict=True)):
                header = out[i]
                if isinstance(header, ObjectHeader):
                    try:
                        await self._open(header, frame[header_len:], key.coords.layer_start,
                                         key.coords.layer_stop)
                    except CorruptObjectError as exc:
                        out[i] = exc
        return out

    def start_read_frames(
        self, keys: Sequence[ObjectKey], frames: Sequence[memoryview]
    ) -> PendingFrames | None:
        """Start ``read_frames`` in the backend's native code (``NativeReads.start``:
        the reads and their checksums run without the GIL and without a Python thread), for
        objects of the plain framed format; else None, having read nothing (then call
        ``read_frames``). The handle's ``result()`` verifies and returns what ``read_frames``
        returns, except that an object stored larger than its frame raises
        ``InvalidRangeError`` for the batch (``read_frames`` then finds it). No read budget and
        no deadline: the backend's path is local I/O and the caller bounds its own batches."""
        headers = self._frame_headers(keys, frames)
        spans = self._block_spans(keys, frames, headers) if keys else None
        if spans is None:
            return None
        storage_keys = [self.storage_key(k) for k in keys]
        reads = self.backend.native_reads().start(storage_keys, list(frames), spans)
        return PendingFrames(self, list(keys), list(frames), headers, storage_keys, reads)

    def _frame_headers(self, keys: Sequence[ObjectKey], frames: Sequence[memoryview]) -> list[int]:
        """The header length of each frame of a ``read_frames`` call (checked to leave room
        for a payload)."""
        if len(keys) != len(frames):
            raise ValueError(f"read_frames: {len(keys)} keys but {len(frames)} frames")
        headers = [self.header_bytes(key.coords.num_layers) for key in keys]
        for key, frame, header_len in zip(keys, frames, headers, strict=True):
            if len(frame) <= header_len:
                raise ValueError(f"{key}: a frame of {len(frame)} bytes has no payload")
        return headers

    def _verified(
        self, keys: Sequence[ObjectKey], frames: Sequence[memoryview], headers: Sequence[int],
        storage_keys: Sequence[str], got: Sequence[int | None],
        sums: Sequence[tuple[int, ...]] | None,
    ) -> list[ObjectHeader | CorruptObjectError | None]:
        """Per key of a batch read whole (``got``: bytes stored, None a miss): the checked
        header (``_framed``), None, or the ``CorruptObjectError``."""
        out: list[ObjectHeader | CorruptObjectError | None] = []
        for i, (key, frame, header_len, n) in enumerate(zip(keys, frames, headers, got, strict=True)):
            if n is None:
                out.append(None)
                continue
            try:
                out.append(self._framed(key, storage_keys[i], frame, header_len, n,
                                        None if sums is None else sums[i]))
            except CorruptObjectError as exc:
                out.append(exc)
        return out

    def _framed(
        self, key: ObjectKey, storage_key: str, frame: memoryview, header_len: int, n: int,
        sums: tuple[int, ...] | None,
    ) -> ObjectHeader:
        """The checked header of a frame read whole (``n`` bytes stored), its blocks checked
        against ``sums`` where the backend computed them (else the caller opens the payload).
        Raises ``CorruptObjectError``: a stored size other than the frame's, a header that
        does not name ``key``, a block whose checksum differs."""
        if n != len(frame):
            raise TruncatedObjectError(f"{storage_key}: stored {n} bytes, the frame is {len(frame)}")
        header = self.format.open_header(key, frame[:header_len],
                                         payload_bytes=len(frame) - header_len)
        if sums is not None:
            check_block_sums(header, sums, key.coords.layer_start, key.coords.layer_stop)
        return header

    def _block_spans(
        self, keys: Sequence[ObjectKey], frames: Sequence[memoryview], headers: Sequence[int]
    ) -> list[list[tuple[int, int]]] | None:
        """The layer blocks of each frame as ``(offset, length)`` spans, when the backend
        hashes inside its reads (``capabilities.native_reads``) and the format checks blocks by
        their checksums alone (plain framed objects); else None (read, then verify)."""
        if not self.backend.capabilities.native_reads or not isinstance(self.format, FramedFormat):
            return None
        spans = []
        for key, frame, header_len in zip(keys, frames, headers, strict=True):
            layers = key.coords.num_layers
            block = (len(frame) - header_len) // layers
            if block * layers != len(frame) - header_len:
                return None  # open_header refuses it: read, then verify as usual
            spans.append([(header_len + i * block, block) for i in range(layers)])
        return spans

    async def read_blocks(
        self,
        key: ObjectKey,
        dest: memoryview,
        *,
        payload_bytes: int,
        layers: tuple[int, int] | None = None,
    ) -> ObjectHeader | None:
        """Read layer blocks ``layers`` (all by default) of an object into ``dest``, verified.

        ``payload_bytes`` is the object's whole payload (from the reader's namespace); ``dest``
        receives exactly the blocks asked for. The header lands in an arena slot. One request
        when the blocks start at the object's first layer (header and blocks are contiguous),
        two ranged reads otherwise. ``None`` on a miss; ``CorruptObjectError`` when the header
        or a block read is wrong, the object is shorter than its frame, or (every layer read)
        longer than it.
        """
        coords = key.coords
        first, stop = layers or (coords.layer_start, coords.layer_stop)
        if not coords.layer_start <= first < stop <= coords.layer_stop:
            raise ValueError(f"{key}: layers [{first}, {stop}) outside the object's")
        block = payload_bytes // coords.num_layers
        if block * coords.num_layers != payload_bytes:
            raise ValueError(f"{key}: {payload_bytes} bytes do not split into layer blocks")
        start = (first - coords.layer_start) * block
        length = (stop - first) * block
        if len(dest) < length:
            raise ValueError(f"{key}: {len(dest)} bytes cannot hold {length}")
        target = dest[:length]
        header_len = self.header_bytes(coords.num_layers)
        storage_key = self.storage_key(key)
        # A headerless format (SGLang's bare objects) takes no header slot.
        arena = self._headers.arena(header_len) if header_len else None
        slot = arena.take() if arena is not None else memoryview(b"")
        head = slot[:header_len]
        taken = await self.read_budget.acquire(header_len + length)
        try:
            if header_len == 0:
                hit = await self._ranged(storage_key, [target], [ByteRange.of(start, length)])
            elif start == 0:
                # Header and blocks are contiguous: one scatter read (the file backend serves
                # it with one open and one preadv). The whole object is read as such, so that
                # its stored size is checked too (bytes appended to it are corruption).
                whole = stop == coords.layer_stop
                hit = await self._scatter(storage_key, [head, target], header_len + length, whole)
            else:
                hit = await self._ranged(
                    storage_key,
                    [head, target],
                    [ByteRange(0, header_len), ByteRange.of(header_len + start, length)],
                )
            if not hit:
                return None
            header = self.format.open_header(key, head, payload_bytes=payload_bytes)
            await self._open(header, target, first, stop)
            return header
        finally:
            await self.read_budget.release(taken)
            if arena is not None:
                arena.give(slot)  # the read has ended: the backend writes no more into it

    async def _open(self, header: ObjectHeader, data: memoryview, first: int, stop: int) -> None:
        """Verify (and decrypt, sealed) blocks [first, stop) in place, off the loop when large."""
        await off_loop(len(data), lambda: self.format.open_blocks(header, data, first, stop))

    async def _scatter(
        self, storage_key: str, buffers: list[memoryview], length: int, whole: bool
    ) -> bool:
        """The first ``length`` bytes of an object into ``buffers``; ``whole``: they are all
        of it, and a stored size other than ``length`` is corrupt."""
        try:
            n = await self._bounded(
                self.backend.get_scatter(storage_key, buffers, None if whole else ByteRange(0, length)),
                length,
            )
        except InvalidRangeError as exc:
            if whole:  # the object does not fit the frame
                raise CorruptObjectError(f"{storage_key}: stored larger than its frame: {exc}") from exc
            # The range reaches past the end: the stored object is shorter than its frame.
            raise TruncatedObjectError(f"{storage_key}: {exc}") from exc
        if n is not None and n != length:
            raise TruncatedObjectError(f"{storage_key}: stored {n} bytes, the frame is {length}")
        return n is not None

    async def _ranged(
        self, storage_key: str, buffers: list[memoryview], ranges: list[ByteRange]
    ) -> bool:
        try:
            got = await self._bounded(
                self.backend.get_into([storage_key] * len(buffers), buffers, ranges),
                sum(r.end - r.start for r in ranges),
            )
        except InvalidRangeError as exc:
            raise TruncatedObjectError(f"{storage_key}: {exc}") from exc
        return all(n is not None for n in got)

    async def _bounded(self, call: Awaitable[T], nbytes: int = 0) -> T:
        """``call``, which moves ``nbytes``, within ``deadline.seconds(nbytes)``."""
        return await wait_for(call, self.deadline.seconds(nbytes))

    # -- tools ------------------------------------------------------------------------------

    async def _read_header(self, storage_key: str) -> ObjectHeader | None:
        """The checked header of one stored object, ``None`` on a miss (``read_headers``' way
        for an object shorter than its probe or with a longer header). The header must
        describe the key it is stored under; ``CorruptObjectError`` otherwise."""
        expected = _parsed(storage_key)
        probe = payload_offset(1)
        for length in (probe, payload_offset(MAX_LAYERS_PER_OBJECT)):
            buf = bytearray(length)
            try:
                got = await self._bounded(self.backend.get_scatter(storage_key, [buf], ByteRange(0, length)))
            except InvalidRangeError:
                # Shorter than the probe: read what there is and let the decoder judge it.
                data = await self._bounded(self.backend.get_bytes(storage_key))
                if data is None:
                    return None
                return decode_header(data, expected=expected, object_length=len(data))
            if got is None:
                return None
            try:
                return decode_header(buf, expected=expected)
            except TruncatedObjectError:
                if length != probe:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def read_headers(
        self, storage_keys: Sequence[str]
    ) -> list[ObjectHeader | CorruptObjectError | None]:
        """The checked headers of stored objects, in one backend call (operator tools that read
        a header per page of a whole store: ``gc``): per key the header, which must describe
        the key it is stored under, ``None`` on a miss, or the ``CorruptObjectError``
        (returned, not raised). Objects shorter than the
        first probe, or with a longer header, are read again one by one. Objects of a format
        with no header (SGLang's bare objects) are not read: their header is the format's,
        synthesised from the key (``payload_offset`` 0, no parent, ``payload_length`` 0:
        not known)."""
        # A store's keys share few tails (namespace and coordinates): each is parsed and its
        # format looked up once per call, and a header is checked against its storage key
        # (a string comparison), not a parsed key per object (~10 us each at gc's scale).
        tails: dict[str, ObjectKey | None] = {}
        keys: list[ObjectKey | None] = []
        bare: list[bool] = []
        for storage_key in storage_keys:
            page, _, tail = storage_key.partition("_")
            if tail not in tails:
                tails[tail] = _parsed(_SAMPLE_PAGE + "_" + tail)
            sample = tails[tail]
            if sample is None or not is_page_hash(page):
                keys.append(None)
                bare.append(False)
                continue
            keys.append(sample)
            bare.append(self._tool_format(sample).header_bytes(sample.coords.num_layers) == 0)
        wanted = [k for k, skip in zip(storage_keys, bare, strict=True) if not skip]
        probe = payload_offset(1)
        buffers = [bytearray(probe) for _ in wanted]
        try:
            read: Sequence[int | None] = await self._bounded(self.backend.get_into(
                wanted, buffers, [ByteRange(0, probe)] * len(wanted))) if wanted else []
        except InvalidRangeError:
            read = [-1] * len(wanted)  # one is shorter than the probe: key by key
        found = iter(zip(buffers, read, strict=True))
        out: list[ObjectHeader | CorruptObjectError | None] = []
        for storage_key, sample, skip in zip(storage_keys, keys, bare, strict=True):
            if skip:
                assert sample is not None
                expected = _parsed(storage_key)
                assert expected is not None
                out.append(self._tool_format(expected).open_header(
                    expected, memoryview(b""), payload_bytes=0))
                continue
            buf, n = next(found)
            try:
                if n is None:
                    out.append(None)
                elif n < 0 or sample is None:
                    out.append(await self._read_header(storage_key))
                else:
                    try:
                        out.append(decode_header(buf, expected=storage_key))
                    except TruncatedObjectError:
                        out.append(await self._read_header(storage_key))  # a longer header
            except CorruptObjectError as exc:
                out.append(exc)
        return out

    async def read_object(self, storage_key: str) -> tuple[ObjectHeader, memoryview] | None:
        """A whole stored object, verified (its stored size included): header and payload
        (operator tools; the cache's data path uses ``read_frames`` / ``read_blocks``)."""
        found = await self._stored(storage_key)
        if found is None:
            return None
        key, size = found
        frame = memoryview(bytearray(size))
        header_len = self.header_bytes(key.coords.num_layers)
        if size <= header_len:
            raise TruncatedObjectError(f"{storage_key}: {size} bytes hold no payload")
        (header,) = await self.read_frames([key], [frame])
        if isinstance(header, CorruptObjectError):
            raise header
        if header is None:
            return None
        return header, frame[header_len:]

    async def verify_stored(
        self,
        storage_key: str,
        buffer: memoryview,
        *,
        window: int | None = None,
        keys: KeyRing | None = None,
    ) -> ObjectHeader | None:
        """Verify a whole stored object through ``buffer`` (operator tools: ``inspect
        --verify``): its stored size (``stat``: the object's own, not a listing's, which can
        be stale) and header against the key, then every layer block, whole blocks at a time,
        at most ``window`` bytes (default ``len(buffer)``) per ranged read. Memory is
        ``buffer``, or one block when a block is larger (a format checks whole blocks): a
        512 MiB object never costs a copy of itself.

        Sealed objects (a tenant's) are authenticated with the key of ``keys`` their header
        names; when ``keys`` does not hold it, only the header is checked (the caller sees
        ``header.sealed`` and ``header.key_id``). ``None`` on a miss; ``CorruptObjectError``
        when the object is corrupt (including a size other than its frame's, or a key that
        is no object key).
        """
        found = await self._stored(storage_key)
        if found is None:
            return None
        key, size = found
        coords = key.coords
        fmt = self._tool_format(key)
        header_len = fmt.header_bytes(coords.num_layers)
        if len(buffer) < max(header_len, payload_offset(coords.num_layers, sealed=True)):
            raise ValueError(f"a buffer of {len(buffer)} bytes cannot hold the header")
        header: ObjectHeader
        if header_len == 0:
            header = fmt.open_header(key, buffer[:0], payload_bytes=size)
        else:
            if size <= header_len:
                raise TruncatedObjectError(f"{storage_key}: {size} bytes hold no payload")
            if not await self._ranged(storage_key, [buffer[:header_len]],
                                      [ByteRange(0, header_len)]):
                return None
            try:
                header = fmt.open_header(key, buffer[:header_len],
                                         payload_bytes=size - header_len)
            except TruncatedObjectError:
                # A sealed header can be longer than a plain one (over 246 layers).
                longer = payload_offset(coords.num_layers, sealed=True)
                if longer <= header_len or size <= longer:
                    raise
                if not await self._ranged(storage_key, [buffer[:longer]], [ByteRange(0, longer)]):
                    return None
                header = decode_header(buffer[:longer], expected=key, object_length=size)
        tenant_key = None
        if header.sealed:
            tenant_key = None if keys is None or header.key_id is None else keys.key(header.key_id)
            if tenant_key is None:
                return header  # not ours to authenticate: the header alone was checked
        offset = header.payload_offset
        payload_len = size - offset
        block = payload_len // coords.num_layers
        if payload_len <= 0 or block * coords.num_layers != payload_len:
            raise CorruptObjectError(
                f"{storage_key}: {payload_len} payload bytes do not split into "
                f"{coords.num_layers} layer blocks")
        per_read = max(1, min(window or len(buffer), len(buffer)) // block)
        scratch = buffer if block <= len(buffer) else memoryview(bytearray(block))
        for first in range(coords.layer_start, coords.layer_stop, per_read):
            stop = min(first + per_read, coords.layer_stop)
            data = scratch[: (stop - first) * block]
            start = offset + (first - coords.layer_start) * block
            if not await self._ranged(storage_key, [data], [ByteRange.of(start, len(data))]):
                return None
            if tenant_key is not None:
                verify_blocks(header, data, first, stop, key=tenant_key)  # authenticates
            else:
                fmt.open_blocks(header, data, first, stop)
        return header

    async def _stored(self, storage_key: str) -> tuple[ObjectKey, int] | None:
        """The parsed key and stored size of an object (tools); None on a miss.
        ``InvalidKeyError`` for what is no storage key at all (a caller's bug, as every
        backend call raises), ``CorruptObjectError`` for a storage key that is no object's."""
        validate_storage_key(storage_key)
        key = _parsed(storage_key)
        if key is None:
            raise CorruptObjectError(f"{storage_key[:80]!r} is not an object key")
        (stat,) = await self._bounded(self.backend.stat([storage_key]))
        return None if stat is None else (key, stat.size)

    def _tool_format(self, key: ObjectKey) -> ObjectFormat:
        """The format tools read ``key`` in: this ``ObjectIO``'s when it serves a namespace,
        else the one the key's namespace digest says (``format_for``)."""
        return self.format if self.namespace is not None else format_for(key)


def _pages(frames: Sequence[Frame]) -> list[Sequence[Frame]]:
    """``frames`` cut into pages: runs of consecutive frames of one page hash."""
    pages: list[Sequence[Frame]] = []
    start = 0
    for i in range(1, len(frames) + 1):
        if i == len(frames) or frames[i].key.page_hash != frames[start].key.page_hash:
            pages.append(frames[start:i])
            start = i
    return pages


#: a page hash to parse a key's tail with (``read_headers``).
_SAMPLE_PAGE = "0" * 64


def _parsed(storage_key: str) -> ObjectKey | None:
    try:
        return parse_key(storage_key)
    except InvalidKeyError:
        return None


class PendingFrames:
    """A ``read_frames`` under way in a backend's native code (``ObjectIO.start_read_frames``):
    ``done()`` never waits, ``wait()`` waits for the reads (the frames are not written after
    it returns), ``result()`` waits and verifies (see ``start_read_frames``)."""

    def __init__(
        self, io: ObjectIO, keys: list[ObjectKey], frames: list[memoryview], headers: list[int],
        storage_keys: list[str], reads: PendingReads,
    ) -> None:
        self._io, self._keys, self._frames, self._headers = io, keys, frames, headers
        self._storage_keys, self._reads = storage_keys, reads

    def done(self) -> bool:
        return self._reads.done()

    def wait(self) -> None:
        self._reads.wait()

    def result(self) -> list[ObjectHeader | CorruptObjectError | None]:
        got, sums = self._reads.result()
        return self._io._verified(self._keys, self._frames, self._headers, self._storage_keys,
                                  got, sums)


def start_write_together(
    batches: Sequence[tuple[ObjectIO, Sequence[Frame]]],
) -> PendingFrameWrites | None:
    """``ObjectIO.start_write_frames`` of several ``ObjectIO``s' frames over one backend as
    ONE backend job (a model's cache components, each its own namespace: one reservation and
    one queue slot on the writer for all of them): each batch's frames checked and sealed by
    its own ``ObjectIO`` (its namespace, its format, its storage keys), then all stored or
    not together. None, having stored nothing, where any batch could not start alone (no
    native writes, a sealed format) or there are no frames. The deadline is the most lenient
    of the ``ObjectIO``s' for all the bytes (the links of one owner share their limits).
    ``ValueError`` (before anything is sealed) for a frame without a payload, an ``ObjectIO``
    without a namespace, or batches over different backends."""
    batches = [(io, frames) for io, frames in batches if frames]
    namespaces = [io._writable(frames) for io, frames in batches]
    if not batches:
        return None
    backend = batches[0][0].backend
    if any(io.backend is not backend for io, _ in batches):
        raise ValueError("frames written together must go to one backend")
    if not backend.capabilities.native_writes or any(io.format.sealed for io, _ in batches):
        return None
    outs = [io._page_out(frames, ns) for (io, frames), ns in zip(batches, namespaces, strict=True)]
    for out in outs:
        out.seal()
    keys = [k for out in outs for k in out.keys]
    buffers = [b for out in outs for b in out.buffers]
    nbytes = sum(out.nbytes for out in outs)
    start_by = max(io.deadline.end(nbytes) for io, _ in batches)
    seconds = max(io.deadline.seconds(nbytes) for io, _ in batches)
    writes = backend.native_writes().start(keys, buffers, start_by=start_by)
    return PendingFrameWrites(writes, len(keys), seconds, keys[0])


class _Put(Protocol):
    """A put under way, as a handle over it sees it (``PendingWrites``, ``PendingFrameWrites``)."""

    @property
    def ended(self) -> float | None: ...

    def done(self) -> bool: ...

    def wait(self) -> None: ...


_P = TypeVar("_P", bound=_Put)


class PutOver(Generic[_P]):
    """A handle over the put ``_writes`` (``PendingFrameWrites``, ``pages.PendingPageWrites``):
    its ``done()``, ``wait()`` and ``ended`` are the put's."""

    _writes: _P

    def done(self) -> bool:
        return self._writes.done()

    def wait(self) -> None:
        self._writes.wait()

    @property
    def ended(self) -> float | None:
        """The ``time.monotonic()`` at which the put ended (None: not yet, or never begun)."""
        return self._writes.ended


class PendingFrameWrites(PutOver[PendingWrites]):
    """A ``put_together`` under way in a backend's own job (``ObjectIO.start_write_frames``):
    ``done()`` never waits, ``wait()`` waits for the put (the frames are not read after it
    returns), ``result()`` waits, then ``True`` per frame only where the put stored them all
    within its deadline; a failure or a late put is logged and all ``False`` (one stored late
    may still be visible: never ``True`` for one that is not)."""

    def __init__(self, writes: PendingWrites, count: int, seconds: float, first: str) -> None:
        self._writes, self._count, self._seconds, self._first = writes, count, seconds, first

    def result(self) -> list[bool]:
        self.wait()
        try:
            self._writes.result()
        except Exception as exc:  # a lost copy, not an error of the caller's path
            log.warning("put of %d objects (the first: %s) failed: %r", self._count,
                        self._first[:24], exc)
            return [False] * self._count
        began, ended = self._writes.began, self._writes.ended
        if began is None or ended is None or ended - began > self._seconds:
            log.warning("put of %d objects (the first: %s) not stored by its deadline "
                        "(%.1f s)", self._count, self._first[:24], self._seconds)
            return [False] * self._count
        return [True] * self._count
