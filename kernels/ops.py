"""The public ops: choose the Triton kernels or the torch reference by device.

``backend="auto"`` (the default) runs the Triton kernel for CUDA tensors when triton is
installed and the torch reference otherwise (CPU tensors, or CUDA without triton: the
reference's index ops run on any device). ``"torch"`` and ``"triton"`` force one; tests use
``"triton"`` on CPU tensors under ``TRITON_INTERPRET=1``. Contracts are those of ``reference``.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from types import ModuleType
from typing import Literal

import torch

from hicache_store.layout.host import UnifiedPageLayout

from . import reference, triton_ops
from .pools import DevicePool, HostPool

Backend = Literal["auto", "torch", "triton"]

__all__ = ["Backend", "host_to_unified", "pack_pages", "unified_to_host", "unpack_pages"]


@cache
def triton_available() -> bool:
    """Whether triton can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def implementation(backend: Backend, device: torch.device) -> ModuleType:
    """The module (``reference`` or ``triton_ops``) that runs an op for ``device``."""
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
    """Gather device-pool pages into unified staging rows (see ``reference.pack_pages``)."""
    impl = implementation(backend, pool.device)
    result: torch.Tensor = impl.pack_pages(
        pool, pages, staging, layout, layers=layers, check_indices=check_indices
    )
    return result


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
    """Scatter unified staging rows into device-pool pages (see ``reference.unpack_pages``)."""
    impl = implementation(backend, pool.device)
    impl.unpack_pages(staging, pool, pages, layout, layers=layers, check_indices=check_indices)


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
    """SGLang host pool pages to unified rows (see ``reference.host_to_unified``)."""
    impl = implementation(backend, host.device)
    result: torch.Tensor = impl.host_to_unified(
        host, pages, staging, layout, layers=layers, check_indices=check_indices
    )
    return result


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
    """Unified rows to SGLang host pool pages (see ``reference.unified_to_host``)."""
    impl = implementation(backend, host.device)
    impl.unified_to_host(staging, host, pages, layout, layers=layers, check_indices=check_indices)
