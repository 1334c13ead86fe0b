"""vLLM's CPU KV cache as a host layout (``PoolLayout("vllm_cpu")``) through the kernels.

The oracle is vLLM's own view of its cache, restated from ``CPUAttentionBackendImpl.forward``
(vLLM 0.32): each layer's ``[num_blocks, H, block_size, 2 * D]`` tensor is viewed as
``[num_blocks, H, 2 * block_size, D]`` and split in two on dim 2 into the key and value caches.
A token's K and V are read through that view, never through ``element_offsets``.
"""

from __future__ import annotations

import pytest
import torch

from hicache_store.kernels import HostPool, host_to_unified, unified_to_host
from hicache_store.layout.host import PoolLayout, UnifiedPageLayout
from hicache_store.layout.namespace import Grid, ModelShape, Namespace

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 3, 4, 8, 32, 6


def vllm_cache() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation holding every layer, and the per-layer tensors vLLM registers."""
    torch.manual_seed(1)
    whole = torch.randn(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM)
    return whole, [whole[layer] for layer in range(LAYERS)]


def vllm_kv(layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's key and value caches ``[blocks, H, block_size, D]`` of one layer."""
    blocks, heads, size, _ = layer_cache.shape
    return layer_cache.view(blocks, heads, size * 2, -1).chunk(2, dim=2)


def namespace(heads_per_group: int = HEADS) -> Namespace:
    shape = ModelShape.mha(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    return Namespace.create("m", shape, "float32", BLOCK, Grid(LAYERS, heads_per_group))


def host_pool(whole: torch.Tensor) -> HostPool:
    layout = PoolLayout("vllm_cpu", "mha", LAYERS, HEADS, DIM, BLOCK, BLOCKS)
    return HostPool(whole.view(layout.shape), layout)


def test_shape_and_strides_match_vllm_allocation() -> None:
    layout = PoolLayout("vllm_cpu", "mha", LAYERS, HEADS, DIM, BLOCK, BLOCKS)
    assert layout.shape == (LAYERS, BLOCKS, HEADS, 2, BLOCK, DIM)
    whole, _ = vllm_cache()
    assert layout.numel == whole.numel()


@pytest.mark.parametrize("heads_per_group", [HEADS, 2, 1])
def test_pack_reads_what_vllm_attention_reads(heads_per_group: int) -> None:
    whole, layers = vllm_cache()
    ns = namespace(heads_per_group)
    unified = UnifiedPageLayout.full_page(ns)
    pages = torch.tensor([4, 1, 3])
    staging = torch.empty(len(pages), unified.page_bytes // 4)
    host_to_unified(host_pool(whole), pages * BLOCK, staging, unified)
    for i, block in enumerate(pages.tolist()):
        for layer in range(LAYERS):
            key, value = vllm_kv(layers[layer])
            for plane, cache in ((0, key), (1, value)):
                for head in range(HEADS):
                    offsets = unified.element_offsets(
                        layer, plane, torch.arange(BLOCK)[:, None].numpy(), head,
                        torch.arange(DIM)[None, :].numpy(),
                    )
                    got = staging[i][torch.from_numpy(offsets)]
                    assert torch.equal(got, cache[block, head])


def test_unpack_writes_only_the_named_blocks_and_round_trips() -> None:
    whole, _ = vllm_cache()
    ns = namespace()
    unified = UnifiedPageLayout.full_page(ns)
    pages = torch.tensor([2, 5])
    staging = torch.empty(len(pages), unified.page_bytes // 4)
    host_to_unified(host_pool(whole), pages * BLOCK, staging, unified)
    original = whole.clone()
    target = torch.zeros_like(whole)
    unified_to_host(staging, host_pool(target), torch.tensor([0, 3]) * BLOCK, unified)
    for layer in range(LAYERS):
        for dst, src in ((0, 2), (3, 5)):
            assert torch.equal(target[layer, dst], original[layer, src])
        for untouched in (1, 2, 4, 5):
            assert not target[layer, untouched].any()
    assert torch.equal(whole, original)  # the source is unchanged


def test_layer_range_unpack_touches_only_those_layers() -> None:
    whole, _ = vllm_cache()
    unified = UnifiedPageLayout.full_page(namespace())
    staging = torch.empty(1, unified.page_bytes // 4)
    host_to_unified(host_pool(whole), torch.tensor([1]) * BLOCK, staging, unified)
    target = torch.zeros_like(whole)
    unified_to_host(staging, host_pool(target), torch.tensor([1]) * BLOCK, unified,
                    layers=(1, 2))
    assert torch.equal(target[1, 1], whole[1, 1])
    assert not target[0].any() and not target[2].any()


def test_mla_is_refused() -> None:
    with pytest.raises(ValueError, match="MHA only"):
        PoolLayout("vllm_cpu", "mla", LAYERS, 1, DIM, BLOCK, BLOCKS)
