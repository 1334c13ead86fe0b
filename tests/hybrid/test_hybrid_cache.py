"""The hybrid mini engine through every tier: the seed's branch-backup scenario, L3 restores,
corrupt and missing snapshots shortening the match to the last usable checkpoint."""

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
CONFIG = MiniLlamaConfig(dtype="float32")


@pytest.fixture(scope="module")
def model() -> HybridMiniLlama:
    return HybridMiniLlama(CONFIG, state_dim=8)


def namespace() -> Namespace:
    shape = ModelShape.mha(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim)
    grid = Grid(CONFIG.num_layers, CONFIG.num_kv_heads)
    return Namespace.create("hybrid-mini", shape, "float32", PAGE, grid)


def make_cache(
    model: HybridMiniLlama, backend: Backend | None = None, **options: object
) -> HybridCache:
    l1 = 64
    pool = model.make_pool(l1, PAGE)
    config = TierConfig(
        l1_pages=l1, l2_pages=64, prefetch_policy="wait_complete", prefetch_threshold_tokens=PAGE
    )
    return HybridCache(
        namespace(),
        config,
        pool,
        model.state_shape,
        snapshot_l1_slots=16,
        snapshot_l2_slots=16,
        backend=backend,
        **options,
    )  # type: ignore[arg-type]


def hashes(tokens: list[int]) -> list[str]:
    return page_hashes(torch.tensor(tokens).numpy().astype("<u4"), PAGE, algo=namespace().hash_algo)


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def test_model_resumes_bit_exact_from_a_snapshot(model: HybridMiniLlama) -> None:
    tokens = rand(random.Random(0), 21)
    pool = model.make_pool(8, PAGE)
    slots = torch.arange(21)
    full, _, snaps = model.prefill(torch.tensor(tokens), 0, slots, pool, None, snapshot_at=(12,))
    assert torch.equal(full, model.forward_full(tokens))
    tail, _, _ = model.prefill(torch.tensor(tokens[12:]), 12, slots, pool, snaps[12])
    assert torch.equal(tail, full[12:])
    with pytest.raises(ValueError):
        model.prefill(torch.tensor(tokens[12:]), 12, slots, pool, None)


@pytest.mark.parametrize("rule_on", [True, False])
def test_branch_backup_recovers_the_shared_prefix(model: HybridMiniLlama, rule_on: bool) -> None:
    """Seed 002: document + question A, then document + question B, evict L1, ask the document
    again. With the rule, the snapshot B created at the document's end was backed up on its own
    (the document's KV already was), so the whole document is recovered from L2."""
    rng = random.Random(1)
    doc = rand(rng, 24)  # 6 pages
    cache = make_cache(model, backup_snapshots_on_existing_prefix=rule_on)
    assert serve(cache, model, doc + rand(rng, 9)) == 0
    kv_l2_before = cache.tier.host.used
    # B: the document's KV is there, but no snapshot at its end: recompute, snapshot the branch
    assert serve(cache, model, doc + rand(rng, 9)) == 0
    doc_end = hashes(doc)[5]
    assert cache.snapshots.location(doc_end) is Location.L1  # taken while serving B
    # A's end and B's end are backed up with their new pages; the document's end only by the rule
    assert cache.snapshots.metrics.backups_l2 == (3 if rule_on else 2)
    cache.tier.flush()
    cache.evict_device()
    assert cache.tier.pool.num_used_pages == 0 and cache.snapshots.l1_used == 0
    assert cache.tier.host.used >= kv_l2_before  # the document's KV stayed in L2
    reused = serve(cache, model, doc + rand(rng, 7))
    assert reused == (len(doc) if rule_on else 0)


def test_restore_from_l3_in_a_fresh_instance(model: HybridMiniLlama, tmp_path: Path) -> None:
    rng = random.Random(2)
    doc = rand(rng, 20)
    backend = open_backend(f"file://{tmp_path}/l3")
    first = make_cache(model, backend)
    serve(first, model, doc + rand(rng, 5))
    serve(first, model, doc + rand(rng, 6))  # snapshot at the document's end, backed up
    first.flush()
    first.close()
    second = make_cache(model, backend)
    assert serve(second, model, doc + rand(rng, 3)) == len(doc)
    assert second.snapshots.metrics.loads_l3 == 1
    second.close()


def test_corrupt_or_missing_snapshot_falls_back_to_an_earlier_checkpoint(
    model: HybridMiniLlama,
) -> None:
    rng = random.Random(3)
    backend = open_backend("memory://")
    doc = rand(rng, 16)
    more = doc + rand(rng, 8)  # checkpoints at 16 (branch) and 24 tokens
    writer = make_cache(model, backend)
    serve(writer, model, [*more, 5])
    serve(writer, model, doc + rand(rng, 6))  # snapshot at the document's end (16)
    writer.flush()
    more_hashes = hashes(more)
    l3 = writer.snapshots.l3
    assert l3 is not None
    writer.close()
    # corrupt the snapshot at 24 tokens: a fresh instance resumes at 16 instead
    key = l3.key(more_hashes[5])
    raw = bytearray(run_sync(backend.get_bytes(key)) or b"")
    raw[-1] ^= 1
    run_sync(backend.put([key], [bytes(raw)]))
    reader = make_cache(model, backend)
    assert serve(reader, model, [*more, 9, 9]) == 16
    assert reader.snapshots.l3 is not None and reader.snapshots.l3.io.corruptions == 1
    # the reader re-took the snapshot at 24 and backed it up: the corrupt object is replaced
    healed = make_cache(model, backend)
    assert serve(healed, model, [*more, 8, 8]) == 24
    healed.close()
    # both snapshots gone: recompute from the start, still correct (KV alone is not enough)
    run_sync(backend.delete([l3.key(more_hashes[3]), l3.key(more_hashes[5])]))
    third = make_cache(model, backend)
    assert serve(third, model, [*more, 7, 7]) == 0
    reader.close()
    third.close()
