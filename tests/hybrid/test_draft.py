"""Draft-model KV beside the target's, packed and sidecar (seed 000 §3): restored with the
target from L2 and from L3 in a fresh instance, both models' logits equal to their own full
recompute; a missing draft page limits a speculative request's match."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.engine.config import MiniLlamaConfig
from hicache_store.engine.model import MiniLlama
from hicache_store.hybrid.components import Location
from hicache_store.hybrid.draft import (
    DraftPrepared,
    PackedDraftCache,
    SidecarDraftCache,
    check_packable,
    draft_config,
    layer_view,
)
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import parse_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.config import TierConfig

PAGE = 4
TARGET_CFG = MiniLlamaConfig(dtype="float32")
DRAFT_CFG = draft_config(TARGET_CFG, num_layers=2, seed=11)
L1_PAGES = 32


@pytest.fixture(scope="module")
def models() -> tuple[MiniLlama, MiniLlama]:
    return MiniLlama(TARGET_CFG), MiniLlama(DRAFT_CFG)


def tier_config() -> TierConfig:
    return TierConfig(
        l1_pages=L1_PAGES,
        l2_pages=64,
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=PAGE,
    )


def ns(model: str, cfg: MiniLlamaConfig) -> Namespace:
    shape = ModelShape.mha(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    return Namespace.create(model, shape, cfg.dtype, PAGE, Grid(cfg.num_layers, cfg.num_kv_heads))


def sidecar(models: tuple[MiniLlama, MiniLlama], backend: Backend | None) -> SidecarDraftCache:
    target, draft = models
    return SidecarDraftCache(
        ns("target", TARGET_CFG),
        tier_config(),
        target.make_pool(L1_PAGES, PAGE),
        draft.make_pool(L1_PAGES, PAGE),
        ns("draft", DRAFT_CFG),
        store_l2_pages=64,
        backend=backend,
    )


def packed(backend: Backend | None) -> PackedDraftCache:
    return PackedDraftCache(TARGET_CFG, DRAFT_CFG, tier_config(), PAGE, backend=backend)


Cache = SidecarDraftCache | PackedDraftCache


def make(org: str, models: tuple[MiniLlama, MiniLlama], backend: Backend | None) -> Cache:
    return sidecar(models, backend) if org == "sidecar" else packed(backend)


def serve(
    cache: Cache,
    models: tuple[MiniLlama, MiniLlama],
    tokens: list[int],
    *,
    speculative: bool = True,
) -> int:
    """Serve one request with both models (the draft only when speculating); check both models'
    logits against their own full recompute, bit for bit; return the reused tokens."""
    target, draft = models
    prep: DraftPrepared
    if isinstance(cache, SidecarDraftCache):
        req = cache.match(tokens, speculative=speculative)
        prep = cache.prepare(req)
        target_pool, draft_pool = cache.pool, cache.draft_pool
    else:
        kv = cache.match(tokens)
        prep = cache.prepare(kv)
        target_pool, draft_pool = cache.target_pool, cache.draft_pool
    suffix = torch.tensor(tokens[prep.start :])
    logits = target.prefill(suffix, prep.start, prep.slots, target_pool, prep.target_wait)
    expected = target.forward_full(torch.tensor(tokens))[prep.start :]
    assert torch.equal(logits, expected), "target logits differ from a full recompute"
    if speculative:
        assert prep.speculative
        d_logits = draft.prefill(suffix, prep.start, prep.slots, draft_pool, prep.draft_wait)
        d_expected = draft.forward_full(torch.tensor(tokens))[prep.start :]
        assert torch.equal(d_logits, d_expected), "draft logits differ from a full recompute"
    if isinstance(cache, SidecarDraftCache):
        cache.complete(req)
    else:
        cache.complete(kv)
    cache.check_invariants()
    return prep.start


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TARGET_CFG.vocab_size) for _ in range(n)]


def hashes(tokens: list[int]) -> list[str]:
    algo = ns("target", TARGET_CFG).hash_algo
    return page_hashes(torch.tensor(tokens).numpy().astype("<u4"), PAGE, algo=algo)


def keys(backend: Backend) -> list[str]:
    async def collect() -> list[str]:
        it: AsyncIterator[str] = backend.list_prefix("")
        return [k async for k in it]

    return run_sync(collect())


def test_draft_config_and_packability() -> None:
    assert DRAFT_CFG.vocab_size == TARGET_CFG.vocab_size
    assert DRAFT_CFG.num_layers < TARGET_CFG.num_layers and DRAFT_CFG.seed != TARGET_CFG.seed
    check_packable(TARGET_CFG, DRAFT_CFG)
    with pytest.raises(ValueError, match="sidecar"):
        check_packable(TARGET_CFG, DRAFT_CFG.with_(head_dim=8))
    with pytest.raises(ValueError):
        draft_config(TARGET_CFG, seed=TARGET_CFG.seed)


def test_layer_view_shares_buffers() -> None:
    pool = PackedDraftCache(TARGET_CFG, DRAFT_CFG, tier_config(), PAGE).pool
    view = layer_view(pool, 4, 6)
    assert view.num_layers == 2 and view.k_buffers[0] is pool.k_buffers[4]
    page = view.alloc(1)  # one allocator
    assert pool.is_allocated(page[0])
    with pytest.raises(ValueError):
        layer_view(pool, 5, 7)


@pytest.mark.parametrize("org", ["sidecar", "packed"])
def test_restore_after_l1_eviction_brings_back_both_models(
    models: tuple[MiniLlama, MiniLlama], org: str
) -> None:
    rng = random.Random(10)
    doc = rand(rng, 20)  # 5 pages
    cache = make(org, models, None)
    assert serve(cache, models, doc + rand(rng, 6)) == 0
    assert serve(cache, models, doc + rand(rng, 3)) == len(doc)  # from L1
    cache.evict_device()
    assert cache.pool.num_used_pages == 0
    if isinstance(cache, SidecarDraftCache):
        assert cache.draft_location(hashes(doc)[4]) is Location.L2
        restored = cache.metrics.draft_pages_restored
    assert serve(cache, models, doc + rand(rng, 5)) == len(doc)  # from L2, both models
    if isinstance(cache, SidecarDraftCache):
        assert cache.metrics.draft_pages_restored == restored + 5
        assert cache.draft_location(hashes(doc)[4]) is Location.L1
    cache.close()


@pytest.mark.parametrize("org", ["sidecar", "packed"])
def test_restore_from_l3_in_a_fresh_instance(
    models: tuple[MiniLlama, MiniLlama], org: str, tmp_path: Path
) -> None:
    rng = random.Random(11)
    doc = rand(rng, 24)  # 6 pages
    backend = open_backend(f"file://{tmp_path}/l3")
    first = make(org, models, backend)
    serve(first, models, doc + rand(rng, 5))
    first.flush()
    first.close()
    second = make(org, models, backend)
    assert serve(second, models, doc + rand(rng, 3)) == len(doc)
    stored = [parse_key(k) for k in keys(backend) if not k.startswith("M_")]
    if isinstance(second, SidecarDraftCache):
        assert second.store.metrics.loads_l3 == 6
        # the draft's objects: its own namespace and component, keyed by the target's pages
        draft_objs = [k for k in stored if k.coords.component == 3]
        assert {k.page_hash for k in draft_objs} >= set(hashes(doc))
        assert {k.namespace_digest for k in draft_objs} == {ns("draft", DRAFT_CFG).digest}
    else:
        # one object per page holds all 4 + 2 layers: the draft's travel inside the target's
        assert {(k.coords.layer_start, k.coords.layer_stop) for k in stored} == {(0, 6)}
        assert {k.coords.component for k in stored} == {0}
        assert {k.page_hash for k in stored} >= set(hashes(doc))
    second.close()


def test_missing_draft_page_limits_a_speculative_match(
    models: tuple[MiniLlama, MiniLlama], tmp_path: Path
) -> None:
    rng = random.Random(12)
    doc = rand(rng, 24)  # 6 pages
    backend = open_backend(f"file://{tmp_path}/l3")
    writer = sidecar(models, backend)
    serve(writer, models, doc + rand(rng, 5))
    writer.flush()
    l3 = writer.store.l3
    assert l3 is not None
    writer.close()
    # the draft's object of page 3 is lost (the target's KV of every page is still there)
    assert run_sync(backend.delete([l3.key(hashes(doc)[3])])) == [True]
    reader = sidecar(models, backend)
    # a request that does not speculate: the target alone decides, the whole document hits
    assert serve(reader, models, doc + rand(rng, 3), speculative=False) == len(doc)
    # a speculative one: not a full hit; the match stops where the draft's pages stop
    req = reader.match(doc + rand(rng, 2))
    prep = reader.prepare(req)
    assert prep.start == 3 * PAGE
    assert req.match is not None and req.match.limited_by == ("draft",)
    assert req.match.alone == {"target": 6, "draft": 3}
    reader.tier.complete(req.kv)  # abandon this one (no compute)
    assert reader.metrics.limited_by_draft == 1
    assert serve(reader, models, doc + rand(rng, 4)) == 3 * PAGE  # bit-exact from page 3
    # that request recomputed pages 3-5 with the draft and backed its page 3 up again
    assert reader.draft_location(hashes(doc)[3]) is Location.L1
    reader.evict_device()
    assert serve(reader, models, doc + rand(rng, 1)) == len(doc)
    reader.close()


def test_corrupt_draft_object_is_a_miss(
    models: tuple[MiniLlama, MiniLlama], tmp_path: Path
) -> None:
    rng = random.Random(13)
    doc = rand(rng, 16)
    backend = open_backend(f"file://{tmp_path}/l3")
    writer = sidecar(models, backend)
    serve(writer, models, doc + rand(rng, 3))
    writer.flush()
    l3 = writer.store.l3
    assert l3 is not None
    writer.close()
    key = l3.key(hashes(doc)[2])
    raw = bytearray(run_sync(backend.get_bytes(key)) or b"")
    raw[-1] ^= 1
    run_sync(backend.put([key], [bytes(raw)]))
    reader = sidecar(models, backend)
    assert serve(reader, models, doc + rand(rng, 2)) == 2 * PAGE
    assert reader.store.l3 is not None and reader.store.l3.io.corruptions == 1
    reader.close()
