"""``HiCacheStoreLinker`` through SGLang 0.5.23's linker factory and its tree-side wrapper.

SGLang's ``create_unified_cache_linker`` loads the linker from ``--unified-cache-external-
linker-config`` exactly as a server does; device pools are SGLang's ``MHATokenToKVPool`` on CPU;
page keys come from SGLang's ``get_storage_hash_str`` (which seeds a request's chain with its
``cache_salt`` / ``extra_key``); ``UnifiedCacheLinkerWrapper`` drives the rank-agreement of
lookups, layer-wise load completion and offload completion. The radix tree itself is played by
the test (a few attributes the wrapper touches), as in ``sglang_cpu``.
"""

from __future__ import annotations

import array
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from hicache_store.layout.namespace import kv_scales_digest

P = 4  # page size


def linker_config(url: str, **extra: Any) -> dict[str, Any]:
    return {"linker": "HiCacheStoreLinker",
            "linker_module_path": "hicache_store.integrations.sglang_linker",
            "linker_extra_config": {"url": url, "model": "org/model", **extra}}


@contextmanager
def as_rank(sglang: ModuleType, tp_rank: int, tp_size: int) -> Iterator[None]:
    rc = sglang.module_any("sglang.srt.runtime_context")
    saved = rc.get_parallel
    rc.get_parallel = lambda: SimpleNamespace(attn_tp_rank=tp_rank, attn_tp_size=tp_size)
    try:
        yield
    finally:
        rc.get_parallel = saved


class _Allocator:
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def get_kvcache(self) -> Any:
        return self.pool


def make_linker(sglang: ModuleType, url: str, *, heads: int = 4, tp: tuple[int, int] = (0, 1),
                components: Any = None, server_args: Any = None,
                dtype: torch.dtype = torch.bfloat16, **extra: Any) -> Any:
    memory_pool = sglang.module("sglang.srt.mem_cache.memory_pool")
    factory = sglang.module_any("sglang.srt.mem_cache.unified_cache.linker_factory")
    ct = sglang.module_any("sglang.srt.mem_cache.unified_cache.component_type").ComponentType
    cip = sglang.module_any("sglang.srt.mem_cache.cache_init_params")
    pool = memory_pool.MHATokenToKVPool(size=64, page_size=P, dtype=dtype, head_num=heads,
                                        head_dim=8, layer_num=3, device="cpu",
                                        enable_memory_saver=False, start_layer=0, end_layer=3)
    params = cip.CacheInitParams(disable=False, req_to_token_pool=None,
                                 token_to_kv_pool_allocator=_Allocator(pool), page_size=P)
    with as_rank(sglang, *tp):
        return factory.create_unified_cache_linker(
            server_args or SimpleNamespace(), params, backend="dynamic",
            config=linker_config(url, **extra),
            components=components or {ct.FULL},
        )


def keys_for(sglang: ModuleType, tokens: list[int], salt: str | None = None,
             extra_key: str | None = None) -> list[str]:
    utils = sglang.module("sglang.srt.mem_cache.utils")
    radix = sglang.module_any("sglang.srt.mem_cache.radix_cache")
    key = radix.RadixKey(array.array("q", tokens), extra_key=extra_key, cache_salt=salt)
    return list(utils.get_storage_hash_str(key, None, page_size=P))


def kv(sglang: ModuleType, keys: list[str], slots: torch.Tensor | None = None) -> Any:
    hs = sglang.module("sglang.srt.mem_cache.hicache_storage")
    return hs.PoolTransfer(name=hs.PoolName.KV, keys=keys, device_indices=slots)


