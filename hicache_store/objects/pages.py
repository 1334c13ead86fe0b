"""Pages <-> stored objects: a rank's host page to the objects its plans name, and back.

Writes: each page becomes the objects ``plan_writes`` gives this rank (one writer per object
among replicas). ``write_page`` frames them in reused staging (each object's payload copied
once from the host row behind its reserved header) and ``ObjectIO.put`` seals and stores them;
a page counts as written when all its objects are. ``write_in_order`` writes several pages
so, each kept or not on its own (a leading run of them on a slow store); ``write_pages``
stores a run of pages in one backend call, kept or lost together; ``start_write_pages``
starts such a run in the backend's native code (no loop), for a caller that polls it, and
``start_write_links`` the runs of several links (a model's cache components) as one job,
framing in place the pages a caller packed straight into ``frame_rows``' memory.
Callers whose staging already has the frame layout (the SGLang adapter relays straight into
it) use ``ObjectIO.put`` themselves.

Reads: each page is assembled from the objects (or layer ranges of objects) ``plan_reads``
names, every byte verified by ``ObjectIO.read_blocks`` before it counts: whole head groups land
straight in the host row, head subsets in reused scratch and are sliced after verification. A
miss, a corrupt object or an error fails the page (never wrong bytes); outcomes are counted in
the ``IOStats`` the caller passes, nothing raises, so the tier degrades to recomputation.

Sealed namespaces (``keys``: a tenant key ring, ``hicache_store.tenant``): callers still pass
public page hashes; the active key's ``SealedFormat`` names, seals and opens the objects. A
page is looked for under the active key's names first, then under each older readable key's
(key rotation): ``exists_prefix`` asks older keys only about the objects newer ones lacked,
and each object read falls back key by key on a miss. In a sealed namespace every object that
fails a check counts as ``IOStats.tampered``: nobody without the key can make a valid one, and
bit rot fails the tags too.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from hicache_store.backends.aio import wait_for
from hicache_store.backends.base import Backend
from hicache_store.backends.lifetime import gather_settled
from hicache_store.backends.prefix import search_prefix
from hicache_store.layout.errors import CorruptObjectError, GridMismatchError, MissingKeyError
from hicache_store.layout.framing import ObjectHeader
from hicache_store.layout.keys import ObjectKey
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.plans import (
    ObjectRead,
    ReadPlan,
    WritePlan,
    apply_segments,
    plan_reads,
    plan_writes,
)
from hicache_store.layout.topology import Topology
from hicache_store.tenant import KeyRing

from .arena import Arena, Arenas
from .format import ObjectFormat
from .io import (
    DEFAULT_MIN_BANDWIDTH_MIB_S,
    Deadline,
    Frame,
    IOStats,
    ObjectIO,
    PendingFrames,
    PendingFrameWrites,
    PutOver,
    start_write_together,
)
from .sealed import SealedFormat

log = logging.getLogger(__name__)
Row = npt.NDArray[np.uint8]


@dataclasses.dataclass(frozen=True)
class PageWrite:
    """One page of ``L3Link.write_pages``: its hash, its host row and the chain's previous
    page (``parent_hash``, for the objects' headers; None for a chain's first page)."""

    page_hash: str
    row: Row
    parent_hash: str | None


@dataclasses.dataclass(frozen=True)
class FrameRows:
    """Fresh frame memory for ``len(rows)`` pages of one link whose page is one object holding
    the whole host row (``L3Link.frame_rows``): ``rows[i]`` is page ``i``'s payload in place
    (a view of ``frames[i]`` past its header). A caller fills the rows, gives them as its
    pages' ``PageWrite.row`` in order, and this to ``start_write_links``: the pages are
    framed without a copy. The rows stay the frames' until the put ends."""

    frames: Row  # [pages, header + row]
    rows: Row  # [pages, row]: frames[:, header:]


class TransferLimits(Protocol):
    """The two limits every link takes from its owner's configuration."""

    @property
    def max_inflight_bytes(self) -> int: ...

    @property
    def io_timeout_s(self) -> float: ...


