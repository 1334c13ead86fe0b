"""The torch reference: the specification of every copy, and the CPU implementation.

The four public ops (``ops.pack_pages``, ``unpack_pages``, ``host_to_unified``,
``unified_to_host``) validate their arguments into a ``CopyPlan`` and run ``copy`` here or its
twin with the same signature in ``triton_ops``. Each op moves KV between a pool (``DevicePool`` or ``HostPool``) and unified pages in a staging
buffer ``[N, page_bytes]`` (row ``i`` is page ``i`` of ``pages``, in ``page_unified`` order for
``layout``). In index notation, for every selected page ``i`` with slot table row ``s``, local
layer ``l`` in ``layers``, plane ``p``, token ``t``, local head ``h`` and dim ``d``::

    staging[i] @ layout.element_offsets(layer_start + l, p, t, head_start + h, d)
        ==  pool[l][p][s[t], h, d]

``pack_pages`` / ``host_to_unified`` establish it by writing the staging rows;
``unpack_pages`` / ``unified_to_host`` by writing the pool's selected slots. Nothing else is
written: other pages, other layers and other bytes of the destination keep their contents.
Bytes move as integers, so float8 values and NaN payloads are copied exactly.

How the torch code does it without a Python loop per page or per layer: the pool is viewed as
one strided tensor ``[layers, planes, pages, page_size, heads, dim]`` and the staging run of
head blocks as a permuted view with the same axes, and one index op moves all selected pages of
all layers (``index_select`` into the staging view, ``index_put_`` back). Each page of each
(layer, plane) is a contiguous run of ``page_size * heads * dim`` elements on both sides when
the run spans the shard's heads, so the op streams memory like a plain copy. Two cases use more
than one call: a device pool whose layers are separate allocations (one call per (layer,
plane) buffer: a torch call addresses one storage; each call still moves every page), and a
shard whose head range cuts a head group (one call per run of equal blocks). Slot tables that are
not whole pages of one grid use advanced indexing (``index.Tensor_out`` / ``index_put_``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ._pages import page_structure
from ._plan import CopyPlan
from ._unified import BlockRun, run_view
from ._views import coalesce, widen
from .pools import DevicePool, HostPool, as_bits

__all__ = ["copy"]


def copy(plan: CopyPlan, *, to_pool: bool) -> None:
    """Run a validated copy: staging rows -> the pool's slots (``to_pool``) or the reverse.

    ``plan`` comes from ``plan_copy`` (the public ops in ``ops`` build it), so nothing here is
    checked again.
    """
    ns = plan.layout.namespace
    page_size = ns.page_size
    structure = page_structure(plan.table, page_size)
    for run in plan.runs:
        unified = as_bits(run_view(plan.stage, run, plan.layout, plan.layers))
        # [N, count, L, planes, P, heads, D] -> [L, planes, N, P, count, heads, D]
        unified = unified.permute(2, 3, 0, 4, 1, 5, 6)
        for pool_view, lsel, psel in _pool_views(plan, run):
            target = unified[lsel, psel]
            if structure is not None and (isinstance(plan.pool, DevicePool) or structure[0] == 0):
                residue, page_ids = structure
                paged = _paged(plan.pool, pool_view, residue, page_size)
                _page_copy(paged, page_ids, target, to_pool=to_pool)
            else:
                _token_copy(plan, pool_view, target, to_pool=to_pool)


def _page_copy(
    paged: torch.Tensor, page_ids: torch.Tensor, target: torch.Tensor, *, to_pool: bool
) -> None:
    """Whole pages: ``target[:, :, i] <-> paged[:, :, page_ids[i]]`` as one index op.

    Pages go to the front (the index axis), the rest is widened and coalesced (``_views``)
    so that each page moves as a few long runs. Gathering is ``index_select`` into the
    staging view; scattering is ``index_put_``, which copies whole runs per index (faster
    than ``index_copy_``, which looks up the index per element). Page ids are distinct for
    scatters (validated), so ``index_put_`` without accumulation is deterministic.
    """
    pool_side, stage_side = widen(paged.movedim(2, 0), target.movedim(2, 0))
    pool_side, stage_side = coalesce(pool_side, stage_side, 1, 1)
    if to_pool:
        pool_side.index_put_((page_ids,), stage_side)
    else:
        torch.index_select(pool_side, 0, page_ids, out=stage_side)


def _pool_views(plan: CopyPlan, run: BlockRun) -> Iterator[tuple[torch.Tensor, slice, slice]]:
    """Views ``[L', planes', <slot axes>, count, heads, D]`` of the pool for a head run.

    The slot axes are ``(slots,)`` for a device pool and ``(pages, page_size)`` for a host
    pool. Yields one view with every selected layer when the pool is one storage, else one per
    (layer, plane) buffer with the staging slices it pairs with.
    """
    l0, l1 = plan.layers

    def heads(view: torch.Tensor) -> torch.Tensor:
        picked = view.narrow(-2, run.head0, run.num_heads)
        return picked.view(*picked.shape[:-2], run.count, run.heads, picked.shape[-1])

    pool = plan.pool
    if isinstance(pool, HostPool):
        yield heads(as_bits(pool.paged)[l0:l1]), slice(None), slice(None)
        return
    stacked = pool.stacked
    if stacked is not None:
        yield heads(as_bits(stacked)[l0:l1]), slice(None), slice(None)
        return
    # Separate allocations: one call per buffer (see the module docstring).
    for p, buffers in enumerate(pool.planes):
        for layer in range(l0, l1):
            view = as_bits(buffers[layer])[None, None]
            yield heads(view), slice(layer - l0, layer - l0 + 1), slice(p, p + 1)


def _paged(
    pool: DevicePool | HostPool, view: torch.Tensor, residue: int, page_size: int
) -> torch.Tensor:
    """``[L', planes', pages, P, ...]``: a device view's slots from ``residue`` cut into pages."""
    if isinstance(pool, HostPool):
        return view
    usable = (view.shape[2] - residue) // page_size
    whole = view.narrow(2, residue, usable * page_size)
    return whole.view(*whole.shape[:2], usable, page_size, *whole.shape[3:])


def _token_copy(
    plan: CopyPlan, pool_view: torch.Tensor, target: torch.Tensor, *, to_pool: bool
) -> None:
    """Slot-by-slot copy for slot tables that are not whole pages of one grid."""
    table = plan.table
    if isinstance(plan.pool, HostPool):
        page_size = plan.layout.namespace.page_size
        # [L', planes', pages, P, ...] -> [pages, P, L', planes', ...]
        front = pool_view.movedim((2, 3), (0, 1))
        indices = [table // page_size, table % page_size]
    else:
        front = pool_view.movedim(2, 0)  # [slots, L', planes', ...]
        indices = [table]
    target_front = target.movedim((2, 3), (0, 1))  # [N, P, L', planes', ...]
    front, target_front = widen(front, target_front)
    front, target_front = coalesce(front, target_front, len(indices), 2)
    if to_pool:
        front.index_put_(tuple(indices), target_front)
    else:
        torch.ops.aten.index.Tensor_out(front, indices, out=target_front)
