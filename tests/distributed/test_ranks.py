"""Multi-rank deployments as real processes (gloo on loopback): agreement, cross-topology L3
sharing, faults, consensus check, MLA and CP.

One pool of four rank processes serves every case of this module (starting a process that
imports torch takes seconds); groups of 1, 2 or 4 ranks run on its leading ranks. Every task
has a hard timeout far above its normal duration, after which the pool's processes are killed.
TP/PP compute is simulated (every rank computes the full forward over an all-gathered prefix);
the KV shards, the per-rank tiers, the L3 objects and the agreements are real.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from _dist_tasks import Outcome, Rogue, Setup, cp_restore, mla_one_writer, serve_group, serve_single

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultConfig
from hicache_store.demo.bench.workload import WorkloadSpec, generate
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.launch import RankPool, RankTaskError
from hicache_store.distributed.consensus import ENV_VAR
from hicache_store.distributed.cp import CPShardStore
from hicache_store.errors import MissingKeyError
from hicache_store.layout.topology import Topology

TIMEOUT_S = 90.0  # per task; a normal task takes well under 5 s
HITS = ("hit_tokens_l1", "hit_tokens_l2", "hit_tokens_l3", "computed_tokens", "evictions_l1")


_POOLS: list[RankPool] = []


@pytest.fixture(scope="module")
def _pool_holder() -> Iterator[list[RankPool]]:
    yield _POOLS
    for p in _POOLS:
        p.close()


@pytest.fixture
def pool(_pool_holder: list[RankPool]) -> RankPool:
    """The module's four rank processes, restarted if a failed test had to kill them."""
    if not _pool_holder or _pool_holder[-1].broken:
        _pool_holder.append(RankPool(4))
    return _pool_holder[-1]


def workload() -> list[list[int]]:
    spec = WorkloadSpec(
        groups=2,
        conversations=2,
        turns=3,
        system_tokens=32,
        question_tokens=8,
        answer_tokens=8,
        vocab_size=512,
        seed=3,
    )
    return [r.prompt for r in generate(spec)]


def docs(n: int = 3, length: int = 33, seed: int = 11) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(n)]


def check_group(outcomes: list[Outcome], reference: Outcome | None = None) -> None:
    """Every rank computed exactly what a recompute gives, from the same prefix."""
    first = outcomes[0]
    for rank, out in enumerate(outcomes):
        assert all(out.exact), f"rank {rank}: logits differ from a full recompute"
        assert out.starts == first.starts, f"rank {rank} used other prefixes"
        assert out.digests == first.digests
        assert out.agreements == first.agreements
    if reference is not None:
        assert all(reference.exact)
        assert first.starts == reference.starts
        assert first.digests == reference.digests


@pytest.mark.slow  # two groups of rank processes of its own: the module's costliest test
@pytest.mark.parametrize("topology", [Topology(2, 1), Topology(1, 2)], ids=["tp2", "pp2"])
def test_group_serves_multi_turn_like_one_process(
    pool: RankPool, tmp_path: Path, topology: Topology
) -> None:
    prompts = workload()
    single = pool.run(
        serve_single, Setup(str(tmp_path / "single")), prompts, ranks=1, timeout_s=TIMEOUT_S
    )[0]
    setup = Setup(str(tmp_path / "group"))
    outcomes = pool.run(serve_group, setup, topology, prompts, ranks=2, timeout_s=TIMEOUT_S)
    check_group(outcomes, single)
    assert single.metrics["hit_tokens_l2"] > 0 and single.metrics["hit_tokens_l3"] > 0
    for out in outcomes:
        for name in HITS:
            assert out.metrics[name] == single.metrics[name], name
        assert out.metrics["token_hit_rate"] == single.metrics["token_hit_rate"]


def test_completions_consumed_in_agreed_order_without_flushes(
    pool: RankPool, tmp_path: Path
) -> None:
    """No flush between requests: backups finish at each rank's own pace, yet every rank
    applies the same completions at the same points, so their hit counts stay identical."""
    setup = Setup(str(tmp_path / "l3"), flush_each=False, prefetch_policy="best_effort")
    outcomes = pool.run(
        serve_group, setup, Topology(2, 2), workload() * 2, ranks=4, timeout_s=TIMEOUT_S
    )
    check_group(outcomes)
    for out in outcomes[1:]:
        for name in HITS:
            assert out.metrics[name] == outcomes[0].metrics[name], name


