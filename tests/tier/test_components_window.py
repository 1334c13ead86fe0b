"""Sliding-window KV as a tier component: its own pools and L3 objects on the KV grid of its own
namespace, restored only inside the window, with missing or corrupt window pages shortening the
match to a usable prefix; the slots ``prepare`` hands the engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from _hybrid_helpers import Hybrid, hashes, make_hybrid

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.hybrid import WINDOW_TAG, HybridMiniLlama, WindowPool
from hicache_store.layout.keys import ObjectCoords, object_key
from hicache_store.tier.cache import Prepared, Request
from hicache_store.tier.components import KV_TAG

PAGE = 4
WINDOW = 8  # a resume at s needs tokens (s - 8, s): the last two pages
CONFIG = MiniLlamaConfig(window_layers=(1, 3), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def model() -> HybridMiniLlama:
    return HybridMiniLlama(CONFIG, state_dim=8)


def make(model: HybridMiniLlama, backend: Backend | None = None, **kw: object) -> Hybrid:
    return make_hybrid(model, "hybrid-window-mini", PAGE, backend=backend, **kw)  # type: ignore[arg-type]


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def document_in_l3(model: HybridMiniLlama, backend: Backend, rng: random.Random) -> list[int]:
    """A 24-token document served once and flushed: its KV, a checkpoint at 24 and its window
    (pages 4, 5) are in ``backend`` (L3); the writer is closed."""
    doc = rand(rng, 24)
    writer = make(model, backend)
    writer.serve([*doc, 1])
    writer.tier.flush()
    writer.close()
    return doc


def window_keys(cache: Hybrid, page_hash: str) -> list[str]:
    """The storage keys of one page's window object (one head group per the grid)."""
    assert cache.window is not None
    ns = cache.window.namespace
    return [
        object_key(page_hash, ns.digest, ObjectCoords(0, 2, group, WINDOW_TAG))
        for group in range(ns.num_head_groups)
    ]


def test_window_geometry(model: HybridMiniLlama) -> None:
    ns = make(model).tier.namespace
    pool = WindowPool(CONFIG, ns, 8)
    spec = pool.component.spec
    assert spec.window_tokens == WINDOW - 1
    assert pool.namespace.num_layers == 2 and pool.namespace.page_size == PAGE
    assert pool.namespace.model == f"{ns.model}#window"
    assert spec.pages_needed(6, PAGE) == range(4, 6)
    with pytest.raises(ValueError, match="no sliding-window layers"):
        WindowPool(MiniLlamaConfig(), ns, 8)


def test_l1_and_l2_hits_restore_the_window(model: HybridMiniLlama) -> None:
    rng = random.Random(0)
    doc = rand(rng, 24)
    cache = make(model)
    assert cache.serve(doc + rand(rng, 5)) == 0
    assert cache.serve(doc + rand(rng, 5)) == 0  # snapshot at the branch (24)
    assert cache.serve(doc + rand(rng, 5)) == 24  # everything in L1
    assert cache.extra("restored_l2_window") == 0
    cache.tier.flush()
    cache.tier.evict_device()
    assert all(h.l1 is None for n in cache.tier.tree.nodes() if (h := n.held(WINDOW_TAG)))
    assert cache.serve(doc + rand(rng, 5)) == 24  # KV, window and snapshot from L2
    assert cache.extra("restored_l2_window") == 2


