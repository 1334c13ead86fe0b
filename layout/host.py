"""Host-memory layouts as index arithmetic: where the bytes of (page, layer, K/V, token, head) live.

Two families:

* ``UnifiedPageLayout``: one host page of a rank's shard in the ``page_unified`` order
  (head group, layer, K/V, token, head in group, dim).
  The page is a sequence of *head blocks*: the intersections of the grid's head groups with the
  shard's head range, in head order. Each block is ``(layer, plane, token, head_in_block, dim)``
  row-major over the shard's layers (``plane`` is K/V for MHA; MLA has one plane and one block).
  For a full page this is exactly ``(head_group, layer, K/V, token, head_in_group, dim)``, and
  for any shard the bytes of one stored object are one contiguous slice of the host page.
* ``PoolLayout``: SGLang's host pools (``layer_first``, ``page_first``, ``page_first_direct``,
  ``page_head``; MHA and MLA), whole-pool tensors with K and V split on the outermost axis.
* ``VllmCpuLayout``: vLLM 0.32's CPU paged KV cache (MHA), K and V inside each (block, head),
  K stored dim-major.

Both give shapes and row-major strides in *elements*; the kernels and the SGLang adapter take
every index from here. Nothing here allocates or copies.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np
import numpy.typing as npt

from .keys import ObjectCoords
from .namespace import Namespace
from .topology import HeadSpan, LayerHeadSpan, Shard

PoolLayoutName = Literal["layer_first", "page_first", "page_first_direct", "page_head"]
POOL_LAYOUTS: tuple[str, ...] = ("layer_first", "page_first", "page_first_direct", "page_head")
IntArray = npt.NDArray[np.int64]


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major array of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class HeadBlock(HeadSpan):
    """One head block of a unified host page.

    ``group`` is the grid head group it belongs to (``None`` for MLA); ``head_start`` /
    ``head_stop`` are global KV-head indices; ``offset`` and ``nbytes`` locate it in the page.
    """

    group: int | None
    head_start: int
    head_stop: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class UnifiedPageLayout(LayerHeadSpan):
    """The ``page_unified`` layout of one host page holding layers and heads of a shard."""

    namespace: Namespace
    layer_start: int
    layer_stop: int
    head_start: int
    head_stop: int

    def __post_init__(self) -> None:
        ns = self.namespace
        if not 0 <= self.layer_start < self.layer_stop <= ns.num_layers:
            raise ValueError(
                f"layers [{self.layer_start}, {self.layer_stop}) outside the model's {ns.num_layers}"
            )
        if not 0 <= self.head_start < self.head_stop <= ns.num_kv_heads:
            raise ValueError(
                f"heads [{self.head_start}, {self.head_stop}) outside the model's {ns.num_kv_heads}"
            )

    @classmethod
    def for_shard(cls, namespace: Namespace, shard: Shard) -> UnifiedPageLayout:
        return cls(
            namespace, shard.layer_start, shard.layer_stop, shard.head_start, shard.head_stop
        )

    @classmethod
    def full_page(cls, namespace: Namespace) -> UnifiedPageLayout:
        return cls(namespace, 0, namespace.num_layers, 0, namespace.num_kv_heads)

    @cached_property
    def blocks(self) -> tuple[HeadBlock, ...]:
        ns = self.namespace
        if not ns.uses_head_groups:
            size = self.num_layers * ns.layer_block_bytes(1)
            return (HeadBlock(None, 0, 1, 0, size),)
        hpg = ns.grid.heads_per_group
        blocks = []
        offset = 0
        for group in range(self.head_start // hpg, (self.head_stop - 1) // hpg + 1):
            start = max(self.head_start, group * hpg)
            stop = min(self.head_stop, (group + 1) * hpg)
            size = self.num_layers * ns.layer_block_bytes(stop - start)
            blocks.append(HeadBlock(group, start, stop, offset, size))
            offset += size
        return tuple(blocks)

    @property
    def page_bytes(self) -> int:
        last = self.blocks[-1]
        return last.offset + last.nbytes

    def block_of_head(self, head: int) -> HeadBlock:
        for block in self.blocks:
            if block.head_start <= head < block.head_stop:
                return block
        raise ValueError(f"head {head} is not in [{self.head_start}, {self.head_stop})")

    def block_shape(self, block: HeadBlock) -> tuple[int, ...]:
        """Element shape of a block: ``(layer, plane, token, head, dim)``."""
        ns = self.namespace
        return (self.num_layers, ns.kv_planes, ns.page_size, block.num_heads, ns.head_dim)

    def object_range(self, coords: ObjectCoords) -> tuple[int, int] | None:
        """Byte range ``[start, stop)`` of a whole object inside this page, if it lies inside.

        ``None`` when the page does not hold the object completely (its layers or the whole
        head group are not all in the shard).
        """
        if not (self.layer_start <= coords.layer_start and coords.layer_stop <= self.layer_stop):
            return None
        ns = self.namespace
        for block in self.blocks:
            if block.group == coords.head_group and (
                block.group is None
                or (block.head_start, block.head_stop) == ns.group_heads(block.group)
            ):
                per_layer = ns.layer_block_bytes(block.num_heads)
                start = block.offset + (coords.layer_start - self.layer_start) * per_layer
                return start, start + coords.num_layers * per_layer
        return None

    def element_offsets(
        self,
        layer: IntArray | int,
        plane: IntArray | int,
        token: IntArray | int,
        head: IntArray | int,
        dim: IntArray | int,
    ) -> IntArray:
        """Element offsets (units of the dtype) of global (layer, plane, token, head, dim).

        Vectorised: arguments broadcast like numpy arrays. Out-of-shard coordinates raise.
        """
        ns = self.namespace
        layer_a, plane_a, token_a, head_a, dim_a = np.broadcast_arrays(
            *(np.asarray(v, dtype=np.int64) for v in (layer, plane, token, head, dim))
        )
        checks = (
            ("layer", layer_a, self.layer_start, self.layer_stop),
            ("plane", plane_a, 0, ns.kv_planes),
            ("token", token_a, 0, ns.page_size),
            ("head", head_a, self.head_start, self.head_stop),
            ("dim", dim_a, 0, ns.head_dim),
        )
        for name, values, low, high in checks:
            if values.size and (values.min() < low or values.max() >= high):
                raise ValueError(f"{name} index outside [{low}, {high})")
        item = ns.itemsize
        starts = np.array([b.head_start for b in self.blocks], dtype=np.int64)
        block_index = np.searchsorted(starts, head_a, side="right") - 1
        block_heads = np.array([b.num_heads for b in self.blocks], dtype=np.int64)[block_index]
        block_base = np.array([b.offset // item for b in self.blocks], dtype=np.int64)[block_index]
        head_in_block = head_a - starts[block_index]
        # (layer, plane, token, head, dim) row-major inside the block.
        index = (layer_a - self.layer_start) * ns.kv_planes + plane_a
        index = index * ns.page_size + token_a
        index = index * block_heads + head_in_block
        index = index * ns.head_dim + dim_a
        return np.asarray(block_base + index, dtype=np.int64)


class _SlotPool(abc.ABC):
    """What the host-pool layouts share: storage of ``shape`` addressed by (plane, token slot,
    local layer, local head, dim). ``element_offsets`` broadcasts the coordinates to int64
    arrays; each layout's ``_offsets`` maps them to its storage order and checks their range."""

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The storage's dimensions, outermost first."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def element_offsets(
        self,
        plane: IntArray | int,
        slot: IntArray | int,
        layer: IntArray | int,
        head: IntArray | int,
        dim: IntArray | int,
    ) -> IntArray:
        """Element offsets of (plane, token slot, local layer, local head, dim); vectorised.
        Out-of-range coordinates raise ``ValueError``."""
        plane_a, slot_a, layer_a, head_a, dim_a = np.broadcast_arrays(
            *(np.asarray(v, dtype=np.int64) for v in (plane, slot, layer, head, dim))
        )
        return self._offsets(plane_a, slot_a, layer_a, head_a, dim_a)

    @abc.abstractmethod
    def _offsets(
        self, plane: IntArray, slot: IntArray, layer: IntArray, head: IntArray, dim: IntArray
    ) -> IntArray:
        """``element_offsets`` of coordinates already broadcast to int64 arrays."""