@pytest.mark.parametrize(
    ("reader", "ranks"),
    [(Topology(1, 1), 1), (Topology(2, 1), 2), (Topology(4, 1), 4), (Topology(1, 4), 4)],
    ids=["tp1", "tp2", "tp4-head-subset", "pp4-layer-range"],
)
def test_cross_topology_read_back(
    pool: RankPool, tmp_path: Path, reader: Topology, ranks: int
) -> None:
    setup = Setup(str(tmp_path / "l3"))
    written = docs()
    writers = pool.run(serve_group, setup, Topology(2, 2), written, ranks=4, timeout_s=TIMEOUT_S)
    check_group(writers)
    assert all(out.metrics["backups_l3"] == 8 * len(written) for out in writers)
    prompts = [[*doc, 1, 2, 3] for doc in written]
    readers = pool.run(serve_group, setup, reader, prompts, ranks=ranks, timeout_s=TIMEOUT_S)
    check_group(readers)
    for out in readers:
        assert out.starts == [32] * len(written)  # every full page from L3
        assert out.metrics["hit_tokens_l3"] == 32 * len(written)
        assert out.metrics["read_amplification"] == pytest.approx(out.plan_amplification)
    if reader.tp_size == 4:  # 1 head per rank, head groups of 2: read whole, sliced
        assert all(out.plan_amplification == 2.0 for out in readers)
    else:
        assert all(out.plan_amplification == 1.0 for out in readers)


def test_failed_reads_on_one_rank_shorten_the_prefix_for_all(
    pool: RankPool, tmp_path: Path
) -> None:
    setup = Setup(str(tmp_path / "l3"), prefetch_policy="best_effort")
    written = docs(6, 33, seed=5)
    pool.run(serve_group, setup, Topology(2, 1), written, ranks=2, timeout_s=TIMEOUT_S)
    prompts = [[*doc, 9] for doc in written]
    faults = {1: FaultConfig(seed=4, read_error_rate=0.3)}
    outcomes = pool.run(
        serve_group, setup, Topology(2, 1), prompts, faults, ranks=2, timeout_s=TIMEOUT_S
    )
    check_group(outcomes)
    assert outcomes[1].injected > 0 and outcomes[0].injected == 0
    assert min(outcomes[0].starts) < 32  # rank 0 could have read everything: it followed rank 1
    assert outcomes[0].metrics["hit_tokens_l3"] < 32 * len(written)


def test_rank_without_prefetch_still_joins_every_agreement(pool: RankPool, tmp_path: Path) -> None:
    """Rank 1's existence checks all fail (no prefetch at all); rank 0 prefetches. Both reach
    the same agreements and compute from no L3 prefix; nobody hangs."""
    setup = Setup(str(tmp_path / "l3"))
    written = docs(2)
    pool.run(serve_group, setup, Topology(2, 1), written, ranks=2, timeout_s=TIMEOUT_S)
    faults = {1: FaultConfig(read_error_rate=1.0)}
    prompts = [[*doc, 9] for doc in written]
    outcomes = pool.run(
        serve_group, setup, Topology(2, 1), prompts, faults, ranks=2, timeout_s=TIMEOUT_S
    )
    check_group(outcomes)
    assert outcomes[0].starts == [0, 0]
    assert outcomes[0].metrics["prefetch_started"] == 2
    assert outcomes[1].metrics["prefetch_started"] == 0


# -- consensus check -------------------------------------------------------------------------


def run_rogue(
    pool: RankPool, tmp_path: Path, rogue: Rogue, prompts: list[list[int]]
) -> RankTaskError:
    setup = Setup(str(tmp_path / "l3"))
    pool.run(serve_group, setup, Topology(2, 1), docs(2), ranks=2, timeout_s=TIMEOUT_S)
    with pytest.raises(RankTaskError) as info:
        pool.run(
            serve_group,
            setup,
            Topology(2, 1),
            prompts,
            None,
            rogue,
            ranks=2,
            env={ENV_VAR: "1"},
            timeout_s=TIMEOUT_S,
        )
    error = info.value
    assert sorted(error.errors) == [0, 1], "every rank reports the divergence"
    assert set(error.kinds().values()) == {"RankDivergenceError"}
    assert not pool.broken
    return error


