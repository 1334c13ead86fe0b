"""Write and read plans: which objects a rank writes, and which byte ranges it reads.

A plan depends only on (namespace, topology, rank), so it is computed once and cached
(``plan_writes`` / ``plan_reads`` are memoised); applying it to a page is arithmetic-free
slicing. Byte offsets in a plan are relative to:

* the rank's host page in the ``page_unified`` layout (``UnifiedPageLayout.for_shard``), and
* an object's *payload* (the framing header comes first; ``ObjectRead.object_ranges`` adds its
  length).

Writers: a rank writes the objects its shard covers completely; among replicas only replica 0
writes. A shard that does not align with the grid (its layer range does not start and end on
chunk boundaries, or its heads do not cover whole head groups) cannot write and is refused with
a ``GridMismatchError`` naming grids that would work. Every byte of a page is written by exactly
one rank of a valid writer topology.

Readers: any topology can read. A layer sub-range of an object is a range read of just those
layer blocks; a subset of a head group is read as the whole group (for the needed layers) and
sliced. ``ReadPlan.read_amplification`` is bytes fetched over bytes needed (payload only;
headers are reported apart).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from .errors import GridMismatchError
from .framing import payload_offset
from .host import UnifiedPageLayout
from .keys import ObjectCoords, key_tail, validate_page_hash
from .namespace import MAX_LAYERS_PER_OBJECT, Grid, ModelShape, Namespace
from .topology import Shard, Topology, head_range, shard_of

ByteArray = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Segment:
    """A strided byte copy: ``count`` runs of ``run`` bytes.

    Run ``i`` goes from ``src_offset + i * src_stride`` to ``dst_offset + i * dst_stride``.
    A single contiguous copy has ``count == 1``.
    """

    src_offset: int
    dst_offset: int
    run: int
    count: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.run * self.count

    def src_end(self) -> int:
        return self.src_offset + (self.count - 1) * self.src_stride + self.run

    def dst_end(self) -> int:
        return self.dst_offset + (self.count - 1) * self.dst_stride + self.run


def apply_segments(segments: Iterable[Segment], src: ByteArray, dst: ByteArray) -> None:
    """Execute byte copies from ``src`` to ``dst`` (1-D uint8 arrays); bounds are checked."""
    for seg in segments:
        if seg.src_end() > src.size or seg.dst_end() > dst.size:
            raise ValueError(f"{seg} does not fit src {src.size} / dst {dst.size} bytes")
        if seg.count == 1:
            dst[seg.dst_offset : seg.dst_offset + seg.run] = src[
                seg.src_offset : seg.src_offset + seg.run
            ]
            continue
        src_view = np.lib.stride_tricks.as_strided(
            src[seg.src_offset :], shape=(seg.count, seg.run), strides=(seg.src_stride, 1)
        )
        dst_view = np.lib.stride_tricks.as_strided(
            dst[seg.dst_offset :], shape=(seg.count, seg.run), strides=(seg.dst_stride, 1)
        )
        dst_view[...] = src_view


@dataclass(frozen=True)
class ObjectWrite:
    """One object a rank writes: its coordinates and where its payload lies in the host page."""

    coords: ObjectCoords
    page_offset: int
    nbytes: int


_Object = TypeVar("_Object", "ObjectWrite", "ObjectRead")


@dataclass(frozen=True)
class _KeyedPlan(Generic[_Object]):
    """What a write plan and a read plan share: the deployment and rank they were made for,
    the rank's host page, its objects, and their per-page keys without re-validating the
    constant parts."""

    namespace: Namespace
    topology: Topology
    shard: Shard
    page: UnifiedPageLayout
    objects: tuple[_Object, ...]

    @cached_property
    def key_tails(self) -> tuple[str, ...]:
        """``_{namespace digest}_{suffix}`` of each object, in plan order."""
        return tuple(key_tail(self.namespace.digest, o.coords) for o in self.objects)

    def object_keys(self, page_hash: str, *, trusted: bool = False) -> list[str]:
        """The storage keys of this plan's objects for one page (same order as ``objects``).

        Only the page hash is validated here; the rest was validated when the plan was built.
        ``trusted=True`` skips that check for hashes this library computed itself
        (``hashing.page_hashes``), which the cache tier does; hashes from outside (an engine's
        keys) must be checked. This is the per-page planning work: a few string concatenations.
        """
        if not trusted:
            validate_page_hash(page_hash)
        return [page_hash + tail for tail in self.key_tails]


@dataclass(frozen=True)
class WritePlan(_KeyedPlan[ObjectWrite]):
    """The objects a rank writes for each page (``plan_writes``)."""

    @property
    def bytes_per_page(self) -> int:
        return sum(o.nbytes for o in self.objects)


@dataclass(frozen=True)
class ObjectRead:
    """One object a rank reads: the payload range to fetch and how it lands in the host page.

    ``fetch_start``/``fetch_stop`` are payload-relative; ``segments`` copy from the fetched
    bytes (offset 0 = ``fetch_start``) into the host page. ``layer_start``/``layer_stop`` are
    the layers fetched (for checksum verification).
    """

    coords: ObjectCoords
    fetch_start: int
    fetch_stop: int
    payload_bytes: int
    layer_start: int
    layer_stop: int
    segments: tuple[Segment, ...]
    #: the namespace seals its objects (their headers are longer past 246 layers).
    sealed: bool = False

    @property
    def fetch_bytes(self) -> int:
        return self.fetch_stop - self.fetch_start

    @property
    def header_bytes(self) -> int:
        return payload_offset(self.coords.num_layers, sealed=self.sealed)

    @property
    def is_whole(self) -> bool:
        return self.fetch_start == 0 and self.fetch_stop == self.payload_bytes

    def object_ranges(self) -> tuple[tuple[int, int], ...]:
        """Object-absolute ranges to read: the header, then the payload range (merged when
        the payload range starts at the payload's beginning)."""
        header = self.header_bytes
        if self.fetch_start == 0:
            return ((0, header + self.fetch_stop),)
        return ((0, header), (header + self.fetch_start, header + self.fetch_stop))


@dataclass(frozen=True)
class ReadPlan(_KeyedPlan[ObjectRead]):
    """The objects a rank reads for each page and where they land (``plan_reads``)."""

    @property
    def bytes_needed(self) -> int:
        return self.page.page_bytes

    @property
    def bytes_fetched(self) -> int:
        return sum(o.fetch_bytes for o in self.objects)

    @property
    def header_bytes(self) -> int:
        return sum(o.header_bytes for o in self.objects)

    @property
    def read_amplification(self) -> float:
        return self.bytes_fetched / self.bytes_needed


# -- grids --------------------------------------------------------------------------------------


def _divisors_desc(n: int) -> list[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def _layer_granularity(num_layers: int, topologies: Iterable[Topology]) -> int:
    """The largest chunk size every stage boundary of every topology falls on."""
    g = 0
    for topology in topologies:
        for start, _stop in topology.stage_layers(num_layers)[1:]:
            g = math.gcd(g, start)
    g = g or num_layers
    return next(d for d in _divisors_desc(g) if d <= MAX_LAYERS_PER_OBJECT)


def _head_granularity(shape: ModelShape, replication: str, topologies: Iterable[Topology]) -> int:
    """The largest head-group size every topology's TP shards cover whole groups of."""
    if shape.kv_kind == "mla":
        return 1
    g = 0
    for topology in topologies:
        start, stop, _replica, _n = head_range(shape, replication, topology.tp_size, 0)
        g = math.gcd(g, stop - start)
    return g or shape.num_kv_heads


def suggest_grid(
    shape: ModelShape, topologies: Sequence[Topology], replication: str | None = None
) -> Grid:
    """The coarsest grid that every listed topology can both write and read.

    Coarsest means fewest objects per page: chunks as long as the common divisor of all PP
    stage boundaries allows, head groups as wide as the narrowest TP shard.
    """
    if not topologies:
        raise ValueError("suggest_grid needs at least one topology")
    mode = replication or ("replicated" if shape.kv_kind == "mla" else "head_sharded")
    return Grid(
        _layer_granularity(shape.num_layers, topologies),
        _head_granularity(shape, mode, topologies),
    )


def compatible_grids(namespace: Namespace, topology: Topology) -> tuple[tuple[int, int], ...]:
    """Up to six ``(layers_per_chunk, heads_per_group)`` grids this topology can write,
    coarsest first."""
    coarsest = suggest_grid(namespace.shape, [topology], namespace.replication)
    layer_options = _divisors_desc(coarsest.layers_per_chunk)[:3]
    head_options = _divisors_desc(coarsest.heads_per_group)[:2]
    return tuple((lpc, hpg) for lpc in layer_options for hpg in head_options)


def _check_writer_alignment(namespace: Namespace, topology: Topology, shard: Shard) -> None:
    hpg = namespace.grid.heads_per_group
    layers_ok = namespace.is_chunk_boundary(shard.layer_start) and namespace.is_chunk_boundary(
        shard.layer_stop
    )
    heads_ok = shard.head_start % hpg == 0 and shard.head_stop % hpg == 0
    if layers_ok and heads_ok:
        return
    options = compatible_grids(namespace, topology)
    problems = []
    if not layers_ok:
        grid = namespace.grid
        chunks = (
            f"chunks of {grid.layers_per_chunk}"
            if grid.layer_starts is None
            else f"the chunks starting at layers {grid.layer_starts}"
        )
        problems.append(f"layers [{shard.layer_start}, {shard.layer_stop}) do not fall on {chunks}")
    if not heads_ok:
        problems.append(
            f"KV heads [{shard.head_start}, {shard.head_stop}) do not cover whole groups of {hpg}"
        )
    listed = ", ".join(f"{lpc_}x{hpg_}" for lpc_, hpg_ in options)
    raise GridMismatchError(
        f"{topology} rank {shard.rank} cannot write grid {namespace.grid}: "
        f"{'; '.join(problems)}. Grids it can write (layers x heads): {listed}",
        options,
    )


# -- plans --------------------------------------------------------------------------------------


def _chunks_overlapping(namespace: Namespace, start: int, stop: int) -> range:
    return range(namespace.chunk_of_layer(start), namespace.chunk_of_layer(stop - 1) + 1)


@lru_cache(maxsize=1024)
def plan_writes(namespace: Namespace, topology: Topology, rank: int) -> WritePlan:
    """The objects ``rank`` writes for each page (empty for non-writing replicas).

    Raises ``GridMismatchError`` if the rank's shard does not align with the grid.
    """
    shard = shard_of(namespace, topology, rank)
    page = UnifiedPageLayout.for_shard(namespace, shard)
    _check_writer_alignment(namespace, topology, shard)
    if not shard.is_writer:
        return WritePlan(namespace, topology, shard, page, ())
    objects = []
    for block in page.blocks:
        for chunk in _chunks_overlapping(namespace, shard.layer_start, shard.layer_stop):
            start, stop = namespace.chunk_layers(chunk)
            coords = ObjectCoords(start, stop, block.group)
            where = page.object_range(coords)
            if where is None:  # pragma: no cover - excluded by the alignment check
                raise AssertionError(f"{coords} not inside an aligned shard")
            objects.append(ObjectWrite(coords, where[0], where[1] - where[0]))
    return WritePlan(namespace, topology, shard, page, tuple(objects))


@lru_cache(maxsize=1024)
def plan_reads(namespace: Namespace, topology: Topology, rank: int) -> ReadPlan:
    """The objects ``rank`` reads for each page, the ranges to fetch and where they land."""
    shard = shard_of(namespace, topology, rank)
    page = UnifiedPageLayout.for_shard(namespace, shard)
    ns = namespace
    row = ns.head_dim * ns.itemsize  # bytes of one head's vector for one token
    reads = []
    for block in page.blocks:
        group_heads = (
            ns.group_heads(block.group) if block.group is not None else (0, ns.num_kv_heads)
        )
        group_width = group_heads[1] - group_heads[0]
        object_block = ns.layer_block_bytes(group_width)  # one layer of the stored object
        page_block = ns.layer_block_bytes(block.num_heads)  # one layer in the host page
        for chunk in _chunks_overlapping(ns, shard.layer_start, shard.layer_stop):
            chunk_start, chunk_stop = ns.chunk_layers(chunk)
            first = max(chunk_start, shard.layer_start)
            last = min(chunk_stop, shard.layer_stop)
            fetch_start = (first - chunk_start) * object_block
            fetch_stop = (last - chunk_start) * object_block
            dst = block.offset + (first - shard.layer_start) * page_block
            if block.num_heads == group_width:
                segment = Segment(0, dst, fetch_stop - fetch_start)
            else:  # a head subset: every (layer, plane, token) row is sliced
                segment = Segment(
                    src_offset=(block.head_start - group_heads[0]) * row,
                    dst_offset=dst,
                    run=block.num_heads * row,
                    count=(last - first) * ns.kv_planes * ns.page_size,
                    src_stride=group_width * row,
                    dst_stride=block.num_heads * row,
                )
            reads.append(
                ObjectRead(
                    coords=ObjectCoords(chunk_start, chunk_stop, block.group),
                    fetch_start=fetch_start,
                    fetch_stop=fetch_stop,
                    payload_bytes=ns.object_payload_bytes(chunk),
                    layer_start=first,
                    layer_stop=last,
                    segments=(segment,),
                    sealed=ns.sealed,
                )
            )
    return ReadPlan(namespace, topology, shard, page, tuple(reads))
