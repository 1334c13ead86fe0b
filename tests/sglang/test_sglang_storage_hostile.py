"""The adapter under hostile conditions, as SGLang 0.5.23's own controller calls it.

A backend whose I/O hangs (a dead mount, a remote store that stops answering), objects evicted
between SGLang's hit query and its read, writer and reader configured differently, and
malformed calls (empty batches, keys and host indices of the wrong kind, slots outside the
pool or named twice). The rules: never wrong KV in a slot reported loaded, never a hang of
SGLang's backup or prefetch threads; a miss, a failure or one clear error instead. Host pages
are written and compared by plain indexing (``sglang_cpu``), never by the adapter's kernels.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


class Hang:
    """One core of a backend stuck in I/O that nothing can stop (the caller's cancellation
    included: ``Backend._guarded`` waits for a core to end) until ``release``; then the call
    goes through to the real core."""

    def __init__(self, backend: Any, core: str) -> None:
        self.backend, self.core = backend, core
        self.real = getattr(backend, core)
        self.gate = threading.Event()

        async def stuck(*args: Any, **kwargs: Any) -> Any:
            await asyncio.to_thread(self.gate.wait, 120)
            return await self.real(*args, **kwargs)

        setattr(backend, core, stuck)

    def release(self) -> None:
        setattr(self.backend, self.core, self.real)
        self.gate.set()


def hanging_rank(sglang: ModuleType, tmp_path: Path) -> Any:
    # A short per-call deadline: the adapter's own wait on a call is bounded past it.
    return sglang.Rank(f"faulty://?inner=file://{tmp_path / 'kv'}", extra={"io_timeout_s": 0.2})


def start_prefetch(sglang: ModuleType, rank: Any, tokens: list[int], rid: str) -> tuple[Any, int]:
    """The tree's side up to the read: SGLang's hit query, then (on a hit) host slots."""
    base = sglang.module("sglang.srt.mem_cache.base_prefix_cache")
    ctrl = rank.controller
    ctrl.prefetch(base.CacheRequestHandle(rid=rid, attempt_id=0), list(tokens))
    op = ctrl.prefetch_hit_queue.get(timeout=60)
    hit = int(op.storage_hit_count)
    if hit:
        op.host_indices, _ = ctrl.allocate_storage_hit(
            op, hit, allow_partial=False, min_tokens=hit, evict_host=lambda n: 0
        )
    return op, hit


def finish_prefetch(rank: Any, op: Any, timeout: float = 60) -> int:
    """Hand the operation to SGLang's prefetch I/O thread; the tokens it reports loaded."""
    rank.controller.prefetch_buffer.put(op)
    return int(rank._drain_acks(op, timeout, expect_transfer=True))


def threads_alive(rank: Any) -> bool:
    ctrl = rank.controller
    return all(t.is_alive() for t in (ctrl.backup_thread, ctrl.prefetch_thread,
                                       ctrl.prefetch_io_aux_thread))


# -- 1. a backend that hangs while SGLang's threads wait ---------------------------------------


@pytest.mark.slow
def test_a_put_stuck_in_io_fails_the_backup_instead_of_hanging_it(
    sglang: ModuleType, tmp_path: Path
) -> None:
    rank = hanging_rank(sglang, tmp_path)
    tokens = sglang.tokens_for(2, 4, seed=1)
    pages = [rank.random_page(s) for s in range(2)]
    hang = Hang(rank.storage.backend, "_put")
    try:
        started = time.monotonic()
        # SGLang's backup thread must come back (with nothing stored), not wait on the I/O
        assert rank.backup(tokens, pages, timeout=30) == 0
        assert time.monotonic() - started < 30
        assert rank.storage.counters["set_errors"] == 1
    finally:
        hang.release()
    assert threads_alive(rank)
    # the device answers again: the next backup stores the pages and they read back exactly
    assert rank.backup(tokens, pages) == len(tokens)
    hit, loaded, host_indices = rank.prefetch(tokens)
    assert (hit, loaded) == (len(tokens), len(tokens)) and host_indices is not None
    for i, data in enumerate(pages):
        assert same(rank.host_page_of(host_indices, i), data)
    rank.close()


