"""Topologies (``layout.topology``): PP stage splits, parsing, TP head shards and replicas."""

from __future__ import annotations

import pytest

from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Topology, shard_of, shards

NS = Namespace.create("m", ModelShape.mha(6, 8, 3), "bfloat16", 4, Grid(3, 2))


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