class L3Link:
    """Moves pages between host rows and one backend for one rank of one namespace.

    ``component``: the tag of the objects (``_C{tag}`` in keys and headers; 0 = full-attention
    KV) when the namespace is a cache component's (``tier.components``). ``read_only``: this
    rank writes nothing (a replica that is not its component's writer).
    """

    def __init__(
        self,
        backend: Backend,
        namespace: Namespace,
        topology: Topology,
        rank: int,
        *,
        max_inflight_bytes: int,
        io_timeout_s: float,
        min_bandwidth_mib_s: float = DEFAULT_MIN_BANDWIDTH_MIB_S,
        fmt: ObjectFormat | None = None,
        keys: KeyRing | None = None,
        component: int = 0,
        read_only: bool = False,
    ) -> None:
        """``fmt``: the object format (default: the namespace's, ``format_for``); ``keys``: the
        tenant key ring of a sealed namespace, which picks the formats (give one or neither)."""
        if keys is not None and fmt is not None:
            raise ValueError("give a key ring or an object format, not both")
        if namespace.sealed and keys is None and (fmt is None or not fmt.sealed):
            raise MissingKeyError(
                f"namespace {namespace.digest} is sealed: a tenant key ring is needed "
                "(tenant_key_file / --tenant-key-file)"
            )
        if keys is not None and not namespace.sealed:
            raise ValueError("a tenant key ring was given for a namespace that is not sealed")
        self.backend = backend
        self.namespace = namespace
        self.keys = keys
        formats = [fmt] if keys is None else [SealedFormat(k) for k in keys.readable]
        ios = [
            ObjectIO(
                backend,
                namespace,
                fmt=f,
                max_inflight_bytes=max_inflight_bytes,
                io_timeout_s=io_timeout_s,
                min_bandwidth_mib_s=min_bandwidth_mib_s,
            )
            for f in formats
        ]
        #: the active format's ObjectIO: every write, and the first read of every object.
        self.io = ios[0]
        for older in ios[1:]:  # one byte budget per direction for the whole link
            older.read_budget, older.write_budget = self.io.read_budget, self.io.write_budget
        #: where a page is looked for, in order (more than one only for a rotated key ring).
        self.readers: tuple[ObjectIO, ...] = tuple(ios)
        self.component = component
        self.read_plan: ReadPlan = _tagged(plan_reads(namespace, topology, rank), component)
        self.write_plan: WritePlan | None = None
        if not read_only:
            try:
                self.write_plan = _tagged(plan_writes(namespace, topology, rank), component)
            except GridMismatchError as exc:
                # A rank whose shard does not align with the grid can still read everything.
                log.warning("L3 backups disabled for this rank: %s", exc)
        #: page hashes come from ``hashing.page_hashes`` (the tier), not from outside: skip
        #: re-validating them in ``exists_prefix``'s batch. Leave False for hashes an engine
        #: passes in. (Reads and writes always validate: ``ObjectKey`` checks its parts.)
        self.trusted_hashes = False
        self._frames = Arenas()  # write staging by frame size
        self._scratch = Arenas()  # head-subset reads by fetch size

    @classmethod
    def for_component(
        cls,
        backend: Backend,
        namespace: Namespace,
        topology: Topology,
        rank: int,
        limits: TransferLimits,
        *,
        keys: KeyRing | None,
        component: int,
        read_only: bool,
        min_bandwidth_mib_s: float = DEFAULT_MIN_BANDWIDTH_MIB_S,
    ) -> L3Link:
        """The link of one cache component (``component``: its tag) of a deployment: its
        owner's limits, and the deployment's tenant key ring when ``namespace`` is sealed (a
        component of a sealed model is sealed with it). The tier's links and the SGLang
        adapter's component links are all made here."""
        return cls(
            backend,
            namespace,
            topology,
            rank,
            max_inflight_bytes=limits.max_inflight_bytes,
            io_timeout_s=limits.io_timeout_s,
            min_bandwidth_mib_s=min_bandwidth_mib_s,
            keys=keys if namespace.sealed else None,
            component=component,
            read_only=read_only,
        )

    @property
    def io_timeout_s(self) -> float:
        return self.io.io_timeout_s

    @property
    def deadline(self) -> Deadline:
        """How long a transfer of this link may take (``ObjectIO.deadline``)."""
        return self.io.deadline

    @property
    def can_write(self) -> bool:
        return self.write_plan is not None and bool(self.write_plan.objects)

    def stored_hash(self, page_hash: str) -> str:
        """The page hash new objects of ``page_hash`` are stored under (keyed when sealed)."""
        return self.io.format.stored_hash(page_hash)

    def write_names(self, page_hash: str) -> list[str]:
        """The storage keys this rank writes for one page (``write_plan`` order)."""
        if self.write_plan is None:
            return []
        return self.write_plan.object_keys(self.stored_hash(page_hash), trusted=True)

    # -- existence ------------------------------------------------------------------------

    async def exists_prefix(self, page_hashes: Sequence[str]) -> int:
        """How many leading pages have every object this rank reads (under any readable key).

        The boundary is searched for (``backends.prefix.search_prefix``: O(log n) round trips,
        names built only for the pages probed). Each probe asks about its pages under the
        active key, then each older key only about what the newer ones lacked, so an
        unrotated link costs one ``exists`` per round trip. The whole search is bounded by
        ``io_timeout_s``.
        """
        per_page = len(self.read_plan.objects)
        if not page_hashes or per_page == 0:
            return 0

        async def probe(pages: Sequence[int]) -> list[bool]:
            return await self._probe(page_hashes, pages)

        return await wait_for(search_prefix(len(page_hashes), probe), self.io_timeout_s)

    async def exists_pages(self, page_hashes: Sequence[str]) -> list[bool]:
        """Per page: whether every object this rank reads of it is stored (under any readable
        key); one probe per readable key."""
        if not page_hashes or not self.read_plan.objects:
            return [False] * len(page_hashes)
        pages = range(len(page_hashes))
        return await wait_for(self._probe(page_hashes, pages), self.io_timeout_s)

    async def _probe(self, page_hashes: Sequence[str], pages: Sequence[int]) -> list[bool]:
        """Per page of ``pages``: whether every object this rank reads of it is stored."""
        per_page = len(self.read_plan.objects)
        # Objects not found yet, as (page, object index) pairs.
        missing = [(page, i) for page in pages for i in range(per_page)]
        for reader in self.readers:
            fmt = reader.format
            names: dict[int, list[str]] = {}
            keys = []
            for page, i in missing:
                if page not in names:
                    h = page_hashes[page]
                    # A keyed hash is computed here (from a validated input): trusted.
                    names[page] = self.read_plan.object_keys(
                        fmt.stored_hash(h) if fmt.sealed else h,
                        trusted=self.trusted_hashes or fmt.sealed,
                    )
                keys.append(names[page][i])
            found = await self.backend.exists(keys)
            missing = [m for m, hit in zip(missing, found, strict=True) if not hit]
            if not missing:
                break
        lacking = {page for page, _ in missing}
        return [page not in lacking for page in pages]

    # -- writes -----------------------------------------------------------------------------

    async def write_page(
        self,
        page_hash: str,
        row: Row,
        io: IOStats,
        parent_hash: str | None = None,
        *,
        end: float | None = None,
    ) -> bool:
        """Frame and store this rank's objects of one page; True when all are stored.

        ``parent_hash`` (the chain's previous page, when known) goes into every object's header
        so that offline tools can rebuild the chains (``hicache-store gc``). ``end``: the
        ``time.monotonic()`` by which the page must have started (see ``ObjectIO.put``);
        default, the page's own deadline.
        """
        (done,) = await self.write_in_order([PageWrite(page_hash, row, parent_hash)], io, end=end)
        return done

    async def write_in_order(
        self, pages: Sequence[PageWrite], io: IOStats, *, end: float | None = None
    ) -> list[bool]:
        """Frame and store this rank's objects of several pages, each page stored or not on
        its own, in order (``ObjectIO.put``); per page, True when all its objects are stored.

        For a long backup on a store that may be slow (the SGLang adapter's chunk of a
        chain): the pages are written oldest first, in runs, and those not started by ``end``
        (``time.monotonic()``; default, the pages' own deadline from now) are not started,
        so what is stored and reported True is a leading run of the pages (a page whose put
        failed is False alone). Returns once every put has ended.
        """
        if not self.can_write:
            return [False] * len(pages)
        if not pages:
            return []
        taken: list[tuple[Arena, memoryview]] = []
        try:
            framed = [
                self._frame_page(page.page_hash, page.row, page.parent_hash, taken)
                for page in pages
            ]
            done = await self.io.put([f for frames in framed for f in frames], end=end)
        finally:
            self._give_back(taken)  # every put has ended: the backend keeps no reference
        results: list[bool] = []
        at = 0
        for frames in framed:
            ok = all(done[at : at + len(frames)])
            at += len(frames)
            if ok:
                io.bytes_moved += sum(len(f.buffer) for f in frames)
            results.append(ok)
        return results

    async def write_pages(self, pages: Sequence[PageWrite], io: IOStats) -> bool:
        """Frame and store this rank's objects of several pages in one backend call
        (``ObjectIO.put_together``); True when every object is stored.

        For a run of small pages (the tier's backups of a chain): per-object costs (on the
        file backend a reservation, an index update and a settle each) are paid once for the
        run. All or nothing as reported: on False none counts as stored (one may still be
        visible, as with ``write_page``), so a caller that writes a chain's pages in order
        keeps what it reports stored a prefix of the chain.
        """
        if not self.can_write:
            return False
        if not pages:
            return True
        taken: list[tuple[Arena, memoryview]] = []
        try:
            frames = [
                frame
                for page in pages
                for frame in self._frame_page(page.page_hash, page.row, page.parent_hash, taken)
            ]
            done = await self.io.put_together(frames)
        finally:
            self._give_back(taken)  # the backend call has ended: it keeps no reference
        if not all(done):
            return False
        io.bytes_moved += sum(len(f.buffer) for f in frames)
        return True

    def start_write_pages(self, pages: Sequence[PageWrite]) -> PendingPageWrites | None:
        """``write_pages`` started in the backend's native code (``ObjectIO.start_write_frames``:
        every object of every page framed and sealed on the caller's thread, then stored by
        one backend job, without the library's loop and without a GIL hand-off per object),
        for a caller that polls from a thread holding the GIL; None, having stored nothing,
        where there is no such path (nothing to write, a backend without native writes, a
        sealed namespace): then use ``write_pages``. The frames are fresh memory, the
        handle's until the put ends, so the rows are the caller's again on return. Raises
        what ``start_write_frames`` raises (a closed backend). ``start_write_links`` does
        the same for several links' pages in one job."""
        return start_write_links([(self, pages)])

    def frame_rows(self, pages: int) -> FrameRows | None:
        """Fresh frame memory whose rows a caller packs ``pages`` pages into, to be started
        without copying them (``FrameRows``); None where ``start_write_pages`` has no native
        path or a page is not one object of the whole row (several objects a page: the
        payloads are not contiguous in the frames): then pack into rows of your own."""
        sizes, plan = self._native_sizes(), self.write_plan
        if sizes is None or plan is None or len(plan.objects) != 1 or pages < 1:
            return None
        (obj,) = plan.objects
        if obj.page_offset or obj.nbytes != plan.page.page_bytes:
            return None
        # Fresh memory, never pooled: the put reads it until it ends, however late.
        frames = np.empty((pages, sizes[0]), dtype=np.uint8)
        return FrameRows(frames, frames[:, sizes[0] - obj.nbytes:])

    def _native_sizes(self) -> list[int] | None:
        """The framed size of each object this rank writes of a page (``write_plan`` order),
        or None where this link cannot start native writes (``start_write_pages``)."""
        if (not self.can_write or self.io.format.sealed
                or not self.backend.capabilities.native_writes):
            return None
        assert self.write_plan is not None
        return [self.io.header_bytes(obj.coords.num_layers) + obj.nbytes
                for obj in self.write_plan.objects]

    def _frame_page(
        self,
        page_hash: str,
        row: Row,
        parent_hash: str | None,
        taken: list[tuple[Arena, memoryview]] | Callable[[int], memoryview],
    ) -> list[Frame]:
        """This rank's unsealed frames of one page (``write_plan`` order), each in an arena
        slot recorded in ``taken`` (the caller gives them back once the puts have ended), or
        in the memory ``taken`` gives for its size."""
        assert self.write_plan is not None
        digest = self.namespace.digest
        frames: list[Frame] = []
        for obj in self.write_plan.objects:
            header = self.io.header_bytes(obj.coords.num_layers)
            if callable(taken):
                slot = taken(header + obj.nbytes)
            else:
                arena = self._frames.arena(header + obj.nbytes)
                slot = arena.take()
                taken.append((arena, slot))
            frame = slot[: header + obj.nbytes]
            np.frombuffer(frame, dtype=np.uint8)[header:] = row[
                obj.page_offset : obj.page_offset + obj.nbytes
            ]
            frames.append(Frame(ObjectKey(page_hash, digest, obj.coords), frame, parent_hash))
        return frames

    def _frames_in_place(self, pages: Sequence[PageWrite], mem: FrameRows) -> list[Frame]:
        """The frames of pages packed into ``mem``'s rows (``frame_rows``), without a copy."""
        assert self.write_plan is not None
        (obj,) = self.write_plan.objects
        if len(pages) > len(mem.rows):
            raise ValueError(f"{len(pages)} pages for {len(mem.rows)} frame rows")
        digest = self.namespace.digest
        frames: list[Frame] = []
        for page, row, frame in zip(pages, mem.rows, mem.frames, strict=False):
            if page.row.ctypes.data != row.ctypes.data or len(page.row) != len(row):
                raise ValueError(f"page {page.page_hash[:16]}: its row is not its frame row")
            frames.append(Frame(ObjectKey(page.page_hash, digest, obj.coords), frame.data,
                                page.parent_hash))
        return frames

    @staticmethod
    def _give_back(taken: list[tuple[Arena, memoryview]]) -> None:
        for arena, slot in taken:
            arena.give(slot)

    # -- reads ------------------------------------------------------------------------------

    async def read_page(self, page_hash: str, row: Row, io: IOStats) -> bool:
        """Assemble one page into ``row`` from verified objects; False on any miss or error.

        On False, ``row`` may hold partial data: the caller must not use it. Returns (either
        way) only once no read into ``row`` is in flight: when one object fails the others'
        reads still end first (``gather_settled``), and a read past ``io_timeout_s`` is
        cancelled, which under the ``Backend`` buffer-lifetime contract ends when its I/O has.
        So this may return later than ``io_timeout_s`` by the time that I/O takes, and until it
        returns the row is not the caller's to reuse: callers that cannot wait (the tier's
        engine thread, the SGLang adapter) quarantine the row instead.
        """
        plan = self.read_plan
        digest = self.namespace.digest
        try:
            hits = await gather_settled(
                *(
                    self._read_object(ObjectKey(page_hash, digest, obj.coords), obj, row)
                    for obj in plan.objects
                )
            )
        except CorruptObjectError as exc:
            self._count_corrupt(exc, io)
            return False
        except Exception as exc:
            io.errors += 1
            log.warning("L3 read of page %s failed: %r", page_hash[:16], exc)
            return False
        if not all(hits):
            return False
        self._count_read(io)
        return True

    async def read_prefix(self, page_hashes: Sequence[str], rows: Sequence[Row], io: IOStats) -> int:
        """Read pages into their rows in order; how many leading pages were read and verified
        (past that count rows may hold anything: the caller must not use them).

        For a run of small pages (a prefetch of a chain): when this rank reads its objects
        whole (``ObjectRead.is_whole``) the run is read in one backend call and verified in
        one step (``ObjectIO.read_frames``), then copied into the rows, where ``read_page``
        makes a call, a budget wait and a verification per object; otherwise (head subsets,
        layer ranges) page by page. A page the active key misses is looked for again under
        older keys (``read_page``). Like ``read_page``, returns only once no read into any
        row is in flight.
        """
        if len(page_hashes) != len(rows):
            raise ValueError(f"read_prefix: {len(page_hashes)} pages but {len(rows)} rows")
        plan = self.read_plan
        if len(page_hashes) < 2 or not all(obj.is_whole for obj in plan.objects):
            for n, (page_hash, row) in enumerate(zip(page_hashes, rows, strict=True)):
                if not await self.read_page(page_hash, row, io):
                    return n
            return len(page_hashes)
        reader, digest = self.io, self.namespace.digest
        keys: list[ObjectKey] = []
        frames: list[memoryview] = []
        taken: list[tuple[Arena, memoryview]] = []
        try:
            for page_hash in page_hashes:
                for obj in plan.objects:
                    size = reader.header_bytes(obj.coords.num_layers) + obj.payload_bytes
                    arena = self._scratch.arena(size)
                    slot = arena.take()
                    taken.append((arena, slot))
                    keys.append(ObjectKey(page_hash, digest, obj.coords))
                    frames.append(slot[:size])
            try:
                got = await reader.read_frames(keys, frames)
            except Exception as exc:
                io.errors += 1
                log.warning("L3 read of %d pages from %s failed: %r",
                            len(page_hashes), page_hashes[0][:16], exc)
                return 0
            per_page = len(plan.objects)
            for n, (page_hash, row) in enumerate(zip(page_hashes, rows, strict=True)):
                page = slice(n * per_page, (n + 1) * per_page)
                if self._found_corrupt(got[page], keys[page], io):
                    return n
                if any(o is None for o in got[page]):
                    # Missed under the active key: an older one may have it (or nothing does).
                    if len(self.readers) > 1 and await self.read_page(page_hash, row, io):
                        continue
                    return n
                self._copy_page(frames[page], row, io)
            return len(page_hashes)
        finally:
            self._give_back(taken)  # read_frames has ended: no read into a slot is in flight

    def start_read_pages(
        self, page_hashes: Sequence[str], rows: Sequence[Row]
    ) -> PendingPages | None:
        """Start the reads of pages into their rows in the backend's native code (one
        ``ObjectIO.start_read_frames`` for every object of every page: no Python thread, no
        loop, no GIL hand-off per object), for a caller that polls from a thread holding the
        GIL; None, having read nothing, where there is no such path (the backend has no native
        reads, the format is not plain framed, this rank reads part of an object, or more than
        one key is readable): then use ``read_page``. The rows are written only by
        ``PendingPages.result``, after the objects' checks."""
        if len(page_hashes) != len(rows):
            raise ValueError(f"start_read_pages: {len(page_hashes)} pages but {len(rows)} rows")
        plan = self.read_plan
        if (not page_hashes or len(self.readers) > 1
                or not all(obj.is_whole for obj in plan.objects)):
            return None
        reader, digest = self.io, self.namespace.digest
        sizes = [reader.header_bytes(obj.coords.num_layers) + obj.payload_bytes
                 for obj in plan.objects]
        # Fresh memory, never pooled: it is the handle's until the reads end, however late.
        buffer = np.empty(sum(sizes) * len(page_hashes), dtype=np.uint8).data
        keys: list[ObjectKey] = []
        frames: list[memoryview] = []
        at = 0
        for page_hash in page_hashes:
            for obj, size in zip(plan.objects, sizes, strict=True):
                keys.append(ObjectKey(page_hash, digest, obj.coords))
                frames.append(buffer[at:at + size])
                at += size
        reads = reader.start_read_frames(keys, frames)
        if reads is None:
            return None
        return PendingPages(self, list(page_hashes), list(rows), keys, frames, reads)

    def _found_corrupt(
        self, outcomes: Sequence[ObjectHeader | CorruptObjectError | None],
        keys: Sequence[ObjectKey], io: IOStats,
    ) -> bool:
        """Whether one page's verified reads (plan order) hold a corrupt object; the first is
        named, counted and logged (``_count_corrupt``)."""
        bad = next((i for i, o in enumerate(outcomes) if isinstance(o, CorruptObjectError)), None)
        if bad is None:
            return False
        corrupt = outcomes[bad]
        assert isinstance(corrupt, CorruptObjectError)
        corrupt.key = corrupt.key or self.io.storage_key(keys[bad])
        self._count_corrupt(corrupt, io)
        return True

    def _copy_page(self, frames: Sequence[memoryview], row: Row, io: IOStats) -> None:
        """Copy one page's verified whole-object frames (plan order) into its row, counted."""
        for obj, frame in zip(self.read_plan.objects, frames, strict=True):
            start = self.io.header_bytes(obj.coords.num_layers)
            payload = np.frombuffer(frame, dtype=np.uint8)[start : start + obj.payload_bytes]
            apply_segments(obj.segments, payload, row)
        self._count_read(io)

    def _count_read(self, io: IOStats) -> None:
        """Count one page read in full by this rank's plan."""
        plan = self.read_plan
        io.bytes_fetched += plan.bytes_fetched
        io.bytes_needed += plan.bytes_needed
        io.bytes_moved += plan.bytes_fetched + plan.header_bytes

    def _count_corrupt(self, exc: CorruptObjectError, io: IOStats) -> None:
        """Count and log an object that failed its checks (treated as a miss)."""
        if self.namespace.sealed:
            io.tampered += 1
            log.warning("L3 object failed authentication, treated as a miss: %s", exc)
        else:
            io.corruptions += 1
            if exc.key is not None:
                io.corrupt_keys.append(exc.key)
            log.warning("corrupt L3 object treated as a miss: %s", exc)

    async def _read_object(self, key: ObjectKey, obj: ObjectRead, row: Row) -> bool:
        """One object into ``row``, from the first reader (key) that has it. A corrupt object
        raises ``CorruptObjectError`` with its storage key in ``key``."""
        for reader in self.readers:
            try:
                if await self._read_from(reader, key, obj, row):
                    return True
            except CorruptObjectError as exc:
                exc.key = exc.key or reader.storage_key(key)
                raise
        return False

    async def _read_from(self, reader: ObjectIO, key: ObjectKey, obj: ObjectRead, row: Row) -> bool:
        (segment,) = obj.segments
        direct = segment.count == 1 and segment.src_offset == 0
        layers = (obj.layer_start, obj.layer_stop)
        if direct:
            # Whole head groups land straight in the host row (zero-copy where the backend can).
            target = row[segment.dst_offset : segment.dst_offset + obj.fetch_bytes]
            header = await reader.read_blocks(
                key, target.data, payload_bytes=obj.payload_bytes, layers=layers
            )
            return header is not None
        # A head subset: the whole group's layers into scratch, sliced after verification.
        arena = self._scratch.arena(obj.fetch_bytes)
        slot = arena.take()
        try:
            header = await reader.read_blocks(
                key, slot, payload_bytes=obj.payload_bytes, layers=layers
            )
            if header is not None:
                scratch = np.frombuffer(slot, dtype=np.uint8)[: obj.fetch_bytes]
                apply_segments(obj.segments, scratch, row)
        finally:
            arena.give(slot)
        return header is not None


