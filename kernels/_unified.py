"""The unified side of a copy: staging buffers and the head blocks of a unified page.

A unified host page is a sequence of head blocks (``UnifiedPageLayout.blocks``), each
``(layer, plane, token, head_in_block, dim)`` row-major. Consecutive blocks of equal head count
are evenly spaced, so they collapse into one *run* that a single strided view (torch) or a
single launch (Triton) covers: a TP shard or a full page on a uniform grid is one run; only a
shard whose head range cuts a head group has more. Every offset and stride below comes from the
layout layer (``element_offsets``, ``block_shape``, ``row_major_strides``); nothing is restated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from hicache_store.layout.host import UnifiedPageLayout, row_major_strides

from .pools import _INT_OF_SIZE, check_dtype


@dataclass(frozen=True)
class BlockRun:
    """``count`` evenly spaced head blocks of ``heads`` heads each.

    ``head0`` is the local (shard-relative) index of the run's first head, ``offset`` the
    element offset in the page of (first layer, plane 0, token 0, head ``head0``, dim 0),
    ``stride`` the element distance between consecutive blocks, and ``block_strides`` the
    element strides of a block's ``(layer, plane, token, head, dim)`` axes.
    """

    head0: int
    count: int
    heads: int
    offset: int
    stride: int
    block_strides: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return self.count * self.heads


@lru_cache(maxsize=256)
def block_runs(layout: UnifiedPageLayout) -> tuple[BlockRun, ...]:
    """The head blocks of ``layout`` grouped into runs (cached per layout)."""
    runs: list[BlockRun] = []
    for block in layout.blocks:
        offset = int(layout.element_offsets(layout.layer_start, 0, 0, block.head_start, 0))
        strides = row_major_strides(layout.block_shape(block))
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.heads == block.num_heads
            and (last.count == 1 or offset - last.offset == last.count * last.stride)
        ):
            stride = offset - last.offset if last.count == 1 else last.stride
            runs[-1] = BlockRun(
                last.head0, last.count + 1, last.heads, last.offset, stride, strides
            )
        else:
            head0 = block.head_start - layout.head_start
            # A lone block's stride is its own size (where a next block would start), never
            # 0: torch treats a zero stride in an output view as overlap and takes a slow path.
            size = block.nbytes // layout.namespace.itemsize
            runs.append(BlockRun(head0, 1, block.num_heads, offset, size, strides))
    return tuple(runs)


def staging_elements(
    staging: torch.Tensor, layout: UnifiedPageLayout, num_pages: int, device: torch.device
) -> torch.Tensor:
    """Validate a staging buffer and view it as ``[N, page_elements]`` integers of the KV size.

    Accepted: a 2-D tensor of any supported dtype, one row per page, each row exactly
    ``layout.page_bytes`` bytes, rows not overlapping, the row axis contiguous, on ``device``.
    """
    check_dtype("staging", staging)
    page_bytes = layout.page_bytes
    if staging.device != device:
        raise ValueError(f"staging: on {staging.device}, the pool is on {device}")
    if staging.dim() != 2 or staging.shape[0] != num_pages:
        raise ValueError(
            f"staging: shape {tuple(staging.shape)}, expected [{num_pages} pages, page row]"
        )
    if staging.shape[1] * staging.element_size() != page_bytes:
        raise ValueError(
            f"staging: rows of {staging.shape[1] * staging.element_size()} bytes, the unified "
            f"page of this shard has {page_bytes} bytes"
        )
    if staging.stride(1) != 1 or (num_pages > 1 and staging.stride(0) < staging.shape[1]):
        raise ValueError(
            f"staging: strides {tuple(staging.stride())}, each page row must be contiguous and "
            "rows must not overlap"
        )
    try:
        return staging.view(_INT_OF_SIZE[layout.namespace.itemsize])
    except RuntimeError as exc:
        raise ValueError(
            f"staging: cannot view as {layout.namespace.itemsize}-byte items "
            f"(row stride or offset not a multiple of the item size): {exc}"
        ) from None


def run_view(
    stage: torch.Tensor, run: BlockRun, layout: UnifiedPageLayout, layers: tuple[int, int]
) -> torch.Tensor:
    """``[N, count, layers, planes, P, heads, D]`` view of one run for local ``layers``."""
    ns = layout.namespace
    shape = (
        stage.shape[0],
        run.count,
        layout.num_layers,
        ns.kv_planes,
        ns.page_size,
        run.heads,
        ns.head_dim,
    )
    strides = (stage.stride(0), run.stride, *run.block_strides)
    view = stage.as_strided(shape, strides, stage.storage_offset() + run.offset)
    return view[:, :, layers[0] : layers[1]]


def local_layers(layout: UnifiedPageLayout, layers: tuple[int, int] | None) -> tuple[int, int]:
    """Validate a global half-open layer range and return it relative to the layout."""
    if layers is None:
        return 0, layout.num_layers
    start, stop = layers
    if not layout.layer_start <= start < stop <= layout.layer_stop:
        raise ValueError(
            f"layers: [{start}, {stop}) is not a non-empty part of the layout's layers "
            f"[{layout.layer_start}, {layout.layer_stop})"
        )
    return start - layout.layer_start, stop - layout.layer_start
