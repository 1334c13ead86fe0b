"""The SGLang adapter's KV events (extra-config ``events_endpoint``): the pages a server stores
in L3, published by TP rank 0 as ``BlockStored`` (medium ``STORAGE``) in runs with their
parents, decoded by a router-style subscriber; off by default; bad addresses refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from _kv_subscriber import Subscriber
from test_sglang_storage import StandInPool, adapter, keys_for, random_pages, slots

from hicache_store.layout.errors import ConfigError
from hicache_store.layout.keys import parse_key
from hicache_store.sglang_config import AdapterConfig
from hicache_store.tenant import KEY_FILE_ENV, KEY_TEXT_ENV, format_key_ring


def test_stored_pages_are_published_in_runs_with_their_parents(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = StandInPool("page_first")
    for page, data in enumerate(random_pages(6)):
        pool.put(page, data)
    events_at = {"events_endpoint": f"ipc://{tmp_path}/ev",
                 "events_replay_endpoint": f"ipc://{tmp_path}/r", "events_topic": "sg"}
    store = adapter(pool, url=f"file://{tmp_path / 'kv'}", **events_at)
    replica = adapter(StandInPool("page_first"), url=f"file://{tmp_path / 'kv'}", tp_rank=1,
                      tp_size=2, grid="4x2", **events_at)
    assert store.events is not None and replica.events is None  # rank 0 publishes alone
    keys = keys_for(6)
    assert store.batch_set_v1(keys[:3], slots([0, 1, 2])) == [True] * 3
    prefix = SimpleNamespace(prefix_keys=keys[:3])
    # A write that fails for the middle page: two runs, the second's parent the failed page.
    real = store._set_pages
    monkeypatch.setattr(store, "_set_pages", lambda *a: [True, False, True])
    assert store.batch_set_v1(keys[3:], slots([3, 4, 5]), prefix) == [True, False, True]
    monkeypatch.setattr(store, "_set_pages", real)
    publisher = store.events.publisher
    assert publisher.drain()
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint, topic="sg")
    batches = sub.replay(0)
    sub.close()
    store.close()
    replica.close()
    h = [bytes.fromhex(k) for k in keys]
    assert [b[1] for _, b in batches] == [
        [{"type": "BlockStored", "block_hashes": h[:3], "parent_block_hash": None,
          "token_ids": [], "block_size": 4, "lora_id": None, "medium": "STORAGE",
          "lora_name": None}],
        [{"type": "BlockStored", "block_hashes": [h[3]], "parent_block_hash": h[2],
          "token_ids": [], "block_size": 4, "lora_id": None, "medium": "STORAGE",
          "lora_name": None},
         {"type": "BlockStored", "block_hashes": [h[5]], "parent_block_hash": h[4],
          "token_ids": [], "block_size": 4, "lora_id": None, "medium": "STORAGE",
          "lora_name": None}],
    ]


def test_events_are_off_by_default_and_bad_keys_are_refused() -> None:
    assert AdapterConfig.from_extra_config({"url": "memory://"}).events is None
    with pytest.raises(ConfigError, match="not a tcp://"):
        AdapterConfig.from_extra_config({"url": "memory://", "events_endpoint": "udp://x:1"})
    with pytest.raises(ConfigError, match="needs events_endpoint"):
        AdapterConfig.from_extra_config({"url": "memory://",
                                         "events_replay_endpoint": "ipc:///tmp/r"})


def test_a_sealed_namespace_publishes_the_stored_keyed_names_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(KEY_TEXT_ENV, raising=False)
    ring = tmp_path / "tenant.keys"
    ring.write_text(format_key_ring(b"\x07" * 32))
    ring.chmod(0o600)
    pool = StandInPool("page_first")
    for page, data in enumerate(random_pages(3)):
        pool.put(page, data)
    store = adapter(pool, url=f"file://{tmp_path / 'kv'}", tenant_key_file=str(ring),
                    events_endpoint=f"ipc://{tmp_path}/ev",
                    events_replay_endpoint=f"ipc://{tmp_path}/r")
    keys = keys_for(3)
    assert store.batch_set_v1(keys, slots([0, 1, 2])) == [True] * 3
    assert store.events is not None and store.events.publisher.drain()
    sub = Subscriber(store.events.publisher.endpoint, store.events.publisher.replay_endpoint)
    (event,) = [e for _, batch in sub.replay(0) for e in batch[1]]
    sub.close()
    store.close()
    stored = {parse_key(p.name).page_hash for p in (tmp_path / "kv" / "objects").rglob("*_L*")
              if p.is_file()}
    published = {b.hex() for b in event["block_hashes"]}
    assert event["token_ids"] == [] and published == stored  # the store's own (keyed) names
    assert not published & set(keys)  # never SGLang's plain page hashes
