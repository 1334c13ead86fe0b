"""The multi-turn workload over an L3 that fails: it completes, and never serves wrong KV.

The faulty backend injects 20% errors, latency spikes, timeouts and bit flips on reads, plus
torn writes. Every request's logits must equal a full recompute, corruptions must be counted,
and the host pool must come back to its baseline (no leaked slots) once transfers end.
"""

from __future__ import annotations

import torch

from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.bench.multiturn import namespace_for
from hicache_store.bench.workload import WorkloadSpec, generate
from hicache_store.engine.config import MiniLlamaConfig
from hicache_store.engine.kv_pool import DeviceKVPool
from hicache_store.engine.model import MiniLlama
from hicache_store.tier.cache import HiCache
from hicache_store.tier.config import TierConfig

PAGE = 4


def run(faults: FaultConfig, policy: str) -> tuple[HiCache, FaultyBackend]:
    config = MiniLlamaConfig(dtype="float32")
    model = MiniLlama(config)
    backend = FaultyBackend(open_backend("memory://"), faults)
    spec = WorkloadSpec(
        groups=2,
        conversations=2,
        turns=3,
        system_tokens=48,
        question_tokens=6,
        answer_tokens=10,
        vocab_size=config.vocab_size,
        seed=3,
    )
    pool = DeviceKVPool.for_model(config, num_pages=32, page_size=PAGE)
    tier = HiCache(
        namespace_for(config, PAGE),
        TierConfig(
            l1_pages=48,
            l2_pages=24,
            prefetch_policy=policy,
            prefetch_threshold_tokens=PAGE,  # type: ignore[arg-type]
            prefetch_timeout_base_s=0.05,
            io_timeout_s=0.5,
        ),
        pool,
        backend=backend,
    )
    for request in generate(spec):
        for tokens in (request.prompt, request.prompt + request.answer):
            req = tier.match(tokens)
            prep = tier.prepare(req)
            logits = model.prefill(
                torch.tensor(tokens[prep.start :]),
                prep.start,
                prep.slots,
                pool,
                wait_layer=prep.wait_layer,
            )
            tier.complete(req)
            expected = model.forward_full(torch.tensor(tokens))[prep.start :]
            assert torch.equal(logits, expected), "wrong KV reached the engine"
            tier.tree.check_prefix_closed()
            assert tier.host.used == tier.host_pages_referenced()
    tier.flush(timeout=30)
    return tier, backend


def test_failing_l3_degrades_to_recompute_and_never_serves_corruption() -> None:
    faults = FaultConfig(
        seed=11,
        error_rate=0.2,
        latency_s=0.0,
        latency_jitter_s=0.01,
        timeout_rate=0.05,
        timeout_s=0.02,
        bit_flip_rate=0.2,
        torn_write_rate=0.1,
    )
    corruptions = l3_hits = injected = 0
    for policy in ("wait_complete", "timeout", "best_effort"):
        tier, backend = run(faults, policy)
        injected += backend.injected["bit_flip"] + backend.injected["torn_write"]
        corruptions += tier.metrics.corruptions
        l3_hits += tier.metrics.hit_tokens_l3
        # Host-pool accounting returns to the tree's references, with nothing in flight.
        assert tier.host.used == tier.host_pages_referenced()
        assert not tier._prefetches
        assert all(n.host_lock == 0 and n.lock == 0 for n in tier.tree.nodes())
        tier.close()
    assert injected > 0
    assert corruptions > 0, "injected corruption must be caught and counted"
    assert l3_hits > 0, "some L3 reads should still succeed"
