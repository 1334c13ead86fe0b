"""The hybrid mini engine through every tier of one cache: the seed's branch-backup scenario,
L3 restores, corrupt and missing snapshots shortening the match to the last usable checkpoint,
and component objects prefetched with the KV (never read at ``prepare``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _hybrid_helpers import Hybrid, hashes, make_hybrid

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.hybrid import RECURRENT_TAG, HybridMiniLlama
from hicache_store.layout.keys import ObjectCoords, object_key
from hicache_store.tier.cache import Prepared, Request
from hicache_store.tier.radix import Tier

PAGE = 4
CONFIG = MiniLlamaConfig(dtype="float32")


@pytest.fixture(scope="module")
def model() -> HybridMiniLlama:
    return HybridMiniLlama(CONFIG, state_dim=8)


def make(model: HybridMiniLlama, backend: Backend | None = None, **kw: object) -> Hybrid:
    return make_hybrid(model, "hybrid-mini", PAGE, backend=backend, **kw)  # type: ignore[arg-type]


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def snapshot_key(cache: Hybrid, page_hash: str) -> str:
    """The storage key of the snapshot after ``page_hash``: no rank in it."""
    ns = cache.recurrent.namespace
    return object_key(page_hash, ns.digest, ObjectCoords(0, 1, None, RECURRENT_TAG))


def snapshot_where(cache: Hybrid, page_hash: str) -> Tier | None:
    node = cache.tier.tree.get(page_hash)
    held = None if node is None else node.held(RECURRENT_TAG)
    return None if held is None else held.where()


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


def test_branch_backup_recovers_the_shared_prefix(model: HybridMiniLlama) -> None:
    """Seed 002: document + question A, then document + question B, evict L1, ask the document
    again. The snapshot B created at the document's end is backed up on its own (the document's
    KV already was), so the whole document is recovered from L2."""
    rng = random.Random(1)
    doc = rand(rng, 24)  # 6 pages
    cache = make(model)
    assert cache.serve(doc + rand(rng, 9)) == 0
    kv_l2_before = cache.tier.host.used
    # B: the document's KV is there, but no snapshot at its end: recompute, snapshot the branch
    assert cache.serve(doc + rand(rng, 9)) == 0
    doc_end = hashes(doc, PAGE)[5]
    assert snapshot_where(cache, doc_end) is Tier.L1  # taken while serving B
    # A's end, B's end and the document's end (the branch) are each backed up to L2
    assert cache.extra("backups_l2_recurrent") == 3
    cache.tier.flush()
    cache.tier.evict_device()
    assert cache.tier.pool.num_used_pages == 0  # type: ignore[attr-defined]
    assert snapshot_where(cache, doc_end) is Tier.L2
    assert cache.tier.host.used >= kv_l2_before  # the document's KV stayed in L2
    assert cache.serve(doc + rand(rng, 7)) == len(doc)
    assert cache.extra("restored_l2_recurrent") == 1


def test_a_shared_prefix_whose_checkpoint_was_evicted_gets_one_again(
    model: HybridMiniLlama,
) -> None:
    """A document shared by two conversations loses its checkpoint (evicted), then one of them
    comes back and recomputes from the start: it checkpoints the document's end again (a branch
    point on its path, though its path goes on past it), so the next request sharing the
    document resumes there. Taking one only where the known path ends (conversation A's last
    page) left the document without a checkpoint for good: the multi-turn benchmark's reuse
    with L2 fell below L1 alone (20.7% vs 45.5%)."""
    rng = random.Random(11)
    doc = rand(rng, 24)  # 6 pages
    a = doc + rand(rng, 9)  # 8 full pages
    cache = make(model)
    assert cache.serve(a) == 0
    assert cache.serve(doc + rand(rng, 9)) == 0  # B: checkpoints the branch (the document's end)
    doc_end, a_end = hashes(doc, PAGE)[5], hashes(a, PAGE)[7]
    assert snapshot_where(cache, doc_end) is Tier.L1
    for page_hash in (doc_end, a_end):  # both evicted; A's KV stays
        assert cache.tier.drop(page_hash, "recurrent")
    assert snapshot_where(cache, doc_end) is None
    assert cache.serve(a + rand(rng, 8)) == 0  # A again: no checkpoint on its path
    assert snapshot_where(cache, doc_end) is Tier.L1
    assert cache.serve(doc + rand(rng, 7)) == len(doc)
    cache.close()


def test_restore_from_l3_in_a_fresh_instance(model: HybridMiniLlama, tmp_path: Path) -> None:
    rng = random.Random(2)
    doc = rand(rng, 20)
    backend = open_backend(f"file://{tmp_path}/l3")
    first = make(model, backend)
    first.serve(doc + rand(rng, 5))
    first.serve(doc + rand(rng, 6))  # snapshot at the document's end, backed up
    first.tier.flush()
    assert run_sync(backend.exists([snapshot_key(first, hashes(doc, PAGE)[4])])) == [True]
    first.close()
    second = make(model, backend)
    assert second.serve(doc + rand(rng, 3)) == len(doc)
    assert second.extra("restored_l3_recurrent") == 1
    second.close()


def test_component_objects_are_prefetched_not_read_at_prepare(
    model: HybridMiniLlama, tmp_path: Path
) -> None:
    rng = random.Random(6)
    doc = rand(rng, 20)
    backend = open_backend(f"file://{tmp_path}/l3")
    first = make(model, backend)
    first.serve(doc + rand(rng, 5))
    first.serve(doc + rand(rng, 6))
    first.close()
    second = make(model, backend)
    reads: list[int] = []

    def prefetched(req: Request) -> None:
        assert req.prefetch is not None
        assert [f.tag for f in req.prefetch.extra] == [RECURRENT_TAG]  # with the KV pages
        assert req.prefetch.finished.wait(10)
        reads.append(backend.stats.reads)

    def restored(prep: Prepared) -> None:
        assert backend.stats.reads == reads[0], "prepare read from L3"
        assert prep.start == len(doc)
        ((index, slot),) = prep.components["recurrent"].restored
        assert index == 4
        _, _, snaps = model.prefill(torch.tensor(doc), 0, torch.arange(20), model.make_pool(5, PAGE), None, snapshot_at=(20,))
        assert torch.equal(second.recurrent.state(slot), snaps[20])

    assert second.serve(doc + rand(rng, 3), after_match=prefetched, after_prepare=restored) == 20
    second.close()


def test_corrupt_or_missing_snapshot_falls_back_to_an_earlier_checkpoint(
    model: HybridMiniLlama,
) -> None:
    rng = random.Random(3)
    backend = open_backend("memory://")
    doc = rand(rng, 16)
    more = doc + rand(rng, 8)  # checkpoints at 16 (branch) and 24 tokens
    writer = make(model, backend)
    writer.serve([*more, 5])
    writer.serve(doc + rand(rng, 6))  # snapshot at the document's end (16)
    writer.tier.flush()
    more_hashes = hashes(more, PAGE)
    at24, at16 = snapshot_key(writer, more_hashes[5]), snapshot_key(writer, more_hashes[3])
    writer.close()
    # corrupt the snapshot at 24 tokens: a fresh instance resumes at 16 instead
    raw = bytearray(run_sync(backend.get_bytes(at24)) or b"")
    raw[-1] ^= 1
    run_sync(backend.put([at24], [bytes(raw)]))
    reader = make(model, backend)
    assert reader.serve([*more, 9, 9]) == 16
    assert reader.tier.metrics.corruptions == 1
    assert reader.extra("fetch_failed_recurrent") == 1
    # the reader re-took the snapshot at 24 and backed it up: the corrupt object is replaced
    reader.tier.flush()
    healed = make(model, backend)
    assert healed.serve([*more, 8, 8]) == 24
    healed.close()
    # both snapshots gone: recompute from the start, still correct (KV alone is not enough)
    run_sync(backend.delete([at16, at24]))
    third = make(model, backend)
    assert third.serve([*more, 7, 7]) == 0
    assert third.extra("limited_by_recurrent") == 1
    reader.close()
    third.close()


def test_a_snapshot_that_reads_corrupt_is_backed_up_again_by_its_writer(
    model: HybridMiniLlama,
) -> None:
    """The instance that wrote a snapshot took it for stored after its read failed as corrupt:
    its backups of the snapshot, taken again, skipped L3, so the corrupt object stayed."""
    rng = random.Random(8)
    backend = open_backend("memory://")
    doc = rand(rng, 20)
    writer = make(model, backend)
    writer.serve(doc + rand(rng, 5))
    writer.serve(doc + rand(rng, 6))  # snapshot at the document's end (page 4), backed up
    writer.tier.flush()
    at20 = hashes(doc, PAGE)[4]
    key = snapshot_key(writer, at20)
    raw = bytearray(run_sync(backend.get_bytes(key)) or b"")
    raw[-1] ^= 1
    run_sync(backend.put([key], [bytes(raw)]))
    # The writer loses its memory copies of the snapshot; its KV stays in L1.
    assert writer.tier.drop(at20, "recurrent")
    assert snapshot_where(writer, at20) is Tier.L3
    assert writer.serve(doc + rand(rng, 7)) == 0  # the read fails: no checkpoint before it
    assert writer.extra("fetch_failed_recurrent") == 1
    writer.tier.flush()
    # The snapshot taken again replaced the corrupt object: another instance resumes there.
    reader = make(model, backend)
    assert reader.serve(doc + rand(rng, 3)) == len(doc)
    assert reader.tier.metrics.corruptions == 0
    reader.close()
    writer.close()


def test_a_failing_l3_degrades_to_recompute(model: HybridMiniLlama) -> None:
    rng = random.Random(4)
    inner = open_backend("memory://")
    docs = [rand(rng, 16) for _ in range(3)]
    writer = make(model, inner)
    for doc in docs:
        writer.serve(doc + rand(rng, 5))
        writer.serve(doc + rand(rng, 6))
    writer.close()
    faulty = FaultyBackend(inner, FaultConfig(seed=5, read_error_rate=0.3, bit_flip_rate=0.2))
    reader = make(model, faulty, l1=16, l2=16, snapshot_slots=4, snapshot_l2=4)
    for _ in range(3):
        for doc in docs:
            reader.serve(doc + rand(rng, 3))  # checks logits == recompute every time
    assert faulty.injected
    reader.close()


def test_buffer_only_host_keeps_components_in_transit_only(model: HybridMiniLlama) -> None:
    rng = random.Random(7)
    backend = open_backend("memory://")
    cache = make(model, backend, host_mode="buffer_only")
    doc = rand(rng, 16)
    cache.serve(doc + rand(rng, 5))
    cache.serve(doc + rand(rng, 6))
    cache.tier.flush()
    for part in cache.tier.parts.values():
        assert part.host.used == 0, f"{part.name} keeps host rows after its backups"
    cache.tier.evict_device()
    assert cache.serve(doc + rand(rng, 3)) == 16  # KV and snapshot back from L3
    cache.tier.flush()
    assert all(part.host.used == 0 for part in cache.tier.parts.values())
    cache.close()
