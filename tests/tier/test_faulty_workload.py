"""The multi-turn workload over an L3 that fails: it completes, and never serves wrong KV.

The faulty backend injects 20% errors, latency spikes, timeouts and bit flips on reads, plus
torn writes. Every request's logits must equal a full recompute, corruptions must be counted,
and the host pool must come back to its baseline (no leaked slots) once transfers end.
"""

from __future__ import annotations

import pytest
from _serve import serve_checked

from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.demo.bench.multiturn import namespace_for
from hicache_store.demo.bench.workload import WorkloadSpec, generate
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.tier.cache import HiCache
from hicache_store.tier.components import KV_TAG
from hicache_store.tier.config import TierConfig

PAGE = 4


def serve_workload(tier: HiCache, model: MiniLlama, spec: WorkloadSpec) -> None:
    """Serve every request (and its answer, as decode would), checking each against recompute."""
    for request in generate(spec):
        for tokens in (request.prompt, request.prompt + request.answer):
            serve_checked(tier, model, tokens, message="wrong KV reached the engine")
    tier.flush(timeout=30)


def new_tier(model: MiniLlama, backend: FaultyBackend, policy: str) -> HiCache:
    pool = DeviceKVPool.for_model(model.config, num_pages=32, page_size=PAGE)
    config = TierConfig(
        l1_pages=32,
        l2_pages=12,
        prefetch_policy=policy,  # type: ignore[arg-type]
        prefetch_threshold_tokens=PAGE,
        prefetch_timeout_base_s=0.05,
        io_timeout_s=0.5,
    )
    return HiCache(namespace_for(model.config, PAGE), config, pool, backend=backend)


def assert_idle(tier: HiCache) -> None:
    """Host-pool accounting is back to the tree's references, with nothing in flight."""
    assert tier.host.used == tier.host_pages_referenced()
    assert not tier.prefetcher.ops
    assert all(n.copy(KV_TAG).host_lock == 0 and n.copy(KV_TAG).lock == 0 for n in tier.tree.nodes())


@pytest.mark.slow
def test_failing_l3_degrades_to_recompute_and_never_serves_corruption() -> None:
    model = MiniLlama(MiniLlamaConfig(dtype="float32"))
    spec = WorkloadSpec(
        groups=2,
        conversations=2,
        turns=3,
        system_tokens=48,
        question_tokens=6,
        answer_tokens=10,
        vocab_size=model.config.vocab_size,
        seed=3,
    )
    backend = FaultyBackend(open_backend("memory://"))
    # 1. 20% errors, latency spikes, timeouts, bit flips and torn writes, under each policy.
    backend.faults = FaultConfig(
        seed=11,
        error_rate=0.2,
        latency_jitter_s=0.01,
        timeout_rate=0.05,
        timeout_s=0.02,
        bit_flip_rate=0.2,
        torn_write_rate=0.1,
    )
    for policy in ("wait_complete", "timeout", "best_effort"):
        tier = new_tier(model, backend, policy)
        serve_workload(tier, model, spec)
        assert_idle(tier)
        tier.close()
    assert sum(backend.injected.values()) > 0
    # 2. A fresh instance whose every L3 read is corrupted in transit: all caught, none served.
    backend.faults = FaultConfig(bit_flip_rate=1.0)
    tier = new_tier(model, backend, "wait_complete")
    serve_workload(tier, model, spec)
    assert tier.metrics.corruptions > 0
    assert tier.metrics.hit_tokens_l3 == 0
    assert_idle(tier)
    tier.close()
    # 3. The same store without faults: what the failing phases stored is good KV.
    backend.faults = FaultConfig()
    tier = new_tier(model, backend, "wait_complete")
    serve_workload(tier, model, spec)
    assert tier.metrics.hit_tokens_l3 > 0
    assert_idle(tier)
    tier.close()
