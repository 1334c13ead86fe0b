"""The tier primitives a P/D decode worker needs: ``extend``, ``abort``, ``match(reuse=False)``."""

from __future__ import annotations

import random

import pytest
import torch
from _serve import serve_checked

import hicache_store.tier.pools as tier_pools
from hicache_store.backends import open_backend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.cache import HiCache, TierCapacityError
from hicache_store.tier.components import KV_TAG
from hicache_store.tier.config import TierConfig

PAGE = 4
CONFIG = MiniLlamaConfig(dtype="float32")


@pytest.fixture(scope="module")
def model() -> MiniLlama:
    return MiniLlama(CONFIG)


def make_tier(l1_pages: int, l2_pages: int = 0, url: str | None = None) -> HiCache:
    shape = ModelShape.mha(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim)
    namespace = Namespace.create(
        "mini-llama", shape, "float32", PAGE, Grid(CONFIG.num_layers, CONFIG.num_kv_heads)
    )
    pool = DeviceKVPool.for_model(CONFIG, num_pages=l1_pages, page_size=PAGE)
    config = TierConfig(l1_pages=l1_pages, l2_pages=l2_pages, prefetch_policy="wait_complete")
    return HiCache(namespace, config, pool, backend=open_backend(url) if url else None)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def serve(tier: HiCache, model: MiniLlama, seq: list[int]) -> int:
    """Serve ``seq`` through the tier, check its logits against a full recompute."""
    return serve_checked(tier, model, seq).start


def test_extend_adds_decoded_tokens_that_later_requests_reuse(model: MiniLlama) -> None:
    tier = make_tier(l1_pages=32)
    prompt, answer, question = tokens(1, 10), tokens(2, 9), tokens(3, 5)
    req = tier.match(prompt)
    prep = tier.prepare(req)
    model.prefill(torch.tensor(prompt), 0, prep.slots, tier.pool)  # type: ignore[arg-type]
    slots = tier.extend(req, answer[:1])  # one decoded token, then the rest
    slots = tier.extend(req, answer[1:])
    assert len(slots) == len(prompt) + len(answer)
    assert torch.equal(slots[: len(prompt)], prep.slots), "extend moved earlier tokens"
    assert len(set(slots.tolist())) == len(slots)
    logits = model.prefill(
        torch.tensor(answer), len(prompt), slots, tier.pool  # type: ignore[arg-type]
    )
    full = model.forward_full(torch.tensor(prompt + answer))
    assert torch.equal(logits, full[len(prompt) :])
    tier.complete(req)
    tier.check_invariants()
    # The next turn finds prompt + answer (every full page) cached.
    assert serve(tier, model, prompt + answer + question) == (19 // PAGE) * PAGE


def test_extend_evicts_unlocked_pages_and_refuses_when_all_are_locked(model: MiniLlama) -> None:
    tier = make_tier(l1_pages=6)
    serve(tier, model, tokens(5, 12))  # 3 cached pages, unlocked
    req = tier.match(tokens(6, 8))
    tier.prepare(req)  # 2 pages
    tier.extend(req, tokens(7, 8))  # 2 more: one free page left, so one cached page goes
    assert tier.metrics.evictions_l1 >= 1
    with pytest.raises(TierCapacityError):
        tier.extend(req, tokens(8, 40))
    tier.abort(req)
    tier.check_invariants()
    assert tier.pool.num_free_pages == 6 - sum(
        1 for n in tier.tree.nodes() if n.copy(KV_TAG).l1 is not None
    )


def test_extend_needs_a_prepared_request() -> None:
    tier = make_tier(l1_pages=8)
    req = tier.match(tokens(9, 6))
    with pytest.raises(ValueError, match="not prepared"):
        tier.extend(req, [1, 2])
    tier.abort(req)


def test_abort_after_an_l2_load_gives_everything_back(model: MiniLlama) -> None:
    tier = make_tier(l1_pages=16, l2_pages=32)
    doc = tokens(10, 24)
    serve(tier, model, doc)
    tier.evict_device()  # the document's pages now live in L2 only
    free_before = tier.pool.num_free_pages
    req = tier.match(doc + tokens(11, 6))
    prep = tier.prepare(req)
    assert prep.start == 24 and prep.wait_layer is not None
    tier.abort(req)
    assert tier.pool.num_free_pages == free_before
    nodes = list(tier.tree.nodes())
    assert all(n.copy(KV_TAG).lock == 0 and n.copy(KV_TAG).host_lock == 0 for n in nodes)
    assert all(n.copy(KV_TAG).l1 is None for n in nodes), "an aborted load left an L1 copy"
    assert sum(n.copy(KV_TAG).l2 is not None for n in nodes) == 6
    tier.check_invariants()
    # The L2 copies are still good: the next request restores them and computes exactly.
    assert serve(tier, model, doc + tokens(12, 3)) == 24


def test_abort_after_a_failed_load_never_trusts_its_l1_copies(
    model: MiniLlama, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(l1_pages=16, l2_pages=32)
    doc = tokens(13, 16)
    serve(tier, model, doc)
    tier.evict_device()
    real_unpack = tier_pools.unpack_pages
    calls = 0

    def failing_unpack(*args: object, **kwargs: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # fail half way through the layers
            raise RuntimeError("injected: host-to-device copy failed")
        real_unpack(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tier_pools, "unpack_pages", failing_unpack)
    req = tier.match([*doc, 1])
    prep = tier.prepare(req)
    assert prep.wait_layer is not None
    wait = prep.wait_layer

    def wait_all() -> None:
        for layer in range(CONFIG.num_layers):
            wait(layer)

    with pytest.raises(RuntimeError, match="loading cached KV"):
        wait_all()
    tier.abort(req)
    monkeypatch.setattr(tier_pools, "unpack_pages", real_unpack)
    assert all(n.copy(KV_TAG).l1 is None and n.copy(KV_TAG).lock == 0 for n in tier.tree.nodes())
    tier.check_invariants()
    assert serve(tier, model, [*doc, 2, 3]) == 16


def test_abort_after_match_returns_prefetched_host_pages(model: MiniLlama, tmp_path: object) -> None:
    url = f"file://{tmp_path}/l3"
    writer = make_tier(l1_pages=16, l2_pages=16, url=url)
    doc = tokens(14, 20)
    serve(writer, model, doc)
    writer.close()
    reader = make_tier(l1_pages=16, l2_pages=16, url=url)
    req = reader.match([*doc, 5])
    assert req.prefetch is not None
    reader.abort(req)
    reader.flush()
    assert reader.host.used == reader.host_pages_referenced() == 0
    reader.check_invariants()
    reader.close()


def test_match_without_reuse_ignores_the_cache(model: MiniLlama) -> None:
    tier = make_tier(l1_pages=32)
    doc = tokens(15, 20)
    serve(tier, model, doc)
    cached = {n.page_hash: n.copy(KV_TAG).l1 for n in tier.tree.nodes()}
    req = tier.match([*doc, 7], reuse=False)
    prep = tier.prepare(req)
    assert prep.start == 0
    logits = model.prefill(torch.tensor([*doc, 7]), 0, prep.slots, tier.pool)  # type: ignore[arg-type]
    assert torch.equal(logits, model.forward_full(torch.tensor([*doc, 7])))
    tier.complete(req)
    # The existing copies were kept, the duplicates freed.
    assert {n.page_hash: n.copy(KV_TAG).l1 for n in tier.tree.nodes()} == cached
    assert tier.pool.num_free_pages == 32 - len(cached)
    tier.check_invariants()
