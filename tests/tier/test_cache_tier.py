"""The cache tier driving the mini engine: logits equal recompute from L1, L2 and L3 hits."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _mini_tier import CONFIG, PAGE, make_tier, namespace, prompts
from _serve import serve_checked

from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.layout.hashing import page_hashes
from hicache_store.tier.cache import HiCache
from hicache_store.tier.config import TierConfig


@pytest.fixture(scope="module")
def model() -> MiniLlama:
    return MiniLlama(CONFIG)


def check(tier: HiCache, model: MiniLlama, tokens: list[int]) -> int:
    return serve_checked(tier, model, tokens).start


def test_l1_hit_is_used_in_place(model: MiniLlama) -> None:
    tier = make_tier(l1_pages=32)
    (doc,) = prompts(1, 1, 24)
    assert check(tier, model, doc) == 0
    assert check(tier, model, [*doc, 7, 8, 9]) == 24
    assert tier.metrics.hit_tokens_l1 == 24
    tier.close()


def test_l2_hit_is_loaded_layer_by_layer(model: MiniLlama) -> None:
    tier = make_tier(l1_pages=10, l2_pages=64)
    first, second = prompts(2, 2, 32)
    check(tier, model, first)
    check(tier, model, second)  # evicts the first prompt from L1 (write-through kept it in L2)
    assert tier.metrics.evictions_l1 > 0
    start = check(tier, model, [*first, 1, 2])
    assert start == 32
    assert tier.metrics.hit_tokens_l2 > 0
    assert tier.metrics.bytes_l2_to_l1 > 0
    tier.close()


def write_doc(model: MiniLlama, backend: Backend, seed: int, length: int = 40) -> list[int]:
    """A document served and flushed to ``backend`` by an instance that then stops."""
    writer = make_tier(l1_pages=16, l2_pages=16, backend=backend)
    (doc,) = prompts(seed, 1, length)
    check(writer, model, doc)
    writer.flush()
    assert writer.metrics.backups_l3 == length // PAGE
    writer.close()
    return doc


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_l3_hit_after_a_restart(model: MiniLlama, policy: str) -> None:
    backend = open_backend("memory://")
    doc = write_doc(model, backend, 3)
    # A new instance (empty L1 and L2) over the same L3.
    reader = make_tier(l1_pages=16, l2_pages=16, backend=backend, prefetch_policy=policy)
    start = check(reader, model, [*doc, 5])
    assert start == 40
    assert reader.metrics.hit_tokens_l3 == 40
    assert reader.metrics.read_amplification == 1.0
    reader.close()


def test_best_effort_takes_what_has_arrived_and_never_waits(model: MiniLlama) -> None:
    """``best_effort``: ``prepare`` uses the pages the prefetch has landed by then and waits
    for none. Every L3 call of the readers takes ``latency`` s: a request prepared at once
    after its match recomputes everything, without waiting (``wait_complete`` would wait for
    the reads and reuse 12 tokens); one prepared once its reads have landed reuses all 12."""
    latency = 0.3
    backend = open_backend("memory://")
    doc = write_doc(model, backend, 3, length=12)
    prompt = [*doc, 5]

    def reader() -> HiCache:
        slow = FaultyBackend(backend, FaultConfig(latency_s=latency))
        return make_tier(l1_pages=16, l2_pages=16, backend=slow, prefetch_policy="best_effort")

    at_once = reader()
    times: dict[str, float] = {}
    served = serve_checked(
        at_once, model, prompt,
        after_match=lambda _: times.setdefault("matched", time.perf_counter()),
        after_prepare=lambda _: times.setdefault("prepared", time.perf_counter()),
    )
    assert served.start == 0, "best_effort waited for the prefetch's reads"
    assert times["prepared"] - times["matched"] < latency
    assert at_once.metrics.prefetch_partial == 1
    assert at_once.metrics.hit_tokens_l3 == 0
    at_once.close()

    later = reader()
    # three page reads of ``latency`` s each (one after another here): ten latencies is ample
    served = serve_checked(later, model, prompt, after_match=lambda _: time.sleep(10 * latency))
    assert served.start == 12
    assert later.metrics.prefetch_complete == 1
    assert later.metrics.hit_tokens_l3 == 12
    later.close()


def test_default_config_restores_a_short_prompt_from_l3(model: MiniLlama) -> None:
    # 62 tokens: far below SGLang's 256-token prefetch threshold. The defaults must restore
    # every stored full page of it (15 pages of 4), not silently recompute.
    backend = open_backend("memory://")
    pool = DeviceKVPool.for_model(CONFIG, num_pages=32, page_size=PAGE)
    writer = HiCache(namespace(), TierConfig(l1_pages=32, l2_pages=32), pool, backend=backend)
    (doc,) = prompts(9, 1, 62)
    check(writer, model, doc)
    writer.flush()
    writer.close()
    pool = DeviceKVPool.for_model(CONFIG, num_pages=32, page_size=PAGE)
    reader = HiCache(namespace(), TierConfig(l1_pages=32, l2_pages=32), pool, backend=backend)
    assert check(reader, model, doc) == 60
    assert reader.metrics.hit_tokens_l3 == 60
    reader.close()


def test_a_backend_without_l2_is_refused() -> None:
    pool = DeviceKVPool.for_model(CONFIG, num_pages=8, page_size=PAGE)
    with pytest.raises(ValueError, match="l2_pages"):
        HiCache(namespace(), TierConfig(l1_pages=8), pool, backend=open_backend("memory://"))


def test_write_back_backs_up_on_eviction(model: MiniLlama) -> None:
    tier = make_tier(l1_pages=10, l2_pages=64, write_policy="write_back")
    first, second = prompts(4, 2, 32)
    check(tier, model, first)
    assert tier.metrics.backups_l2 == 0
    check(tier, model, second)
    assert tier.metrics.backups_l2 > 0
    assert check(tier, model, [*first, 3]) == 32
    tier.close()


def test_selective_backs_up_only_hot_pages(model: MiniLlama) -> None:
    tier = make_tier(l1_pages=32, l2_pages=64, write_policy="write_through_selective")
    (doc,) = prompts(5, 1, 16)
    check(tier, model, doc)
    assert tier.metrics.backups_l2 == 0
    check(tier, model, [*doc, 1])  # second hit: now hot
    assert tier.metrics.backups_l2 == 4  # the four pages of the prefix, now hit twice
    tier.close()


def test_buffer_only_keeps_no_host_copies(model: MiniLlama) -> None:
    backend = open_backend("memory://")
    tier = make_tier(
        l1_pages=10,
        l2_pages=16,
        backend=backend,
        host_mode="buffer_only",
        prefetch_policy="wait_complete",
    )
    first, second = prompts(6, 2, 32)
    check(tier, model, first)
    tier.flush()
    assert tier.host.used == 0
    check(tier, model, second)
    tier.flush()
    assert check(tier, model, [*first, 2]) == 32
    assert tier.metrics.hit_tokens_l3 > 0
    tier.flush()
    assert tier.host.used == 0
    tier.close()


def test_corrupt_l3_object_is_a_miss_not_wrong_kv(model: MiniLlama) -> None:
    backend = open_backend("memory://")
    writer = make_tier(l1_pages=16, l2_pages=16, backend=backend)
    (doc,) = prompts(7, 1, 24)
    check(writer, model, doc)
    writer.flush()
    writer.close()
    # Flip one payload byte of the third page's object.
    hashes = page_hashes(doc, PAGE)
    assert writer.l3 is not None
    (key,) = writer.l3.read_plan.object_keys(hashes[2])
    data = bytearray(backend._data[key])  # type: ignore[attr-defined]
    data[-1] ^= 0xFF
    backend._data[key] = bytes(data)  # type: ignore[attr-defined]
    reader = make_tier(l1_pages=16, l2_pages=16, backend=backend, prefetch_policy="wait_complete")
    start = check(reader, model, [*doc, 1])
    assert start == 2 * PAGE  # pages 0 and 1 hit; page 2 is corrupt, so it and 3+ recompute
    assert reader.metrics.corruptions == 1
    reader.close()


def test_the_tier_records_its_namespace_manifest() -> None:
    from hicache_store._sync import run_sync
    from hicache_store.ops.manifest import list_manifests, manifest_key, read_manifest

    backend = open_backend("memory://")
    tier = make_tier(l1_pages=8, l2_pages=8, backend=backend)
    key = manifest_key(tier.namespace)
    assert run_sync(list_manifests(backend)) == [key]
    assert run_sync(read_manifest(backend, key)) == tier.namespace
    tier.close()


def test_the_host_pool_is_offered_to_backends_that_register_memory(model: MiniLlama) -> None:
    from hicache_store.backends.memory import MemoryBackend

    class Registering(MemoryBackend):
        capabilities = MemoryBackend.capabilities.replace(host_buffers=True)

        def __init__(self) -> None:
            super().__init__()
            self.registered: list[int] = []
            self.unregistered: list[int] = []

        async def _register_host_buffer(self, buffer: Any) -> bool:
            self.registered.append(memoryview(buffer).nbytes)
            return True

        async def _unregister_host_buffer(self, buffer: Any) -> None:
            self.unregistered.append(memoryview(buffer).nbytes)

    backend = Registering()
    tier = make_tier(l1_pages=16, l2_pages=8, backend=backend)
    assert backend.registered == [tier.host.data.numel()]
    (doc,) = prompts(8, 1, 20)
    check(tier, model, doc)
    tier.close()
    assert backend.unregistered == [tier.host.data.numel()]

    # The capability decides, not the methods a backend happens to have: undeclared, the pool
    # is never offered (the tier used to look for methods of these names).
    class Undeclared(Registering):
        capabilities = MemoryBackend.capabilities

        async def register_host_buffer(self, buffer: Any) -> bool:
            return await self._register_host_buffer(buffer)

        async def unregister_host_buffer(self, buffer: Any) -> None:
            await self._unregister_host_buffer(buffer)

    quiet = Undeclared()
    tier = make_tier(l1_pages=16, l2_pages=8, backend=quiet)
    check(tier, model, doc)
    tier.close()
    assert quiet.registered == [] and quiet.unregistered == []


def test_metrics_as_dict_and_prometheus_text(model: MiniLlama) -> None:
    tier = make_tier(l1_pages=16, l2_pages=16)
    (doc,) = prompts(9, 1, 24)
    check(tier, model, doc)
    check(tier, model, [*doc, 1])
    data = tier.metrics.to_dict()
    assert data["requests"] == 2
    assert data["hit_tokens_l1"] == 24
    assert data["token_hit_rate"] == pytest.approx(24 / 49)
    text = tier.metrics.to_prometheus()
    assert "hicache_store_hit_tokens_l1 24.0" in text
    assert "# TYPE hicache_store_token_hit_rate gauge" in text
    # every component's counters under one name, labelled (the KV's too)
    assert 'hicache_store_evictions_l1{component="kv"} 0.0' in text
    tier.close()


def test_lookups_count_pages_asked_and_found_per_tier(model: MiniLlama) -> None:
    # Each tier is asked for the pages past what the tiers above held.
    backend = open_backend("memory://")
    doc = write_doc(model, backend, 13)
    reader = make_tier(l1_pages=16, l2_pages=16, backend=backend)
    pages = (len(doc) + 1) // PAGE
    assert check(reader, model, [*doc, 5]) == len(doc)  # from L3
    assert check(reader, model, [*doc, 5]) == len(doc)  # from L1
    data = reader.metrics.to_dict()
    counted = {tier: (data[f"lookup_pages_asked_{tier}"], data[f"lookup_pages_found_{tier}"])
               for tier in ("l1", "l2", "l3")}
    assert counted == {"l1": (2 * pages, pages), "l2": (pages, 0), "l3": (pages, pages)}
    text = reader.metrics.to_prometheus()
    assert f'hicache_store_lookup_pages_asked_total{{tier="l1"}} {2.0 * pages}' in text
    assert f'hicache_store_lookup_pages_found_total{{tier="l3"}} {float(pages)}' in text
    reader.close()


def test_timeout_prefetch_gives_up_on_a_slow_l3_and_recomputes(model: MiniLlama) -> None:
    from hicache_store.backends.faulty import FaultConfig, FaultyBackend

    inner = open_backend("memory://")
    writer = make_tier(l1_pages=16, l2_pages=16, backend=inner)
    (doc,) = prompts(10, 1, 40)
    check(writer, model, doc)
    writer.flush()
    writer.close()
    slow = FaultyBackend(inner, FaultConfig(latency_s=0.4))
    reader = make_tier(
        l1_pages=16,
        l2_pages=16,
        backend=slow,
        prefetch_policy="timeout",
        prefetch_timeout_base_s=0.05,
        prefetch_timeout_per_ki_token_s=0.0,
    )
    req = reader.match([*doc, 1])
    prep = reader.prepare(req)  # waits 0.05 s for reads that take 0.4 s each
    assert prep.start < 40, "the slow prefetch cannot have completed"
    assert reader.metrics.prefetch_timed_out == 1
    logits = model.prefill(
        torch.tensor([*doc, 1][prep.start :]),
        prep.start,
        prep.slots,
        reader.pool,  # type: ignore[arg-type]
        wait_layer=prep.wait_layer,
    )
    reader.complete(req)
    assert torch.equal(logits, model.forward_full(torch.tensor([*doc, 1]))[prep.start :])
    reader.close()
    reader.check_invariants()


@pytest.mark.slow
def test_the_tree_stays_bounded_and_l3_is_probed_again(model: MiniLlama) -> None:
    backend = open_backend("memory://")
    tier = make_tier(l1_pages=12, l2_pages=12, backend=backend, prefetch_policy="wait_complete")
    docs = list(prompts(9, 20, 17))  # 4 full pages each: 80 pages in all, 24 in memory
    for doc in docs:
        check(tier, model, doc)
        tier.flush()
    limit = tier.config.l3_record_limit
    assert limit == 24
    assert len(tier.tree) <= 12 + 12 + limit
    assert tier.tree.match(page_hashes(torch.tensor(docs[0]).numpy().astype("<u4"), PAGE)) == []
    # Forgotten by the tree, still in L3: found by a probe and served from there.
    before = tier.metrics.hit_tokens_l3
    assert check(tier, model, [*docs[0][:16], 3]) == 16
    assert tier.metrics.hit_tokens_l3 - before == 16
    tier.close()


def test_a_closed_tier_refuses_requests_with_a_clear_error(model: MiniLlama, tmp_path: Path) -> None:
    """After ``close()`` the loader and the backups are gone: a request must be refused with an
    error that says so (it was a bare "cannot schedule new futures after shutdown" from the
    loader for an L2 hit, and an L3 prefetch started after close for a miss)."""
    tier = make_tier(l1_pages=8, l2_pages=16, backend=open_backend(f"file://{tmp_path}"))
    (doc,) = prompts(5, 1, 16)
    assert check(tier, model, doc) == 0
    tier.evict_device()  # the document now lives in L2 only: its next use loads L2 -> L1
    pending = tier.match(doc)
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.prepare(pending)
    with pytest.raises(RuntimeError, match="closed"):
        tier.match(doc)
    tier.close()  # a second close is harmless