def start_write_links(
    writes: Sequence[tuple[L3Link, Sequence[PageWrite]]],
    framed: Sequence[FrameRows | None] | None = None,
) -> PendingPageWrites | None:
    """``L3Link.start_write_pages`` of several links' pages over one backend (a model's cache
    components: each link its own namespace and format) as ONE backend job
    (``io.start_write_together``): each link's pages framed by that link (its keys, its
    headers), all stored or not together. ``framed``: per entry, the ``FrameRows`` (of that
    entry's link, ``L3Link.frame_rows``) whose rows are its pages' rows in order, framed in
    place, or None (each page's objects copied into fresh frames). None, having stored
    nothing, where any link with pages has no native path (``start_write_pages``) or there
    are no pages: then each link's ``write_pages``. ``PendingPageWrites.parts`` gives each
    entry's pages and framed bytes, in ``writes`` order. ``ValueError`` for links over
    different backends, or a page whose row is not its ``FrameRows`` row."""
    sizes = [link._native_sizes() if pages else [] for link, pages in writes]
    if not any(pages for _, pages in writes) or any(s is None for s in sizes):
        return None
    in_place = list(framed) if framed is not None else [None] * len(writes)
    total = sum(sum(s) * len(pages)
                for s, (_, pages), mem in zip(sizes, writes, in_place, strict=True)
                if s is not None and mem is None)
    # Fresh memory, never pooled: the put reads it until it ends, however late.
    buffer = np.empty(total, dtype=np.uint8).data
    used = 0

    def carve(size: int) -> memoryview:  # the buffer's next ``size`` bytes
        nonlocal used
        used += size
        return buffer[used - size:used]

    batches = [link._frames_in_place(pages, mem) if mem is not None else
               [frame for page in pages
                for frame in link._frame_page(page.page_hash, page.row, page.parent_hash, carve)]
               for (link, pages), mem in zip(writes, in_place, strict=True)]
    started = start_write_together(
        [(link.io, frames) for (link, _), frames in zip(writes, batches, strict=True)])
    if started is None:
        return None
    parts = tuple((len(pages), sum(len(f.buffer) for f in frames))
                  for (_, pages), frames in zip(writes, batches, strict=True))
    return PendingPageWrites(started, parts)


