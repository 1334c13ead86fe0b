"""Eviction policies of a prefix-closed pool: LRU and prefix-closed ARC, unit by unit and
against direct (scan everything) implementations on random traces."""

from __future__ import annotations

import random
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _trace_helpers import make_trace, random_tree_trace

from hicache_store.demo.bench.trace_format import Trace
from hicache_store.demo.bench.trace_sim import block_policy, simulate
from hicache_store.tier.eviction import (
    ARCEviction,
    LRUEviction,
    make_eviction_policy,
)


def depth_of(node: str) -> int:
    return len(node) - 1  # nodes named by their path: "a", "ab", "abc"


def arc(
    capacity: int = 4, ghost_factor: float = 1.0, recall_factor: float = 0.0
) -> ARCEviction[str]:
    return ARCEviction(capacity, depth_of, lambda n: n, ghost_factor, recall_factor)


def test_lru_offers_least_recent_then_deepest_leaf() -> None:
    lru: LRUEviction[str] = LRUEviction(depth_of)
    lru.begin_request()
    for node in ("a", "ab", "x"):
        lru.admit(node)
        lru.touch(node)
    lru.set_evictable("ab", True)
    lru.set_evictable("x", True)
    assert lru.victim() == "ab"  # same request: the deeper leaf first
    lru.begin_request()
    lru.touch("a")
    lru.touch("ab")
    assert lru.victim() == "x"  # now the least recent
    lru.set_evictable("x", False)  # e.g. locked
    assert lru.victim() == "ab"
    lru.evict("ab")
    assert lru.victim() is None  # "a" is not a leaf until told so
    lru.set_evictable("a", True)
    assert lru.victim() == "a"
    assert len(lru) == 2


def test_arc_promotes_on_reuse_by_a_later_request_only() -> None:
    policy = arc()
    policy.begin_request()
    policy.admit("a")
    policy.touch("a")
    policy.touch("a")  # the same request again: still used once
    assert policy.sizes == (1, 0, 0, 0)
    policy.begin_request()
    policy.touch("a")
    assert policy.sizes == (0, 1, 0, 0)


def test_arc_ghost_hits_admit_to_t2_and_move_p() -> None:
    policy = arc(capacity=4)
    policy.begin_request()
    for node in ("a", "b"):
        policy.admit(node)
        policy.touch(node)
        policy.set_evictable(node, True)
    policy.evict("a")  # from T1: its key goes to B1
    assert policy.sizes == (1, 0, 1, 0)
    policy.begin_request()
    policy.admit("a")  # back while remembered
    assert policy.sizes == (1, 1, 0, 0)
    assert policy.p == 1.0
    policy.touch("a")
    policy.set_evictable("a", True)
    policy.evict("a")  # from T2: to B2
    policy.admit("a")
    assert policy.p == 0.0  # a B2 ghost pulls p down
    assert policy.sizes == (1, 1, 0, 0)


def test_arc_evicts_t1_while_above_target_else_t2() -> None:
    policy = arc(capacity=4)
    policy.begin_request()
    for node in ("a", "b", "c"):
        policy.admit(node)
        policy.touch(node)
        policy.set_evictable(node, True)
    policy.begin_request()
    policy.touch("c")  # c -> T2; T1 = a, b
    assert policy.p == 0.0
    assert policy.victim() == "a"  # |T1| = 2 > p = 0
    policy.p = 2.0
    assert policy.victim() == "c"  # T1 at its target: T2's least recent leaf
    policy.set_evictable("c", False)
    assert policy.victim() == "a"  # T2 has no evictable leaf: T1 after all


def test_recalled_keys_admit_to_t2_without_moving_p() -> None:
    # Ghosts of one page (B1) but a recall memory of three: "a" falls out of B1 yet is still
    # recalled when it comes back, so it goes to T2 and p does not move.
    policy = arc(capacity=1, ghost_factor=1.0, recall_factor=3.0)
    policy.begin_request()
    for node in ("a", "b"):
        policy.admit(node)
        policy.touch(node)
        policy.set_evictable(node, True)
        policy.evict(node)
    assert policy.sizes == (0, 0, 1, 0)  # B1 holds "b" only
    assert policy.recalled == 2
    policy.begin_request()
    policy.admit("a")
    assert policy.sizes == (0, 1, 1, 0)
    assert policy.p == 0.0
    assert policy.recalled == 1  # "a" is resident again: no longer remembered


def test_ghost_lists_and_recall_are_bounded() -> None:
    policy = arc(capacity=3, ghost_factor=2.0, recall_factor=5.0)
    policy.begin_request()
    for i in range(50):
        node = f"n{i}"
        policy.admit(node)
        policy.touch(node)
        policy.set_evictable(node, True)
        policy.evict(node)
    assert policy.sizes == (0, 0, 6, 0)
    assert policy.recalled == 15
    with pytest.raises(ValueError, match="capacity"):
        arc(capacity=0)
    with pytest.raises(ValueError, match="not one of lru, arc"):
        make_eviction_policy("lfu", 4, depth_of, lambda n: n)


