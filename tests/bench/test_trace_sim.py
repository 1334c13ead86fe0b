"""The trace-level references: LRU (the published figures), Belady (against brute force), and
the prefix-closed simulator (against a direct implementation)."""

from __future__ import annotations

import functools
import itertools
import random
from pathlib import Path

import pytest
from _trace_helpers import make_trace, random_tree_trace

from hicache_store.demo.bench.trace_format import Trace, read_trace
from hicache_store.demo.bench.trace_sim import (
    NEVER,
    belady,
    block_policy,
    lru_reference,
    next_uses,
    prefix_hit_tokens,
    simulate,
)

TRACES = Path(__file__).resolve().parents[2] / "bench" / "traces"


def test_prefix_hit_tokens_caps_at_the_prompt() -> None:
    assert prefix_hit_tokens(0, 100, 512) == 0
    assert prefix_hit_tokens(2, 2000, 512) == 1024
    assert prefix_hit_tokens(4, 2000, 512) == 2000  # the partial last block hits its tokens


def test_lru_reference_hand_counted() -> None:
    # capacity 3 blocks of 4 tokens; LRU order after each request in the comments
    trace = make_trace([[1, 2], [1, 3], [4], [1, 2], [1, 3]], lengths=[8, 7, 4, 8, 6])
    count = lru_reference(trace, 3)
    # r0 miss (1 2); r1 hits 1 (2 1 3); r2 miss, evicts 2 (1 3 4); r3 hits 1, evicts 3
    # (4 1 2); r4 hits 1 only (3 gone)
    assert count.hit_tokens == 4 + 4 + 4
    assert count.input_tokens == 33
    assert count.hit_rate == pytest.approx(12 / 33)
    # second half = requests 2, 3, 4 (index >= 5 // 2)
    assert count.second_half_hit_tokens == 8
    assert count.second_half_input_tokens == 18
    assert lru_reference(trace, None).hit_tokens == 4 + 8 + 6
    with pytest.raises(ValueError, match="at least one block"):
        lru_reference(trace, 0)


def test_lru_reference_evicts_a_chain_head_first() -> None:
    # Touch order makes block 1 older than 2: capacity 2 evicts 1, and [1, 2] then misses
    # entirely although 2 is cached (the published reference's behaviour, kept on purpose).
    trace = make_trace([[1, 2], [3], [1, 2]])
    assert lru_reference(trace, 2).hit_tokens == 0
    assert simulate(trace, 2, block_policy("lru", trace, 2)).hit_tokens == 4  # prefix-closed: the tail goes


def naive_belady(trace: Trace, capacity: int) -> tuple[int, int]:
    """Belady by its definition, scanning the future for every victim: (block hits, tokens)."""
    depth = {b: d for r in trace.requests for d, b in enumerate(r.hash_ids)}
    cached: set[int] = set()
    block_hits = tokens = 0
    for index, request in enumerate(trace.requests):
        run = 0
        while run < len(request.hash_ids) and request.hash_ids[run] in cached:
            run += 1
        tokens += min(run * trace.block_tokens, request.input_length)
        block_hits += sum(b in cached for b in request.hash_ids)
        cached.update(request.hash_ids)

        def next_use(block: int, after: int = index) -> int:
            for later in range(after + 1, len(trace.requests)):
                if block in trace.requests[later].hash_ids:
                    return later
            return NEVER

        while len(cached) > capacity:
            cached.remove(max(cached, key=lambda b: (next_use(b), depth[b])))
    return block_hits, tokens


