"""Host layouts (``layout.host``): index arithmetic checked against numpy's own indexing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hicache_store.layout.host import PoolLayout, UnifiedPageLayout
from hicache_store.layout.keys import ObjectCoords
from hicache_store.layout.namespace import Grid, ModelShape, Namespace

NS = Namespace.create("m", ModelShape.mha(6, 8, 3), "bfloat16", 4, Grid(3, 2))


def test_full_page_is_spec_order() -> None:
    layout = UnifiedPageLayout.full_page(NS)
    G, L, P, h, D = NS.num_head_groups, NS.num_layers, NS.page_size, 2, NS.head_dim
    spec = np.arange(G * L * 2 * P * h * D).reshape(G, L, 2, P, h, D)
    layer, plane, token, head, dim = np.meshgrid(
        range(L), range(2), range(P), range(NS.num_kv_heads), range(D), indexing="ij"
    )
    offsets = layout.element_offsets(layer, plane, token, head, dim)
    assert np.array_equal(offsets, spec[head // h, layer, plane, token, head % h, dim])
    assert layout.page_bytes == NS.page_bytes


def test_every_object_is_one_contiguous_slice_of_a_full_page() -> None:
    layout = UnifiedPageLayout.full_page(NS)
    ranges = sorted(
        layout.object_range(ObjectCoords(*NS.chunk_layers(c), g))  # type: ignore[misc]
        for c in range(NS.num_layer_chunks)
        for g in range(NS.num_head_groups)
    )
    assert ranges[0][0] == 0 and ranges[-1][1] == NS.page_bytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_shard_with_partial_group_has_its_own_block() -> None:
    ns = Namespace.create("m", ModelShape.mha(4, 12, 2), "float16", 2, Grid(4, 4))
    layout = UnifiedPageLayout(ns, 0, 4, 0, 6)  # TP2 of 12 heads: group 0 + half of group 1
    assert [(b.group, b.head_start, b.head_stop) for b in layout.blocks] == [(0, 0, 4), (1, 4, 6)]
    assert layout.object_range(ObjectCoords(0, 4, 0)) == (0, layout.blocks[0].nbytes)
    assert layout.object_range(ObjectCoords(0, 4, 1)) is None


def test_out_of_shard_coordinates_raise() -> None:
    layout = UnifiedPageLayout(NS, 3, 6, 2, 4)
    with pytest.raises(ValueError, match="layer index"):
        layout.element_offsets(0, 0, 0, 2, 0)
    with pytest.raises(ValueError, match="head index"):
        layout.element_offsets(3, 0, 0, 4, 0)


POOLS = {
    "layer_first": lambda a, p, s, l, h, d, P: a[p, l, s, h, d],
    "page_first": lambda a, p, s, l, h, d, P: a[p, s, l, h, d],
    "page_first_direct": lambda a, p, s, l, h, d, P: a[p, s // P, l, s % P, h, d],
    "page_head": lambda a, p, s, l, h, d, P: a[p, s // P, h, s % P, l, d],
}


@pytest.mark.parametrize("name", sorted(POOLS))
def test_mha_pool_offsets_match_numpy_indexing(name: str) -> None:
    pool = PoolLayout(name, "mha", num_layers=3, num_heads=2, head_dim=4, page_size=4, num_pages=5)  # type: ignore[arg-type]
    array = np.arange(pool.numel).reshape(pool.shape)
    p, s, l, h, d = np.meshgrid(range(2), range(20), range(3), range(2), range(4), indexing="ij")
    offsets = pool.element_offsets(p, s, l, h, d)
    assert np.array_equal(array.ravel()[offsets], POOLS[name](array, p, s, l, h, d, 4))


@pytest.mark.parametrize("name", ["layer_first", "page_first", "page_first_direct"])
def test_mla_pool_offsets_match_numpy_indexing(name: str) -> None:
    pool = PoolLayout(name, "mla", num_layers=3, num_heads=1, head_dim=5, page_size=2, num_pages=3)  # type: ignore[arg-type]
    array = np.arange(pool.numel).reshape(pool.shape)
    s, l, d = np.meshgrid(range(6), range(3), range(5), indexing="ij")
    offsets = pool.element_offsets(0, s, l, 0, d)
    expected = POOLS[name](array[None], 0, s, l, 0, d, 2)
    assert np.array_equal(array.ravel()[offsets], expected)


def test_mla_has_no_page_head() -> None:
    with pytest.raises(ValueError, match="page_head"):
        PoolLayout("page_head", "mla", 3, 1, 5, 2, 3)
