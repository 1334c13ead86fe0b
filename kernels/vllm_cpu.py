"""Pack / unpack between vLLM 0.32's CPU paged KV cache and unified pages (torch, CPU).

vLLM's CPU cache (``layout.host.VllmCpuLayout``) stores K dim-major and V token-major inside
each (block, head), so its two planes have different strides: the affine pool views of
``reference`` (one stride per axis for both planes) cannot describe it. These two ops take
each plane's strides from the layout layer (``VllmCpuLayout.plane_strides``) and the unified
page's head blocks from ``UnifiedPageLayout.blocks``, and move each (plane, head block) with
one index op over every selected block and layer. Contract, for every selected block ``i``
(vLLM block ``blocks[i]``), local layer ``l``, plane ``p``, token ``t``, local head ``h``, dim
``d``::

    staging[i] @ unified.element_offsets(layer_start + l, p, t, head_start + h, d)
        ==  cache @ vllm.element_offsets(p, blocks[i] * block_size + t, l, h, d)

``pack_blocks`` establishes it by writing staging rows; ``unpack_blocks`` by writing the
cache's selected blocks (only the given layers; nothing else is written). Bytes move as
integers (exact for every dtype). The launcher checks every assumption and raises
``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hicache_store.layout.host import UnifiedPageLayout, VllmCpuLayout

from ._unified import local_layers, staging_elements
from .pools import as_bits, check_dtype

__all__ = ["pack_blocks", "unpack_blocks"]


def _check(
    cache: torch.Tensor,
    layout: VllmCpuLayout,
    blocks: torch.Tensor,
    staging: torch.Tensor,
    unified: UnifiedPageLayout,
    *,
    writes_cache: bool,
) -> torch.Tensor:
    ns = unified.namespace
    check_dtype("cache", cache)
    if cache.device.type != "cpu" or not cache.is_contiguous() or cache.numel() != layout.numel:
        raise ValueError(
            f"cache: expected a contiguous CPU tensor of {layout.numel} elements "
            f"{layout.shape}, got {tuple(cache.shape)} on {cache.device}"
        )
    wrong = [
        f"{name} {got} (unified page needs {want})"
        for name, got, want in (
            ("kv_kind", "mha", ns.kv_kind),
            ("layers", layout.num_layers, unified.num_layers),
            ("heads", layout.num_heads, unified.num_heads),
            ("head_dim", layout.head_dim, ns.head_dim),
            ("block_size", layout.block_size, ns.page_size),
            ("itemsize", cache.element_size(), ns.itemsize),
        )
        if got != want
    ]
    if wrong:
        raise ValueError("vLLM CPU cache does not match the unified layout: " + "; ".join(wrong))
    if blocks.dtype not in (torch.int32, torch.int64) or blocks.dim() != 1:
        raise ValueError(f"blocks: expected a 1-D int32/int64 tensor, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    if blocks.numel():
        low, high = int(blocks.min()), int(blocks.max())
        if low < 0 or high >= layout.num_blocks:
            raise ValueError(f"blocks: span [{low}, {high}], outside [0, {layout.num_blocks})")
        if writes_cache and torch.unique(blocks).numel() != blocks.numel():
            raise ValueError("blocks: a block appears twice; blocks written must not overlap")
    return staging_elements(staging, unified, blocks.numel(), cache.device)


def _plane(cache: torch.Tensor, layout: VllmCpuLayout, plane: int) -> torch.Tensor:
    """``[L, blocks, block_size, H, D]`` view of one plane of the cache, as integers."""
    shape = (layout.num_layers, layout.num_blocks, layout.block_size, layout.num_heads,
             layout.head_dim)
    offset = plane * layout.block_size * layout.head_dim
    bits = as_bits(cache)
    return bits.as_strided(shape, layout.plane_strides(plane), bits.storage_offset() + offset)


def _unified_views(
    stage: torch.Tensor, unified: UnifiedPageLayout, plane: int
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Per head block: (first local head, heads, ``[N, L, P, heads, D]`` view of ``plane``)."""
    ns = unified.namespace
    item = ns.itemsize
    for block in unified.blocks:
        start = block.offset // item
        part = stage[:, start:start + block.nbytes // item]
        view = part.view(stage.shape[0], unified.num_layers, ns.kv_planes, ns.page_size,
                         block.num_heads, ns.head_dim)
        yield block.head_start - unified.head_start, block.num_heads, view[:, :, plane]


def pack_blocks(
    cache: torch.Tensor,
    layout: VllmCpuLayout,
    blocks: torch.Tensor,
    staging: torch.Tensor,
    unified: UnifiedPageLayout,
) -> torch.Tensor:
    """Gather vLLM blocks ``blocks`` of every layer into unified rows of ``staging``."""
    stage = _check(cache, layout, blocks, staging, unified, writes_cache=False)
    index = blocks.to(torch.int64)
    for plane in (0, 1):
        src = _plane(cache, layout, plane)
        for h0, nh, dst in _unified_views(stage, unified, plane):
            picked = torch.index_select(src[:, :, :, h0:h0 + nh], 1, index)  # [L, N, P, h, D]
            dst.copy_(picked.transpose(0, 1))
    return staging


def unpack_blocks(
    staging: torch.Tensor,
    cache: torch.Tensor,
    layout: VllmCpuLayout,
    blocks: torch.Tensor,
    unified: UnifiedPageLayout,
    *,
    layers: tuple[int, int] | None = None,
) -> None:
    """Scatter unified rows into vLLM blocks ``blocks``; ``layers``: only that global range."""
    stage = _check(cache, layout, blocks, staging, unified, writes_cache=True)
    l0, l1 = local_layers(unified, layers)
    index = blocks.to(torch.int64)
    for plane in (0, 1):
        dst = _plane(cache, layout, plane)[l0:l1]
        for h0, nh, src in _unified_views(stage, unified, plane):
            dst[:, :, :, h0:h0 + nh].index_copy_(1, index, src[:, l0:l1].transpose(0, 1))