def optimal_block_hits(trace: Trace, capacity: int) -> int:
    """The most block hits any eviction schedule achieves (exhaustive search)."""
    chains = [frozenset(r.hash_ids) for r in trace.requests]

    @functools.cache
    def best(index: int, cached: frozenset[int]) -> int:
        if index == len(chains):
            return 0
        hits = len(chains[index] & cached)
        present = cached | chains[index]
        if len(present) <= capacity:
            return hits + best(index + 1, present)
        return hits + max(
            best(index + 1, frozenset(keep))
            for keep in itertools.combinations(sorted(present), capacity)
        )

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_belady_matches_its_definition_and_is_optimal_in_block_hits(seed: int) -> None:
    rng = random.Random(seed)
    trace = random_tree_trace(rng, 9, 4, depth=3, reuse=0.75)
    for capacity in (1, 2, 3, 5):
        count = belady(trace, capacity)
        assert (count.block_hits, count.hit_tokens) == naive_belady(trace, capacity)
        assert count.block_hits == optimal_block_hits(trace, capacity)


def test_belady_beats_lru_on_random_traces() -> None:
    rng = random.Random(7)
    for _ in range(20):
        trace = random_tree_trace(rng, 60, 4)
        for capacity in (3, 8, 20):
            assert belady(trace, capacity).block_hits >= lru_reference(trace, capacity).block_hits


def test_next_uses() -> None:
    trace = make_trace([[1, 2], [1], [3], [1, 2]])
    assert next_uses(trace) == [[1, 3], [3], [NEVER], [NEVER, NEVER]]


def naive_leaf_lru(trace: Trace, capacity: int) -> int:
    """A prefix-closed LRU written directly: scan for the least recent, deepest leaf."""
    parent = {b: (r.hash_ids[d - 1] if d else None) for r in trace.requests
              for d, b in enumerate(r.hash_ids)}
    depth = {b: d for r in trace.requests for d, b in enumerate(r.hash_ids)}
    stamp: dict[int, int] = {}
    tokens = 0
    for index, request in enumerate(trace.requests):
        run = 0
        while run < len(request.hash_ids) and request.hash_ids[run] in stamp:
            run += 1
        tokens += min(run * trace.block_tokens, request.input_length)
        for block in request.hash_ids:
            stamp[block] = index
        while len(stamp) > capacity:
            leaves = [b for b in stamp if not any(parent[c] == b for c in stamp)]
            del stamp[min(leaves, key=lambda b: (stamp[b], -depth[b]))]
    return tokens


@pytest.mark.parametrize("seed", range(6))
def test_simulate_lru_matches_a_direct_implementation(seed: int) -> None:
    trace = random_tree_trace(random.Random(seed), 80, 4)
    for capacity in (2, 5, 12):
        assert simulate(trace, capacity, block_policy("lru", trace, capacity)).hit_tokens == naive_leaf_lru(trace, capacity)


#: shared/traces/README.md: LRU token hit rates at 1k, 4k, 16k, 64k blocks and unbounded.
README_LRU = {
    "conversation": (4.5, 8.7, 26.8, 36.6, 37.4),
    "synthetic": (8.4, 23.5, 53.9, 65.1, 65.1),
}
CAPACITIES = (1000, 4000, 16000, 64000, None)


@pytest.mark.parametrize("name", sorted(README_LRU))
def test_lru_reference_reproduces_the_published_figures(name: str) -> None:
    trace = read_trace(TRACES / f"mooncake_{name}_trace.jsonl.gz")
    for capacity, published in zip(CAPACITIES, README_LRU[name], strict=True):
        # the README rounds to 0.1 points
        assert 100 * lru_reference(trace, capacity).hit_rate == pytest.approx(published, abs=0.051)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(README_LRU))
def test_belady_bounds_lru_and_prefix_lru_on_the_real_traces(name: str) -> None:
    trace = read_trace(TRACES / f"mooncake_{name}_trace.jsonl.gz")
    unbounded = lru_reference(trace, None).hit_rate
    for capacity in CAPACITIES[:-1]:
        bound = belady(trace, capacity).hit_rate
        assert bound >= lru_reference(trace, capacity).hit_rate
        assert bound >= simulate(trace, capacity, block_policy("lru", trace, capacity)).hit_rate
        assert bound <= unbounded + 1e-12
    assert belady(trace, 64000).hit_rate == pytest.approx(unbounded)
