"""Page lists: validation and normalisation to a token-slot table.

Callers name pages in one of two forms:

* a 1-D integer tensor ``[N]``: the slot of each page's first token (the page occupies slots
  ``start .. start + page_size - 1``), the form SGLang's ``host_indices[i * page_size]`` gives;
* a 2-D integer tensor ``[N, page_size]``: the slot of every token of every page (a slot
  table), for pools whose pages are not contiguous runs of slots.

Both normalise to the slot table. The torch reference then looks for page structure (every row
a consecutive run and all starts with the same residue modulo the page size), which turns the
copy into whole-page index ops; the Triton kernels use the table as it is.
"""

from __future__ import annotations

from functools import lru_cache

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


@lru_cache(maxsize=64)
def _token_steps(page_size: int, device: torch.device) -> torch.Tensor:
    # Cached per geometry: the 0..page_size-1 offsets every slot table is built from.
    return torch.arange(page_size, dtype=torch.int64, device=device)


def slot_table(
    pages: torch.Tensor,
    *,
    page_size: int,
    num_slots: int,
    device: torch.device,
    writes_pool: bool,
    check_indices: bool,
) -> torch.Tensor:
    """Validate ``pages`` and return its ``[N, page_size]`` int64 slot table.

    Raises ``ValueError`` naming the problem: a wrong dtype, rank, width or device; with
    ``check_indices`` also a slot outside ``[0, num_slots)`` and, when the operation writes the
    pool (``writes_pool``), a slot named twice, since two pages written to one slot race on
    the GPU and make the result depend on the order. Reading a page twice is allowed.
    ``check_indices`` costs a device synchronisation on the GPU; a caller that builds its page
    lists from trusted allocator state may turn it off.
    """
    if pages.dtype not in _INDEX_DTYPES:
        raise ValueError(f"pages: dtype {pages.dtype}, expected torch.int32 or torch.int64")
    if pages.device != device:
        raise ValueError(f"pages: on {pages.device}, the pool is on {device}")
    if pages.dim() == 1:
        table = pages.to(torch.int64)[:, None] + _token_steps(page_size, device)
    elif pages.dim() == 2 and pages.shape[1] == page_size:
        table = pages.to(torch.int64)
    else:
        raise ValueError(
            f"pages: shape {tuple(pages.shape)}, expected [N] first slots or "
            f"[N, {page_size}] slot table"
        )
    if check_indices:
        check_indices_in(table, num_slots, what="pages", unit="slot", of="the pool's ",
                         distinct=writes_pool)
    return table


def check_indices_in(
    indices: torch.Tensor, count: int, *, what: str, unit: str, of: str = "", distinct: bool
) -> None:
    """Every index in ``indices`` within ``[0, count)`` and, with ``distinct`` (the operation
    writes them), none named twice; else a ``ValueError`` naming the argument ``what``, its
    ``unit`` and the bounds (``of``: whose). Costs a device synchronisation on the GPU."""
    if not indices.numel():
        return
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= count:
        raise ValueError(f"{what}: {unit}s span [{low}, {high}], outside {of}[0, {count})")
    if distinct and torch.unique(indices).numel() != indices.numel():
        raise ValueError(f"{what}: a {unit} appears twice; {what} written must not overlap")


def page_structure(table: torch.Tensor, page_size: int) -> tuple[int, torch.Tensor] | None:
    """``(residue, page_ids)`` when the table is made of whole pages of one slot grid.

    That is: every row is ``start .. start + page_size - 1`` and every start has the same
    residue ``r`` modulo ``page_size``; then slot ``start + t`` is token ``t`` of page
    ``(start - r) // page_size`` of the pool viewed from slot ``r`` on. ``None`` otherwise.
    """
    if table.shape[0] == 0:
        return 0, table[:, 0]
    starts = table[:, 0]
    if not torch.equal(table, starts[:, None] + _token_steps(page_size, table.device)):
        return None
    residue = int(starts[0]) % page_size
    if not bool((starts % page_size == residue).all()):
        return None
    return residue, (starts - residue) // page_size
