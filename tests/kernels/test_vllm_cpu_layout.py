"""vLLM's CPU KV cache (``layout.host.VllmCpuLayout``) and its copies (``kernels.vllm_cpu``).

The layout's element offsets are held to vLLM's own cache writer in ``tests/vllm`` (where vLLM
is installed); here the copies are held to the offsets, element by element, for shards cut
into one and several head blocks, with untouched memory and the source checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache_store.kernels.vllm_cpu import pack_blocks, unpack_blocks
from hicache_store.layout.blocks import SKIP, BlockPages
from hicache_store.layout.host import UnifiedPageLayout, VllmCpuLayout
from hicache_store.layout.namespace import Grid, ModelShape, Namespace

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 3, 4, 8, 32, 6


def layout() -> VllmCpuLayout:
    return VllmCpuLayout(LAYERS, HEADS, DIM, BLOCK, BLOCKS)


def cache() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(layout().shape)


def unified(heads_per_group: int = HEADS, head_start: int = 0,
            head_stop: int = HEADS) -> UnifiedPageLayout:
    shape = ModelShape.mha(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    ns = Namespace.create("m", shape, "float32", BLOCK, Grid(LAYERS, heads_per_group))
    return UnifiedPageLayout(ns, 0, LAYERS, head_start, head_stop)


def test_offsets_are_a_bijection_onto_the_storage() -> None:
    lay = layout()
    p, s, layer, h, d = np.meshgrid(np.arange(2), np.arange(BLOCK * BLOCKS), np.arange(LAYERS),
                                    np.arange(HEADS), np.arange(DIM), indexing="ij")
    offsets = lay.element_offsets(p, s, layer, h, d).ravel()
    assert sorted(offsets.tolist()) == list(range(lay.numel))


def test_k_is_dim_major_and_v_token_major_within_a_block_and_head() -> None:
    lay = layout()
    run = BLOCK * DIM
    assert lay.element_offsets(0, 1, 0, 0, 0) == 1  # K: the next token is the next element
    assert lay.element_offsets(0, 0, 0, 0, 1) == BLOCK  # ... the next dim a block further
    assert lay.element_offsets(1, 0, 0, 0, 0) == run  # V follows K
    assert lay.element_offsets(1, 0, 0, 0, 1) == run + 1
    assert lay.element_offsets(1, 1, 0, 0, 0) == run + DIM
    for plane in (0, 1):
        strides = lay.plane_strides(plane)
        base = lay.element_offsets(plane, 0, 0, 0, 0)
        # (slot, layer, head, dim) steps of the (layer, block, token, head, dim) axes
        steps = [(0, 1, 0, 0), (BLOCK, 0, 0, 0), (1, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1)]
        for stride, (slot, layer, head, dim) in zip(strides, steps, strict=True):
            got = lay.element_offsets(plane, slot, layer, head, dim) - base
            assert got == stride


@pytest.mark.parametrize(("hpg", "h0", "h1"), [(HEADS, 0, HEADS), (2, 0, HEADS), (1, 1, 3),
                                              (2, 1, 4)])
def test_pack_follows_the_offsets(hpg: int, h0: int, h1: int) -> None:
    src = cache()
    lay = layout()
    uni = unified(hpg, h0, h1)
    local = VllmCpuLayout(LAYERS, h1 - h0, DIM, BLOCK, BLOCKS)
    shard = src[:, :, h0:h1].contiguous()  # this rank's heads, as vLLM would hold them
    blocks = torch.tensor([4, 1, 3])
    staging = torch.empty(len(blocks), uni.page_bytes // 4)
    pack_blocks(shard, local, blocks, staging, uni)
    flat = shard.reshape(-1)
    for i, block in enumerate(blocks.tolist()):
        p, t, layer, h, d = np.meshgrid(np.arange(2), np.arange(BLOCK), np.arange(LAYERS),
                                        np.arange(h1 - h0), np.arange(DIM), indexing="ij")
        pool = local.element_offsets(p, block * BLOCK + t, layer, h, d)
        page = uni.element_offsets(layer, p, t, h + h0, d)
        assert torch.equal(staging[i][torch.from_numpy(page.ravel())],
                           flat[torch.from_numpy(pool.ravel())])
    assert lay.numel == src.numel()


def test_unpack_writes_only_the_named_blocks_and_layers() -> None:
    src = cache()
    original = src.clone()
    lay = layout()
    uni = unified(2)
    staging = torch.empty(2, uni.page_bytes // 4)
    pack_blocks(src, lay, torch.tensor([2, 5]), staging, uni)
    assert torch.equal(src, original)  # packing leaves the source alone
    target = torch.zeros_like(src)
    unpack_blocks(staging, target, lay, torch.tensor([0, 3]), uni)
    for dst, from_block in ((0, 2), (3, 5)):
        assert torch.equal(target[:, dst], original[:, from_block])
    for untouched in (1, 2, 4, 5):
        assert not target[:, untouched].any()
    partial = torch.zeros_like(src)
    unpack_blocks(staging, partial, lay, torch.tensor([0, 3]), uni, layers=(1, 2))
    assert torch.equal(partial[1, 0], original[1, 2])
    assert not partial[0].any()
    assert not partial[2].any()


def test_launcher_refuses_what_does_not_fit() -> None:
    src = cache()
    lay = layout()
    uni = unified()
    staging = torch.empty(2, uni.page_bytes // 4)
    with pytest.raises(ValueError, match="outside"):
        pack_blocks(src, lay, torch.tensor([0, BLOCKS]), staging, uni)
    with pytest.raises(ValueError, match="appears twice"):
        unpack_blocks(staging, src, lay, torch.tensor([1, 1]), uni)
    with pytest.raises(ValueError, match="heads"):
        pack_blocks(src, lay, torch.tensor([0, 1]), staging, unified(1, 0, 2))
    with pytest.raises(ValueError, match="contiguous"):
        pack_blocks(src.transpose(0, 1), lay, torch.tensor([0, 1]), staging, uni)


def paged(page: int, heads_per_group: int = 2) -> UnifiedPageLayout:
    shape = ModelShape.mha(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    ns = Namespace.create("m", shape, "float32", page, Grid(LAYERS, heads_per_group))
    return UnifiedPageLayout(ns, 0, LAYERS, 0, HEADS)


def slot_token(geometry: BlockPages, slot: int) -> int:
    """The first cache token of a segment slot, written out from the contract."""
    per_block = geometry.segments_per_block
    return (slot // per_block) * BLOCK + (slot % per_block) * geometry.segment


@pytest.mark.parametrize(("page", "slots"), [
    (2 * BLOCK, [4, 1, 3, 0]),  # a page of two blocks, in the order named
    (3 * BLOCK, [2, 5, 0]),
    (BLOCK // 2, [9, 0, 4]),  # half a block: slot 9 is block 4's second half
    (BLOCK // 4, [23, 1, 6]),
])
def test_pages_of_several_blocks_or_part_of_one_follow_the_offsets(
    page: int, slots: list[int]
) -> None:
    src = cache()
    lay = layout()
    uni = paged(page)
    geometry = BlockPages(page, BLOCK)
    rows = len(slots) // geometry.segments_per_page
    staging = torch.empty(rows, uni.page_bytes // 4)
    pack_blocks(src, lay, torch.tensor(slots), staging, uni)
    flat = src.reshape(-1)
    seg = geometry.segment
    for i in range(rows):
        for j in range(geometry.segments_per_page):
            start = slot_token(geometry, slots[i * geometry.segments_per_page + j])
            p, t, layer, h, d = np.meshgrid(np.arange(2), np.arange(seg), np.arange(LAYERS),
                                            np.arange(HEADS), np.arange(DIM), indexing="ij")
            pool = lay.element_offsets(p, start + t, layer, h, d)
            row = uni.element_offsets(layer, p, j * seg + t, h, d)
            assert torch.equal(staging[i][torch.from_numpy(row.ravel())],
                               flat[torch.from_numpy(pool.ravel())])
    # ... and back: exactly the named segments are written, the skipped ones are not
    target = torch.zeros_like(src)
    written = [s if k else SKIP for k, s in enumerate(slots)]  # the first segment skipped
    unpack_blocks(staging, target, lay, torch.tensor(written), uni)
    expected = torch.zeros_like(src).reshape(-1)
    for s in written:
        if s == SKIP:
            continue
        p, t, layer, h, d = np.meshgrid(np.arange(2), np.arange(seg), np.arange(LAYERS),
                                        np.arange(HEADS), np.arange(DIM), indexing="ij")
        at = torch.from_numpy(lay.element_offsets(p, slot_token(geometry, s) + t, layer, h,
                                                  d).ravel())
        expected[at] = flat[at]
    assert torch.equal(target.reshape(-1), expected)
    one_layer = torch.zeros_like(src)
    unpack_blocks(staging, one_layer, lay, torch.tensor(slots), uni, layers=(1, 2))
    assert not one_layer[0].any() and not one_layer[2].any() and one_layer[1].any()


def test_launcher_refuses_slots_that_do_not_fit_the_page() -> None:
    src = cache()
    lay = layout()
    uni = paged(2 * BLOCK)
    staging = torch.empty(1, uni.page_bytes // 4)
    with pytest.raises(ValueError, match="not whole pages of 2 segments"):
        pack_blocks(src, lay, torch.tensor([1, 2, 3]), staging, uni)
    with pytest.raises(ValueError, match="outside"):
        pack_blocks(src, lay, torch.tensor([SKIP, 2]), staging, uni)  # a pack names them all
    with pytest.raises(ValueError, match="appears twice"):
        unpack_blocks(staging, src, lay, torch.tensor([3, 3]), uni)
    half = paged(BLOCK // 2)
    with pytest.raises(ValueError, match="outside"):
        pack_blocks(src, lay, torch.tensor([2 * BLOCKS]), torch.empty(1, half.page_bytes // 4),
                    half)
    odd = paged(24)
    with pytest.raises(ValueError, match="neither a multiple nor a divisor"):
        pack_blocks(src, lay, torch.tensor([0]), torch.empty(1, odd.page_bytes // 4), odd)
