"""Sliding-window KV as a cache component: its own pools and L3 objects, restored only inside the
window, with missing or corrupt window pages shortening the match to a usable prefix."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _hybrid_helpers import serve

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.engine.config import MiniLlamaConfig
from hicache_store.hybrid.cache import HybridCache
from hicache_store.hybrid.components import Location
from hicache_store.hybrid.model import HybridMiniLlama
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.config import TierConfig

PAGE = 4
WINDOW = 8  # a resume at s needs tokens (s - 8, s): the last two pages
CONFIG = MiniLlamaConfig(window_layers=(1, 3), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def model() -> HybridMiniLlama:
    return HybridMiniLlama(CONFIG, state_dim=8)


def namespace() -> Namespace:
    layers = len(CONFIG.full_layers)
    shape = ModelShape.mha(layers, CONFIG.num_kv_heads, CONFIG.head_dim)
    grid = Grid(layers, CONFIG.num_kv_heads)
    return Namespace.create("hybrid-window-mini", shape, "float32", PAGE, grid)


def make_cache(model: HybridMiniLlama, backend: Backend | None = None, **kw: int) -> HybridCache:
    pool = model.make_pool(64, PAGE)
    config = TierConfig(
        l1_pages=64, l2_pages=64, prefetch_policy="wait_complete", prefetch_threshold_tokens=PAGE
    )
    return HybridCache(
        namespace(),
        config,
        pool,
        model.state_shape,
        snapshot_l1_slots=16,
        snapshot_l2_slots=16,
        backend=backend,
        window=model.window_component(PAGE),
        window_l1_slots=kw.get("window_l1_slots", 32),
        window_l2_slots=kw.get("window_l2_slots", 64),
    )


def hashes(tokens: list[int]) -> list[str]:
    return page_hashes(torch.tensor(tokens).numpy().astype("<u4"), PAGE, algo=namespace().hash_algo)


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def window_key(cache: HybridCache, page_hash: str) -> str:
    assert cache.windows is not None and cache.windows.l3 is not None
    return cache.windows.l3.key(page_hash)


def test_window_geometry(model: HybridMiniLlama) -> None:
    component = model.window_component(PAGE)
    assert component is not None
    assert component.spec.window_tokens == WINDOW - 1 and component.spec.num_layers == 2
    assert component.page_shape == (2, 2, PAGE, CONFIG.num_kv_heads, CONFIG.head_dim)
    assert component.spec.pages_needed(6, PAGE) == range(4, 6)
    assert HybridMiniLlama(MiniLlamaConfig()).window_component(PAGE) is None
    with pytest.raises(ValueError, match="window_l1_slots"):
        make_cache(model, window_l1_slots=2)


def test_l1_and_l2_hits_restore_the_window(model: HybridMiniLlama) -> None:
    rng = random.Random(0)
    doc = rand(rng, 24)
    cache = make_cache(model)
    assert serve(cache, model, doc + rand(rng, 5)) == 0
    assert serve(cache, model, doc + rand(rng, 5)) == 0  # snapshot at the branch (24)
    assert serve(cache, model, doc + rand(rng, 5)) == 24  # everything in L1
    assert cache.windows is not None and cache.windows.metrics.loads_l1 == 2
    cache.flush()
    cache.evict_device()
    assert cache.windows.l1_used == 0
    assert serve(cache, model, doc + rand(rng, 5)) == 24  # KV, window and snapshot from L2
    assert cache.windows.metrics.loads_l2 == 2
    assert cache.metrics.window_pages_restored == 4


def test_restore_from_l3_loads_only_the_window(model: HybridMiniLlama, tmp_path: Path) -> None:
    """Only the window pages before checkpoints are stored (a resume happens only there), and a
    fresh instance resumes after the 6-page document from L3 with the window layers' KV of its
    last two pages."""
    rng = random.Random(1)
    doc = rand(rng, 24)
    backend = open_backend(f"file://{tmp_path}/l3")
    first = make_cache(model, backend)
    serve(first, model, doc + rand(rng, 5))
    serve(first, model, doc + rand(rng, 6))  # snapshot at the document's end, backed up
    first.flush()
    doc_hashes = hashes(doc)
    stored = run_sync(backend.exists([window_key(first, h) for h in doc_hashes]))
    assert stored == [False] * 4 + [True] * 2  # the window before the checkpoint at 24
    first.close()
    second = make_cache(model, backend)
    assert serve(second, model, doc + rand(rng, 3)) == len(doc)
    assert second.windows is not None and second.windows.metrics.loads_l3 == 2
    assert second.snapshots.metrics.loads_l3 == 1
    assert second.metrics.limited_by == {"kv": 0, "window": 0, "recurrent": 0}
    second.close()


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_missing_window_page_shortens_the_match(model: HybridMiniLlama, damage: str) -> None:
    """Checkpoints at 16 and 24 tokens; the window page 5 (inside the window at 24) is lost:
    the match falls back to 16, whose window (pages 2, 3) is intact, and stays exact."""
    rng = random.Random(2)
    backend = open_backend("memory://")
    doc = rand(rng, 16)
    more = doc + rand(rng, 8)
    writer = make_cache(model, backend)
    serve(writer, model, [*more, 5])  # snapshot at 24
    serve(writer, model, doc + rand(rng, 6))  # snapshot at the branch, 16
    writer.flush()
    key = window_key(writer, hashes(more)[5])
    writer.close()
    if damage == "delete":
        assert run_sync(backend.delete([key])) == [True]
    else:
        raw = bytearray(run_sync(backend.get_bytes(key)) or b"")
        raw[-1] ^= 1
        run_sync(backend.put([key], [bytes(raw)]))
    reader = make_cache(model, backend)
    assert serve(reader, model, [*more, 9, 9]) == 16
    metrics = reader.metrics
    assert metrics.limited_by["window"] == 1 and metrics.limited_by["kv"] == 0
    assert metrics.load_failures == (1 if damage == "corrupt" else 0)
    assert reader.windows is not None and reader.windows.l3 is not None
    assert reader.windows.l3.io.corruptions == (1 if damage == "corrupt" else 0)
    # per component: KV and snapshots reach 24 tokens, the window 20 (pages 3, 4 intact)
    assert metrics.component_tokens == {"kv": 24, "window": 20, "recurrent": 24}
    rates = metrics.hit_rates()
    assert rates["all"] == 16 / 26 and rates["window"] == 20 / 26
    # the reader recomputed page 5's window KV and backed it up: the next reader resumes at 24
    healed = make_cache(model, backend)
    assert serve(healed, model, [*more, 8, 8]) == 24
    reader.close()
    healed.close()


def test_complete_requires_the_window_buffer(model: HybridMiniLlama) -> None:
    cache = make_cache(model)
    tokens = rand(random.Random(3), 10)
    hreq = cache.match(tokens)
    prep = cache.prepare(hreq)
    assert prep.window is not None and prep.window.length == 10
    assert prep.snapshot_at == (8,)
    _, _, snaps = model.prefill(
        torch.tensor(tokens),
        0,
        prep.slots,
        cache.pool,
        None,
        window=prep.window,
        snapshot_at=prep.snapshot_at,
    )
    with pytest.raises(ValueError, match="window KV buffer"):
        cache.complete(hreq, snaps)
    cache.complete(hreq, snaps, prep.window)
    assert cache.windows is not None
    # the window before the checkpoint at 8 tokens: pages 0 and 1
    assert [cache.windows.location(h) for h in hashes(tokens)] == [Location.L1, Location.L1]
