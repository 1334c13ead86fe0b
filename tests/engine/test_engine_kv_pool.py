"""DeviceKVPool: buffer format, page allocator, slot arithmetic."""

from __future__ import annotations

import threading

import pytest
import torch

from hicache_store.demo.engine import DeviceKVPool, MiniLlamaConfig, PoolExhaustedError
from hicache_store.layout.errors import HiCacheStoreError


def make_pool(num_pages: int = 8, page_size: int = 4) -> DeviceKVPool:
    return DeviceKVPool(
        num_layers=3, num_kv_heads=2, head_dim=8, num_pages=num_pages, page_size=page_size
    )


def test_buffers_have_the_kernels_device_pool_format() -> None:
    pool = make_pool()
    assert pool.num_slots == 32
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    for buf in (*pool.k_buffers, *pool.v_buffers):
        assert buf.shape == (32, 2, 8)
        assert buf.dtype == torch.float32
        assert buf.is_contiguous()
        assert not buf.any()
    # Separate allocations per layer and plane.
    ptrs = {b.data_ptr() for b in (*pool.k_buffers, *pool.v_buffers)}
    assert len(ptrs) == 6
    assert pool.bytes_per_token == 3 * 2 * 2 * 8 * 4
    assert pool.bytes_per_page == pool.bytes_per_token * 4


def test_kernels_accept_the_buffers() -> None:
    from hicache_store.kernels.pools import DevicePool

    pool = make_pool()
    device = DevicePool.mha(pool.k_buffers, pool.v_buffers)
    assert device.kv_kind == "mha"


def test_for_model_matches_config() -> None:
    cfg = MiniLlamaConfig(dtype="bfloat16")
    pool = DeviceKVPool.for_model(cfg, num_pages=5, page_size=16)
    assert (pool.num_layers, pool.num_kv_heads, pool.head_dim) == (
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    assert pool.dtype == torch.bfloat16
    assert pool.k_buffers[0].shape == (80, cfg.num_kv_heads, cfg.head_dim)
    assert pool.bytes_per_token == cfg.kv_bytes_per_token


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("num_kv_heads", -1), ("head_dim", 0), ("num_pages", 0), ("page_size", 0)],
)
def test_bad_geometry_is_refused(field: str, value: int) -> None:
    kwargs = {
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 2,
        "num_pages": 1,
        "page_size": 1,
        field: value,
    }
    with pytest.raises(ValueError, match=field):
        DeviceKVPool(**kwargs)
    with pytest.raises(ValueError, match="dtype"):
        DeviceKVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=1, page_size=1, dtype="x")


def test_alloc_free_and_reuse() -> None:
    pool = make_pool()
    assert pool.alloc(0) == []
    first = pool.alloc(3)
    assert first == [0, 1, 2]
    assert pool.num_free_pages == 5 and pool.num_used_pages == 3
    assert all(pool.is_allocated(p) for p in first)
    second = pool.alloc(2)
    assert second == [3, 4]
    pool.free([1, 0])
    assert not pool.is_allocated(0)
    assert pool.alloc(2) == [1, 0]  # most recently freed first, in the order given
    assert pool.num_free_pages == 3


def test_exhaustion_raises_and_allocates_nothing() -> None:
    pool = make_pool(num_pages=4)
    pool.alloc(3)
    with pytest.raises(PoolExhaustedError) as info:
        pool.alloc(2)
    err = info.value
    assert isinstance(err, HiCacheStoreError)
    assert (err.requested, err.available) == (2, 1)
    assert "requested 2 pages, 1 free of 4" in str(err)
    assert pool.num_free_pages == 1
    assert pool.alloc(1) == [3]
    with pytest.raises(PoolExhaustedError):
        pool.alloc(1)
    with pytest.raises(ValueError, match="non-negative"):
        pool.alloc(-1)


@pytest.mark.parametrize(
    ("pages", "message"),
    [([9], "out of range"), ([-1], "out of range"), ([0, 0], "twice"), ([5], "not allocated")],
)
def test_bad_free_is_refused_atomically(pages: list[int], message: str) -> None:
    pool = make_pool()
    pool.alloc(3)
    with pytest.raises(ValueError, match=message):
        pool.free([1, *pages])
    assert pool.num_free_pages == 5
    assert pool.is_allocated(1)


def test_slots_of() -> None:
    pool = make_pool(page_size=4)
    assert pool.slots_of([2, 0]).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    slots = pool.slots_of(torch.tensor([7]))
    assert slots.dtype == torch.int64
    assert slots.tolist() == [28, 29, 30, 31]
    assert pool.slots_of([]).numel() == 0
    with pytest.raises(ValueError, match="pages"):
        pool.slots_of([8])
    with pytest.raises(ValueError, match="pages"):
        pool.slots_of([-1])


def test_allocator_is_thread_safe() -> None:
    pool = make_pool(num_pages=64)
    got: list[list[int]] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            pages = pool.alloc(2)
            with lock:
                got.append(pages)
            pool.free(pages)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 800
    assert pool.num_free_pages == 64
