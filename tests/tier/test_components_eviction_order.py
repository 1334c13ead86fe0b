"""One eviction order across components: every pool of the tier (the KV's and each
component's, L1 and L2) evicts by the configured policy, fed the same history of each page, so
pools holding copies of the same pages, with the same capacity, keep the same pages."""

from __future__ import annotations

import random

import pytest
from _hybrid_helpers import Hybrid, make_hybrid

from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.hybrid import RECURRENT_TAG, WINDOW_TAG, HybridMiniLlama
from hicache_store.tier.components import KV_TAG
from hicache_store.tier.eviction import EVICTION_POLICIES
from hicache_store.tier.radix import Tier

PAGE = 4
CONFIG = MiniLlamaConfig(window_layers=(1, 3), sliding_window=PAGE)
# Prompts of one page (+ one token to compute), by index. Pages used again sit in ARC's T2,
# which LRU does not have: the two policies keep different pages here (checked below).
ORDER = [0, 1, 0, 2, 3, 4, 0, 1, 5, 2, 0, 6, 3, 1, 0, 7, 4, 0, 2, 6]
CAPACITY = 3


@pytest.fixture(scope="module")
def model() -> HybridMiniLlama:
    return HybridMiniLlama(CONFIG, state_dim=8)


def resident(cache: Hybrid, tier: Tier) -> dict[str, set[str]]:
    """Per pool (kv, window, recurrent): the pages whose copy ``tier`` holds."""
    nodes = list(cache.tier.tree.nodes())
    out = {"kv": {n.page_hash for n in nodes if n.resident(tier, KV_TAG)}}
    for name, tag in (("window", WINDOW_TAG), ("recurrent", RECURRENT_TAG)):
        out[name] = {
            n.page_hash
            for n in nodes
            if (h := n.held(tag)) is not None
            and (h.l1 if tier is Tier.L1 else h.l2) is not None
        }
    return out


def replay(model: HybridMiniLlama, policy: str, tier: Tier) -> list[set[str]]:
    """Serve ``ORDER`` with ``CAPACITY`` pages in ``tier`` for the KV and each component (the
    other tier large, or absent); after each request, check every pool holds the same pages.
    Returns the KV's resident pages after each request."""
    rng = random.Random(3)
    prompts = [[rng.randrange(CONFIG.vocab_size) for _ in range(PAGE)] for _ in range(8)]
    if tier is Tier.L1:  # no L2; a missed prompt needs two device pages, one slot each
        sizes = {"l1": CAPACITY + 1, "l2": 0, "window_slots": CAPACITY,
                 "snapshot_slots": CAPACITY}
    else:  # L1 never evicts; write-through backs every page and object up to L2
        sizes = {"l1": 64, "window_slots": 64, "snapshot_slots": 64, "l2": CAPACITY,
                 "window_l2": CAPACITY, "snapshot_l2": CAPACITY}
    cache = make_hybrid(model, f"order-{policy}", PAGE, eviction_policy=policy, **sizes)  # type: ignore[arg-type]
    kept = []
    for step, index in enumerate(ORDER):
        cache.serve([*prompts[index], step])
        pools = resident(cache, tier)
        assert pools["window"] == pools["kv"], f"step {step}: window keeps other pages than kv"
        assert pools["recurrent"] == pools["kv"], f"step {step}: recurrent keeps other pages"
        assert len(pools["kv"]) <= CAPACITY
        kept.append(pools["kv"])
    evictions = cache.tier.metrics.evictions_l1 if tier is Tier.L1 else cache.tier.metrics.evictions_l2
    assert evictions >= len(set(ORDER)) - CAPACITY  # the pools were full and evicted
    cache.close()
    return kept


@pytest.mark.slow
@pytest.mark.parametrize("tier", [Tier.L1, Tier.L2], ids=["L1", "L2"])
def test_components_evict_in_the_kv_order(model: HybridMiniLlama, tier: Tier) -> None:
    kept = {policy: replay(model, policy, tier) for policy in EVICTION_POLICIES}
    # The policies disagree on this sequence: a component pool with another policy than the
    # KV's would keep other pages.
    assert kept["lru"] != kept["arc"]


def test_component_pools_use_the_configured_policy(model: HybridMiniLlama) -> None:
    for policy in EVICTION_POLICIES:
        cache = make_hybrid(model, f"kinds-{policy}", PAGE, eviction_policy=policy)
        kinds = {type(p) for p in cache.tier.tree.policies.values()}
        assert len(kinds) == 1, f"{policy}: pools use {kinds}"
        assert len(cache.tier.tree.policies) == 2 + 2 * 2  # KV and two components, L1 and L2
        cache.close()
