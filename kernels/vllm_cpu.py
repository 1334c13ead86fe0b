"""Pack / unpack between vLLM 0.32's CPU paged KV cache and unified pages (torch, CPU).

vLLM's CPU cache (``layout.host.VllmCpuLayout``) stores K dim-major and V token-major inside
each (block, head), so its two planes have different strides: the affine pool views of
``reference`` (one stride per axis for both planes) cannot describe it. These two ops take
each plane's strides from the layout layer (``VllmCpuLayout.plane_strides``) and the unified
page's head blocks from ``UnifiedPageLayout.blocks``, and move each (plane, head block) with
one index op over every selected segment and layer.

The unified page's size may be the block size, a multiple of it or a divisor of it
(``layout.blocks.BlockPages``): a page is ``segments_per_page`` *segments* of
``segment = min(page, block)`` tokens, each at a *segment slot* of the cache (slot ``s``:
tokens ``(s % segments_per_block) * segment`` on of block ``s // segments_per_block``; where
page and block are equal, slots are block ids). ``slots`` names the segment slots of every
page, in order (``N * segments_per_page`` of them for ``N`` staging rows). Contract, for every
page ``i``, its segment ``j`` at slot ``s = slots[i * segments_per_page + j]``, local layer
``l``, plane ``p``, token ``t < segment``, local head ``h``, dim ``d``::

    staging[i] @ unified.element_offsets(layer_start + l, p, j * segment + t, head_start + h, d)
        ==  cache @ vllm.element_offsets(p, slot_token(s) + t, l, h, d)

where ``slot_token(s) = (s // per_block) * block_size + (s % per_block) * segment``.
``pack_blocks`` establishes it by writing staging rows; ``unpack_blocks`` by writing the
cache's selected segments (only the given layers; a slot ``layout.blocks.SKIP`` is not
written; nothing else is written). Bytes move as integers (exact for every dtype). The
launcher checks every assumption and raises ``ValueError`` naming it.

``pack_block_runs`` / ``unpack_block_runs`` move caches whose block of one layer is one
contiguous run of bytes (vLLM's CPU MLA cache: a block's tokens of ``[kv_c | k_pe]``; a Mamba
or gated-delta-net state block: the state's tensors back to back), given as a ``[L, blocks,
R]`` byte view of any strides: staging row ``i`` is layer 0's run of block ``blocks[i]``,
then layer 1's, and so on (the unified page of an MLA namespace, and of a state namespace
whose "layers" are the model's state layers)::

    staging[i, l * R : (l + 1) * R]  ==  runs[l, blocks[i], :]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from hicache_store.layout.blocks import SKIP, BlockPages
from hicache_store.layout.host import UnifiedPageLayout, VllmCpuLayout

from ._pages import check_indices_in
from ._unified import local_layers, staging_elements
from .pools import as_bits, check_dtype

__all__ = ["pack_block_runs", "pack_blocks", "unpack_block_runs", "unpack_blocks"]


def _check(
    cache: torch.Tensor,
    layout: VllmCpuLayout,
    slots: torch.Tensor,
    staging: torch.Tensor,
    unified: UnifiedPageLayout,
    *,
    writes_cache: bool,
) -> tuple[torch.Tensor, BlockPages]:
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
            ("itemsize", cache.element_size(), ns.itemsize),
        )
        if got != want
    ]
    if wrong:
        raise ValueError("vLLM CPU cache does not match the unified layout: " + "; ".join(wrong))
    geometry = BlockPages(ns.page_size, layout.block_size)  # (raises when neither divides)
    if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
        raise ValueError(f"slots: expected a 1-D int32/int64 tensor, got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    per_page = geometry.segments_per_page
    if slots.numel() % per_page:
        raise ValueError(f"slots: {slots.numel()} segment slots, not whole pages of "
                         f"{per_page} segments")
    named = slots[slots != SKIP] if writes_cache else slots
    check_indices_in(named, layout.num_blocks * geometry.segments_per_block, what="slots",
                     unit="segment slot", distinct=writes_cache)
    stage = staging_elements(staging, unified, slots.numel() // per_page, cache.device)
    return stage, geometry


def _plane(cache: torch.Tensor, layout: VllmCpuLayout, plane: int,
           geometry: BlockPages) -> torch.Tensor:
    """``[L, blocks, segments per block, segment, H, D]`` view of one plane, as integers."""
    seg = geometry.segment
    shape = (layout.num_layers, layout.num_blocks, geometry.segments_per_block, seg,
             layout.num_heads, layout.head_dim)
    layer, block, token, head, dim = layout.plane_strides(plane)
    offset = plane * layout.block_size * layout.head_dim
    bits = as_bits(cache)
    return bits.as_strided(shape, (layer, block, seg * token, token, head, dim),
                           bits.storage_offset() + offset)


def _unified_views(
    stage: torch.Tensor, unified: UnifiedPageLayout, plane: int, geometry: BlockPages
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Per head block: (first local head, heads, ``[N, L, segments per page, segment, heads,
    D]`` view of ``plane``)."""
    ns = unified.namespace
    item = ns.itemsize
    for block in unified.blocks:
        start = block.offset // item
        part = stage[:, start:start + block.nbytes // item]
        view = part.view(stage.shape[0], unified.num_layers, ns.kv_planes,
                         geometry.segments_per_page, geometry.segment, block.num_heads,
                         ns.head_dim)
        yield block.head_start - unified.head_start, block.num_heads, view[:, :, plane]


def pack_blocks(
    cache: torch.Tensor,
    layout: VllmCpuLayout,
    slots: torch.Tensor,
    staging: torch.Tensor,
    unified: UnifiedPageLayout,
) -> torch.Tensor:
    """Gather the segments at ``slots`` (every one named) of every layer into unified rows of
    ``staging``, one row per ``segments_per_page`` slots."""
    stage, geometry = _check(cache, layout, slots, staging, unified, writes_cache=False)
    index = slots.to(torch.int64)
    whole = geometry.segments_per_block == 1
    if whole:
        # Whole blocks: gather each named block's run of each layer first (one contiguous
        # run of the storage each: a memcpy), then reorder from that compact copy, in the
        # slots' order already: a view of it. An index op over the strided plane view itself
        # makes torch copy the WHOLE cache contiguous first: its cost grew with vLLM's cache,
        # not with the pages (7 ms for one page of a 32 MiB cache against 0.2 ms:
        # bench/bench_kernels_vllm_cpu.py).
        cache = as_bits(cache).view(layout.num_layers, layout.num_blocks, -1).index_select(
            1, index)
        layout = dataclasses.replace(layout, num_blocks=index.numel())
    else:
        blocks, parts = index // geometry.segments_per_block, index % geometry.segments_per_block
    rows = stage.shape[0]
    for plane in (0, 1):
        src = _plane(cache, layout, plane, geometry)
        for h0, nh, dst in _unified_views(stage, unified, plane, geometry):
            heads = src[..., h0:h0 + nh, :]
            # [L, M, seg, h, D]
            picked = heads[:, :, 0] if whole else heads[:, blocks, parts]
            shaped = picked.view(picked.shape[0], rows, geometry.segments_per_page,
                                 *picked.shape[2:])
            dst.copy_(shaped.transpose(0, 1))
    return staging


def unpack_blocks(
    staging: torch.Tensor,
    cache: torch.Tensor,
    layout: VllmCpuLayout,
    slots: torch.Tensor,
    unified: UnifiedPageLayout,
    *,
    layers: tuple[int, int] | None = None,
) -> None:
    """Scatter unified rows into the segments at ``slots`` (``SKIP``: not written);
    ``layers``: only that global range."""
    stage, geometry = _check(cache, layout, slots, staging, unified, writes_cache=True)
    l0, l1 = local_layers(unified, layers)
    index = slots.to(torch.int64)
    keep = index != SKIP
    every = bool(keep.all())
    if not every:
        index = index[keep]
    blocks, parts = index // geometry.segments_per_block, index % geometry.segments_per_block
    for plane in (0, 1):
        dst = _plane(cache, layout, plane, geometry)[l0:l1]
        for h0, nh, src in _unified_views(stage, unified, plane, geometry):
            # [N, L, per page, seg, h, D] -> [N * per page, L, seg, h, D]: one entry per slot
            rows = src[:, l0:l1].transpose(1, 2).flatten(0, 1)
            if not every:
                rows = rows[keep]
            target = dst[..., h0:h0 + nh, :]
            if geometry.segments_per_block == 1:
                target[:, :, 0].index_copy_(1, blocks, rows.transpose(0, 1))
            else:  # [blocks, per block, L, seg, h, D]: the slots' two indices lead
                target.permute(1, 2, 0, 3, 4, 5).index_put_((blocks, parts), rows)


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
    check_indices_in(blocks, num_blocks, what="blocks", unit="cache block",
                     distinct=writes_cache)
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
