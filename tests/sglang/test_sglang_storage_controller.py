"""The adapter driven by SGLang 0.5.23's own controller, host pools and threads.

Every storage call here is made by SGLang's ``HybridCacheController`` (its backup, prefetch
and prefetch-I/O threads) on SGLang's real host pools; the adapter is loaded by SGLang's
``StorageBackendFactory``. Host pages are written and compared by plain indexing in the test
(the oracle), never by the adapter's kernels.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from hicache_store.integrations.sglang import HiCacheStoreStorage

MHA = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA = ("layer_first", "page_first", "page_first_direct")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.parametrize(("layout", "mla"), [(x, False) for x in MHA] + [(x, True) for x in MLA])
def test_every_layout_round_trips_through_sglangs_controller(
    sglang: ModuleType, url: str, layout: str, mla: bool
) -> None:
    writer = sglang.Rank(url, layout=layout, mla=mla)
    assert isinstance(writer.storage, HiCacheStoreStorage)
    tokens = sglang.tokens_for(3, writer.geometry.page_size)
    pages = [writer.random_page(seed) for seed in range(3)]
    assert writer.backup(tokens, pages) == len(tokens)
    reader = sglang.Rank(url, layout=layout, mla=mla)
    # one page more than stored: SGLang's hit query stops at the first missing page
    hit, loaded, host_indices = reader.prefetch(tokens + [7] * writer.geometry.page_size)
    assert (hit, loaded) == (len(tokens), len(tokens))
    assert host_indices is not None
    for i, data in enumerate(pages):
        assert same(reader.host_page_of(host_indices, i), data)
    writer.close()
    reader.close()


def test_tp2_writers_tp1_reader_through_the_controller(sglang: ModuleType, url: str) -> None:
    half = sglang.Geometry(heads=2)
    tokens = sglang.tokens_for(2, half.page_size, seed=3)
    g = torch.Generator().manual_seed(11)
    full_pages = [torch.randint(-30000, 30000, (2, 4, 4, 4, 8), generator=g,
                                dtype=torch.int16).view(torch.bfloat16) for _ in range(2)]
    for tp_rank in range(2):
        rank = sglang.Rank(url, layout="page_head", geometry=half,
                           parallel=sglang.parallel_state(tp_rank, 2), extra={"grid": "4x2"})
        mine = [p[:, :, :, 2 * tp_rank : 2 * tp_rank + 2] for p in full_pages]
        assert rank.backup(tokens, mine) == len(tokens)
        rank.close()
    reader = sglang.Rank(url, layout="layer_first", extra={"grid": "4x2"})
    hit, loaded, host_indices = reader.prefetch(tokens)
    assert (hit, loaded) == (len(tokens), len(tokens))
    assert host_indices is not None
    for i, data in enumerate(full_pages):
        assert same(reader.host_page_of(host_indices, i), data)
    reader.close()


# -- sidecar pools the adapter does not store: refused at start-up; no v2 call ever raises ------


def _sidecar(sglang: ModuleType, name: str) -> tuple[Any, Any, Any]:
    names = sglang.module("sglang.srt.mem_cache.hicache_storage").PoolName
    device, host = sglang.kv_host_pool(sglang.Geometry(heads=2), "page_first")
    return names(name), device, host


@pytest.mark.parametrize("pool", ["draft", "indexer", "deepseek_v4_c4"])
def test_a_sidecar_pool_is_refused_at_startup_with_one_clear_error(
    sglang: ModuleType, url: str, pool: str
) -> None:
    with pytest.raises(ValueError, match=rf"'{pool}' host pool.*does not store") as caught:
        sglang.Rank(url, sidecars=[_sidecar(sglang, pool)])
    assert "refuses at start-up" in str(caught.value)


def test_a_sidecar_added_at_runtime_is_refused_on_the_scheduler_thread(
    sglang: ModuleType, url: str
) -> None:
    rank = sglang.Rank(url)
    names = sglang.module("sglang.srt.mem_cache.hicache_storage").PoolName
    _, device, host = _sidecar(sglang, "draft")
    entry = sglang.pool_entry(names.DRAFT, host, device)
    with pytest.raises(ValueError, match="'draft' host pool"):
        rank.controller.register_host_pool_entry(entry)
    rank.close()


def test_v2_calls_from_sglangs_threads_never_raise(sglang: ModuleType, url: str) -> None:
    """A runtime attach whose sidecar registration failed leaves SGLang's storage threads
    running with the sidecar in the tree's transfers: every v2 call must come back as data."""
    hs = sglang.module("sglang.srt.mem_cache.hicache_storage")
    rank = sglang.Rank(url)
    rank.controller.detach_storage_backend()
    name, device, host = _sidecar(sglang, "draft")
    rank.group.add_entry(sglang.pool_entry(name, host, device))
    with sglang.as_rank(rank.parallel), pytest.raises(ValueError, match="'draft' host pool"):
        rank.controller.attach_storage_backend(
            "dynamic", model_name="org/model",
            storage_backend_extra_config=sglang.extra_config(url),
            host_pools=rank.group.entries,
        )
    ctrl = rank.controller
    assert ctrl.enable_storage  # SGLang keeps the backend attached and its threads running
    storage = ctrl.storage_backend
    g = rank.geometry
    tokens = sglang.tokens_for(2, g.page_size, seed=5)
    hashes = rank.hashes(tokens)
    kv = rank.group.alloc(2 * g.page_size)
    draft = rank.group.alloc(g.page_size, pool=hs.PoolName.DRAFT)
    trailing = hs.PoolHitPolicy.TRAILING_PAGES
    ctrl.write_storage(kv, tokens, hash_value=hashes, extra_pools=[
        hs.PoolTransfer(name=hs.PoolName.DRAFT, host_indices=draft, keys=hashes[-1:],
                        hit_policy=trailing)])
    op = ctrl.ack_backup_queue.get(timeout=60)
    assert op.pool_storage_result.extra_pool_hit_pages == {hs.PoolName.DRAFT: 0}
    # the prefetch thread's v2 hit query: no hit, no exception
    base = sglang.module("sglang.srt.mem_cache.base_prefix_cache")
    ctrl.prefetch(base.CacheRequestHandle(rid="v2", attempt_id=0), tokens, extra_pools=[
        hs.PoolTransfer(name=hs.PoolName.DRAFT, keys=hashes[-1:], hit_policy=trailing)])
    query = ctrl.prefetch_hit_queue.get(timeout=60)
    assert query.storage_hit_count == 0
    # direct calls with malformed transfers: data, never an exception
    assert storage.batch_get_v2([object(), None]) == {}
    assert storage.batch_set_v2(7) == {}
    bad = hs.PoolTransfer(name=hs.PoolName.KV, host_indices=torch.tensor([10**9]), keys=hashes)
    assert storage.batch_get_v2([bad]) == {hs.PoolName.KV: [False, False]}
    result = storage.batch_exists_v2(hashes, [object()])
    assert isinstance(result, hs.PoolTransferResult) and result.kv_hit_pages == 0
    for thread in (ctrl.backup_thread, ctrl.prefetch_thread, ctrl.prefetch_io_aux_thread):
        assert thread.is_alive()
    assert storage.counters["v2_refused"] >= 2
    rank.close()


