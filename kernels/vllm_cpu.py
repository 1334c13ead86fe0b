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

``pack_block_runs`` / ``unpack_block_runs`` move caches whose block of one layer is one
contiguous run of bytes (vLLM's CPU MLA cache: a block's tokens of ``[kv_c | k_pe]``; a Mamba
or gated-delta-net state block: the state's tensors back to back), given as a ``[L, blocks,
R]`` byte view of any strides: staging row ``i`` is layer 0's run of block ``blocks[i]``,
then layer 1's, and so on (the unified page of an MLA namespace, and of a state namespace
whose "layers" are the model's state layers)::

    staging[i, l * R : (l + 1) * R]  ==  runs[l, blocks[i], :]
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hicache_store.layout.host import UnifiedPageLayout, VllmCpuLayout

from ._unified import local_layers, staging_elements
from .pools import as_bits, check_dtype

__all__ = ["pack_block_runs", "pack_blocks", "unpack_block_runs", "unpack_blocks"]


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


def _check_runs(
    runs: torch.Tensor, blocks: torch.Tensor, staging: torch.Tensor, *, writes_cache: bool
) -> torch.Tensor:
    """Validate a runs view and a staging buffer; ``staging`` as ``[N, L, R]`` bytes."""
    if runs.dtype not in (torch.uint8, torch.int8) or runs.dim() != 3:
        raise ValueError(f"runs: expected a [layers, blocks, run bytes] uint8/int8 view, got "
                         f"{runs.dtype} {tuple(runs.shape)}")
    if runs.device.type != "cpu" or runs.stride(2) != 1:
        raise ValueError(f"runs: on {runs.device}, strides {runs.stride()}: each run must be "
                         "contiguous bytes in host memory")
    layers, num_blocks, run = runs.shape
    if blocks.dtype not in (torch.int32, torch.int64) or blocks.dim() != 1:
        raise ValueError(f"blocks: expected a 1-D int32/int64 tensor, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    if blocks.numel():
        low, high = int(blocks.min()), int(blocks.max())
        if low < 0 or high >= num_blocks:
            raise ValueError(f"blocks: span [{low}, {high}], outside [0, {num_blocks})")
        if writes_cache and torch.unique(blocks).numel() != blocks.numel():
            raise ValueError("blocks: a block appears twice; blocks written must not overlap")
    if staging.device.type != "cpu" or staging.dim() != 2 or staging.shape[0] != blocks.numel():
        raise ValueError(f"staging: shape {tuple(staging.shape)} on {staging.device}, expected "
                         f"[{blocks.numel()} pages, page row] in host memory")
    row = staging.shape[1] * staging.element_size()
    if row != layers * run:
        raise ValueError(f"staging: rows of {row} bytes, a page of {layers} runs of {run} "
                         f"bytes has {layers * run}")
    if staging.stride(1) != 1 or (blocks.numel() > 1 and staging.stride(0) < staging.shape[1]):
        raise ValueError(f"staging: strides {tuple(staging.stride())}, each page row must be "
                         "contiguous and rows must not overlap")
    return staging.view(torch.uint8).view(blocks.numel(), layers, run)


def pack_block_runs(runs: torch.Tensor, blocks: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
    """Gather block ``blocks[i]``'s run of every layer of ``runs`` into staging row ``i``."""
    stage = _check_runs(runs, blocks, staging, writes_cache=False)
    picked = torch.index_select(runs.view(torch.uint8), 1, blocks.to(torch.int64))  # [L, N, R]
    stage.copy_(picked.transpose(0, 1))
    return staging


def unpack_block_runs(
    staging: torch.Tensor, runs: torch.Tensor, blocks: torch.Tensor, *,
    layers: tuple[int, int] | None = None,
) -> None:
    """Scatter staging rows into block ``blocks[i]`` of ``runs``; ``layers``: only that range
    of ``runs``' layers (nothing else is written)."""
    stage = _check_runs(runs, blocks, staging, writes_cache=True)
    l0, l1 = layers if layers is not None else (0, runs.shape[0])
    if not 0 <= l0 < l1 <= runs.shape[0]:
        raise ValueError(f"layers: [{l0}, {l1}) outside [0, {runs.shape[0]})")
    dst = runs.view(torch.uint8)[l0:l1]
    dst.index_copy_(1, blocks.to(torch.int64), stage[:, l0:l1].transpose(0, 1))
