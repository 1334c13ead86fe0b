"""The public ops, written once: check the pool kind, validate, then run the chosen copy.

Each op moves KV between a pool (``DevicePool`` or ``HostPool``) and unified pages in a
caller-owned staging buffer ``[N, page_bytes]``; ``reference`` states the contract in index
notation. Every op validates its arguments through ``plan_copy`` (a ``ValueError`` naming the
bad argument) and hands the validated ``CopyPlan`` to one of two implementations of the same
``copy(plan, *, to_pool)``: ``reference`` (torch index ops; the specification) or
``triton_ops`` (one Triton kernel).

``backend="auto"`` (the default) runs the Triton kernel for CUDA tensors when triton is
installed and the torch reference otherwise (CPU tensors, or CUDA without triton: the
reference's index ops run on any device). ``"torch"`` and ``"triton"`` force one; tests use
``"triton"`` on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from types import ModuleType
from typing import Literal

import torch

from hicache_store.layout.host import UnifiedPageLayout

from . import reference, triton_ops
from ._plan import plan_copy
from .pools import DevicePool, HostPool

Backend = Literal["auto", "torch", "triton"]

__all__ = ["Backend", "host_to_unified", "pack_pages", "unified_to_host", "unpack_pages"]


@cache
def triton_available() -> bool:
    """Whether triton can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def implementation(backend: Backend, device: torch.device) -> ModuleType:
    """The module (``reference`` or ``triton_ops``) whose ``copy`` runs an op for ``device``."""
    if backend == "torch":
        return reference
    if backend == "triton":
        return triton_ops
    if backend == "auto":
        return triton_ops if device.type == "cuda" and triton_available() else reference
    raise ValueError(f"backend: {backend!r} is not one of 'auto', 'torch', 'triton'")


def pack_pages(
    pool: DevicePool,
    pages: torch.Tensor,
    staging: torch.Tensor,
    layout: UnifiedPageLayout,
    *,
    layers: tuple[int, int] | None = None,
    check_indices: bool = True,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Gather ``pages`` of a device pool into ``staging`` in unified order; returns ``staging``.

    ``pages``: ``[N]`` first slots or ``[N, page_size]`` slot table (int32/int64, on the pool's
    device). ``staging``: ``[N, layout.page_bytes]`` bytes (any supported dtype whose rows are
    that many bytes). ``layers``: optional global half-open layer range; only those layers'
    bytes of the staging rows are written.
    """
    _run("pack_pages", DevicePool, pool, pages, staging, layout, layers, check_indices, backend,
         to_pool=False)
    return staging


def unpack_pages(
    staging: torch.Tensor,
    pool: DevicePool,
    pages: torch.Tensor,
    layout: UnifiedPageLayout,
    *,
    layers: tuple[int, int] | None = None,
    check_indices: bool = True,
    backend: Backend = "auto",
) -> None:
    """Scatter unified pages from ``staging`` into the device pool's ``pages``.

    The inverse of ``pack_pages``. ``layers`` restores only that global layer range, for
    layer-wise loading (compute on layer ``i`` while ``i + 1`` is still in flight). Pages must
    not overlap (checked with ``check_indices``).
    """
    _run("unpack_pages", DevicePool, pool, pages, staging, layout, layers, check_indices, backend,
         to_pool=True)


def host_to_unified(
    host: HostPool,
    pages: torch.Tensor,
    staging: torch.Tensor,
    layout: UnifiedPageLayout,
    *,
    layers: tuple[int, int] | None = None,
    check_indices: bool = True,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Relayout ``pages`` of a host pool into unified pages in ``staging``; returns ``staging``.

    Same contract as ``pack_pages`` with the host pool as the source; ``pages`` are the host
    pool's token slots (SGLang's ``host_indices``), first slots or a slot table.
    """
    _run("host_to_unified", HostPool, host, pages, staging, layout, layers, check_indices,
         backend, to_pool=False)
    return staging


def unified_to_host(
    staging: torch.Tensor,
    host: HostPool,
    pages: torch.Tensor,
    layout: UnifiedPageLayout,
    *,
    layers: tuple[int, int] | None = None,
    check_indices: bool = True,
    backend: Backend = "auto",
) -> None:
    """Relayout unified pages from ``staging`` into a host pool (the inverse of the above)."""
    _run("unified_to_host", HostPool, host, pages, staging, layout, layers, check_indices,
         backend, to_pool=True)


def _run(
    op: str,
    kind: type[DevicePool] | type[HostPool],
    pool: DevicePool | HostPool,
    pages: torch.Tensor,
    staging: torch.Tensor,
    layout: UnifiedPageLayout,
    layers: tuple[int, int] | None,
    check_indices: bool,
    backend: Backend,
    *,
    to_pool: bool,
) -> None:
    """The one wrapper behind the four ops: pool kind, backend, validation, then the copy."""
    if not isinstance(pool, kind):
        raise ValueError(f"{op}: pool must be a {kind.__name__}, got {type(pool).__name__}")
    impl = implementation(backend, pool.device)
    plan = plan_copy(
        pool, pages, staging, layout, layers=layers, writes_pool=to_pool,
        check_indices=check_indices,
    )
    impl.copy(plan, to_pool=to_pool)