@dataclass(frozen=True)
class PoolLayout(_SlotPool):
    """One of SGLang's host-pool layouts for a rank: shape and element strides of its tensor.

    ``num_layers`` and ``num_heads`` are the rank's local counts; the pool holds ``num_pages``
    pages of ``page_size`` token slots. MHA shapes (K/V outermost)::

        layer_first        (2, L, slots, H, D)
        page_first         (2, slots, L, H, D)
        page_first_direct  (2, pages, L, page_size, H, D)
        page_head          (2, pages, H, page_size, L, D)

    MLA drops the K/V axis and has one head: ``layer_first (L, slots, 1, D)``,
    ``page_first (slots, L, 1, D)``, ``page_first_direct (pages, L, page_size, 1, D)``;
    ``page_head`` does not exist for MLA.
    """

    name: PoolLayoutName
    kv_kind: Literal["mha", "mla"]
    num_layers: int
    num_heads: int
    head_dim: int
    page_size: int
    num_pages: int

    def __post_init__(self) -> None:
        if self.name not in POOL_LAYOUTS:
            raise ValueError(f"layout: {self.name!r} is not one of {', '.join(POOL_LAYOUTS)}")
        if self.kv_kind == "mla" and (self.name == "page_head" or self.num_heads != 1):
            raise ValueError("MLA host pools have one head and no page_head layout")
        for field in ("num_layers", "num_heads", "head_dim", "page_size", "num_pages"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}: must be positive")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def shape(self) -> tuple[int, ...]:
        L, H, D, P, N = (
            self.num_layers,
            self.num_heads,
            self.head_dim,
            self.page_size,
            self.num_pages,
        )
        per_plane = {
            "layer_first": (L, N * P, H, D),
            "page_first": (N * P, L, H, D),
            "page_first_direct": (N, L, P, H, D),
            "page_head": (N, H, P, L, D),
        }[self.name]
        return ((2, *per_plane)) if self.kv_kind == "mha" else per_plane

    @property
    def strides(self) -> tuple[int, ...]:
        return row_major_strides(self.shape)

    def _offsets(
        self, plane: IntArray, slot: IntArray, layer: IntArray, head: IntArray, dim: IntArray
    ) -> IntArray:
        # docstring inherited (``element_offsets``)
        page, token = np.divmod(slot, self.page_size)
        coords = {
            "layer_first": (layer, slot, head, dim),
            "page_first": (slot, layer, head, dim),
            "page_first_direct": (page, layer, token, head, dim),
            "page_head": (page, head, token, layer, dim),
        }[self.name]
        if self.kv_kind == "mha":
            coords = (plane, *coords)
        offset = np.zeros(plane.shape, dtype=np.int64)
        for index, size, stride in zip(coords, self.shape, self.strides, strict=True):
            if index.size and (index.min() < 0 or index.max() >= size):
                raise ValueError(f"index outside the pool's shape {self.shape}")
            offset += index * stride
        return offset


