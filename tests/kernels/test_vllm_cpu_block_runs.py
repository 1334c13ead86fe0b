"""``kernels.vllm_cpu.pack_block_runs`` / ``unpack_block_runs``: caches whose block of one layer is
one contiguous run of bytes (vLLM's CPU MLA cache, a recurrent-state block), held to the
contract byte by byte, on a strided view (layers apart by more than their blocks, blocks
padded), with the source unchanged and memory outside the selected runs untouched."""

from __future__ import annotations

import pytest
import torch

from hicache_store.kernels.vllm_cpu import pack_block_runs, unpack_block_runs
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Grid, ModelShape, Namespace

LAYERS, BLOCKS, RUN, PADDED, LAYER_GAP = 3, 7, 40, 64, 16


def storage() -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes and a ``[L, blocks, RUN]`` view of them: each block padded to ``PADDED``
    bytes, each layer ``LAYER_GAP`` bytes after the previous one's last block."""
    gen = torch.Generator().manual_seed(3)
    layer_stride = BLOCKS * PADDED + LAYER_GAP
    raw = torch.randint(0, 256, (LAYERS * layer_stride,), generator=gen, dtype=torch.uint8)
    return raw, raw.as_strided((LAYERS, BLOCKS, RUN), (layer_stride, PADDED, 1))


def test_pack_gathers_each_layers_run_of_each_block_in_order() -> None:
    raw, runs = storage()
    before = raw.clone()
    blocks = torch.tensor([5, 0, 3])
    staging = torch.full((3, LAYERS * RUN), 0xEE, dtype=torch.uint8)
    pack_block_runs(runs, blocks, staging)
    for i, b in enumerate(blocks.tolist()):
        for layer in range(LAYERS):
            assert torch.equal(staging[i, layer * RUN:(layer + 1) * RUN], runs[layer, b])
    assert torch.equal(raw, before)  # the source is unchanged


@pytest.mark.parametrize("layers", [None, (1, 3), (0, 1)])
def test_unpack_writes_exactly_the_selected_runs(layers: tuple[int, int] | None) -> None:
    raw, runs = storage()
    before = raw.clone()
    blocks = torch.tensor([2, 6], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    staging = torch.randint(0, 256, (2, LAYERS * RUN), generator=gen, dtype=torch.uint8)
    unpack_block_runs(staging, runs, blocks, layers=layers)
    l0, l1 = layers or (0, LAYERS)
    expected = before.clone()
    view = expected.as_strided(runs.shape, runs.stride())
    for i, b in enumerate(blocks.tolist()):
        for layer in range(l0, l1):
            view[layer, b] = staging[i, layer * RUN:(layer + 1) * RUN]
    assert torch.equal(raw, expected)  # those runs, and not one byte else


def test_round_trip_through_an_mla_namespaces_unified_page() -> None:
    """The staging row is the unified page of an MLA namespace: ``(layer, token, latent)``."""
    tokens, latent = 4, 5
    ns = Namespace.create("m", ModelShape.mla(LAYERS, latent), "float16", tokens,
                          Grid(LAYERS, 1))
    assert UnifiedPageLayout.full_page(ns).page_bytes == LAYERS * tokens * latent * 2
    cache = torch.randn(LAYERS, BLOCKS, tokens, latent).to(torch.float16)
    runs = cache.view(torch.uint8).view(LAYERS, BLOCKS, tokens * latent * 2)
    blocks = torch.tensor([1, 4])
    staging = torch.empty((2, UnifiedPageLayout.full_page(ns).page_bytes), dtype=torch.uint8)
    pack_block_runs(runs, blocks, staging)
    page = staging.view(torch.float16).view(2, LAYERS, tokens, latent)
    assert torch.equal(page, cache[:, blocks].transpose(0, 1))
    restored = torch.zeros_like(cache)
    unpack_block_runs(staging, restored.view(torch.uint8).view(runs.shape), blocks)
    assert torch.equal(restored[:, blocks], cache[:, blocks])
    assert not restored[:, [0, 2, 3, 5, 6]].any()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("float runs", "uint8/int8 view"),
        ("row size", "rows of 100 bytes"),
        ("block range", r"span \[0, 7\], outside \[0, 7\)"),
        ("duplicate", "appears twice"),
        ("layers", r"layers: \[2, 5\) outside"),
    ],
)
def test_the_launcher_names_what_is_wrong(case: str, message: str) -> None:
    _, runs = storage()
    blocks = torch.tensor([0, 1])
    staging = torch.zeros((2, LAYERS * RUN), dtype=torch.uint8)
    calls = {
        "float runs": lambda: pack_block_runs(torch.zeros(LAYERS, BLOCKS, RUN), blocks, staging),
        "row size": lambda: pack_block_runs(runs, blocks, torch.zeros((2, 100), dtype=torch.uint8)),
        "block range": lambda: pack_block_runs(runs, torch.tensor([0, 7]), staging),
        "duplicate": lambda: unpack_block_runs(staging, runs, torch.tensor([1, 1])),
        "layers": lambda: unpack_block_runs(staging, runs, blocks, layers=(2, 5)),
    }
    with pytest.raises(ValueError, match=message):
        calls[case]()
