"""The seed's cross-topology example at full width: a TP4/PP2 group (8 processes) writes, a
TP2/PP1 group and a single process read it back (slow: eight rank processes on a small CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _dist_tasks import Setup, serve_group
from test_ranks import TIMEOUT_S, check_group, docs

from hicache_store.demo.launch import RankPool
from hicache_store.layout.plans import plan_reads, plan_writes
from hicache_store.layout.topology import Topology


@pytest.mark.slow
def test_tp4_pp2_writes_tp2_and_tp1_read(tmp_path: Path) -> None:
    # 4 KV heads, 4 layers, grid 2 layers x 1 head: each TP4/PP2 rank writes one object per
    # page, each TP2/PP1 rank reads four (seed 000, section 4, scaled down).
    setup = Setup(str(tmp_path / "l3"), grid=(2, 1))
    ns = setup.namespace
    assert all(len(plan_writes(ns, Topology(4, 2), r).objects) == 1 for r in range(8))
    assert all(len(plan_reads(ns, Topology(2, 1), r).objects) == 4 for r in range(2))
    written = docs(2)
    prompts = [[*doc, 5, 6] for doc in written]
    with RankPool(8) as pool:
        writers = pool.run(serve_group, setup, Topology(4, 2), written, timeout_s=TIMEOUT_S * 2)
        check_group(writers)
        for reader, ranks in ((Topology(2, 1), 2), (Topology(1, 1), 1)):
            readers = pool.run(
                serve_group, setup, reader, prompts, ranks=ranks, timeout_s=TIMEOUT_S
            )
            check_group(readers)
            for out in readers:
                assert out.starts == [32, 32]
                assert out.metrics["read_amplification"] == out.plan_amplification == 1.0
