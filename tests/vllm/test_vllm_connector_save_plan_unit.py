"""The connector's save planning and lookup evidence for a model of several KV cache groups
(Gemma-2 style: a sliding-window part and a full part), on the scheduler side, without an
engine: vLLM 0.32's own specs as the parts, the connector's own methods over a stand-in for
vLLM's block tables and the store's answers.

* A window part saves only the pages a later hit reads (the window behind the step's end and
  the page before it), and every such hit still finds every page it needs.
* A lookup's evidence for the write admission is what the hit reads and what stops it: a
  window part's pages behind a gap of the full part are no hit, so a store that lost the
  histories' first pages puts the admission on hold.
* What the store still holds past the hit is not saved again; a refusal counts the objects
  the plan would have saved, not pages that were saved already.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from hicache_store.integrations._admission import ReuseAdmission
from hicache_store.integrations.vllm._config import ConnectorConfig
from hicache_store.integrations.vllm._groups import describe_groups, pages_to_save
from hicache_store.integrations.vllm.connector import HiCacheStoreConnector, _part_key, _Tracked
from hicache_store.layout.blocks import BlockPages
from hicache_store.layout.topology import Topology
from hicache_store.tier.components import Tier, match_components

BLOCK, WINDOW = 32, 64  # tests/vllm's tiny Gemma-2: pages of 32 tokens, a window of 64
NULL = 0
PAGE_BYTES = 4096  # (the write admission's sizes: a store without capacity_usage ignores them)


def gemma_parts() -> list[Any]:
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                dtype=torch.float32, sliding_window=WINDOW)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                             dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names[0::2], sliding), KVCacheGroupSpec(names[1::2], full)])
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2))
    return describe_groups(ConnectorConfig(url="file:///unused"), vllm_config,  # type: ignore[arg-type]
                           kv, Topology(1, 1), "tiny")


class Store:
    """The store's objects, as the scheduler's lookups see them: part keys present."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def link(self, group: int) -> Any:
        async def exists_pages(hashes: list[str]) -> list[bool]:
            return [_part_key(group, h) in self.keys for h in hashes]
        return SimpleNamespace(exists_pages=exists_pages)


def connector(store: Store, admission: ReuseAdmission | None) -> Any:
    """A scheduler-side connector over ``store``; vLLM's block tables: every block held
    (``blocks``: request id -> block count), ids from 1 (0 is the null block)."""
    conn: Any = object.__new__(HiCacheStoreConnector)
    parts = gemma_parts()
    blocks: dict[str, int] = {}
    conn.blocks = blocks
    conn.parts = parts
    conn.admission = admission
    conn.block_size = conn.page_size = BLOCK
    conn.pages = BlockPages(BLOCK, BLOCK)
    conn.config = SimpleNamespace(lookup_timeout_s=30.0)
    conn._breaker = SimpleNamespace(open=False)
    conn._part_links = [store.link(p.group) for p in parts]
    conn._saved, conn._refuted = OrderedDict(), OrderedDict()
    conn._page_bytes = {p.group: PAGE_BYTES for p in parts}
    conn.metrics, conn._interval, conn._lock = Counter(), Counter(), threading.Lock()
    conn.hints = SimpleNamespace(holds=lambda req_id, pages: False)
    conn._kv_cache_manager = SimpleNamespace(
        block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=NULL)),
        get_block_ids=lambda req_id: tuple(list(range(1, blocks[req_id] + 1)) for _ in parts))
    return conn


