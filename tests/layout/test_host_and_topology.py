"""Host layouts and topologies: index arithmetic checked against numpy's own indexing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hicache_store.layout.host import PoolLayout, UnifiedPageLayout
from hicache_store.layout.keys import ObjectCoords
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Topology, shard_of, shards

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


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        (60, 4, [15, 15, 15, 15]),
        (61, 2, [31, 30]),
        (61, 4, [15, 15, 16, 15]),
        (62, 4, [15, 16, 16, 15]),
    ],
)
def test_even_pp_split_follows_vllm_rule(layers: int, pp: int, expected: list[int]) -> None:
    stages = Topology(1, pp).stage_layers(layers)
    assert [b - a for a, b in stages] == expected
    assert stages[0][0] == 0 and stages[-1][1] == layers


def test_explicit_pp_split() -> None:
    topology = Topology.parse("tp=2,pp=2,layers=40/20")
    assert topology.stage_layers(60) == ((0, 40), (40, 60))
    assert Topology.parse(str(topology)) == topology
    with pytest.raises(ValueError, match="sum to 60"):
        topology.stage_layers(61)


@pytest.mark.parametrize("bad", ["tp=0", "tp=2,tp=4", "dp=2", "tp=x", "pp=2,layers=1/2/3"])
def test_bad_topologies(bad: str) -> None:
    with pytest.raises(ValueError):
        Topology.parse(bad)


def test_tp_head_sharding_and_replication() -> None:
    assert [(s.head_start, s.head_stop) for s in shards(NS, Topology(4, 1))] == [
        (0, 2),
        (2, 4),
        (4, 6),
        (6, 8),
    ]
    wide = shards(NS, Topology(16, 1))
    assert [(s.head_start, s.replica) for s in wide[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match="does not divide"):
        shard_of(NS, Topology(3, 1), 0)
    with pytest.raises(ValueError, match="not a multiple"):
        shard_of(NS, Topology(12, 1), 0)


def test_mla_is_replicated_across_tp() -> None:
    ns = Namespace.create("m", ModelShape.mla(61, 8), "bfloat16", 2, Grid(31))
    group = shards(ns, Topology(4, 2))
    assert all((s.head_start, s.head_stop) == (0, 1) for s in group)
    assert [s.is_writer for s in group] == [True, False, False, False] * 2
    assert [s.rank for s in group] == list(range(8))
    assert (group[5].tp_rank, group[5].pp_rank) == (1, 1)
