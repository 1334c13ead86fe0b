"""The tier's KV events: a subscriber that keeps the set of pages per medium from the events
alone ends with exactly the tier's L2 copies (CPU) and the store's pages (STORAGE); stored
pages carry their tokens, which hash to their block hashes; a sealed namespace publishes
keyed hashes and no token ids."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from _kv_subscriber import Subscriber
from _serve import serve_checked

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import object_key_parts
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.sealing import TenantKey
from hicache_store.tenant import KeyRing
from hicache_store.tier.cache import HiCache
from hicache_store.tier.components import KV
from hicache_store.tier.config import TierConfig
from hicache_store.tier.events import TierEvents

PAGE = 4
CONFIG = MiniLlamaConfig(dtype="float32")


@pytest.fixture(scope="module")
def model() -> MiniLlama:
    return MiniLlama(CONFIG)


def namespace(*, sealed: bool = False) -> Namespace:
    shape = ModelShape.mha(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim)
    grid = Grid(CONFIG.num_layers, CONFIG.num_kv_heads)
    ns = Namespace.create("mini-llama", shape, "float32", PAGE, grid)
    return dataclasses.replace(ns, sealed=True) if sealed else ns


def make_tier(tmp_path: Path, backend: Backend, ns: Namespace, keys: KeyRing | None = None,
              *, l2_pages: int = 12) -> HiCache:
    pool = DeviceKVPool.for_model(CONFIG, num_pages=8, page_size=PAGE)
    config = TierConfig(l1_pages=8, l2_pages=l2_pages, prefetch_threshold_tokens=PAGE,
                        events_endpoint=f"ipc://{tmp_path}/ev",
                        events_replay_endpoint=f"ipc://{tmp_path}/replay", events_topic="kv")
    return HiCache(ns, config, pool, backend=backend, keys=keys)


def workload(tier: HiCache, model: MiniLlama, seed: int, n: int) -> list[list[int]]:
    """Conversations that share prefixes and outgrow L1 and L2 (evictions at both)."""
    rng = random.Random(seed)
    stems = [[rng.randrange(CONFIG.vocab_size) for _ in range(12)] for _ in range(3)]
    prompts = []
    for _ in range(n):
        tail = [rng.randrange(CONFIG.vocab_size) for _ in range(rng.randrange(5, 20))]
        prompt = rng.choice(stems) + tail
        serve_checked(tier, model, prompt)
        prompts.append(prompt)
    tier.flush()
    return prompts


def events_of(tier: HiCache) -> list[dict[str, Any]]:
    """Every event the tier published, in order, as a router decodes them (replay socket)."""
    assert tier.events is not None
    publisher = tier.events.publisher
    assert publisher.drain()
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, topic="kv")
    try:
        batches = sub.replay(0)
    finally:
        sub.close()
    assert [seq for seq, _ in batches] == list(range(publisher.sent_batches))
    assert publisher.dropped_batches == 0
    return [event for _, batch in batches for event in batch[1]]


def page_sets(events: list[dict[str, Any]]) -> dict[str, set[bytes]]:
    held: dict[str, set[bytes]] = {"CPU": set(), "STORAGE": set()}
    for event in events:
        if event["type"] == "BlockStored":
            held[event["medium"]].update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            held[event["medium"]].difference_update(event["block_hashes"])
        else:
            raise AssertionError(f"unexpected {event}")
    return held


def stored_pages(backend: Backend, ns: Namespace) -> set[bytes]:
    async def keys() -> list[str]:
        return [k async for k in backend.list_prefix("")]

    pages = set()
    for key in run_sync(keys()):
        parts = object_key_parts(key)
        if parts is not None and parts[1] == ns.digest:
            pages.add(bytes.fromhex(parts[0]))
    return pages


def test_a_subscriber_rebuilds_l2_and_l3_from_events_alone(
        tmp_path: Path, model: MiniLlama) -> None:
    ns = namespace()
    backend = open_backend("memory://")
    tier = make_tier(tmp_path, backend, ns)
    assert tier.events is not None
    sub = Subscriber(tier.events.publisher.endpoint, topic="kv")
    time.sleep(0.3)  # the subscription reaches the publisher before the first event
    workload(tier, model, seed=1, n=40)
    events = events_of(tier)
    held = page_sets(events)
    in_l2 = {bytes.fromhex(n.page_hash) for n in tier.tree.nodes()
             if (h := n.held(KV.tag)) is not None and h.l2 is not None}
    in_store = stored_pages(backend, ns)
    removed_cpu = sum(len(e["block_hashes"]) for e in events
                      if e["type"] == "BlockRemoved" and e["medium"] == "CPU")
    assert removed_cpu > 0  # L2 evicted pages: the workload outgrew it
    assert held["CPU"] == in_l2 and len(in_l2) > 0
    assert held["STORAGE"] == in_store and len(in_store) > 20
    # Every stored block carries its tokens, and they hash to the block's hash from its parent.
    for event in events:
        if event["type"] != "BlockStored":
            continue
        assert event["block_size"] == PAGE and event["lora_id"] is None
        tokens = event["token_ids"]
        assert len(tokens) == PAGE * len(event["block_hashes"])
        parent = event["parent_block_hash"]
        for i, block in enumerate(event["block_hashes"]):
            page = struct.pack(f"<{PAGE}I", *tokens[i * PAGE:(i + 1) * PAGE])
            assert hashlib.sha256((parent or b"") + page).digest() == block
            parent = block
    tier.close()
    # Closing reports the L2 copies gone (host memory goes with the process); L3 stays. The
    # subscriber connected from the start saw every batch live, the close's included.
    live = []
    while (got := sub.recv(2.0)) is not None:
        live.append(got)
    sub.close()
    assert [seq for seq, _ in live] == list(range(len(live)))
    final = page_sets([e for _, batch in live for e in batch[1]])
    assert final["CPU"] == set() and final["STORAGE"] == in_store


@pytest.mark.parametrize("policy", ["lru", "arc", "session"])
def test_pages_l2_refuses_at_once_are_never_reported(
        tmp_path: Path, model: MiniLlama, policy: str) -> None:
    """Without L3 a request's new pages are ranked by the policy before L2 makes room, and
    those it gives up at once never had an L2 copy: no event names them. Every page reported
    stored was copied to L2, every one reported removed was evicted from it."""
    pool = DeviceKVPool.for_model(CONFIG, num_pages=8, page_size=PAGE)
    config = TierConfig(l1_pages=8, l2_pages=4, eviction_policy=policy,
                        events_endpoint=f"ipc://{tmp_path}/ev",
                        events_replay_endpoint=f"ipc://{tmp_path}/replay", events_topic="kv")
    tier = HiCache(namespace(), config, pool)
    workload(tier, model, seed=3, n=30)
    events = events_of(tier)
    in_l2 = {bytes.fromhex(n.page_hash) for n in tier.tree.nodes()
             if (h := n.held(KV.tag)) is not None and h.l2 is not None}
    metrics = tier.metrics.to_dict()
    tier.close()

    def pages(kind: str) -> int:
        return sum(len(e["block_hashes"]) for e in events
                   if e["type"] == kind and e["medium"] == "CPU")

    assert metrics["l2_admissions_refused"] > 0  # new pages were refused at once
    assert pages("BlockStored") == metrics["backups_l2"]
    assert pages("BlockRemoved") == metrics["evictions_l2"] > 0
    assert page_sets(events)["CPU"] == in_l2


def test_a_sealed_namespace_publishes_keyed_hashes_and_no_tokens(
        tmp_path: Path, model: MiniLlama) -> None:
    ns = namespace(sealed=True)
    keys = KeyRing((TenantKey(os.urandom(32)),))
    backend = open_backend("memory://")
    tier = make_tier(tmp_path, backend, ns, keys)
    prompts = workload(tier, model, seed=2, n=15)
    events = events_of(tier)
    tier.close()
    plain = {h for p in prompts for h in page_hashes(p, PAGE)}
    plain_bytes = {bytes.fromhex(h) for h in plain}
    seen_hashes: set[bytes] = set()
    for event in events:
        seen_hashes.update(event["block_hashes"])
        if event["type"] == "BlockStored":
            assert event["token_ids"] == []
            if event["parent_block_hash"] is not None:
                seen_hashes.add(event["parent_block_hash"])
    assert seen_hashes and not seen_hashes & plain_bytes
    # No other field could carry them: each event has exactly the fields of vLLM's classes.
    stored_fields = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                     "lora_id", "medium", "lora_name"}
    for event in events:
        assert set(event) == (stored_fields if event["type"] == "BlockStored"
                              else {"type", "block_hashes", "medium"})
        assert event.get("lora_name") is None
    # The STORAGE pages are the store's own (keyed) names: a router can match them to L3.
    assert page_sets(events)["STORAGE"] == stored_pages(backend, ns)


def test_a_sealed_namespace_without_its_key_ring_refuses_to_publish(tmp_path: Path) -> None:
    config = TierConfig(l1_pages=1, events_endpoint=f"ipc://{tmp_path}/ev").events_config()
    with pytest.raises(ValueError, match="sealed namespace.*refusing to publish"):
        TierEvents(config, namespace(sealed=True), keys=None)
    # No socket was opened: the address is free for a publisher that may publish.
    TierEvents(config, namespace()).close([])


def test_events_are_off_by_default_and_bad_addresses_are_refused(tmp_path: Path) -> None:
    assert TierConfig(l1_pages=1).events_endpoint is None
    pool = DeviceKVPool.for_model(CONFIG, num_pages=4, page_size=PAGE)
    assert HiCache(namespace(), TierConfig(l1_pages=4), pool).events is None
    with pytest.raises(ValueError, match="not a tcp://"):
        TierConfig(l1_pages=1, events_endpoint="udp://127.0.0.1:1")
    with pytest.raises(ValueError, match="needs events_endpoint"):
        TierConfig(l1_pages=1, events_replay_endpoint=f"ipc://{tmp_path}/r")


@pytest.mark.slow
def test_pages_the_tier_finds_gone_from_l3_are_reported_removed(
        tmp_path: Path, model: MiniLlama) -> None:
    ns = namespace()
    backend = open_backend("memory://")
    pool = DeviceKVPool.for_model(CONFIG, num_pages=8, page_size=PAGE)
    config = TierConfig(l1_pages=8, l2_pages=4, prefetch_threshold_tokens=PAGE,
                        l3_record_pages=500, events_endpoint=f"ipc://{tmp_path}/ev",
                        events_replay_endpoint=f"ipc://{tmp_path}/replay", events_topic="kv")
    tier = HiCache(ns, config, pool, backend=backend)
    rng = random.Random(4)
    prompt = [rng.randrange(CONFIG.vocab_size) for _ in range(3 * PAGE + 2)]
    serve_checked(tier, model, prompt)
    tier.flush()
    for _ in range(6):  # push the prompt's pages out of L1 and L2: L3 alone holds them
        serve_checked(tier, model, [rng.randrange(CONFIG.vocab_size) for _ in range(5 * PAGE)])
    tier.flush()
    hashes = page_hashes(prompt, PAGE)
    nodes = [tier.tree.get(h) for h in hashes]
    assert all(n is not None and n.held(KV.tag).in_l3 and not n.held(KV.tag).in_memory
               for n in nodes)

    async def delete_pages() -> None:
        doomed = [k async for k in backend.list_prefix("")
                  if (parts := object_key_parts(k)) is not None and parts[0] in hashes]
        assert await backend.delete(doomed) == [True] * len(doomed)

    run_sync(delete_pages())
    serve_checked(tier, model, prompt)  # the prefetch misses: recomputed, reported gone
    tier.flush()
    events = events_of(tier)
    known_l3 = {bytes.fromhex(n.page_hash) for n in tier.tree.nodes()
                if (h := n.held(KV.tag)) is not None and h.in_l3}
    tier.close()
    first = bytes.fromhex(hashes[0])
    removals = [e for e in events if e["type"] == "BlockRemoved" and e["medium"] == "STORAGE"]
    assert any(first in e["block_hashes"] for e in removals)
    # The events follow what the tier knows of L3, exactly: the refuted page was written
    # again by the recompute's backup (stored once more after its removal).
    held = page_sets(events)["STORAGE"]
    assert held == known_l3 and first in held