def track(conn: Any, req_id: str, tokens: list[int]) -> Any:
    conn.blocks[req_id] = -(-len(tokens) // BLOCK)
    return _Tracked(SimpleNamespace(request_id=req_id, all_token_ids=tokens))


def saved(store: Store, saves: list[Any]) -> dict[int, list[int]]:
    """The saves written to ``store``; per part group, the page indices (block ids - 1)."""
    out: dict[int, list[int]] = {}
    for save in saves:
        store.keys.update(_part_key(save.part, h) for h in save.hashes)
        out[save.part] = [b - 1 for b in save.slots]
    return out


def test_a_window_part_saves_the_window_behind_the_step_end_and_every_such_hit_is_whole() -> None:
    window, full = gemma_parts()
    # A prefill of 12 pages and 5 tokens: the window part keeps the pages a hit at 11 or 12
    # pages reads (a window of 63 tokens: two pages behind each), the full part every page.
    assert pages_to_save(window, 0, 12, False, BLOCK) == [9, 10, 11]
    assert pages_to_save(full, 0, 12, False, BLOCK) == list(range(12))
    assert pages_to_save(window, 11, 12, True, BLOCK) == [11]  # a decode step's one page
    assert pages_to_save(window, 0, 1, False, BLOCK) == [0]
    store = Store()
    conn = connector(store, None)
    tokens = list(range(12 * BLOCK + 5))
    tracked = track(conn, "a", tokens)
    got = saved(store, conn._plan_save_parts(tracked, 0, len(tokens)))
    assert got == {window.group: [9, 10, 11], full.group: list(range(12))}
    # A hit at 11 and at 12 pages finds every page each part needs.
    hashes = conn._hashes(tracked, len(tokens))
    availability = {p.name: [Tier.L3 if _part_key(p.group, h) in store.keys else None
                             for h in hashes] for p in (window, full)}
    specs = [window.spec, full.spec]
    assert match_components(specs, availability, BLOCK).prefix_pages == 12
    assert match_components(specs, availability, BLOCK, max_pages=11).prefix_pages == 11


def test_pages_a_hit_does_not_read_are_no_evidence_so_a_thrashing_store_is_held() -> None:
    store, evictions = Store(), [0]
    admission = ReuseAdmission(lambda: evictions[0])
    conn = connector(store, admission)
    _, full = conn.parts
    histories = {c: list(range(1000 * n, 1000 * n + 12 * BLOCK + 5)) for n, c in enumerate("abc")}
    for c, tokens in histories.items():
        saved(store, conn._plan_save_parts(track(conn, c, tokens), 0, len(tokens)))
    # The store evicted every history's first full page (least recently used); the window
    # pages at their ends are still there.
    evictions[0] += 3
    for c, tokens in histories.items():
        store.keys.discard(_part_key(full.group, conn._hashes(track(conn, c, tokens), BLOCK)[0]))
    for c in "ab":  # the next turns come back: each a miss of what the store evicted
        tokens = histories[c] + list(range(7, 7 + BLOCK))
        tracked = track(conn, c + "2", tokens)
        hashes = conn._hashes(tracked, (len(tokens) - 1) // BLOCK * BLOCK)
        assert conn._match_parts(tracked, hashes, 0) == (0, False)
    assert admission.counts.hits == 0
    assert admission.counts.premature_evictions == 2
    assert admission.holding


def test_what_the_store_holds_past_the_hit_is_not_saved_again() -> None:
    store = Store()
    conn = connector(store, None)
    window, full = conn.parts
    tokens = list(range(12 * BLOCK + 5))
    saved(store, conn._plan_save_parts(track(conn, "a", tokens), 0, len(tokens)))
    first = conn._hashes(track(conn, "a", tokens), BLOCK)[0]
    store.keys.discard(_part_key(full.group, first))  # evicted: no hit at all
    longer = tokens + list(range(5000, 5000 + BLOCK))
    tracked = track(conn, "b", longer)
    hashes = conn._hashes(tracked, (len(longer) - 1) // BLOCK * BLOCK)
    assert conn._match_parts(tracked, hashes, 0) == (0, False)
    got = saved(store, conn._plan_save_parts(tracked, 0, len(longer)))
    # The full part's lost page and its new one (pages 1-11 are still stored), the window
    # part's new page only (10 and 11, the rest of its window, are stored).
    assert got == {window.group: [12], full.group: [0, 12]}
    # The next lookup is a hit of every page but the one holding the last token.
    again = track(conn, "c", [*longer, 1])
    hashes = conn._hashes(again, len(longer))
    assert conn._match_parts(again, hashes, 0) == (13 * BLOCK, True)


@pytest.mark.parametrize("already_saved", [True, False])
def test_a_refusal_counts_the_objects_the_plan_would_have_saved(already_saved: bool) -> None:
    store, evictions = Store(), [0]
    admission = ReuseAdmission(lambda: evictions[0])
    conn = connector(store, admission)
    tokens = list(range(12 * BLOCK + 5))
    tracked = track(conn, "a", tokens)
    if already_saved:
        saved(store, conn._plan_save_parts(tracked, 0, len(tokens)))
        tracked = track(conn, "a2", tokens)
    # A premature eviction before any hit: the admission holds.
    admission.written(["x"])
    evictions[0] += 1
    admission.answered("x", False, "other")
    assert admission.holding
    assert conn._plan_save_parts(tracked, 0, len(tokens)) == []
    # Pages saved already are not refused; otherwise each part's pages the plan would save.
    assert conn.metrics["saves_refused_pages"] == (0 if already_saved else 12 + 3)
