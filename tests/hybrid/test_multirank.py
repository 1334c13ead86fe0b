"""Several ranks agree on a prefix at which every rank can resume (a checkpoint each of them
holds, with its window pages), even when their usable checkpoints differ.

Each rank is a thread with its own ``HybridCache`` over one shared backend, joined by a real
barrier-based group. The ranks serve the whole model (their KV pages are identical replicas under
the same keys) so each rank's logits can be checked against a recompute; their component objects
are per-rank shards (``_H{rank}`` keys), which is what lets one rank lose an object the other
still has.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
import torch
from _hybrid_helpers import serve

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.engine.config import MiniLlamaConfig
from hicache_store.hybrid.cache import HybridCache
from hicache_store.hybrid.model import HybridMiniLlama
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.config import TierConfig

PAGE = 4
CONFIG = MiniLlamaConfig(window_layers=(1,), sliding_window=6)
T = TypeVar("T")


class ThreadGroup:
    """``RankGroup`` for ranks that are threads of one process: a real rendezvous per call,
    checking that every rank is at the same decision (a mismatch is a bug: it would hang or
    pair the wrong values across processes)."""

    def __init__(self, size: int) -> None:
        self.size_ = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[tuple[int, str] | None] = [None] * size
        self.calls: list[list[str]] = [[] for _ in range(size)]

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)

    def agree_min(self, rank: int, value: int, what: str) -> int:
        self.slots[rank] = (value, what)
        self.calls[rank].append(what)
        self.barrier.wait()
        entries = [s for s in self.slots if s is not None]
        decisions = {w for _, w in entries}
        result = min(v for v, _ in entries)
        self.barrier.wait()  # everyone has read before anyone writes the next value
        assert len(decisions) == 1, f"ranks at different decisions: {decisions}"
        return result


class _Member:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank

    @property
    def size(self) -> int:
        return self.group.size_

    def agree_min(self, value: int, what: str) -> int:
        return self.group.agree_min(self.rank, value, what)


@pytest.fixture(scope="module")
def model() -> HybridMiniLlama:
    return HybridMiniLlama(CONFIG, state_dim=8)


def namespace() -> Namespace:
    layers = len(CONFIG.full_layers)
    shape = ModelShape.mha(layers, CONFIG.num_kv_heads, CONFIG.head_dim)
    return Namespace.create("hybrid-ranks", shape, "float32", PAGE, Grid(layers, 2))


def make_cache(model: HybridMiniLlama, backend: Backend, group: _Member) -> HybridCache:
    config = TierConfig(
        l1_pages=64, l2_pages=64, prefetch_policy="wait_complete", prefetch_threshold_tokens=PAGE
    )
    return HybridCache(
        namespace(),
        config,
        model.make_pool(64, PAGE),
        model.state_shape,
        snapshot_l1_slots=16,
        snapshot_l2_slots=16,
        backend=backend,
        window=model.window_component(PAGE),
        window_l1_slots=32,
        window_l2_slots=64,
        group=group,
    )


def on_ranks(group: ThreadGroup, fn: Callable[[int], T]) -> list[T]:
    """Run ``fn(rank)`` on every rank; a rank that fails breaks the barrier (the others stop at
    their next agreement instead of waiting out the timeout) and its error is raised."""

    def guarded(rank: int) -> T:
        try:
            return fn(rank)
        except threading.BrokenBarrierError:
            raise
        except BaseException:
            group.barrier.abort()
            raise

    with ThreadPoolExecutor(group.size_) as pool:
        futures = [pool.submit(guarded, rank) for rank in range(group.size_)]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]


def test_ranks_descend_to_a_checkpoint_every_rank_holds(model: HybridMiniLlama) -> None:
    rng = random.Random(0)
    doc = [rng.randrange(CONFIG.vocab_size) for _ in range(24)]
    tails = [[rng.randrange(CONFIG.vocab_size) for _ in range(3)] for _ in range(4)]
    backend = open_backend("memory://")
    group = ThreadGroup(2)

    def write(rank: int) -> HybridCache:
        cache = make_cache(model, backend, group.member(rank))
        serve(cache, model, doc + tails[0])  # checkpoint at 24
        serve(cache, model, doc[:16] + tails[1])  # branch: checkpoint at 16
        serve(cache, model, doc[:8] + tails[2])  # branch: checkpoint at 8
        cache.flush()
        return cache

    writers = on_ranks(group, write)
    ends = page_hashes(torch.tensor(doc).numpy().astype("<u4"), PAGE)
    l3 = [w.snapshots.l3 for w in writers]
    assert l3[0] is not None and l3[1] is not None
    assert l3[0].key(ends[5]) != l3[1].key(ends[5])  # per-rank shard keys
    assert l3[0].key(ends[5]).endswith("_H0_C2") and l3[1].key(ends[5]).endswith("_H1_C2")
    # rank 0 loses its checkpoint at 16, rank 1 its checkpoint at 24: 24 is not usable on
    # rank 1, 16 not on rank 0; the ranks descend 24 -> 16 -> 8, where both can resume
    assert run_sync(backend.delete([l3[0].key(ends[3]), l3[1].key(ends[5])])) == [True, True]
    for writer in writers:
        writer.close()

    group = ThreadGroup(2)

    def read(rank: int) -> tuple[int, int, float]:
        cache = make_cache(model, backend, group.member(rank))
        start = serve(cache, model, doc + tails[3])
        rounds = cache.agreement_rounds
        rate = cache.metrics.hit_rates()["recurrent"]
        cache.close()
        return start, rounds, rate

    results = on_ranks(group, read)
    assert [r[0] for r in results] == [8, 8]
    assert [r[1] for r in results] == [3, 3]
    # each rank's own view of its snapshots: rank 0 could have resumed at 24, rank 1 at 16
    assert [r[2] * 27 for r in results] == [24, 16]
    assert group.calls[0] == group.calls[1]


def test_ranks_that_agree_at_once_take_one_round(model: HybridMiniLlama) -> None:
    rng = random.Random(1)
    doc = [rng.randrange(CONFIG.vocab_size) for _ in range(16)]
    backend = open_backend("memory://")
    group = ThreadGroup(2)

    def run(rank: int) -> tuple[int, int]:
        cache = make_cache(model, backend, group.member(rank))
        serve(cache, model, [*doc, 1, 2, 3])
        serve(cache, model, [*doc, 4, 5])  # resumes at 16 (checkpoint from the first request)
        rounds = cache.agreement_rounds
        start = serve(cache, model, [*doc, 6, 7])
        cache.close()
        return start, rounds

    assert on_ranks(group, run) == [(16, 1), (16, 1)]