def test_restore_from_l3_loads_only_the_window(model: HybridMiniLlama, tmp_path: Path) -> None:
    """Only the window pages before checkpoints are stored (a resume happens only there), and a
    fresh instance resumes after the 6-page document from L3 with the window layers' KV of its
    last two pages."""
    rng = random.Random(1)
    doc = rand(rng, 24)
    backend = open_backend(f"file://{tmp_path}/l3")
    first = make(model, backend)
    first.serve(doc + rand(rng, 5))
    first.serve(doc + rand(rng, 6))  # snapshot at the document's end, backed up
    first.tier.flush()
    stored = [all(run_sync(backend.exists(window_keys(first, h)))) for h in hashes(doc, PAGE)]
    assert stored == [False] * 4 + [True] * 2  # the window before the checkpoint at 24
    first.close()
    second = make(model, backend)
    assert second.serve(doc + rand(rng, 3)) == len(doc)
    assert second.extra("restored_l3_window") == 2
    assert second.extra("restored_l3_recurrent") == 1
    assert not any(second.extra(f"limited_by_{n}") for n in ("kv", "window", "recurrent"))
    second.close()


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_missing_window_page_shortens_the_match(model: HybridMiniLlama, damage: str) -> None:
    """Checkpoints at 16 and 24 tokens; the window page 5 (inside the window at 24) is lost:
    the match falls back to 16, whose window (pages 2, 3) is intact, and stays exact."""
    rng = random.Random(2)
    backend = open_backend("memory://")
    doc = rand(rng, 16)
    more = doc + rand(rng, 8)
    writer = make(model, backend)
    writer.serve([*more, 5])  # snapshot at 24
    writer.serve(doc + rand(rng, 6))  # snapshot at the branch, 16
    writer.tier.flush()
    key = window_keys(writer, hashes(more, PAGE)[5])[0]
    writer.close()
    if damage == "delete":
        assert run_sync(backend.delete([key])) == [True]
    else:
        raw = bytearray(run_sync(backend.get_bytes(key)) or b"")
        raw[-1] ^= 1
        run_sync(backend.put([key], [bytes(raw)]))
    reader = make(model, backend)
    assert reader.serve([*more, 9, 9]) == 16
    assert reader.extra("limited_by_window") == 1 and reader.extra("limited_by_kv") == 0
    assert reader.extra("fetch_failed_window") == (1 if damage == "corrupt" else 0)
    assert reader.tier.metrics.corruptions == (1 if damage == "corrupt" else 0)
    # per component: KV and snapshots reach 24 tokens, the window 20 (pages 3, 4 intact)
    hit = {n: reader.extra(f"component_hit_tokens_{n}") for n in ("kv", "window", "recurrent")}
    assert hit == {"kv": 24, "window": 20, "recurrent": 24}
    # the reader recomputed page 5's window KV and backed it up: the next reader resumes at 24
    reader.tier.flush()
    healed = make(model, backend)
    assert healed.serve([*more, 8, 8]) == 24
    reader.close()
    healed.close()


def test_prepare_hands_out_the_slots_to_restore_and_to_fill(model: HybridMiniLlama) -> None:
    cache = make(model)
    tokens = rand(random.Random(3), 10)
    req = cache.tier.match(tokens)
    prep = cache.tier.prepare(req)
    window, recurrent = prep.components["window"], prep.components["recurrent"]
    assert window.restored == () and recurrent.restored == ()
    # a checkpoint after the last full page (8 tokens), and the window pages before it: 0, 1
    assert [i for i, _ in recurrent.produce] == [1]
    assert [i for i, _ in window.produce] == [0, 1]
    assert len({s for _, s in window.produce}) == 2
    cache.tier.complete(req)  # nothing written into the slots: still recorded as produced
    assert cache.extra("produced_window") == 2
    cache.tier.check_invariants()


def test_a_prefetch_does_not_evict_the_objects_its_plan_resumes_with(
    model: HybridMiniLlama,
) -> None:
    """The plan resumes at 24 tokens with the window page 4 from L2 and page 5 from L3 (its KV
    pages 4 and 5 are in L3 only, so the match did not touch page 4's window). The window's L2
    is full: the row for page 5 must not be made by evicting page 4, or the request recomputes
    everything (the hybrid benchmark with L3 reused 68.9% where each component alone allowed
    87.6%)."""
    rng = random.Random(7)
    backend = open_backend("memory://")
    doc = document_in_l3(model, backend, rng)
    reader = make(model, backend, l2=6, window_l2=3)
    assert reader.serve([*doc, 2, 2]) == 24  # all from L3, into L2
    reader.tier.evict_device()
    # Two pages of another prompt: their KV backups evict the document's KV pages 4 and 5 from
    # L2 (L3 keeps them), their window pages take the window's L2 but for page 4's row.
    assert reader.serve(rand(rng, 9)) == 0
    reader.tier.flush()  # its backups settled: the state below does not depend on their timing
    reader.tier.evict_device()
    page4, page5 = (reader.tier.tree.get(h) for h in hashes(doc, PAGE)[4:6])
    assert page4 is not None and page5 is not None
    assert page4.copy(KV_TAG).l2 is None and page5.copy(KV_TAG).l2 is None and page4.copy(KV_TAG).in_l3
    w4, w5 = page4.held(WINDOW_TAG), page5.held(WINDOW_TAG)
    assert w4 is not None and w4.l2 is not None and w4.l1 is None
    assert w5 is None or not w5.in_memory
    assert reader.tier.parts[WINDOW_TAG].host.free_pages == 0
    assert reader.serve([*doc, 3, 3]) == 24
    assert reader.extra("restored_l3_window") >= 3  # pages 4, 5, then 5 again
    reader.close()