def test_kv_only_v2_transfers_are_served_like_v1(sglang: ModuleType, url: str) -> None:
    hs = sglang.module("sglang.srt.mem_cache.hicache_storage")
    rank = sglang.Rank(url)
    g = rank.geometry
    tokens = sglang.tokens_for(2, g.page_size, seed=9)
    hashes = rank.hashes(tokens)
    pages = [rank.random_page(s) for s in (1, 2)]
    src = rank.group.alloc(2 * g.page_size)
    for i, data in enumerate(pages):
        rank.host_page_of(src, i).copy_(data)
    kv = hs.PoolName.KV
    storage = rank.storage
    assert storage.batch_set_v2([hs.PoolTransfer(name=kv, host_indices=src, keys=hashes)]) == {
        kv: [True, True]}
    result = storage.batch_exists_v2(hashes, [hs.PoolTransfer(name=kv, keys=hashes)])
    assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (2, {"kv": 2})
    dst = rank.group.alloc(2 * g.page_size)
    assert storage.batch_get_v2([hs.PoolTransfer(name=kv, host_indices=dst, keys=hashes)]) == {
        kv: [True, True]}
    for i, data in enumerate(pages):
        assert same(rank.host_page_of(dst, i), data)
    rank.close()


# -- metrics ---------------------------------------------------------------------------------------

_COLLECTOR: dict[str, Any] = {}