@pytest.mark.slow
def test_a_hung_exists_or_read_is_a_miss_and_late_bytes_never_reach_the_pool(
    sglang: ModuleType, tmp_path: Path
) -> None:
    rank = hanging_rank(sglang, tmp_path)
    tokens = sglang.tokens_for(3, 4, seed=2)
    pages = [rank.random_page(s) for s in range(3)]
    assert rank.backup(tokens, pages) == len(tokens)
    # the hit query hangs: SGLang's prefetch thread gets no hit
    hang = Hang(rank.storage.backend, "_exists")
    try:
        assert rank.prefetch(tokens, timeout=30)[0] == 0
    finally:
        hang.release()
    # the hit query answers, then the reads hang: nothing is reported loaded
    op, hit = start_prefetch(sglang, rank, tokens, "hung-read")
    assert hit == len(tokens)
    for i in range(3):
        rank.host_page_of(op.host_indices, i).fill_(3)
    marked = rank.host_page_of(op.host_indices, 0).clone()
    hang = Hang(rank.storage.backend, "_get_scatter")
    try:
        assert finish_prefetch(rank, op, timeout=30) == 0
    finally:
        hang.release()
    time.sleep(0.5)  # the released reads end into staging the adapter dropped
    for i in range(3):
        assert same(rank.host_page_of(op.host_indices, i), marked)
    assert threads_alive(rank)
    assert rank.prefetch(tokens)[1] == len(tokens)  # and the store serves again
    rank.close()


# -- 2. partial results: evicted between SGLang's hit query and its read -----------------------


def test_a_page_evicted_after_the_hit_query_is_never_reported_loaded(
    sglang: ModuleType, tmp_path: Path
) -> None:
    rank = sglang.Rank(f"file://{tmp_path / 'kv'}")
    tokens = sglang.tokens_for(3, 4, seed=3)
    pages = [rank.random_page(s) for s in range(3)]
    assert rank.backup(tokens, pages) == len(tokens)
    op, hit = start_prefetch(sglang, rank, tokens, "evicted")
    assert hit == len(tokens)
    for path in (tmp_path / "kv").rglob(rank.hashes(tokens)[1] + "*"):
        path.unlink()  # another server's eviction, between the query and the read
    for i in range(3):
        rank.host_page_of(op.host_indices, i).fill_(5)
    marked = rank.host_page_of(op.host_indices, 1).clone()
    assert finish_prefetch(rank, op) == 4  # page 0 only: SGLang stops at the first miss
    assert same(rank.host_page_of(op.host_indices, 0), pages[0])
    assert same(rank.host_page_of(op.host_indices, 1), marked)
    assert rank.storage.counters["get_failed"] == 1
    rank.close()


# -- 3. writer and reader configured differently ------------------------------------------------


@pytest.mark.parametrize(
    "reader",
    [
        {"geometry": {"page_size": 8}},
        {"geometry": {"dtype": torch.float16}},
        {"geometry": {"layers": 2}},
        {"geometry": {"heads": 2, "head_dim": 16}},  # the same bytes per page, other heads
        {"mla": True, "geometry": {"kv_dim": 64}},  # the same bytes per page, MLA
        {"model": "org/other-model"},
        {"extra": {"tenant_salt": "other"}},
        {"extra": {"grid": "2x2"}},
        {"extra": {"key_scheme": "sglang-ukv1"}},
    ],
    ids=["page_size", "dtype", "layers", "heads", "mla", "model", "tenant", "grid", "scheme"],
)
def test_a_reader_configured_otherwise_misses_and_leaves_the_pool_alone(
    sglang: ModuleType, url: str, reader: dict[str, Any]
) -> None:
    writer = sglang.Rank(url)
    tokens = sglang.tokens_for(2, 4, seed=4)
    assert writer.backup(tokens, [writer.random_page(s) for s in range(2)]) == len(tokens)
    hashes = writer.hashes(tokens)  # asked with the writer's own page keys
    kwargs = dict(reader)
    kwargs["geometry"] = sglang.Geometry(**reader.get("geometry", {}))
    rank = sglang.Rank(url, **kwargs)
    storage = rank.storage
    assert storage.batch_exists(hashes) == 0
    p = rank.geometry.page_size
    dst = rank.group.alloc(len(hashes) * p)
    before = rank.host.kv_buffer.clone()
    assert storage.batch_get_v1(hashes, dst) == [False, False]
    assert torch.equal(rank.host.kv_buffer.view(torch.uint8), before.view(torch.uint8))
    writer.close()
    rank.close()