@dataclass(frozen=True)
class VllmCpuLayout(_SlotPool):
    """vLLM 0.32's CPU paged KV cache of one rank (``CPUAttentionBackend``), MHA.

    vLLM allocates every layer in one tensor (its layout ``LBHNC``) and registers each layer as
    ``[num_blocks, H, block_size, 2 * D]``; the attention kernel (ISA ``vec``) splits a
    (block, head) run of ``2 * block_size * D`` elements into the K half, then the V half, and
    stores **K dim-major** (``[D, block_size]``: the block's tokens are contiguous per dim) and
    V token-major (``[block_size, D]``). Checked against vLLM's own
    ``cpu_attn_reshape_and_cache`` (``tests/vllm``, and by the connector at start-up). So the
    storage is ``(L, blocks, H, K/V, block_size * D)`` and the per-plane strides differ: this is
    not one of the affine ``PoolLayout`` s. Pages are vLLM blocks (a connector with another
    page size moves segments of them: ``layout.blocks``).
    """

    num_layers: int
    num_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive")

    @property
    def shape(self) -> tuple[int, ...]:
        """The storage as vLLM allocates it: ``(L, blocks, H, 2, block_size * D)``."""
        return (self.num_layers, self.num_blocks, self.num_heads, 2,
                self.block_size * self.head_dim)

    def plane_strides(self, plane: int) -> tuple[int, int, int, int, int]:
        """Element strides of (layer, block, token, head, dim) within ``plane`` (0 = K, 1 = V);
        the plane starts ``plane * block_size * D`` elements into each (block, head) run."""
        _, B, H, _, run = self.shape
        head = 2 * run
        block = H * head
        layer = B * block
        if plane == 0:
            return (layer, block, 1, head, self.block_size)
        if plane == 1:
            return (layer, block, self.head_dim, head, 1)
        raise ValueError(f"plane {plane} is not 0 (K) or 1 (V)")

    def _offsets(
        self, plane: IntArray, slot: IntArray, layer: IntArray, head: IntArray, dim: IntArray
    ) -> IntArray:
        # docstring inherited (``element_offsets``); slot ``s`` is token ``s % block_size`` of
        # block ``s // block_size``
        block, token = np.divmod(slot, self.block_size)
        for name, values, size in (
            ("plane", plane, 2), ("block", block, self.num_blocks),
            ("layer", layer, self.num_layers), ("head", head, self.num_heads),
            ("dim", dim, self.head_dim),
        ):
            if values.size and (values.min() < 0 or values.max() >= size):
                raise ValueError(f"{name} index outside [0, {size})")
        run = self.block_size * self.head_dim
        base = ((layer * self.num_blocks + block) * self.num_heads + head) * 2 * run
        inner = np.where(plane == 0, dim * self.block_size + token, token * self.head_dim + dim)
        return np.asarray(base + plane * run + inner, dtype=np.int64)