def test_a_plan_keeps_its_objects_until_prepare_or_abort(model: HybridMiniLlama) -> None:
    """A matched request's plan resumes with the window pages 4, 5 from L2; another prompt is
    served before it is prepared, and its window pages' backups need the window's two L2 rows.
    They must not take the plan's (the request would recompute everything): the backups are
    dropped instead. ``abort`` releases the plan."""
    rng = random.Random(11)
    backend = open_backend("memory://")
    doc = document_in_l3(model, backend, rng)
    reader = make(model, backend, window_l2=2)
    assert reader.serve([*doc, 2]) == 24  # from L3: the window pages fill the window's L2
    reader.tier.evict_device()
    restored: list[float] = []

    def serve_another(_: Request) -> None:
        assert reader.serve(rand(rng, 9)) == 0  # window pages 0, 1 and a checkpoint at 8
        assert reader.extra("backups_dropped_window") == 2
        restored.append(reader.extra("restored_l2_window"))

    def from_l2(prep: Prepared) -> None:
        assert prep.start == 24
        assert reader.extra("restored_l2_window") == restored[0] + 2

    assert reader.serve([*doc, 3, 3], after_match=serve_another, after_prepare=from_l2) == 24
    # a request matched, then aborted, leaves no pin behind
    reader.tier.evict_device()
    req = reader.tier.match([*doc, 4, 4])
    assert any(h.host_lock for n in reader.tier.tree.nodes() if (h := n.held(WINDOW_TAG)))
    reader.tier.abort(req)
    assert not any(
        h.host_lock or h.lock for n in reader.tier.tree.nodes() for h in n.records()
    )
    reader.tier.check_invariants()
    reader.close()


def test_restoring_one_object_never_evicts_another_the_resume_needs(
    model: HybridMiniLlama,
) -> None:
    """The resume at 12 tokens needs the window pages 1 (in L2) and 2 (in L1). The window's L1
    holds two slots, pages 0 and 2, both used by this request's match (LRU: the deeper, page 2,
    goes first). Making room for page 1 must evict page 0, not page 2 (which would then be
    restored from L2 again, or lost without an L2 copy)."""
    rng = random.Random(12)
    backend = open_backend("memory://")
    doc = rand(rng, 16)
    writer = make(model, backend)
    for end in (4, 12, 16):  # checkpoints at 1, 3, 4 pages; window pages 0 .. 3
        writer.serve([*doc[:end], 1])
    writer.tier.flush()
    writer.close()
    reader = make(model, backend, window_slots=2, window_l2=2, eviction_policy="lru")
    # window pages 2, 3 into L2 and L1: the plan's objects take the window's two L2 rows before
    # those of its fallback (page 0, for a resume at 4 tokens)
    assert reader.serve([*doc, 2]) == 16
    assert reader.serve([*doc[:4], 2]) == 4  # page 0 from L3: L1 holds pages 0, 2 now
    page0, page1, page2 = (reader.tier.tree.get(h) for h in hashes(doc, PAGE)[:3])
    assert page0 is not None and page1 is not None and page2 is not None
    w0, w2 = page0.held(WINDOW_TAG), page2.held(WINDOW_TAG)
    assert w0 is not None and w0.l1 is not None and w2 is not None and w2.l1 is not None
    w1 = page1.held(WINDOW_TAG)
    assert w1 is None or not w1.in_memory
    restored, evicted = reader.extra("restored_l2_window"), reader.extra("evictions_l1_window")
    assert reader.serve([*doc[:12], 2]) == 12  # page 1 from L3 through L2, page 2 in L1
    assert reader.extra("restored_l2_window") == restored + 1
    assert reader.extra("evictions_l1_window") == evicted + 1
    assert w0.l1 is None and w2.l1 is not None
    reader.close()


def test_a_shortfall_no_component_explains_is_counted(model: HybridMiniLlama) -> None:
    """Every component could resume after the whole document from L3, but the prefetch leaves
    that little KV in L3 (its threshold): the request recomputes, counted as limited by the
    prefetch, not by a component."""
    rng = random.Random(13)
    backend = open_backend("memory://")
    doc = document_in_l3(model, backend, rng)
    reader = make(model, backend, prefetch_threshold_tokens=64)
    assert reader.serve([*doc, 2]) == 0
    hit = {n: reader.extra(f"component_hit_tokens_{n}") for n in ("kv", "window", "recurrent")}
    assert hit == {"kv": 24, "window": 24, "recurrent": 24}
    assert reader.extra("limited_by_prefetch") == 1
    assert not any(reader.extra(f"limited_by_{n}") for n in ("kv", "window", "recurrent", "ranks"))
    reader.close()