def test_heaps_stay_proportional_to_live_leaves() -> None:
    policy: LRUEviction[str] = LRUEviction(depth_of)
    policy.begin_request()
    policy.admit("a")
    policy.set_evictable("a", True)
    for _ in range(10_000):
        policy.begin_request()
        policy.touch("a")  # every touch leaves a stale entry behind
    heaps = policy._leaves._heaps
    assert sum(len(h) for h in heaps.values()) <= 2 * 1 + 64 + 1


def naive_prefix_arc(
    trace: Trace, capacity: int, ghost_factor: float, recall_factor: float
) -> int:
    """Prefix-closed ARC with a recall memory written directly: ordered dicts, a scan for the
    oldest leaf."""
    parent = {b: (r.hash_ids[d - 1] if d else None) for r in trace.requests
              for d, b in enumerate(r.hash_ids)}
    depth = {b: d for r in trace.requests for d, b in enumerate(r.hash_ids)}
    segment: dict[int, int] = {}
    stamp: dict[int, int] = {}
    ghosts: dict[int, OrderedDict[int, None]] = {1: OrderedDict(), 2: OrderedDict()}
    p = 0.0
    limit = int(ghost_factor * capacity)
    recall: OrderedDict[int, None] = OrderedDict()
    tokens = 0
    for index, request in enumerate(trace.requests):
        run = 0
        while run < len(request.hash_ids) and request.hash_ids[run] in segment:
            run += 1
        tokens += min(run * trace.block_tokens, request.input_length)
        for block in request.hash_ids:
            if block in segment:
                if segment[block] == 1 and stamp[block] < index:
                    segment[block] = 2
            elif block in ghosts[1]:
                p = min(capacity, p + max(len(ghosts[2]) / len(ghosts[1]), 1.0))
                del ghosts[1][block]
                segment[block] = 2
            elif block in ghosts[2]:
                p = max(0.0, p - max(len(ghosts[1]) / len(ghosts[2]), 1.0))
                del ghosts[2][block]
                segment[block] = 2
            else:
                segment[block] = 1
            if block in recall:
                del recall[block]
                segment[block] = 2
            stamp[block] = index
        while len(segment) > capacity:
            leaves = [b for b in segment if not any(parent[c] == b for c in segment)]

            def oldest(s: int, leaves: list[int] = leaves) -> int | None:
                pool = [b for b in leaves if segment[b] == s]
                return min(pool, key=lambda b: (stamp[b], -depth[b])) if pool else None

            t1, t2 = oldest(1), oldest(2)
            in_t1 = sum(1 for s in segment.values() if s == 1)
            victim = t1 if t1 is not None and (in_t1 > p or t2 is None) else (t2 if t2 is not None else t1)
            assert victim is not None
            ghosts[segment.pop(victim)][victim] = None
            recall[victim] = None
            for g in (*ghosts.values(), recall):
                while len(g) > (limit if g is not recall else int(recall_factor * capacity)):
                    g.popitem(last=False)
    return tokens


@pytest.mark.parametrize("seed", range(8))
def test_arc_matches_a_direct_implementation(seed: int) -> None:
    trace = random_tree_trace(random.Random(seed), 120, 4, reuse=0.8)
    for capacity in (2, 6, 15):
        for ghosts, recall in ((2.0, 0.0), (1.0, 4.0)):
            policy = ARCEviction(capacity, block_depth(trace), lambda b: b, ghosts, recall)
            assert simulate(trace, capacity, policy).hit_tokens == naive_prefix_arc(
                trace, capacity, ghosts, recall
            )


def block_depth(trace: Trace) -> Callable[[int], int]:
    depth = {b: d for r in trace.requests for d, b in enumerate(r.hash_ids)}
    return depth.__getitem__


def test_arc_keeps_reused_chains_through_a_scan() -> None:
    # One chain used every 4th request, one-off chains in between: LRU with room for 4
    # blocks keeps nothing of [0, 1] by the time it comes back; ARC keeps it in T2.
    chains: list[list[int]] = []
    fresh = 100
    for i in range(40):
        if i % 4 == 0:
            chains.append([0, 1])
        else:
            chains.append([fresh, fresh + 1])
            fresh += 2
    trace = make_trace(chains)
    lru = simulate(trace, 4, block_policy("lru", trace, 4))
    arced = simulate(trace, 4, block_policy("arc", trace, 4))
    assert lru.hit_tokens == 0
    assert arced.hit_tokens == (10 - 2) * 8  # every return after the first two (of 10)
