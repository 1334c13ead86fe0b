"""Hybrid models over real rank processes (gloo on loopback): window KV on the KV grid and
recurrent checkpoints replicated with one writer, so state one topology wrote is restored by
another with logits equal to a recompute; and ranks whose checkpoints differ descend together
to a prefix every one of them can resume at."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _dist_tasks import HybridOutcome, HybridSetup, serve_hybrid
from test_ranks import TIMEOUT_S

from hicache_store.demo.launch import RankPool
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.topology import Topology


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(512) for _ in range(n)]


def check(outcomes: list[HybridOutcome]) -> None:
    for rank, out in enumerate(outcomes):
        assert all(out.exact), f"rank {rank}: logits differ from a full recompute"
        assert out.starts == outcomes[0].starts, f"rank {rank} resumed elsewhere"
        assert out.rounds == outcomes[0].rounds


@pytest.mark.slow
def test_state_written_by_tp2_pp2_is_restored_by_tp1_and_tp4(tmp_path: Path) -> None:
    rng = random.Random(0)
    docs = [rand(rng, 32) for _ in range(2)]
    setup = HybridSetup(str(tmp_path / "l3"))
    with RankPool(4) as pool:
        # TP2/PP2: a checkpoint at each document's end (its last full page)
        writers = pool.run(
            serve_hybrid, setup, Topology(2, 2), [[*d, 1, 2] for d in docs], timeout_s=TIMEOUT_S
        )
        check(writers)
        assert writers[0].extra["backups_l3_recurrent"] == 2  # rank 0 writes the snapshots
        assert "backups_l3_recurrent" not in writers[1].extra
        for reader, ranks in ((Topology(1, 1), 1), (Topology(4, 1), 4)):
            readers = pool.run(
                serve_hybrid, setup, reader, [[*d, 7, 8, 9] for d in docs], ranks=ranks,
                timeout_s=TIMEOUT_S,
            )
            check(readers)
            assert readers[0].starts == [32, 32]  # whole documents from L3, every component
            for out in readers:
                assert out.extra["restored_l3_recurrent"] == 2
                assert out.extra["restored_l3_window"] == 2 * 2  # the two pages in the window


@pytest.mark.slow
def test_ranks_descend_to_a_checkpoint_every_rank_holds() -> None:
    rng = random.Random(1)
    doc = rand(rng, 24)
    tails = [rand(rng, 3) for _ in range(4)]
    prompts = [doc + tails[0], doc[:16] + tails[1], doc[:8] + tails[2], doc + tails[3], doc + tails[0]]
    ends = page_hashes(torch.tensor(doc).numpy().astype("<u4"), 4)
    # before the last request rank 0 loses its checkpoint at 16 tokens and rank 1 its one at
    # 24: rank 0 could resume at 24, rank 1 at 16; 16 is not usable on rank 0, so the agreed
    # prefix descends to 8 (two agreed values: 16, then 8). That request checkpoints 24 again
    # on rank 1, so the last one resumes there, agreed at once.
    drops = {3: {0: [ends[3]], 1: [ends[5]]}}
    with RankPool(2) as pool:
        out = pool.run(
            serve_hybrid, HybridSetup(None), Topology(2, 1), prompts, drops, timeout_s=TIMEOUT_S
        )
    check(out)
    assert out[0].starts == [0, 0, 0, 8, 24]
    assert out[0].rounds == [1, 1, 1, 2, 1]  # at once whenever the ranks hold the same
    # the fourth request resumed below what each rank could alone: counted as the ranks' limit
    assert [o.extra.get("limited_by_ranks", 0) for o in out] == [1, 1]
    assert out[0].calls == out[1].calls  # the same agreements on both ranks