def _collector(sglang: ModuleType) -> tuple[Any, dict[str, str]]:
    """SGLang's own storage metrics collector (one per process: it registers its metrics)."""
    if not _COLLECTOR:
        mc = sglang.module("sglang.srt.observability.metrics_collector")
        labels = {"model_name": "hicache-store-test", "storage_backend": "dynamic"}
        _COLLECTOR["c"] = (mc.StorageMetricsCollector(labels=labels), labels)
    collector, labels = _COLLECTOR["c"]
    return collector, labels


def test_get_stats_is_logged_by_sglangs_collector(sglang: ModuleType, url: str) -> None:
    from prometheus_client import REGISTRY

    mc = sglang.module("sglang.srt.observability.metrics_collector")
    collector, labels = _collector(sglang)

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = {n: sample(n) for n in ("sglang:backup_pgs_count", "sglang:backup_pgs_sum",
                                     "sglang:prefetch_pgs_sum", "sglang:prefetch_bandwidth_count")}
    rank = sglang.Rank(url, enable_storage_metrics=True)
    tokens = sglang.tokens_for(3, rank.geometry.page_size, seed=4)
    assert rank.backup(tokens, [rank.random_page(s) for s in range(3)]) == len(tokens)
    assert rank.prefetch(tokens)[1] == len(tokens)
    # what UnifiedRadixCache does each scheduler step with --enable-metrics
    stats = rank.controller.storage_backend.get_stats()
    assert isinstance(stats, mc.StorageMetrics)
    if not hasattr(stats, "prefetch_stats"):
        stats.prefetch_stats = {}
    collector.log_storage_metrics(stats)
    assert sample("sglang:backup_pgs_count") == before["sglang:backup_pgs_count"] + 1
    assert sample("sglang:backup_pgs_sum") == before["sglang:backup_pgs_sum"] + 3
    assert sample("sglang:prefetch_pgs_sum") == before["sglang:prefetch_pgs_sum"] + 3
    assert sample("sglang:prefetch_bandwidth_count") > before["sglang:prefetch_bandwidth_count"]
    # drained: the next step logs nothing new
    again = rank.storage.get_stats()
    assert (again.backup_pgs, again.prefetch_pgs) == ([], [])
    collector.log_storage_metrics(again)
    assert sample("sglang:backup_pgs_count") == before["sglang:backup_pgs_count"] + 1
    # our counters: cumulative, and exported to Prometheus for SGLang's /metrics
    assert rank.storage.counters["set_pages"] == 3
    assert rank.storage.counters["get_pages"] == 3
    events = {"event": "set_pages", "tp_rank": "0", "pp_rank": "0"}
    assert (REGISTRY.get_sample_value("hicache_store_sglang_events_total", events) or 0) >= 3
    rank.close()


def test_lookups_count_pages_asked_and_found_for_prometheus(sglang: ModuleType, url: str) -> None:
    # The L3 hit rate an operator watches: SGLang's controller asks the store for a prompt's
    # pages (batch_exists); the adapter counts those asked and those found.
    from prometheus_client import REGISTRY

    rank = sglang.Rank(url, enable_storage_metrics=True)
    page = rank.geometry.page_size
    tokens = sglang.tokens_for(5, page, seed=12)
    assert rank.backup(tokens[: 3 * page], [rank.random_page(s) for s in range(3)]) == 3 * page
    labels = {"integration": "sglang", "tier": "l3", "tp_rank": "0", "pp_rank": "0"}

    def sample(counter: str) -> float:
        return REGISTRY.get_sample_value(f"hicache_store_{counter}_total", labels) or 0.0

    before = {c: sample(c) for c in ("lookup_pages_asked", "lookup_pages_found")}
    assert rank.prefetch(tokens)[1] == 3 * page
    counters = rank.storage.counters
    assert (counters["lookup_pages_asked_l3"], counters["lookup_pages_found_l3"]) == (5, 3)
    assert sample("lookup_pages_asked") == before["lookup_pages_asked"] + 5
    assert sample("lookup_pages_found") == before["lookup_pages_found"] + 3
    rank.close()


# -- clear ------------------------------------------------------------------------------------------


