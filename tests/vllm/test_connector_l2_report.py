"""How the scheduler learns which pages every worker holds in L2 (no engine).

Each worker reports, per step, the pages it added to and evicted from its L2
(``HiCacheStoreWorkerMeta``); vLLM aggregates the workers' reports with ``aggregate`` and the
scheduler applies the result (``apply_l2_report``). A page counts as held only when every
worker added it; an eviction anywhere removes it.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from functools import reduce

import pytest

from hicache_store.integrations.vllm import connector
from hicache_store.integrations.vllm.connector import HiCacheStoreWorkerMeta, apply_l2_report


def aggregate(*reports: HiCacheStoreWorkerMeta) -> HiCacheStoreWorkerMeta:
    out = reduce(lambda a, b: a.aggregate(b), reports)
    assert isinstance(out, HiCacheStoreWorkerMeta)
    return out


def test_a_page_is_held_when_every_worker_added_it() -> None:
    held: OrderedDict[str, None] = OrderedDict()
    rank0 = HiCacheStoreWorkerMeta({"a": 1, "b": 1}, set())
    rank1 = HiCacheStoreWorkerMeta({"a": 1}, set())  # b's load failed on rank 1
    apply_l2_report(held, aggregate(rank0, rank1), workers=2)
    assert list(held) == ["a"]


def test_an_eviction_on_any_worker_removes_the_page() -> None:
    held: OrderedDict[str, None] = OrderedDict({"a": None, "b": None})
    rank0 = HiCacheStoreWorkerMeta({"c": 1}, {"a"})
    rank1 = HiCacheStoreWorkerMeta({"c": 1}, set())
    apply_l2_report(held, aggregate(rank0, rank1), workers=2)
    assert list(held) == ["b", "c"]
    # Added by every worker but evicted by one in the same step: not held.
    apply_l2_report(held, aggregate(HiCacheStoreWorkerMeta({"d": 1}, {"d"}),
                                    HiCacheStoreWorkerMeta({"d": 1}, set())), workers=2)
    assert "d" not in held


def test_aggregation_is_order_free_and_survives_pickling() -> None:
    reports = [HiCacheStoreWorkerMeta({"a": 1, "b": 1}, {"x"}),
               HiCacheStoreWorkerMeta({"a": 1}, {"y"}),
               HiCacheStoreWorkerMeta({"a": 1, "b": 1}, set())]
    forward, backward = aggregate(*reports), aggregate(*reports[::-1])
    assert forward == backward == HiCacheStoreWorkerMeta({"a": 3, "b": 2}, {"x", "y"})
    assert pickle.loads(pickle.dumps(forward)) == forward  # how workers' outputs travel


def test_the_list_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connector, "SAVED_MEMORY", 3)
    held: OrderedDict[str, None] = OrderedDict()
    for h in "abcde":
        apply_l2_report(held, HiCacheStoreWorkerMeta({h: 1}, set()), workers=1)
    assert list(held) == ["c", "d", "e"]


def test_the_workers_store_evictions_add_up() -> None:
    # (the scheduler's write admission counts what every worker's saves evicted)
    reports = [HiCacheStoreWorkerMeta(store_evictions=3), HiCacheStoreWorkerMeta({"a": 1}, set()),
               HiCacheStoreWorkerMeta(failed={"x"}, store_evictions=4)]
    out = aggregate(*reports)
    assert out.store_evictions == 7 and out.added == {"a": 1} and out.failed == {"x"}
    assert pickle.loads(pickle.dumps(out)) == out
