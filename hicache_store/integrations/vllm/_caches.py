"""vLLM's per-layer CPU caches of one KV cache group, as the kernels see them (worker side).

``GroupCache`` packs vLLM blocks of one group (``_groups.GroupPart``) into unified page rows and
unpacks rows into blocks, through ``kernels.vllm_cpu``:

* ``mha`` groups (full and sliding-window attention): vLLM's ``LBHNC`` cache, every layer of
  the group a consecutive slice of one allocation (``vllm_cpu_cache``), held to vLLM's own
  cache writer at start-up (``check_cache_layout``); ``pack_blocks`` / ``unpack_blocks``.
* ``mla`` groups: ``[blocks, 1, block, latent]`` per layer, one contiguous run per block;
  ``state`` groups: vLLM's raw page per block, the state's tensors back to back at its start
  (padding after them). Both as a ``[layers, blocks, run]`` byte view (``runs_view``: the layers
  at one stride in one allocation, every stride checked); ``pack_block_runs`` /
  ``unpack_block_runs``.

Every layout assumption is checked when the cache is built; a mismatch is a ``ConfigError``
naming it (the worker refuses to start rather than move wrong bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache_store.kernels.vllm_cpu import (
    pack_block_runs,
    pack_blocks,
    unpack_block_runs,
    unpack_blocks,
)
from hicache_store.layout.errors import ConfigError
from hicache_store.layout.host import UnifiedPageLayout, VllmCpuLayout, row_major_strides

from ._groups import MHA, GroupPart

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def vllm_cpu_cache(
    tensors: Sequence[torch.Tensor], heads: int, head_dim: int, block_size: int
) -> tuple[torch.Tensor, VllmCpuLayout]:
    """vLLM's per-layer CPU KV tensors as one storage and its layout, every assumption checked.

    Each layer must be ``[blocks, heads, block_size, 2 * head_dim]``, contiguous, and the layers
    consecutive slices of one allocation (vLLM 0.32's ``LBHNC`` CPU cache).
    """
    first = tensors[0]
    expected = (first.shape[0], heads, block_size, 2 * head_dim)
    per_layer = int(np.prod(expected))
    for i, t in enumerate(tensors):
        if tuple(t.shape) != expected or not t.is_contiguous():
            raise ConfigError(
                f"HiCacheStoreConnector: KV layer {i} is {tuple(t.shape)} strides {t.stride()}; "
                f"expected a contiguous [blocks, heads, block_size, 2 * head_dim] = {expected} "
                "(vLLM's CPU attention cache)"
            )
        if t.device.type != "cpu" or t.dtype != first.dtype:
            raise ConfigError(
                f"HiCacheStoreConnector: KV layer {i} on {t.device} {t.dtype}; only vLLM's CPU "
                "cache is supported"
            )
        same = t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not same or t.storage_offset() != first.storage_offset() + i * per_layer:
            raise ConfigError(
                "HiCacheStoreConnector: vLLM's KV layers are not consecutive slices of one "
                "allocation (layout LBHNC expected)"
            )
    layout = VllmCpuLayout(len(tensors), heads, head_dim, block_size, int(first.shape[0]))
    whole = first.as_strided(layout.shape, row_major_strides(layout.shape),
                             first.storage_offset())
    return whole, layout


def check_cache_layout(
    vllm_config: VllmConfig, dtype: torch.dtype, heads: int, head_dim: int, block_size: int
) -> None:
    """Hold ``VllmCpuLayout`` to vLLM's own cache writer for this deployment's attention ISA.

    Writes random K and V (exact in ``dtype``) into block 1 of a scratch two-block cache with
    ``cpu_attn_reshape_and_cache``, as vLLM's attention does, and reads them back through the
    layout's offsets. Refuses to start (``ConfigError``) on any difference.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache_dtype = vllm_config.cache_config.cache_dtype
    isa = _get_attn_isa(vllm_config.model_config.dtype, block_size, head_dim, cache_dtype)
    layout = VllmCpuLayout(1, heads, head_dim, block_size, 2)
    scratch = torch.zeros(layout.shape, dtype=dtype)
    per_layer = scratch[0].view(2, heads, 2 * block_size, head_dim)
    key_cache, value_cache = per_layer.chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn((block_size, heads, head_dim), generator=gen).to(dtype)
    value = torch.randn((block_size, heads, head_dim), generator=gen).to(dtype)
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)  # block 1
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                   kv_cache_dtype=cache_dtype)
    t, h, d = np.meshgrid(np.arange(block_size), np.arange(heads), np.arange(head_dim),
                          indexing="ij")
    flat = scratch.reshape(-1)
    for plane, written in ((0, key), (1, value)):
        at = torch.from_numpy(layout.element_offsets(plane, block_size + t, 0, h, d))
        if not torch.equal(flat[at], written):
            raise ConfigError(
                f"HiCacheStoreConnector: vLLM's CPU KV cache layout for attention ISA {isa!r} "
                f"({dtype}) is not the one this connector knows ({'K' if plane == 0 else 'V'} "
                "differs); this ISA is not supported"
            )