def test_clear_keeps_a_shared_store_unless_allowed(sglang: ModuleType, url: str,
                                                   tmp_path: Path) -> None:
    tokens = sglang.tokens_for(2, 4, seed=8)
    writer = sglang.Rank(url)
    assert writer.backup(tokens, [writer.random_page(s) for s in range(2)]) == len(tokens)
    objects = lambda: sorted(p for p in (tmp_path / "kv").rglob("*") if p.is_file())  # noqa: E731
    stored = objects()
    assert writer.controller.clear_storage_backend()  # SGLang's HTTP clear endpoint
    assert objects() == stored
    assert writer.storage.counters["clear_refused"] == 1
    other_tenant = sglang.Rank(url, extra={"tenant_salt": "b", "allow_clear": True})
    assert other_tenant.backup(tokens, [writer.random_page(s) for s in range(2)]) == len(tokens)
    allowed = sglang.Rank(url, extra={"allow_clear": True})
    assert allowed.storage.clear() is True
    assert sglang.Rank(url).prefetch(tokens)[0] == 0
    assert sglang.Rank(url, extra={"tenant_salt": "b"}).prefetch(tokens)[0] == len(tokens)
    for rank in (writer, other_tenant, allowed):
        rank.close()


def test_threads_keep_running_after_failed_calls(sglang: ModuleType, url: str) -> None:
    """A backend that fails every call: SGLang's threads get False/0 and keep going."""
    from hicache_store import _sync

    rank = sglang.Rank(url)
    _sync.run_sync(rank.storage.backend.close(), timeout=30)  # every call now raises inside
    tokens = sglang.tokens_for(2, 4, seed=12)
    assert rank.backup(tokens, [rank.random_page(s) for s in range(2)]) == 0
    assert rank.prefetch(tokens)[0] == 0
    counters = rank.storage.counters
    assert counters.get("set_errors", 0) + counters.get("set_failed", 0) >= 2
    assert counters.get("exists_errors", 0) >= 1
    ctrl = rank.controller
    assert all(t.is_alive() for t in (ctrl.backup_thread, ctrl.prefetch_thread,
                                       ctrl.prefetch_io_aux_thread))
    rank.close()


# -- float8 KV: stored under its scales, refused without them ---------------------------------

#: the per-layer k/v scales of the tests' 4-layer model (SGLang's RadixAttention k/v_scale).
FP8_SCALES = {"k": [0.5, 0.25, 2.0, 1.0], "v": [1.0, 0.125, 4.0, 1.0]}


def _fp8_rank(sglang: ModuleType, url: str, scales: dict[str, Any] | None,
              layout: str = "page_first") -> Any:
    extra: dict[str, Any] = {"kv_dtype": "fp8_e4m3"}
    if scales is not None:
        extra["kv_scales"] = scales
    return sglang.Rank(url, layout=layout, geometry=sglang.Geometry(dtype=torch.float8_e4m3fn),
                       extra=extra)


def test_fp8_pages_are_served_only_under_their_scales(sglang: ModuleType, url: str) -> None:
    """SGLang's float8 pools (uint8 buffers): pages round-trip byte for byte to a reader with
    the same scales (another layout, the scales given another way), and a reader whose scales
    differ in one layer finds nothing."""
    writer = _fp8_rank(sglang, url, FP8_SCALES)
    assert writer.host.kv_buffer.dtype == torch.uint8  # SGLang keeps float8 KV as its bytes
    tokens = sglang.tokens_for(3, writer.geometry.page_size)
    g = torch.Generator().manual_seed(5)
    pages = [torch.randint(0, 256, tuple(writer.page(0).shape), generator=g, dtype=torch.uint8)
             for _ in range(3)]
    assert writer.backup(tokens, pages) == len(tokens)
    writer.close()

    same_scales = {"k": [float(x) for x in torch.tensor(FP8_SCALES["k"])], "v": FP8_SCALES["v"]}
    reader = _fp8_rank(sglang, url, same_scales, layout="page_head")
    hit, loaded, host_indices = reader.prefetch(tokens)
    assert (hit, loaded) == (len(tokens), len(tokens))
    assert host_indices is not None
    for i, data in enumerate(pages):
        assert torch.equal(reader.host_page_of(host_indices, i), data)
    reader.close()

    other = _fp8_rank(sglang, url, {"k": FP8_SCALES["k"], "v": [1.0, 0.125, 4.0, 2.0]})
    hit, _, _ = other.prefetch(tokens)
    assert hit == 0
    other.close()


def test_fp8_kv_without_its_scales_is_refused_at_startup(sglang: ModuleType, url: str) -> None:
    with pytest.raises(ValueError, match=r'float8_e4m3fn KV needs its per-layer k/v scales.*'
                       r'set "kv_scales" in the extra-config') as caught:
        _fp8_rank(sglang, url, None)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r'"kv_scales" holds 3 k and 3 v scales for a model '
                       "of 4 layers"):
        _fp8_rank(sglang, url, {"k": [1.0] * 3, "v": [1.0] * 3})
