"""The Triton launcher: ``copy``, the same signature and contract as ``reference.copy``.

The public ops (``ops``) validate through ``plan_copy`` (shapes, strides, dtypes, devices, page
bounds, overlap, layer range); the launcher turns the validated plan's pool into a base tensor,
a table of (layer, plane) offsets from it and a ``[N, page_size]`` table of token offsets, and
launches ``kv_page_copy_kernel`` once per run of head blocks (one launch for a TP shard or a uniform full page). The kernel moves elements as
integers of the KV item size, so every dtype is byte-exact.

Tensors must be CUDA tensors, or CPU tensors when this process runs Triton's interpreter
(``TRITON_INTERPRET=1`` set before the kernel module was first imported; see
``_triton_kernel``). Triton itself is imported only when ``copy`` is first called.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ._plan import CopyPlan
from ._unified import BlockRun
from .pools import HostPool, as_bits

__all__ = ["copy"]

#: bytes one program moves: 16 KiB keeps a 4-warp program at 8 x 16-byte accesses per thread.
_TILE_BYTES = 16384


def _kernel() -> tuple[Any, bool]:
    from . import _triton_kernel

    return _triton_kernel.kv_page_copy_kernel, _triton_kernel.INTERPRETED


@dataclass(frozen=True)
class _PoolAddressing:
    """How the kernel reaches the pool: one base tensor and element offsets from it."""

    base: torch.Tensor  # integer view whose data pointer is the base
    lp_offsets: tuple[int, ...]  # per selected (layer, plane), elements from the base
    tokens: torch.Tensor  # [N, P] int64, elements from a (layer, plane) buffer's start
    token_strides: tuple[int, ...]  # the strides the token offsets are combinations of
    head_stride: int


def _pool_addressing(plan: CopyPlan) -> _PoolAddressing:
    l0, l1 = plan.layers
    pool = plan.pool
    page_size = plan.layout.namespace.page_size
    if isinstance(pool, HostPool):
        s_layer, s_plane, s_page, s_token, s_head, _ = pool.axis_strides
        planes = pool.paged.shape[1]
        offsets = tuple(
            layer * s_layer + p * s_plane for layer in range(l0, l1) for p in range(planes)
        )
        tokens = (plan.table // page_size) * s_page + (plan.table % page_size) * s_token
        return _PoolAddressing(as_bits(pool.buffer), offsets, tokens, (s_page, s_token), s_head)
    # Separate allocations are addressed from the first buffer: on a GPU (and in the
    # interpreter) a pointer is a flat address, so an offset may reach another allocation.
    first = pool.planes[0][0]
    item = first.element_size()
    deltas = [
        pool.planes[p][layer].data_ptr() - first.data_ptr()
        for layer in range(l0, l1)
        for p in range(len(pool.planes))
    ]
    if any(delta % item for delta in deltas):
        raise ValueError(f"device pool: buffer addresses are not {item}-byte aligned to each other")
    return _PoolAddressing(
        as_bits(first),
        tuple(delta // item for delta in deltas),
        plan.table * first.stride(0),
        (first.stride(0),),
        first.stride(1),
    )


def _alignment(plan: CopyPlan, addressing: _PoolAddressing, stage: torch.Tensor) -> int:
    """Largest power of two (at most 16 bytes' worth) dividing every row offset, in elements.

    The kernel promises the compiler (``tl.multiple_of``) that row offsets are multiples of
    this, which lets it emit 16-byte loads and stores; every term the offsets are built from is
    included, so the promise holds. The base pointers' alignment is Triton's to check.
    """
    ns = plan.layout.namespace
    terms = [ns.head_dim, addressing.head_stride, stage.stride(0), *addressing.lp_offsets]
    terms += list(addressing.token_strides)
    for run in plan.runs:
        terms += [run.offset + plan.layers[0] * run.block_strides[0], run.stride]
    align = max(1, 16 // ns.itemsize)
    while align > 1 and any(term % align for term in terms):
        align //= 2
    return align


def _check_run(plan: CopyPlan, run: BlockRun) -> None:
    # The kernel computes unified offsets as a row-major (layer, plane, token, head, dim)
    # block; refuse to run if the layout layer ever says otherwise.
    ns = plan.layout.namespace
    inner = run.heads * ns.head_dim
    expected = (ns.kv_planes * ns.page_size * inner, ns.page_size * inner, inner, ns.head_dim, 1)
    if run.block_strides != expected:
        raise ValueError(
            f"unified block strides {run.block_strides} are not the row-major {expected} the "
            "Triton kernel assumes"
        )


def copy(plan: CopyPlan, *, to_pool: bool) -> None:
    """Triton version of ``reference.copy`` (same contract): one launch per head-block run."""
    pack = not to_pool
    device = plan.pool.device
    kernel, interpreted = _kernel()
    if device.type != "cuda" and not (interpreted and device.type == "cpu"):
        raise ValueError(
            f"triton backend: tensors on {device}; it needs CUDA tensors, or CPU tensors with "
            "TRITON_INTERPRET=1 set before the kernels were first imported"
        )
    num_pages = plan.table.shape[0]
    if num_pages == 0:
        return
    addressing = _pool_addressing(plan)
    lp_table = _offset_table(addressing.lp_offsets, device)
    tokens = addressing.tokens.contiguous()
    stage = as_bits(plan.stage)
    ns = plan.layout.namespace
    align = _alignment(plan, addressing, stage)
    block_d = triton_next_power_of_2(ns.head_dim)
    for run in plan.runs:
        _check_run(plan, run)
        rows = ns.page_size * run.num_heads
        tile_rows = max(1, _TILE_BYTES // (block_d * ns.itemsize))
        block_r = min(triton_next_power_of_2(rows), tile_rows)
        stage_off = run.offset + plan.layers[0] * run.block_strides[0]
        grid = (num_pages, len(addressing.lp_offsets), -(-rows // block_r))
        kernel[grid](
            addressing.base,
            lp_table,
            tokens,
            stage,
            stage.stride(0),
            stage_off,
            run.stride,
            addressing.head_stride,
            run.head0,
            P=ns.page_size,
            HEADS=run.heads,
            NUM_HEADS=run.num_heads,
            D=ns.head_dim,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            ALIGN=align,
            PACK=pack,
        )


@lru_cache(maxsize=256)
def _offset_table(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Cached: pools live as long as the engine, so their buffer offsets repeat call after
    # call and the small host-to-device copy of the table is paid once per layer range.
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def triton_next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (``tl.arange`` needs power-of-two extents)."""
    return 1 << max(0, n - 1).bit_length()