def runs_view(tensors: Sequence[torch.Tensor], run_bytes: int, what: str) -> torch.Tensor:
    """The layers' tensors as one ``[layers, blocks, run_bytes]`` uint8 view: block ``b`` of
    layer ``l`` is one contiguous run at the start of the tensor's block ``b``. The tensors
    must share one allocation, at one stride from each other, with equal shapes and strides."""
    first = tensors[0]
    blocks = int(first.shape[0])
    item = first.element_size()
    block_stride = first.stride(0) * item
    inner = first[0]
    if not inner.is_contiguous() or inner.numel() * item < run_bytes:
        raise ConfigError(f"HiCacheStoreConnector: {what} layer block {tuple(inner.shape)} "
                          f"strides {inner.stride()} is not {run_bytes} contiguous bytes")
    if block_stride < run_bytes:
        raise ConfigError(f"HiCacheStoreConnector: {what} blocks are {block_stride} bytes "
                          f"apart, runs of {run_bytes} bytes would overlap")
    base = first.untyped_storage().data_ptr()
    starts = [t.storage_offset() * t.element_size() for t in tensors]
    step = starts[1] - starts[0] if len(tensors) > 1 else blocks * block_stride
    for i, t in enumerate(tensors):
        if (t.untyped_storage().data_ptr() != base or t.shape != first.shape
                or t.stride() != first.stride() or t.dtype != first.dtype
                or starts[i] != starts[0] + i * step or t.device.type != "cpu"):
            raise ConfigError(f"HiCacheStoreConnector: {what} layer {i} is not at one stride "
                              "from the others in one host allocation")
    if len(tensors) > 1 and step < blocks * block_stride and step > 0:
        raise ConfigError(f"HiCacheStoreConnector: {what} layers overlap")
    raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
    return raw.as_strided((len(tensors), blocks, run_bytes), (step, block_stride, 1), starts[0])


@dataclass
class GroupCache:
    """One group's vLLM blocks <-> unified page rows of its part (see the module docstring)."""

    part: GroupPart
    layout: UnifiedPageLayout
    cache: torch.Tensor  # mha: the whole group as one tensor; else a runs view
    cache_layout: VllmCpuLayout | None = None

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    def pack(self, blocks: torch.Tensor, staging: torch.Tensor) -> None:
        if self.cache_layout is not None:
            pack_blocks(self.cache, self.cache_layout, blocks, staging, self.layout)
        else:
            pack_block_runs(self.cache, blocks, staging)

    def unpack(self, staging: torch.Tensor, blocks: torch.Tensor,
               layers: tuple[int, int] | None = None) -> None:
        """``layers``: only that range of the group's own (local) layers."""
        if self.cache_layout is not None:
            start = self.layout.layer_start
            unpack_blocks(staging, self.cache, self.cache_layout, blocks, self.layout,
                          layers=None if layers is None else (start + layers[0],
                                                              start + layers[1]))
        else:
            unpack_block_runs(staging, self.cache, blocks, layers=layers)


def group_cache(
    part: GroupPart, tensors: Sequence[torch.Tensor], layout: UnifiedPageLayout,
    vllm_config: VllmConfig,
) -> GroupCache:
    """The cache of ``part`` over vLLM's per-layer ``tensors`` (in the part's layer order),
    for the unified ``layout`` of this rank's shard; every assumption checked."""
    ns = part.namespace
    if part.kind == MHA:
        heads = layout.head_stop - layout.head_start
        cache, cache_layout = vllm_cpu_cache(tensors, heads, ns.head_dim, ns.page_size)
        check_cache_layout(vllm_config, cache.dtype, heads, ns.head_dim, ns.page_size)
        return GroupCache(part, layout, cache, cache_layout)
    run = layout.page_bytes // layout.num_layers
    return GroupCache(part, layout, runs_view(tensors, run, part.name))
