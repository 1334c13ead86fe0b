"""Launcher-side validation shared by the torch reference and the Triton kernels.

``plan_copy`` checks every assumption the copy makes (pool against layout, staging shape and
strides, page indices, layer range) and returns the validated, normalised pieces; after it, the
reference and the kernels trust their inputs (the nano-vllm split: the launcher validates, the
kernel trusts). Every failure is a ``ValueError`` that names the offending argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache_store.layout.host import UnifiedPageLayout

from ._pages import slot_table
from ._unified import BlockRun, block_runs, local_layers, staging_elements
from .pools import DevicePool, HostPool


@dataclass(frozen=True)
class CopyPlan:
    """A validated copy between ``pool`` and the unified pages in ``stage``.

    ``table`` is the ``[N, page_size]`` int64 slot table, ``stage`` the staging buffer viewed
    as ``[N, page_elements]`` integers of the KV item size, ``layers`` the local half-open
    layer range to move and ``runs`` the unified page's head-block runs.
    """

    pool: DevicePool | HostPool
    layout: UnifiedPageLayout
    table: torch.Tensor
    stage: torch.Tensor
    layers: tuple[int, int]
    runs: tuple[BlockRun, ...]


def plan_copy(
    pool: DevicePool | HostPool,
    pages: torch.Tensor,
    staging: torch.Tensor,
    layout: UnifiedPageLayout,
    *,
    layers: tuple[int, int] | None,
    writes_pool: bool,
    check_indices: bool,
) -> CopyPlan:
    if not isinstance(pool, (DevicePool, HostPool)):
        raise ValueError(f"pool: expected a DevicePool or HostPool, got {type(pool).__name__}")
    if not isinstance(layout, UnifiedPageLayout):
        raise ValueError(f"layout: expected a UnifiedPageLayout, got {type(layout).__name__}")
    pool.check_against(layout)
    table = slot_table(
        pages,
        page_size=layout.namespace.page_size,
        num_slots=pool.num_slots,
        device=pool.device,
        writes_pool=writes_pool,
        check_indices=check_indices,
    )
    stage = staging_elements(staging, layout, table.shape[0], pool.device)
    if stage.untyped_storage().data_ptr() in _pool_storages(pool):
        raise ValueError("staging: shares memory with the pool; the copy would read its own output")
    return CopyPlan(pool, layout, table, stage, local_layers(layout, layers), block_runs(layout))


def _pool_storages(pool: DevicePool | HostPool) -> set[int]:
    if isinstance(pool, HostPool):
        return {pool.buffer.untyped_storage().data_ptr()}
    return {buf.untyped_storage().data_ptr() for plane in pool.planes for buf in plane}