def wrapper(sglang: ModuleType, linker: Any) -> Any:
    """SGLang's tree-side wrapper over ``linker``, for one rank (collectives are no-ops)."""
    ucl = sglang.module_any("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
    ct = sglang.module_any("sglang.srt.mem_cache.unified_cache.component_type").ComponentType
    full = SimpleNamespace()
    tree = SimpleNamespace(
        tree_components={ct.FULL}, components={ct.FULL: full}, _components_tuple=(full,),
        tree_core=SimpleNamespace(), page_size=P, _all_reduce_attn_groups=lambda t, op: None,
    )
    return ucl.UnifiedCacheLinkerWrapper(tree, linker)


def fill(linker: Any, slots: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Random K/V into ``slots`` of the linker's device pool; returns [layer][K, V] copies."""
    g = torch.Generator().manual_seed(seed)
    pool = linker.device_pool
    out = []
    for layer in range(pool.layer_num):
        planes = []
        for buffer in (pool.k_buffer[layer], pool.v_buffer[layer]):
            data = torch.randint(-30000, 30000, (len(slots), *buffer.shape[1:]), generator=g,
                                 dtype=torch.int16).view(torch.bfloat16)
            buffer[slots] = data
            planes.append(data)
        out.append(torch.stack(planes))
    return out


def device_kv(linker: Any, slots: torch.Tensor) -> list[torch.Tensor]:
    pool = linker.device_pool
    return [torch.stack((pool.k_buffer[l][slots], pool.v_buffer[l][slots]))
            for l in range(pool.layer_num)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b, strict=True))


def test_offload_lookup_layer_wise_load_through_sglangs_factory_and_wrapper(
    sglang: ModuleType, url: str
) -> None:
    # imported after SGLang (the sglang fixture): the linker subclasses SGLang's class
    from hicache_store.integrations.sglang_linker import HiCacheStoreLinker

    ucl = sglang.module_any("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
    writer = make_linker(sglang, url)
    assert isinstance(writer, HiCacheStoreLinker) and isinstance(writer, ucl.UnifiedCacheLinker)
    tokens = list(range(100, 100 + 3 * P))
    keys = keys_for(sglang, tokens)
    src = torch.arange(8, 8 + 3 * P)
    data = fill(writer, src, seed=1)
    w = wrapper(sglang, writer)
    assert writer.offload([kv(sglang, keys, src)])
    w.pending_offloads.append(None)  # what offload_nodes records for the node
    deadline = time.monotonic() + 60
    while w.num_completed_offloads() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.take_completed_offloads(1) == [True]

    from prometheus_client import REGISTRY

    labels = {"integration": "sglang_linker", "tier": "l3", "tp_rank": "0", "pp_rank": "0"}

    def sample(counter: str) -> float:
        return REGISTRY.get_sample_value(f"hicache_store_{counter}_total", labels) or 0.0

    before = {c: sample(c) for c in ("lookup_pages_asked", "lookup_pages_found")}
    # SGLang's --enable-metrics: the lookups also go to its Prometheus registry
    reader = make_linker(sglang, url, server_args=SimpleNamespace(enable_metrics=True))
    r = wrapper(sglang, reader)
    restorable = reader.lookup("req", [kv(sglang, keys + keys_for(sglang, [1] * P))])
    assert restorable == [1, 2, 3]
    counted = (reader.counters["lookup_pages_asked_l3"], reader.counters["lookup_pages_found_l3"])
    assert counted == (4, 3)
    assert sample("lookup_pages_asked") == before["lookup_pages_asked"] + 4
    assert sample("lookup_pages_found") == before["lookup_pages_found"] + 3
    assert r._sync_restorable_prefix(restorable, num_pages=4, device_hit_pages=0) == 3
    dst = torch.arange(32, 32 + 3 * P)
    assert reader.load("req", [kv(sglang, keys, dst)])
    r.inflight_load_rids.append("req")  # what load_back records
    index = r.start_layer_wise_loading()
    counter = r.layer_done_counter
    counter.set_consumer(index)
    for layer in range(3):  # the forward waits layer by layer
        counter.wait_until(layer)
    assert r.finish_loads() == []  # every layer landed: no request to abort
    assert same(device_kv(reader, dst), data)
    assert reader.counters["load_pages"] == 3
    writer.close()
    reader.close()


def test_salt_and_extra_key_keep_tenants_apart(sglang: ModuleType, url: str) -> None:
    linker = make_linker(sglang, url)
    tokens = list(range(7, 7 + 2 * P))
    slots = torch.arange(0, 2 * P)
    fill(linker, slots, seed=2)
    assert linker.offload([kv(sglang, keys_for(sglang, tokens, salt="tenant-a"), slots)])
    linker.reset()  # waits for the offload
    assert linker.lookup("a", [kv(sglang, keys_for(sglang, tokens, salt="tenant-a"))]) == [1, 2]
    assert linker.lookup("b", [kv(sglang, keys_for(sglang, tokens, salt="tenant-b"))]) == []
    assert linker.lookup("c", [kv(sglang, keys_for(sglang, tokens))]) == []
    assert linker.lookup("d", [kv(sglang, keys_for(sglang, tokens, extra_key="lora-1",
                                                    salt="tenant-a"))]) == []
    other = make_linker(sglang, url, tenant_salt="deployment-2")  # our namespace salt on top
    assert other.lookup("a", [kv(sglang, keys_for(sglang, tokens, salt="tenant-a"))]) == []
    linker.close()
    other.close()


def test_tp2_linkers_store_what_a_tp1_linker_loads(sglang: ModuleType, url: str) -> None:
    tokens = list(range(300, 300 + 2 * P))
    keys = keys_for(sglang, tokens)
    slots = torch.arange(4, 4 + 2 * P)
    halves = []
    for tp_rank in range(2):
        rank = make_linker(sglang, url, heads=2, tp=(tp_rank, 2), grid="3x2")
        halves.append(fill(rank, slots, seed=10 + tp_rank))
        assert rank.offload([kv(sglang, keys, slots)])
        rank.reset()
        rank.close()
    whole = make_linker(sglang, url, heads=4, grid="3x2")
    assert whole.lookup("r", [kv(sglang, keys)]) == [1, 2]
    dst = torch.arange(40, 40 + 2 * P)
    assert whole.load("r", [kv(sglang, keys, dst)])
    index = whole.start_layer_wise_loading()
    assert whole.finish_layer_wise_loading(index)
    expected = [torch.cat((a, b), dim=2) for a, b in zip(*halves, strict=True)]
    assert same(device_kv(whole, dst), expected)
    whole.close()


def test_a_failed_load_is_reported_never_raised(sglang: ModuleType, url: str) -> None:
    linker = make_linker(sglang, url)
    keys = keys_for(sglang, list(range(50, 50 + P)))
    dst = torch.arange(0, P)
    before = device_kv(linker, dst)
    assert linker.load("gone", [kv(sglang, keys, dst)])  # nothing stored under these keys
    w = wrapper(sglang, linker)
    w.inflight_load_rids.append("gone")
    index = w.start_layer_wise_loading()
    w.layer_done_counter.set_consumer(index)
    w.layer_done_counter.wait_until(0)  # returns: the failure is reported by finish
    assert w.finish_loads() == ["gone"]  # the tree aborts the request
    assert same(device_kv(linker, dst), before)
    assert not linker.load("bad", [kv(sglang, keys, torch.arange(0, 3))])  # wrong slot count
    assert linker.lookup("bad", [kv(sglang, ["not-a-hash"])]) == []
    assert linker.counters["load_failed"] == 1
    linker.close()


def test_hybrid_components_are_refused_at_startup(sglang: ModuleType, url: str) -> None:
    ct = sglang.module_any("sglang.srt.mem_cache.unified_cache.component_type").ComponentType
    with pytest.raises(ValueError, match="SWA"):
        make_linker(sglang, url, components={ct.FULL, ct.SWA})


def test_fp8_kv_needs_its_scales_at_startup(sglang: ModuleType, url: str) -> None:
    """A float8 device pool: refused without ``kv_scales`` (one line naming it); with them,
    their digest is in the namespace."""
    with pytest.raises(ValueError, match=r'float8_e4m3fn KV needs its per-layer k/v scales.*'
                       r'"kv_scales" in the extra-config'):
        make_linker(sglang, url, dtype=torch.float8_e4m3fn)
    linker = make_linker(sglang, url, dtype=torch.float8_e4m3fn, kv_scales={"k": 0.5, "v": 1.0})
    assert linker.link.namespace.kv_scales == kv_scales_digest([0.5] * 3, [1.0] * 3)
    linker.close()


def test_the_linker_and_the_storage_adapter_share_pages(sglang: ModuleType, url: str) -> None:
    """Pages the linker offloads from a device pool, SGLang's controller prefetches through the
    storage adapter into its host pool (same extra-config keys, same namespace)."""
    linker = make_linker(sglang, url)
    tokens = list(range(900, 900 + 2 * P))
    keys = keys_for(sglang, tokens)
    slots = torch.arange(16, 16 + 2 * P)
    data = fill(linker, slots, seed=7)  # [layer] -> [K/V, tokens, heads, dim]
    assert linker.offload([kv(sglang, keys, slots)])
    linker.reset()
    linker.close()
    rank = sglang.Rank(url, geometry=sglang.Geometry(layers=3, heads=4))
    assert rank.hashes(tokens) == keys
    hit, loaded, host_indices = rank.prefetch(tokens)
    assert (hit, loaded) == (2 * P, 2 * P) and host_indices is not None
    for page in range(2):
        expected = torch.stack([d[:, page * P : (page + 1) * P] for d in data], dim=1)
        assert torch.equal(rank.host_page_of(host_indices, page).contiguous().view(torch.int16),
                           expected.view(torch.int16))
    rank.close()