def test_a_kv_dtype_that_contradicts_the_pool_is_refused_at_startup(
    sglang: ModuleType, url: str
) -> None:
    # bfloat16 and float16 have one element size: a reader told its bfloat16 pool holds
    # float16 would load a float16 deployment's bytes as bfloat16 (and a writer mislabel its own)
    writer = sglang.Rank(url, geometry=sglang.Geometry(dtype=torch.float16))
    tokens = sglang.tokens_for(2, 4, seed=10)
    assert writer.backup(tokens, [writer.random_page(s) for s in range(2)]) == len(tokens)
    with pytest.raises(ValueError, match='"kv_dtype" \'float16\' contradicts the host pool'):
        sglang.Rank(url, extra={"kv_dtype": "float16"})
    with pytest.raises(ValueError, match="contradicts"):
        sglang.Rank(url, geometry=sglang.Geometry(dtype=torch.float16),
                    extra={"kv_dtype": "bf16"})  # SGLang's spelling of the other one
    same_dtype = sglang.Rank(url, geometry=sglang.Geometry(dtype=torch.float16),
                             extra={"kv_dtype": "float16"})  # stating the pool's own: fine
    assert same_dtype.prefetch(tokens)[1] == len(tokens)
    writer.close()
    same_dtype.close()


def test_loaded_pages_are_exact_under_random_backend_faults(
    sglang: ModuleType, tmp_path: Path
) -> None:
    # Errors, torn writes (a prefix stored, success reported), flipped bits and timeouts,
    # across layouts: whatever SGLang's threads get, every page it loads is the page written.
    from hicache_store.backends.faulty import FaultConfig

    url = f"faulty://?inner=file://{tmp_path / 'kv'}"
    writer = sglang.Rank(url, layout="page_head")
    reader = sglang.Rank(url, layout="page_first_direct", extra={"io_timeout_s": 0.5})
    writer.storage.backend.faults = FaultConfig(seed=1, error_rate=0.1, torn_write_rate=0.2)
    reader.storage.backend.faults = FaultConfig(
        seed=2, error_rate=0.1, bit_flip_rate=0.2, timeout_rate=0.05, timeout_s=1.0
    )
    loaded_pages = 0
    for round_ in range(16):
        n = 1 + round_ % 6
        tokens = sglang.tokens_for(n, 4, seed=100 + round_)
        pages = [writer.random_page(round_ * 10 + i) for i in range(n)]
        writer.backup(tokens, pages)
        hit, loaded, host_indices = reader.prefetch(tokens)
        assert loaded <= hit
        for i in range(loaded // 4):
            assert same(reader.host_page_of(host_indices, i), pages[i]), (round_, i)
        loaded_pages += loaded // 4
        if host_indices is not None:
            reader.group.free(host_indices)
    injected = reader.storage.backend.injected
    assert loaded_pages > 0 and injected["bit_flip"] > 0 and injected["timeout"] > 0
    assert writer.storage.backend.injected["torn_write"] > 0
    assert reader.storage.counters["corrupt_objects"] > 0
    assert threads_alive(reader) and threads_alive(writer)
    writer.close()
    reader.close()


# -- 4. malformed calls -------------------------------------------------------------------------


def test_malformed_calls_are_failures_and_write_no_host_slot(
    sglang: ModuleType, url: str
) -> None:
    rank = sglang.Rank(url)
    storage = rank.storage
    p = rank.geometry.page_size
    tokens = sglang.tokens_for(2, p, seed=5)
    hashes = rank.hashes(tokens)
    pages = [rank.random_page(s) for s in range(2)]
    src = rank.stage(pages)
    assert storage.batch_set_v1(hashes, src) == [True, True]
    empty = torch.tensor([], dtype=torch.int64)
    assert (storage.batch_exists([]), storage.batch_get_v1([], empty)) == (0, [])
    assert storage.batch_set_v1([], empty) == []
    dst = rank.group.alloc(2 * p)
    size = int(rank.host.size)
    bad_slots = {
        "list": dst.tolist(),
        "float": dst.float(),
        "negative": torch.cat([dst[:p], torch.arange(-p, 0)]),  # would index from the end
        "past the pool": torch.cat([dst[:p], torch.arange(size, size + p)]),
        "one slot twice": torch.cat([dst[:p], dst[:p]]),  # two pages into one slot
        "too few": dst[:p],
    }
    pool = rank.host.kv_buffer
    for name, slots in bad_slots.items():
        before = pool.clone()
        assert storage.batch_get_v1(hashes, slots) == [False, False], name
        assert torch.equal(pool.view(torch.int16), before.view(torch.int16)), name
    bad_keys: list[Any] = [[hashes[0].encode(), hashes[1]], [hashes[0].upper(), hashes[1]],
                           [None, hashes[1]], [7, hashes[1]]]
    for keys in bad_keys:
        before = pool.clone()
        assert storage.batch_get_v1(keys, dst) == [False, False], keys
        assert storage.batch_set_v1(keys, src) == [False, False], keys
        assert storage.batch_exists(keys) == 0, keys
        assert torch.equal(pool.view(torch.int16), before.view(torch.int16)), keys
    assert storage.counters["get_errors"] == len(bad_slots) + len(bad_keys)
    # a backup may read one slot for two pages (the pool is only read): stored as asked
    twice = rank.hashes(sglang.tokens_for(2, p, seed=6))
    assert storage.batch_set_v1(twice, torch.cat([src[:p], src[:p]])) == [True, True]
    assert storage.batch_get_v1(twice, dst) == [True, True]
    for i in range(2):
        assert same(rank.host_page_of(dst, i), pages[0])
    # a key twice in one read: both slots get the page
    pool[:] = 0
    assert storage.batch_get_v1([hashes[1], hashes[1]], dst) == [True, True]
    for i in range(2):
        assert same(rank.host_page_of(dst, i), pages[1])
    assert threads_alive(rank)
    rank.close()


def test_state_slots_outside_the_pool_or_twice_are_refused(sglang: ModuleType, url: str) -> None:
    # Mamba states move one slot per key through SGLang's own page methods, where a negative
    # slot indexes from the end of the pool: refused before any I/O, both directions.
    import hybrid_cases as cases

    hs = sglang.module("sglang.srt.mem_cache.hicache_storage")
    rank = cases.hybrid_rank(sglang, url, ("mamba",))
    storage = rank.storage
    pool = rank.entries["mamba"]
    keys = rank.hashes(sglang.tokens_for(2, rank.geometry.page_size, seed=7))
    states = [rank.fill_sidecar("mamba", slot, seed=slot) for slot in (1, 2)]

    def move(op: str, slots: list[int], names: list[str] = keys) -> list[bool]:
        transfer = hs.PoolTransfer(name=hs.PoolName.MAMBA, host_indices=torch.tensor(slots),
                                   keys=names)
        call = storage.batch_get_v2 if op == "get" else storage.batch_set_v2
        return list(call([transfer])[hs.PoolName.MAMBA])

    assert move("set", [1, 2]) == [True, True]
    last = pool.size - 1
    other = rank.hashes(sglang.tokens_for(2, rank.geometry.page_size, seed=8))
    assert move("set", [1, -1], other) == [False, False]  # would store the last slot's state
    assert move("get", [3], other[1:]) == [False]  # nothing was stored under it
    rank.mark_sidecar("mamba", 0)

    def snapshot() -> list[torch.Tensor]:
        return [rank.sidecar_page("mamba", slot) for slot in range(pool.size)]

    untouched = snapshot()
    for slots in ([1, -1], [1, pool.size], [3, 3], [1.0, 2.0]):
        assert move("get", slots) == [False, False], slots
        assert all(map(torch.equal, snapshot(), untouched)), slots
    assert move("get", [3, last]) == [True, True]
    assert torch.equal(rank.sidecar_page("mamba", 3), states[0])
    assert torch.equal(rank.sidecar_page("mamba", last), states[1])
    rank.close()
