"""Component objects through the tier's one transfer path: namespaced, framed, keyed without a
rank; backed up in the background with typed completion events (one per object, every
component, KV included); failures as events, not L3 copies, retried on the next use; a bounded
queue; slots a request holds are never evicted under it."""

from __future__ import annotations

import random

import pytest
import torch
from _hybrid_helpers import Hybrid, hashes, make_hybrid

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.hybrid import RECURRENT_TAG, HybridMiniLlama
from hicache_store.layout.framing import decode_header
from hicache_store.layout.keys import ObjectCoords, object_key, parse_key
from hicache_store.tier.transfers import BackupEvent

PAGE = 4
CONFIG = MiniLlamaConfig(window_layers=(1, 3), sliding_window=8)


@pytest.fixture(scope="module")
def model() -> HybridMiniLlama:
    return HybridMiniLlama(CONFIG, state_dim=8)


def make(model: HybridMiniLlama, backend: Backend | None = None, **kw: object) -> Hybrid:
    return make_hybrid(model, "events", PAGE, backend=backend, **kw)  # type: ignore[arg-type]


def rand(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def snapshot_key(cache: Hybrid, page_hash: str) -> str:
    ns = cache.recurrent.namespace
    return object_key(page_hash, ns.digest, ObjectCoords(0, 1, None, RECURRENT_TAG))


def test_objects_are_namespaced_framed_and_rankless(model: HybridMiniLlama) -> None:
    backend = open_backend("memory://")
    cache = make(model, backend)
    tokens = rand(1, 13)  # 3 full pages, a checkpoint after the third
    cache.serve(tokens)
    cache.tier.flush()
    page_hashes = hashes(tokens, PAGE)
    key = snapshot_key(cache, page_hashes[2])
    parsed = parse_key(key)
    assert key.endswith("_L0-0_C2") and "_H" not in key  # no rank, no head group
    assert parsed.namespace_digest == cache.recurrent.namespace.digest
    raw = run_sync(backend.get_bytes(key))
    assert raw is not None
    header = decode_header(raw, object_length=len(raw))
    assert header.coords.component == RECURRENT_TAG and header.parent_hash == page_hashes[1]
    # another model's tier never sees it: its components are in its own namespaces
    other = make_hybrid(model, "another-model", PAGE, backend=backend)
    assert other.serve(tokens) == 0
    cache.close()
    other.close()


def test_backups_end_in_typed_events(model: HybridMiniLlama) -> None:
    backend = open_backend("memory://")
    cache = make(model, backend)
    tokens = rand(4, 17)  # 4 full pages, snapshot at 16
    cache.serve(tokens)
    cache.tier.flush()
    events = cache.tier.drain_events()
    assert all(isinstance(e, BackupEvent) and e.ok for e in events)
    page_hashes = hashes(tokens, PAGE)
    by_component = {(e.component, e.page_hash) for e in events}
    # every KV page; the snapshot at 16 tokens and the window pages before it (pages 2, 3)
    assert by_component == (
        {("kv", h) for h in page_hashes}
        | {("recurrent", page_hashes[3])}
        | {("window", h) for h in page_hashes[2:]}
    )
    assert cache.tier.drain_events() == []
    cache.close()


def test_failed_put_is_an_event_not_an_l3_copy_and_is_retried(model: HybridMiniLlama) -> None:
    backend = FaultyBackend(open_backend("memory://"), FaultConfig(write_error_rate=1.0))
    cache = make(model, backend)
    tokens = rand(5, 9)  # 2 full pages: a snapshot after page 1
    cache.serve(tokens)
    cache.tier.flush()
    events = [e for e in cache.tier.drain_events() if e.component == "recurrent"]
    assert events == [BackupEvent(hashes(tokens, PAGE)[1], "recurrent", False)]
    node = cache.tier.tree.get(hashes(tokens, PAGE)[1])
    held = None if node is None else node.held(RECURRENT_TAG)
    assert held is not None and not held.in_l3 and held.l2 is not None
    backend.faults = FaultConfig()
    assert cache.serve([*tokens[:8], 3, 3]) == 8  # uses the snapshot: its backup is retried
    cache.tier.flush()
    retried = [e for e in cache.tier.drain_events() if e.component == "recurrent"]
    assert retried == [BackupEvent(hashes(tokens, PAGE)[1], "recurrent", True)]
    assert run_sync(backend.exists([snapshot_key(cache, hashes(tokens, PAGE)[1])])) == [True]
    cache.close()


def test_backup_queue_is_bounded(model: HybridMiniLlama) -> None:
    backend = FaultyBackend(open_backend("memory://"), FaultConfig(latency_s=0.05))
    cache = make(model, backend, max_queued_backup_pages=3)
    cache.serve(rand(6, 33))  # 8 KV pages, a snapshot and its window pages: more than 3
    dropped = cache.tier.metrics.backups_dropped + sum(
        v for k, v in cache.tier.metrics.extra.items() if k.startswith("backups_dropped_")
    )
    assert dropped > 0
    assert cache.tier._transfers.in_flight <= 3
    # pages, not chains: 8 KV pages, 3 queued; the snapshot and its window (pages 6, 7) find
    # the queue full
    assert cache.tier.metrics.backups_dropped == 5
    assert cache.extra("backups_dropped_window") == 2
    assert cache.extra("backups_dropped_recurrent") == 1
    cache.tier.flush()
    cache.close()


def test_backup_copies_only_what_is_missing(model: HybridMiniLlama) -> None:
    backend = open_backend("memory://")
    cache = make(model, backend)
    doc = rand(7, 16)
    cache.serve([*doc, 1])  # a snapshot at 16: to L2 and L3
    cache.tier.flush()
    puts = backend.stats.writes
    assert cache.extra("backups_l2_recurrent") == 1
    assert cache.serve([*doc, 2]) == 16  # restored from L1; nothing is missing below
    cache.tier.flush()
    assert cache.extra("backups_l2_recurrent") == 1
    kv_and_new = backend.stats.writes - puts
    assert kv_and_new == 0, "an object already in L2 and L3 was written again"
    cache.close()


def test_slots_a_request_holds_are_never_evicted_under_it(model: HybridMiniLlama) -> None:
    cache = make(model, snapshot_slots=1, l2=0)
    doc = rand(8, 8)
    cache.serve([*doc, 1])  # a snapshot after page 1 in the only slot
    first = cache.tier.match([*doc, 2])
    prep = cache.tier.prepare(first)  # restores it: the slot is locked by this request
    assert prep.start == 8
    # A second request in flight cannot take the slot: its new snapshot is dropped (counted),
    # and a restore needing a slot is refused rather than evicting the first request's state.
    second = cache.tier.match(rand(9, 9))
    assert cache.tier.prepare(second).components["recurrent"].produce == ()
    assert cache.extra("produce_dropped_recurrent") == 1
    state = cache.recurrent.state(prep.components["recurrent"].restored[0][1])
    cache.tier.complete(second)
    cache.tier.complete(first)
    cache.tier.check_invariants()
    assert torch.equal(cache.recurrent.state(prep.components["recurrent"].restored[0][1]), state)