P = TypeVar("P", ReadPlan, WritePlan)


def _tagged(plan: P, component: int) -> P:
    """``plan`` with its objects' coordinates tagged with ``component`` (keys ``_C{tag}``)."""
    if not component:
        return plan
    objects = tuple(
        dataclasses.replace(o, coords=dataclasses.replace(o.coords, component=component))
        for o in plan.objects
    )
    return dataclasses.replace(plan, objects=objects)


class PendingPages:
    """Page reads under way in a backend's native code (``L3Link.start_read_pages``):
    ``done()`` never waits; ``result()`` waits, checks every object and copies each page whose
    objects all arrived and passed into its row."""

    def __init__(self, link: L3Link, page_hashes: list[str], rows: list[Row],
                 keys: list[ObjectKey], frames: list[memoryview], reads: PendingFrames) -> None:
        self._link, self._hashes, self._rows = link, page_hashes, rows
        self._keys, self._frames, self._reads = keys, frames, reads

    def done(self) -> bool:
        return self._reads.done()

    def result(self, io: IOStats) -> list[bool]:
        """Per page whether it was read, checked and copied into its row (a miss or a corrupt
        object is False, counted in ``io`` as ``read_page`` counts it). Raises what
        ``PendingFrames.result`` raises (a backend failure; ``InvalidRangeError`` when an
        object is stored larger than its frame): then no row was written."""
        link = self._link
        got = self._reads.result()
        per_page = len(link.read_plan.objects)
        out: list[bool] = []
        for n, row in enumerate(self._rows):
            page = slice(n * per_page, (n + 1) * per_page)
            if link._found_corrupt(got[page], self._keys[page], io) or any(
                    o is None for o in got[page]):
                out.append(False)
                continue
            link._copy_page(self._frames[page], row, io)
            out.append(True)
        return out


class PendingPageWrites(PutOver[PendingFrameWrites]):
    """Pages being stored by a backend's own job (``L3Link.start_write_pages``), kept or lost
    together as ``write_pages``'s: ``done()`` never waits, ``wait()`` waits for the put (its
    frames are not read after it returns), ``ended`` is when it ended (``time.monotonic()``;
    None: not yet). ``stored()`` waits, then whether every page was stored within the put's
    deadline; judged once (a lock: the caller's thread and another may both ask), the same
    answer every time. ``pages`` and ``nbytes``: the pages and the framed bytes put;
    ``parts``: the same per link (``start_write_links``' order)."""

    def __init__(self, writes: PendingFrameWrites, parts: Sequence[tuple[int, int]]) -> None:
        self._writes, self.parts = writes, tuple(parts)
        self.pages = sum(pages for pages, _ in self.parts)
        self.nbytes = sum(nbytes for _, nbytes in self.parts)
        self._lock = threading.Lock()
        self._stored: bool | None = None

    def stored(self) -> bool:
        with self._lock:
            if self._stored is None:
                self._stored = all(self._writes.result())
            return self._stored
