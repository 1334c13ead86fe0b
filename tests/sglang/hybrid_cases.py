"""Hybrid-model cases on SGLang's real controller and ``HostPoolGroup`` (``sglang_cpu``), for
any store URL: the file tests (``test_sglang_v2_hybrid``) and the S3 tests on SeaweedFS
(``tests/backends_s3/test_sglang_hybrid_s3``) run the same cases.

Sidecar bytes are written and compared through SGLang's own pool methods
(``set_from_flat_data_page`` / ``get_data_page``), never through the adapter.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import torch

from hicache_store import _sync

#: pages per node, and each pool's trailing pages (SWA: a 2-page window; Mamba: one state).
NODE_PAGES = 4
TRAILING = {"swa": 2, "mamba": 1}


@dataclasses.dataclass(frozen=True)
class Store:
    """A store URL and its backend options (SeaweedFS's endpoint and keys for S3)."""

    url: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def hybrid_rank(sglang: ModuleType, store: str | Store, pools: tuple[str, ...],
                **kwargs: Any) -> Any:
    """A rank with KV plus ``pools`` (``"swa"``, ``"mamba"``) in its host pool group."""
    if isinstance(store, str):
        store = Store(store)
    if store.options:
        kwargs["extra"] = {**kwargs.get("extra", {}), "backend_options": store.options}
    names = sglang.module("sglang.srt.mem_cache.hicache_storage").PoolName
    sidecars = []
    for pool in pools:
        if pool == "swa":
            # two sliding-window layers, the KV's heads and page size
            swa = dataclasses.replace(kwargs.get("geometry", sglang.Geometry()), layers=2)
            device, host = sglang.kv_host_pool(swa, kwargs.get("layout", "page_first"))
        else:
            device, host = sglang.mamba_host_pool(**kwargs.pop("mamba", {}))
        sidecars.append((names(pool), device, host))
    return sglang.HybridRank(
        store.url, trailing={p: TRAILING[p] for p in pools}, sidecars=sidecars, **kwargs
    )


def same_kv(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def check_loaded(rank: Any, fetched: Any, pages: list[torch.Tensor],
                 written: dict[str, list[torch.Tensor]]) -> None:
    """KV pages and every sidecar page the prefetch loaded equal what was written."""
    assert fetched.host_indices is not None
    for i, data in enumerate(pages):
        assert same_kv(rank.host_page_of(fetched.host_indices, i), data)
    for name, transfer in fetched.transfers.items():
        pool = rank.entries[name]
        slots = transfer.host_indices.reshape(-1)[:: pool.page_size].tolist()
        assert len(slots) == len(written[name])
        for slot, data in zip(slots, written[name], strict=True):
            assert torch.equal(rank.sidecar_page(name, int(slot)), data)


def sidecar_keys(rank: Any, name: str, page_hash: str) -> list[str]:
    """The storage keys of one page's objects of sidecar ``name`` (what this rank writes)."""
    return list(rank.storage._sidecars[name].link.write_names(page_hash))


def run(coro: Any) -> Any:
    return _sync.run_sync(coro, timeout=60)


# -- the cases -------------------------------------------------------------------------------


def round_trip(sglang: ModuleType, url: str | Store, pools: tuple[str, ...],
               layout: str = "page_first") -> None:
    """A node backed up with its sidecars by one server is restored whole by another (the KV
    and SWA host pools in ``layout``; the reader's in another one)."""
    writer = hybrid_rank(sglang, url, pools, layout=layout)
    page = writer.geometry.page_size
    tokens = sglang.tokens_for(NODE_PAGES, page, seed=1)
    pages = [writer.random_page(s) for s in range(NODE_PAGES)]
    stored, written, pool_pages = writer.backup_hybrid(tokens, pages, sidecar_seed=5)
    assert stored == len(tokens)
    assert pool_pages == {p: TRAILING[p] for p in pools}
    writer.close()

    other = "layer_first" if layout != "layer_first" else "page_head"
    reader = hybrid_rank(sglang, url, pools, layout=other)
    fetched = reader.prefetch_hybrid(tokens + [9] * page)  # one page more than stored
    assert (fetched.hit, fetched.loaded) == (len(tokens), len(tokens))
    assert fetched.whole(page)
    hashes = reader.hashes(tokens)
    for name, transfer in fetched.transfers.items():  # the controller re-aligned the keys
        assert transfer.keys == hashes[-TRAILING[name]:]
    check_loaded(reader, fetched, pages, written)
    counters = reader.storage.counters
    assert counters.get("corrupt_objects", 0) == 0
    reader.close()


def sparse_hits(sglang: ModuleType, url: str | Store, pools: tuple[str, ...]) -> None:
    """Two nodes: sidecars exist only at node ends, so only those prefix lengths restore; a
    sidecar object missing at the second node's end cuts the hit back to the first node, and
    the first node's sidecars are what the tree gets."""
    hs = sglang.module("sglang.srt.mem_cache.hicache_storage")
    rank = hybrid_rank(sglang, url, pools)
    page = rank.geometry.page_size
    tokens = sglang.tokens_for(2 * NODE_PAGES, page, seed=2)
    cut = NODE_PAGES * page
    first = [rank.random_page(s) for s in range(NODE_PAGES)]
    second = [rank.random_page(s) for s in range(NODE_PAGES, 2 * NODE_PAGES)]
    _, written_first, _ = rank.backup_hybrid(tokens[:cut], first, sidecar_seed=1)
    # the second node: its pages chained after the first (SGLang hashes from the sequence start)
    hashes = rank.hashes(tokens)
    stored, _, _ = rank.backup_hybrid(tokens, first + second, sidecar_seed=2)
    assert stored == len(tokens)

    transfers = [
        hs.PoolTransfer(name=hs.PoolName(p), keys=["__placeholder__"] * TRAILING[p],
                        hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)
        for p in pools
    ]
    result = rank.storage.batch_exists_v2(hashes, transfers)
    assert result.kv_hit_pages == 2 * NODE_PAGES
    # every length whose trailing window / state is stored: the two node ends
    assert result.restorable_prefix_pages == [NODE_PAGES, 2 * NODE_PAGES]
    # KV alone would restore any length: the sidecars are what makes it sparse
    assert rank.storage.batch_exists(hashes) == 2 * NODE_PAGES

    # lose one sidecar object at the second node's end: that length is gone
    victim = pools[-1]
    keys = sidecar_keys(rank, victim, hashes[-1])
    assert keys and all(run(rank.storage.backend.delete(keys)))
    result = rank.storage.batch_exists_v2(hashes, transfers)
    assert result.restorable_prefix_pages == [NODE_PAGES]
    assert result.kv_hit_pages == NODE_PAGES
    assert result.extra_pool_hit_pages[hs.PoolName.KV] == 2 * NODE_PAGES
    rank.close()

    reader = hybrid_rank(sglang, url, pools)
    fetched = reader.prefetch_hybrid(tokens)
    assert (fetched.hit, fetched.loaded) == (cut, cut)
    assert fetched.whole(page)
    check_loaded(reader, fetched, first, written_first)
    reader.close()


def corrupt_state(sglang: ModuleType, url: str | Store, pool: str) -> None:
    """A sidecar object that exists but fails verification is a miss for its pool: the tree's
    all-or-nothing rule drops the prefetch, and the host slot keeps what it held."""
    writer = hybrid_rank(sglang, url, (pool,))
    page = writer.geometry.page_size
    tokens = sglang.tokens_for(NODE_PAGES, page, seed=3)
    pages = [writer.random_page(s) for s in range(NODE_PAGES)]
    writer.backup_hybrid(tokens, pages, sidecar_seed=3)
    backend = writer.storage.backend
    (key, *_) = sidecar_keys(writer, pool, writer.hashes(tokens)[-1])
    data = bytearray(run(backend.get_bytes(key)))
    data[-1] ^= 0xFF  # the last payload byte
    run(backend.put([key], [bytes(data)]))
    writer.close()

    reader = hybrid_rank(sglang, url, (pool,))
    reader.mark_sidecar(pool, 0x5A)
    fetched = reader.prefetch_hybrid(tokens)
    assert fetched.hit == len(tokens)  # existence cannot see it
    assert fetched.loaded == len(tokens)
    assert fetched.pool_hits[pool] < TRAILING[pool]
    assert not fetched.whole(page)
    size = reader.entries[pool].page_size
    slot = int(fetched.transfers[pool].host_indices.reshape(-1)[-size])
    assert bool((reader.sidecar_page(pool, slot) == 0x5A).all())  # never written into
    assert reader.storage.counters.get("corrupt_objects", 0) >= 1
    reader.close()


def tp_reshard(sglang: ModuleType, url: str | Store) -> None:
    """SWA pages written at TP 1 are read by each rank of TP 2 (its head half): the SWA
    objects, like KV, carry no rank."""
    writer = hybrid_rank(sglang, url, ("swa",), extra={"grid": "1x2"})
    page = writer.geometry.page_size
    tokens = sglang.tokens_for(NODE_PAGES, page, seed=4)
    pages = [writer.random_page(s) for s in range(NODE_PAGES)]
    _, written, _ = writer.backup_hybrid(tokens, pages, sidecar_seed=4)
    layers, heads, dim = 2, writer.geometry.heads, writer.geometry.head_dim
    writer.close()
    half = heads // 2
    for tp_rank in range(2):
        reader = hybrid_rank(
            sglang, url, ("swa",), extra={"grid": "1x2"},
            geometry=sglang.Geometry(heads=half), parallel=sglang.parallel_state(tp_rank, 2),
        )
        # the reader's SWA pool holds half the heads too
        reader_pool = reader.entries["swa"]
        assert reader_pool.head_num == half
        fetched = reader.prefetch_hybrid(tokens)
        assert fetched.whole(page)
        slots = fetched.transfers["swa"].host_indices.reshape(-1)[::page].tolist()
        for slot, data in zip(slots, written["swa"], strict=True):
            full = data.view(torch.bfloat16).reshape(2, layers, page, heads, dim)
            mine = full[:, :, :, tp_rank * half : (tp_rank + 1) * half].contiguous()
            assert torch.equal(reader.sidecar_page("swa", int(slot)), mine.view(-1).view(torch.uint8))
        reader.close()