def test_consensus_check_names_a_skipped_agreement(pool: RankPool, tmp_path: Path) -> None:
    prompts = [[*doc, 9] for doc in docs(2)]
    error = run_rogue(pool, tmp_path, Rogue(1, "skip_prefetch_agreement"), prompts)
    message = error.messages()[0]
    assert message == error.messages()[1]
    assert "Found rank divergence at decision #2 ('prefetch_pages'): the call differs" in message
    assert "ranks [0]: prefetch_pages (agree)" in message
    assert "ranks [1]: prefix_pages (agree)" in message
    assert "request=1" in message


def test_consensus_check_names_different_arguments(pool: RankPool, tmp_path: Path) -> None:
    prompts = [[*doc, 9] for doc in docs(2)]
    error = run_rogue(pool, tmp_path, Rogue(1, "other_prompt", at=1), prompts)
    message = error.messages()[0]
    assert "('backup_acks'): the arguments differ" in message
    assert "request=2" in message
    assert "ranks [0]: " in message and "ranks [1]: " in message


def test_consensus_check_names_a_different_result(pool: RankPool, tmp_path: Path) -> None:
    prompts = [[*doc, 9] for doc in docs(2)] * 2
    error = run_rogue(pool, tmp_path, Rogue(1, "evict_l1", at=2), prompts)
    message = error.messages()[0]
    assert "('match_l1_l2_pages'): the result differs" in message
    assert "ranks [0]: (8, 0)" in message and "ranks [1]: (0, 8)" in message
    assert "request=3" in message


def test_consensus_check_passes_a_healthy_group(pool: RankPool, tmp_path: Path) -> None:
    setup = Setup(str(tmp_path / "l3"))
    outcomes = pool.run(
        serve_group,
        setup,
        Topology(2, 2),
        workload()[:6],
        ranks=4,
        env={ENV_VAR: "1"},
        timeout_s=TIMEOUT_S,
    )
    check_group(outcomes)


# -- MLA and CP ------------------------------------------------------------------------------


def test_mla_one_writer_all_readers(pool: RankPool, tmp_path: Path) -> None:
    results = pool.run(mla_one_writer, str(tmp_path / "l3"), 3, ranks=4, timeout_s=TIMEOUT_S)
    assert [r["can_write"] for r in results] == [True, False, False, False]
    assert [r["written"] for r in results] == [3, 0, 0, 0]
    for r in results:
        assert r["agreed"] == 3 and r["same"] == [True] * 3
        assert r["objects"] == 3 * 2  # one writer: 2 layer chunks per page, no duplicates


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_restores_pages_on_their_owners(pool: RankPool, tmp_path: Path, cp: int) -> None:
    setup = Setup(str(tmp_path / "l3"))
    (doc,) = docs(1, 29, seed=8)  # 7 full pages
    pool.run(serve_group, setup, Topology(1, 1), [doc], ranks=1, timeout_s=TIMEOUT_S)
    results = pool.run(cp_restore, setup, [*doc, 4], ranks=cp, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["owned"] == [q for q in range(7) if q % cp == rank]
        assert r["placed"] and r["exact"] and r["start"] == 28


def test_cp_restores_sealed_pages_with_the_tenant_key(pool: RankPool, tmp_path: Path) -> None:
    """A sealed namespace: a single process writes sealed objects, a CP group opens them with
    the tenant's key ring; without the ring a CP rank refuses before any I/O."""
    setup = Setup(str(tmp_path / "l3"), sealed=True)
    (doc,) = docs(1, 29, seed=8)  # 7 full pages
    written = pool.run(serve_single, setup, [doc], ranks=1, timeout_s=TIMEOUT_S)[0]
    assert written.exact == [True]
    cp = 2
    results = pool.run(cp_restore, setup, [*doc, 4], ranks=cp, timeout_s=TIMEOUT_S)
    for rank, r in enumerate(results):
        assert r["owned"] == [q for q in range(7) if q % cp == rank]
        assert r["placed"] and r["exact"] and r["start"] == 28
    one_rank = SimpleNamespace(size=1, rank=0)
    kv = DeviceKVPool.for_model(setup.model_config, num_pages=7, page_size=setup.page)
    backend = open_backend(f"file://{setup.l3_dir}")
    try:
        with pytest.raises(MissingKeyError, match="is sealed"):
            CPShardStore(setup.namespace, kv, one_rank, backend)  # type: ignore[arg-type]
    finally:
        run_sync(backend.close())
