"""What the tier believes L3 holds follows what L3 answers: a page whose read fails, or that
the existence check finds missing, is no longer taken as stored, so the next backup of its KV
stores it again.

A put the backend acknowledged but stored torn (a crash mid-write, a full disk the backend did
not notice) leaves a corrupt object. The instance that wrote it records the page as in L3
(``in_l3``) and, before the fix, kept that belief after every read of the object failed as
corrupt: its backups skipped the page (write-through and buffer-only mode both skip pages "in
L3"), so the store kept the corrupt object for good and every later request recomputed the page
and everything after it, for this instance and every other one sharing the store.
"""

from __future__ import annotations

from pathlib import Path

import torch
from _serve import serve_checked

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.demo.bench.multiturn import namespace_for
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.layout.hashing import page_hashes
from hicache_store.tier.cache import HiCache
from hicache_store.tier.components import KV_TAG
from hicache_store.tier.config import TierConfig

PAGE = 4
#: pages of the document, every one stored torn.
PAGES = 3


def new_tier(model: MiniLlama, backend: FaultyBackend, host_mode: str) -> HiCache:
    pool = DeviceKVPool.for_model(model.config, num_pages=16, page_size=PAGE)
    config = TierConfig(
        l1_pages=16,
        l2_pages=16,
        host_mode=host_mode,  # type: ignore[arg-type]
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=PAGE,
    )
    return HiCache(namespace_for(model.config, PAGE), config, pool, backend=backend)


def serve(tier: HiCache, model: MiniLlama, tokens: list[int]) -> int:
    """Serve one request from a cold L1 (and, in cache mode, a cold L2), checked against a
    full recompute; return the tokens it reused."""
    tier.evict_device()
    for node in list(tier.tree.nodes()):  # a cold L2: what the tier knows of L3 stays
        tier.residency.drop(node, tier.kv)
    served = serve_checked(tier, model, tokens, message="wrong KV reached the engine",
                           invariants=False)
    tier.flush(timeout=30)
    tier.check_invariants()
    return served.start


def test_a_page_whose_l3_object_reads_corrupt_is_backed_up_again(tmp_path: Path) -> None:
    model = MiniLlama(MiniLlamaConfig(dtype="float32"))
    doc = [(7 * i + 3) % model.config.vocab_size for i in range(PAGES * PAGE)]
    prompt = [*doc, 1]
    for host_mode in ("cache", "buffer_only"):
        backend = FaultyBackend(open_backend(f"file://{tmp_path}/{host_mode}"))
        tier = new_tier(model, backend, host_mode)
        # 1. Every object is stored torn, and every put reports success.
        backend.faults = FaultConfig(torn_write_rate=1.0)
        assert serve(tier, model, doc) == 0
        assert backend.injected["torn_write"] == PAGES
        first = tier.tree.get(page_hashes(doc, PAGE, algo=tier.namespace.hash_algo)[0])
        assert first is not None and first.copy(KV_TAG).in_l3 and tier.metrics.backups_l3 == PAGES
        # 2. The store works again. The first page's object reads corrupt: the request
        #    recomputes everything, and its backup must replace that object.
        backend.faults = FaultConfig()
        assert serve(tier, model, prompt) == 0
        assert tier.metrics.corruptions == 1
        assert tier.metrics.backups_l3 == PAGES + 1, "the page that read corrupt was not backed up"
        # 3. Each request heals the first torn page it meets (pages past a failed read are
        #    not read, so nothing is known against them): after one per page, L3 serves all.
        for pages in range(1, PAGES):
            assert serve(tier, model, prompt) == pages * PAGE
        assert serve(tier, model, prompt) == PAGES * PAGE
        assert tier.metrics.corruptions == PAGES
        tier.close()
        # 4. Another instance on the store reuses the whole document from L3.
        other = new_tier(model, backend, host_mode)
        assert serve(other, model, prompt) == PAGES * PAGE
        assert other.metrics.hit_tokens_l3 == PAGES * PAGE and other.metrics.corruptions == 0
        other.close()


def test_a_page_gone_from_l3_is_backed_up_again(tmp_path: Path) -> None:
    """A page its writer stored went away (evicted by the backend, deleted by gc or an
    operator): the existence check says so, and the writer's next backup stores it again."""
    model = MiniLlama(MiniLlamaConfig(dtype="float32"))
    doc = [(5 * i + 1) % model.config.vocab_size for i in range(PAGES * PAGE)]
    prompt = [*doc, 2]
    for host_mode in ("cache", "buffer_only"):
        inner = open_backend(f"file://{tmp_path}/{host_mode}")
        backend = FaultyBackend(inner)
        tier = new_tier(model, backend, host_mode)
        assert serve(tier, model, doc) == 0
        assert tier.metrics.backups_l3 == PAGES
        assert tier.l3 is not None
        gone = page_hashes(doc, PAGE, algo=tier.namespace.hash_algo)[1]
        assert all(run_sync(inner.delete(tier.l3.read_plan.object_keys(gone))))
        # Page 0 comes from L3; page 1 is missing, so it and what follows are recomputed,
        # and page 1 is written again (2 and after are still there).
        assert serve(tier, model, prompt) == PAGE
        assert tier.metrics.backups_l3 == PAGES + 1, "the missing page was not backed up"
        tier.close()
        other = new_tier(model, backend, host_mode)
        assert serve(other, model, prompt) == PAGES * PAGE
        other.close()


def test_write_back_writes_again_a_page_whose_l3_write_failed(tmp_path: Path) -> None:
    """Write-back writes a page to L3 when L1 evicts it. A page whose write failed stayed in L2
    and, evicted from L1 again after a later use, was not written again (only a page without
    an L2 copy was backed up): its L2 copy was its only one until L2 evicted it."""
    model = MiniLlama(MiniLlamaConfig(dtype="float32"))
    doc = [(3 * i + 2) % model.config.vocab_size for i in range(PAGES * PAGE)]
    backend = FaultyBackend(open_backend(f"file://{tmp_path}/l3"))
    pool = DeviceKVPool.for_model(model.config, num_pages=16, page_size=PAGE)
    config = TierConfig(l1_pages=16, l2_pages=16, write_policy="write_back")
    tier = HiCache(namespace_for(model.config, PAGE), config, pool, backend=backend)
    backend.faults = FaultConfig(write_error_rate=1.0)
    req = tier.match(doc)
    prep = tier.prepare(req)
    model.prefill(torch.tensor(doc), 0, prep.slots, pool, wait_layer=prep.wait_layer)
    tier.complete(req)
    tier.evict_device()  # to L2, then L3: every put fails
    tier.flush(timeout=30)
    assert tier.metrics.backups_l3_failed == PAGES and tier.metrics.backups_l3 == 0
    backend.faults = FaultConfig()
    req = tier.match([*doc, 1])  # served from L2, then evicted from L1 again
    assert tier.prepare(req).start == PAGES * PAGE
    tier.complete(req)
    tier.evict_device()
    tier.flush(timeout=30)
    assert tier.metrics.backups_l3 == PAGES, "a page whose L3 write failed was not written again"
    tier.close()
    other = new_tier(model, backend, "cache")
    assert serve(other, model, [*doc, 2]) == PAGES * PAGE
    other.close()
