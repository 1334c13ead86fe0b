"""Component objects go to L3 in the background: queued puts, their completion events, failures
and a bounded queue; the hybrid cache's and the sidecar draft's events (one per page, covering
the target and the draft)."""

from __future__ import annotations

import random

# the request helpers of the sibling modules (pytest puts this folder on sys.path)
import test_draft as draft_tests
import test_window_cache as window_tests
import torch

from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.engine.model import MiniLlama
from hicache_store.hybrid.components import ComponentSpec, HitRule
from hicache_store.hybrid.model import HybridMiniLlama
from hicache_store.hybrid.state_l3 import StateL3
from hicache_store.hybrid.store import BackupEvent, ComponentStore
from hicache_store.layout.namespace import Grid, ModelShape, Namespace

SNAP = ComponentSpec("snap", 2, HitRule.CHECKPOINT)
HASHES = [f"{i:064x}" for i in range(1, 9)]


def namespace() -> Namespace:
    return Namespace.create("events", ModelShape.mha(1, 1, 8), "float32", 4, Grid(1, 1))


def store(backend: object, **kw: int) -> ComponentStore:
    l3 = StateL3(backend, namespace(), SNAP)  # type: ignore[arg-type]
    return ComponentStore(
        SNAP, (4,), torch.float32, l1_slots=8, l2_slots=8, l3=l3, async_l3=True, **kw
    )


def test_puts_are_queued_then_applied_with_events() -> None:
    backend = FaultyBackend(open_backend("memory://"))
    backend.faults = FaultConfig(latency_s=0.05)  # every put takes a while
    s = store(backend)
    s.save(HASHES[0], torch.arange(4.0))
    assert s.backup(HASHES[0])
    assert s.l3_pending(HASHES[0]) and not s.in_l3(HASHES[0])
    assert s.metrics.backups_l3_queued == 1 and s.metrics.backups_l3 == 0
    s.backup(HASHES[0])  # already on its way: not queued twice
    assert s.metrics.backups_l3_queued == 1
    assert s.flush(timeout=10) == [BackupEvent("snap", HASHES[0], True)]
    assert s.in_l3(HASHES[0]) and s.pending_l3 == 0 and s.metrics.backups_l3 == 1
    # a fresh store finds and loads it: the bytes are what was saved
    reader = store(backend)
    loaded = reader.load(HASHES[0])
    assert loaded is not None and torch.equal(loaded, torch.arange(4.0))


def test_failed_put_is_an_event_not_an_l3_copy() -> None:
    backend = FaultyBackend(open_backend("memory://"))
    backend.faults = FaultConfig(write_error_rate=1.0)
    s = store(backend)
    s.save(HASHES[1], torch.ones(4))
    s.backup(HASHES[1])
    assert s.flush(timeout=10) == [BackupEvent("snap", HASHES[1], False)]
    assert not s.in_l3(HASHES[1]) and s.metrics.backups_l3_failed == 1
    backend.faults = FaultConfig()
    s.backup(HASHES[1])  # a later backup retries
    assert s.flush(timeout=10) == [BackupEvent("snap", HASHES[1], True)]


def test_queue_is_bounded() -> None:
    backend = FaultyBackend(open_backend("memory://"))
    backend.faults = FaultConfig(latency_s=0.05)
    s = store(backend, max_pending_l3=2)
    for h in HASHES[:4]:
        s.save(h, torch.zeros(4))
        s.backup(h)
    assert s.pending_l3 == 2 and s.metrics.backups_l3_dropped == 2
    assert len(s.flush(timeout=10)) == 2


def test_hybrid_cache_events_cover_snapshots_and_window_pages() -> None:
    model = HybridMiniLlama(window_tests.CONFIG, state_dim=8)
    backend = open_backend("memory://")
    cache = window_tests.make_cache(model, backend)
    tokens = [random.Random(4).randrange(512) for _ in range(17)]
    window_tests.serve(cache, model, tokens)  # 4 full pages, snapshot at 16
    cache.flush()
    events = cache.drain_events()
    assert all(e.ok for e in events)
    hashes = window_tests.hashes(tokens)
    by_component = {(e.component, e.page_hash) for e in events}
    # the snapshot at 16 tokens and the window pages before it (tokens 9..15: pages 2, 3)
    assert by_component == {("recurrent", hashes[3])} | {("window", h) for h in hashes[2:]}
    assert cache.drain_events() == []
    cache.close()


def test_sidecar_page_event_waits_for_target_and_draft() -> None:
    target, draft = MiniLlama(draft_tests.TARGET_CFG), MiniLlama(draft_tests.DRAFT_CFG)
    backend = FaultyBackend(open_backend("memory://"))
    cache = draft_tests.sidecar((target, draft), backend)
    tokens = draft_tests.rand(random.Random(5), 13)  # 3 full pages
    draft_tests.serve(cache, (target, draft), tokens)
    cache.flush()
    events = cache.drain_events()
    hashes = draft_tests.hashes(tokens)
    assert [(e.component, e.page_hash, e.ok) for e in events] == [
        ("target+draft", h, True) for h in hashes[:3]
    ]
    # draft puts failing: the page event says so, even though the target's object is stored
    backend.faults = FaultConfig(write_error_rate=1.0)
    more = tokens[:12] + draft_tests.rand(random.Random(6), 5)
    draft_tests.serve(cache, (target, draft), more)
    cache.flush()
    new = [e for e in cache.drain_events() if e.page_hash == draft_tests.hashes(more)[3]]
    assert [e.ok for e in new] == [False]
    cache.close()
