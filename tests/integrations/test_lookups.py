"""Lookup counters: one naming scheme for every integration and the tier."""

from __future__ import annotations

import pytest

from hicache_store.integrations._lookups import LookupCounters
from hicache_store.tier.metrics import TierMetrics, lookup_counts


def test_counts_by_flat_name_and_in_prometheus_per_tier() -> None:
    from prometheus_client import REGISTRY

    labels = {"integration": "test-lookups", "tier": "l3", "tp_rank": "1", "pp_rank": "0"}

    def sample(counter: str) -> float:
        return REGISTRY.get_sample_value(f"hicache_store_{counter}_total", labels) or 0.0

    counters = LookupCounters("test-lookups", labels={"tp_rank": "1", "pp_rank": "0"})
    counters.count("l3", 8, 5)
    counters.count("l3", 4, 0)
    assert counters.counters() == {"lookup_pages_asked_l3": 12, "lookup_pages_found_l3": 5}
    assert (sample("lookup_pages_asked"), sample("lookup_pages_found")) == (12.0, 5.0)
    quiet = LookupCounters("test-lookups-quiet")  # not exported
    quiet.count("l2", 3, 3)
    assert quiet.counters() == {"lookup_pages_asked_l2": 3, "lookup_pages_found_l2": 3}
    assert REGISTRY.get_sample_value(
        "hicache_store_lookup_pages_asked_total",
        {**labels, "integration": "test-lookups-quiet", "tier": "l2"}) is None


def test_the_tier_uses_the_same_names() -> None:
    metrics = TierMetrics()
    metrics.count_lookup("l1", 10, 4)
    data = metrics.to_dict()
    assert (data["lookup_pages_asked_l1"], data["lookup_pages_found_l1"]) == (10, 4)
    assert data["lookup_pages_asked_l3"] == 0
    assert 'hicache_store_lookup_pages_found_total{tier="l1"} 4.0' in metrics.to_prometheus()


@pytest.mark.parametrize(("tier", "asked", "found", "error"), [
    ("l4", 1, 1, "tier must be one of"),
    ("l3", 2, 3, "finds 0..2"),
    ("l3", 2, -1, "finds 0..2"),
])
def test_impossible_counts_are_refused(tier: str, asked: int, found: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        lookup_counts(tier, asked, found)
