"""Draft-model KV beside the target's, packed and sidecar (seed 000 §3): restored with the
target from L2 and from L3 in a fresh instance, both models' logits equal to their own full
recompute; a missing or corrupt draft page limits a speculative request's match, never a
request that does not speculate; and the draft, the window and the recurrent state in one
cache."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _serve import serve_checked

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.demo.draft import (
    DRAFT_TAG,
    DraftPool,
    check_packable,
    draft_config,
    layer_view,
    make_packed_pool,
    offset_wait,
    packed_namespace,
)
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.demo.hybrid import HybridMiniLlama, RecurrentPool, WindowPool
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import parse_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.cache import HiCache
from hicache_store.tier.config import TierConfig
from hicache_store.tier.radix import Tier
from hicache_store.tier.transfers import BackupEvent

PAGE = 4
TARGET_CFG = MiniLlamaConfig(dtype="float32")
DRAFT_CFG = draft_config(TARGET_CFG, num_layers=2, seed=11)
L1_PAGES = 32


@pytest.fixture(scope="module")
def models() -> tuple[MiniLlama, MiniLlama]:
    return MiniLlama(TARGET_CFG), MiniLlama(DRAFT_CFG)


def tier_config() -> TierConfig:
    return TierConfig(
        l1_pages=L1_PAGES, l2_pages=64, prefetch_policy="wait_complete", prefetch_threshold_tokens=PAGE
    )


def ns(model: str, cfg: MiniLlamaConfig) -> Namespace:
    shape = ModelShape.mha(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    return Namespace.create(model, shape, cfg.dtype, PAGE, Grid(cfg.num_layers, cfg.num_kv_heads))


@dataclass
class Cache:
    """A tier serving the target and the draft (packed: one pool of both; sidecar: the draft as
    a component), and the pools each model runs on."""

    tier: HiCache
    target_pool: DeviceKVPool
    draft_pool: DeviceKVPool
    packed: bool


def make(org: str, models: tuple[MiniLlama, MiniLlama], backend: Backend | None) -> Cache:
    target, draft = models
    if org == "packed":
        pool = make_packed_pool(TARGET_CFG, DRAFT_CFG, L1_PAGES, PAGE)
        namespace = packed_namespace("mini", TARGET_CFG, DRAFT_CFG, PAGE)
        tier = HiCache(namespace, tier_config(), pool, backend=backend)
        layers = TARGET_CFG.num_layers
        return Cache(tier, layer_view(pool, 0, layers), layer_view(pool, layers, pool.num_layers), True)
    target_pool = target.make_pool(L1_PAGES, PAGE)
    sidecar = DraftPool(draft.make_pool(L1_PAGES, PAGE), ns("draft", DRAFT_CFG), l2_slots=64)
    tier = HiCache(
        ns("target", TARGET_CFG), tier_config(), target_pool, backend=backend,
        components=[sidecar.component],
    )
    return Cache(tier, target_pool, sidecar.pool, False)


def run(
    cache: Cache, models: tuple[MiniLlama, MiniLlama], tokens: list[int], *, speculative: bool = True
) -> int:
    """Serve one request with both models (the draft only when speculating); check both models'
    logits against their own full recompute, bit for bit; return the reused tokens."""
    target, draft = models
    need = None if speculative or cache.packed else ()
    req = cache.tier.match(tokens, need=need)
    prep = cache.tier.prepare(req)
    suffix = torch.tensor(tokens[prep.start :])
    logits = target.prefill(suffix, prep.start, prep.slots, cache.target_pool, prep.wait_layer)
    expected = target.forward_full(torch.tensor(tokens))[prep.start :]
    assert torch.equal(logits, expected), "target logits differ from a full recompute"
    if speculative:
        if not cache.packed:
            # the draft's prefix pages are in its pool at the target's slots; it fills the rest
            restored = prep.components["draft"].restored
            assert [i for i, _ in restored] == list(range(prep.start // PAGE))
            wait = None
        else:
            wait = offset_wait(prep.wait_layer, TARGET_CFG.num_layers)
        d_logits = draft.prefill(suffix, prep.start, prep.slots, cache.draft_pool, wait)
        d_expected = draft.forward_full(torch.tensor(tokens))[prep.start :]
        assert torch.equal(d_logits, d_expected), "draft logits differ from a full recompute"
    cache.tier.complete(req)
    cache.tier.check_invariants()
    return prep.start


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TARGET_CFG.vocab_size) for _ in range(n)]


def hashes(tokens: list[int]) -> list[str]:
    return page_hashes(torch.tensor(tokens).numpy().astype("<u4"), PAGE)


def keys(backend: Backend) -> list[str]:
    async def collect() -> list[str]:
        it: AsyncIterator[str] = backend.list_prefix("")
        return [k async for k in it]

    return run_sync(collect())


def draft_where(cache: Cache, page_hash: str) -> Tier | None:
    node = cache.tier.tree.get(page_hash)
    held = None if node is None else node.held(DRAFT_TAG)
    return None if held is None else held.where()


def test_draft_config_and_packability() -> None:
    assert DRAFT_CFG.vocab_size == TARGET_CFG.vocab_size
    assert DRAFT_CFG.num_layers < TARGET_CFG.num_layers and DRAFT_CFG.seed != TARGET_CFG.seed
    check_packable(TARGET_CFG, DRAFT_CFG)
    with pytest.raises(ValueError, match="sidecar"):
        check_packable(TARGET_CFG, DRAFT_CFG.with_(head_dim=TARGET_CFG.head_dim * 2))


def test_layer_view_shares_buffers() -> None:
    pool = make_packed_pool(TARGET_CFG, DRAFT_CFG, 8, PAGE)
    view = layer_view(pool, TARGET_CFG.num_layers, pool.num_layers)
    assert view.num_layers == 2 and view.k_buffers[0] is pool.k_buffers[TARGET_CFG.num_layers]
    page = view.alloc(1)
    assert pool.is_allocated(page[0])


@pytest.mark.parametrize("org", ["packed", "sidecar"])
def test_restore_after_l1_eviction_brings_back_both_models(
    models: tuple[MiniLlama, MiniLlama], org: str
) -> None:
    rng = random.Random(0)
    doc = rand(rng, 20)
    cache = make(org, models, None)
    assert run(cache, models, doc + rand(rng, 6)) == 0
    assert run(cache, models, doc + rand(rng, 3)) == len(doc)  # from L1
    cache.tier.flush()
    cache.tier.evict_device()
    assert cache.tier.pool.num_free_pages == L1_PAGES
    if org == "sidecar":
        assert draft_where(cache, hashes(doc)[4]) is Tier.L2
    assert run(cache, models, doc + rand(rng, 5)) == len(doc)  # from L2, both models
    if org == "sidecar":
        assert cache.tier.metrics.extra["restored_l2_draft"] == 5
        assert draft_where(cache, hashes(doc)[4]) is Tier.L1


@pytest.mark.parametrize("org", ["packed", "sidecar"])
def test_restore_from_l3_in_a_fresh_instance(
    models: tuple[MiniLlama, MiniLlama], org: str, tmp_path: Path
) -> None:
    rng = random.Random(1)
    doc = rand(rng, 24)
    backend = open_backend(f"file://{tmp_path}/l3")
    first = make(org, models, backend)
    run(first, models, doc + rand(rng, 2))
    first.tier.close()
    second = make(org, models, backend)
    assert run(second, models, doc + rand(rng, 3)) == len(doc)
    stored = [parse_key(k) for k in keys(backend) if not k.startswith("M_")]
    if org == "sidecar":
        assert second.tier.metrics.extra["restored_l3_draft"] == 6
        draft_objs = [k for k in stored if k.coords.component == DRAFT_TAG]
        assert {k.page_hash for k in draft_objs} >= set(hashes(doc))
        assert {k.namespace_digest for k in draft_objs} == {ns("draft", DRAFT_CFG).digest}
    else:  # the draft's layers ride in the target's page objects
        assert {(k.coords.layer_start, k.coords.layer_stop) for k in stored} == {(0, 6)}
        assert {k.coords.component for k in stored} == {0}
        assert {k.page_hash for k in stored} >= set(hashes(doc))
    second.tier.close()


def test_missing_draft_page_limits_a_speculative_match(models: tuple[MiniLlama, MiniLlama]) -> None:
    rng = random.Random(2)
    backend = open_backend("memory://")
    doc = rand(rng, 24)
    writer = make("sidecar", models, backend)
    run(writer, models, doc + rand(rng, 2))
    writer.tier.close()
    draft_key = [
        k for k in keys(backend)
        if not k.startswith("M_") and parse_key(k).coords.component == DRAFT_TAG
        and parse_key(k).page_hash == hashes(doc)[3]
    ]
    assert run_sync(backend.delete(draft_key)) == [True]
    reader = make("sidecar", models, backend)
    # a request that does not speculate matches on the target alone
    assert run(reader, models, doc + rand(rng, 3), speculative=False) == len(doc)
    # a speculative one resumes where the draft's KV is complete: after page 2
    assert run(reader, models, doc + rand(rng, 4)) == 3 * PAGE
    extra = reader.tier.metrics.extra
    assert extra["limited_by_draft"] == 1
    assert extra["component_hit_tokens_draft"] == 3 * PAGE
    assert draft_where(reader, hashes(doc)[3]) is Tier.L1  # recomputed with the target
    assert run(reader, models, doc + rand(rng, 1)) == len(doc)
    reader.tier.close()


def test_corrupt_draft_object_is_a_miss(models: tuple[MiniLlama, MiniLlama]) -> None:
    rng = random.Random(3)
    backend = open_backend("memory://")
    doc = rand(rng, 16)
    writer = make("sidecar", models, backend)
    run(writer, models, doc + rand(rng, 2))
    writer.tier.close()
    (key,) = [
        k for k in keys(backend)
        if not k.startswith("M_") and parse_key(k).coords.component == DRAFT_TAG
        and parse_key(k).page_hash == hashes(doc)[2]
    ]
    raw = bytearray(run_sync(backend.get_bytes(key)) or b"")
    raw[-1] ^= 1
    run_sync(backend.put([key], [bytes(raw)]))
    reader = make("sidecar", models, backend)
    assert run(reader, models, doc + rand(rng, 2)) == 2 * PAGE
    assert reader.tier.metrics.corruptions == 1
    reader.tier.close()


@pytest.mark.slow
def test_window_recurrent_and_draft_in_one_cache(tmp_path: Path) -> None:
    """Every component kind at once: the hybrid model's window KV and recurrent checkpoints and a
    sidecar draft model's KV, restored together from L1, L2 and L3; both models exact."""
    config = MiniLlamaConfig(dtype="float32", window_layers=(1, 3), sliding_window=6)
    model = HybridMiniLlama(config, state_dim=8)
    draft = MiniLlama(draft_config(MiniLlamaConfig(dtype="float32"), seed=7))
    namespace = Namespace.create(
        "hybrid+draft", ModelShape.mha(2, config.num_kv_heads, config.head_dim), "float32", PAGE,
        Grid(2, config.num_kv_heads),
    )
    backend = open_backend(f"file://{tmp_path}/l3")

    @dataclass
    class Engine:
        tier: HiCache
        window: WindowPool
        recurrent: RecurrentPool
        sidecar: DraftPool

        def request(self, tokens: list[int]) -> int:
            served = serve_checked(
                self.tier, model, tokens, window=self.window, recurrent=self.recurrent,
                draft=(draft, self.sidecar.pool),
            )
            restored = served.prepared.components["draft"].restored
            assert [i for i, _ in restored] == list(range(served.start // PAGE))
            return served.start

    def build() -> Engine:
        window = WindowPool(config, namespace, 32, l2_slots=64)
        recurrent = RecurrentPool(8, namespace, 16, l2_slots=16)
        sidecar = DraftPool(draft.make_pool(L1_PAGES, PAGE), ns("draft", draft.config), l2_slots=64)
        tier = HiCache(
            namespace, tier_config(), model.make_pool(L1_PAGES, PAGE), backend=backend,
            components=[window.component, recurrent.component, sidecar.component],
        )
        return Engine(tier, window, recurrent, sidecar)

    rng = random.Random(4)
    doc = rand(rng, 20)
    engine = build()
    assert engine.request(doc + rand(rng, 7)) == 0  # a checkpoint at 24 tokens
    assert engine.request(doc + rand(rng, 5)) == 0  # and one at the branch (20)
    assert engine.request(doc + rand(rng, 2)) == len(doc)  # all three from L1
    engine.tier.flush()
    engine.tier.evict_device()
    assert engine.request(doc + rand(rng, 2)) == len(doc)  # all three from L2
    extra = engine.tier.metrics.extra
    assert extra["restored_l2_window"] == 2 and extra["restored_l2_recurrent"] == 1
    assert extra["restored_l2_draft"] == len(doc) // PAGE
    engine.tier.close()
    fresh = build()
    assert fresh.request(doc + rand(rng, 2)) == len(doc)  # all three from L3
    extra = fresh.tier.metrics.extra
    assert extra["restored_l3_window"] == 2 and extra["restored_l3_recurrent"] == 1
    assert extra["restored_l3_draft"] == len(doc) // PAGE
    fresh.tier.close()


def test_sidecar_draft_backups_end_in_typed_events(models: tuple[MiniLlama, MiniLlama]) -> None:
    """Each page's KV and draft objects report their own ``BackupEvent`` (an engine that needs
    both before announcing a page waits for both); a failed draft put is an event saying so,
    not an L3 copy."""
    rng = random.Random(5)
    backend = FaultyBackend(open_backend("memory://"))
    cache = make("sidecar", models, backend)
    tokens = rand(rng, 13)  # 3 full pages
    run(cache, models, tokens)
    cache.tier.flush()
    page = hashes(tokens)
    assert sorted((e.component, e.page_hash, e.ok) for e in cache.tier.drain_events()) == sorted(
        (c, h, True) for h in page[:3] for c in ("kv", "draft")
    )
    backend.faults = FaultConfig(write_error_rate=1.0)
    more = tokens[:12] + rand(rng, 5)
    run(cache, models, more)
    cache.tier.flush()
    new = hashes(more)[3]
    events = [e for e in cache.tier.drain_events() if e.page_hash == new]
    assert sorted(events, key=lambda e: e.component) == [
        BackupEvent(new, "draft", False), BackupEvent(new, "kv", False)
    ]
    assert draft_where(cache, new) is Tier.L1  # kept in memory, not marked as in L3
    node = cache.tier.tree.get(new)
    held = None if node is None else node.held(DRAFT_TAG)
    assert held is not None and not held.in_l3
    cache.tier.close()
