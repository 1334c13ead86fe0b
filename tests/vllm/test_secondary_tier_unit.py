"""``HiCacheStoreTier`` driven as vLLM's tiering manager drives it, without an engine.

A real ``SecondaryTierManager`` subclass over a primary region (a numpy array standing in for
vLLM's shared region: ``(num_chunks, row_bytes)`` int8, as ``create_kv_memoryview`` returns),
on the real file backend; the offloading spec is vLLM's ``OffloadingConfig`` in a minimal
``OffloadingSpec``. Each test checks bytes, verdicts and job results the way vLLM reads them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingSpec,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.integrations.vllm.secondary_tier import (
    ROW_COORDS,
    HiCacheStoreTier,
    check_unscaled_kv,
    page_hash_of,
    row_descriptor,
    row_namespace,
)
from hicache_store.layout.errors import ConfigError
from hicache_store.layout.keys import ObjectKey
from hicache_store.objects import ObjectIO

ROW = 3 * 4096  # bytes of one primary chunk row
CHUNKS = 8
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


class _Spec(OffloadingSpec):
    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError


def offloading_config(*, dtype: str = "float32", tp: int = 1, tokens_per_block: int = 16,
                      events: bool = False, canonical: bool = False,
                      agnostic: bool = False) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, ("l0", "l1"), 0),),
        worker_kv_bytes_per_block=ROW // tp,
        enable_kv_cache_events=events,
        extra_config={},
        engine_id="unit",
        model=OffloadingModelConfig("tiny", dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic),
        canonical_layout=canonical,
        kv_cache_layout="LBHNC",
    )


def key(i: int) -> Any:
    return make_offload_key(i.to_bytes(4, "big") * 8, 0)


class Harness:
    """A tier over its own primary region, with the polling vLLM's manager does."""

    def __init__(self, store: Path, **options: Any) -> None:
        config = options.pop("config", None) or offloading_config(events=options.get(
            "enable_kv_events", False))
        self.primary = np.zeros((CHUNKS, ROW), dtype=np.int8)
        self.tier = HiCacheStoreTier(
            _Spec(config), memoryview(self.primary), "HiCacheStoreTier",
            url=f"file://{store}", **options)
        self.req = ReqContext(req_id="r0")
        self.next_job = 0

    def fill(self, chunk: int, seed: int) -> bytes:
        self.primary[chunk] = np.random.default_rng(seed).integers(-128, 128, ROW, dtype=np.int8)
        return self.primary[chunk].tobytes()

    def job(self, keys: list[Any], chunks: list[int], *, promotion: bool) -> TransferJob:
        self.next_job += 1
        return TransferJob(self.next_job, keys, np.array(chunks, dtype=np.int64), promotion,
                           self.req)

    def finish(self, job: TransferJob) -> JobResult:
        """Poll ``get_finished_jobs`` until ``job`` is reported (vLLM polls every step)."""
        for _ in range(3000):
            for result in self.tier.get_finished_jobs():
                if result.job_id == job.job_id:
                    return result
            self.tier.wait_jobs()
        raise AssertionError(f"job {job.job_id} never finished")

    def store(self, keys: list[Any], chunks: list[int]) -> JobResult:
        job = self.job(keys, chunks, promotion=False)
        self.tier.submit_store(job)
        return self.finish(job)

    def load(self, keys: list[Any], chunks: list[int]) -> JobResult:
        job = self.job(keys, chunks, promotion=True)
        self.tier.submit_load(job)
        return self.finish(job)

    def lookup(self, k: Any, req: ReqContext | None = None) -> tuple[LookupResult, int]:
        """The verdict once it is not RETRY, and how many RETRYs came first."""
        req = req or self.req
        for retries in range(3000):
            found = self.tier.lookup(k, req)
            if found is not LookupResult.RETRY:
                return found, retries
            self.tier.on_schedule_end(END)
            self.tier._lookups._thread.join(0.005)  # let the lookup thread run
        raise AssertionError("lookup never resolved")


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def factory(store: Path | None = None, **options: Any) -> Harness:
        harness = Harness(store or tmp_path / "store", **options)
        made.append(harness)
        return harness

    yield factory
    for harness in made:
        harness.tier.shutdown()


def object_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "objects").rglob("*") if p.is_file())


def test_a_stored_row_is_found_and_loads_byte_for_byte(make: Any) -> None:
    h = make()
    row = h.fill(2, seed=1)
    assert h.store([key(1)], [2]).success
    # Right after the store the answer is HIT, at once or after RETRY steps (the file index's
    # in-memory set is newer than the store's commit, or the check runs off the scheduler
    # thread): never a MISS for a row this tier stored.
    verdict, _ = h.lookup(key(1))
    assert verdict is LookupResult.HIT
    result = h.load([key(1)], [5])
    assert result.success and result.transfer_bytes == ROW
    assert h.primary[5].tobytes() == row
    assert h.tier.stats.loaded == 1 and h.tier.stats.corruptions == 0


def test_an_unknown_key_is_a_miss(make: Any) -> None:
    h = make()
    assert h.lookup(key(9))[0] is LookupResult.MISS


def test_a_lookup_the_backend_answers_now_takes_no_retry_and_a_failed_load_still_misses(
    make: Any, tmp_path: Path
) -> None:
    # A fresh engine over a store nobody writes: the file index answers at once, so vLLM
    # gets HIT / MISS without a RETRY step; the verdict is vLLM's lookup state all the same,
    # so a key whose load fails answers MISS for the rest of the request (livelock guard).
    h = make()
    h.fill(0, seed=6)
    h.fill(1, seed=7)
    assert h.store([key(0), key(1)], [0, 1]).success
    h.tier.shutdown()
    fresh = make()
    names = [fresh.tier.storage_key(k) for k in (key(0), key(1), key(7))]
    # The index's in-memory set is current for a second after a check (an earlier step's
    # asynchronous one): a loaded machine may take longer between the two, hence the tries.
    for _ in range(5):
        run_sync(fresh.tier.backend.exists(names))
        if fresh.tier.backend.inline_exists().now(names) == [True, True, False]:
            break
    else:
        raise AssertionError("the file index never answered at once")
    verdicts = [fresh.tier.lookup(k, fresh.req) for k in (key(0), key(1), key(7))]
    assert verdicts == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    for path in object_files(tmp_path / "store"):
        if path.name == fresh.tier.storage_key(key(1)):
            path.unlink()  # gone behind the index's back: the load finds no file
    result = fresh.load([key(0), key(1)], [4, 5])
    assert not result.success and list(result.successful_keys) == [key(0)]
    assert fresh.tier.lookup(key(1), fresh.req) is LookupResult.MISS
    assert fresh.tier.lookup(key(0), fresh.req) is LookupResult.HIT
    # The request ends: vLLM forgets its verdicts (and asks again for the next request).
    fresh.tier.on_request_finished(fresh.req)
    assert key(1) not in fresh.tier._lookups._lookup_state


def test_a_corrupt_object_fails_only_its_own_key_and_is_deleted(make: Any, tmp_path: Path) -> None:
    h = make(enable_kv_events=True, config=offloading_config(events=True))
    rows = [h.fill(c, seed=c) for c in range(3)]
    assert h.store([key(0), key(1), key(2)], [0, 1, 2]).success
    stored = list(h.tier.take_events())
    assert [e.removed for e in stored] == [False] and len(stored[0].keys) == 3
    assert stored[0].medium is Medium.STORAGE
    bad = h.tier.storage_key(key(1))
    (path,) = [p for p in object_files(tmp_path / "store") if p.name == bad]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # one bit of the payload
    path.write_bytes(bytes(data))
    h.primary[3:6] = 0
    result = h.load([key(0), key(1), key(2)], [3, 4, 5])
    assert not result.success
    assert set(result.successful_keys) == {key(0), key(2)}
    assert h.primary[3].tobytes() == rows[0] and h.primary[5].tobytes() == rows[2]
    assert not h.primary[4].any(), "a row that failed its check never reaches vLLM's slot"
    assert h.tier.stats.corruptions == 1
    assert not path.exists()  # deleted: the next store of that chunk writes it again
    removed = list(h.tier.take_events())
    assert [(e.removed, e.keys) for e in removed] == [(True, [key(1)])]


def test_a_row_the_store_holds_is_not_written_again(make: Any, tmp_path: Path) -> None:
    # vLLM offers a chunk again where it recomputed it (a hybrid's full-attention chunks past
    # the hit its sliding-window group allowed): the row the store holds is not rewritten,
    # the job reports it stored, and its bytes count only what was written.
    h = make(enable_kv_events=True, config=offloading_config(events=True))
    rows = [h.fill(c, seed=10 + c) for c in range(3)]
    first = h.store([key(1)], [0])
    assert first.success and first.transfer_bytes == ROW
    (path,) = object_files(tmp_path / "store")
    written = path.read_bytes()
    writes = h.tier.backend.stats.writes
    again = h.store([key(1), key(2)], [0, 1])
    assert again.success and again.transfer_bytes == ROW  # key(2)'s row only
    assert h.tier.backend.stats.writes == writes + 1
    assert h.tier.stats.stored == 2 and h.tier.stats.bytes_stored == 2 * ROW
    assert h.tier.stats.stores_held == 1
    assert path.read_bytes() == written
    held_only = h.store([key(1), key(2)], [0, 1])  # a job of rows all held: no I/O at all
    assert held_only.success and held_only.transfer_bytes == 0
    assert h.tier.backend.stats.writes == writes + 1 and h.tier.stats.stores_held == 3
    # every row offered is a stored event (a consumer's view of the store stays whole)
    assert [sorted(e.keys) for e in h.tier.take_events()] == [
        [key(1)], sorted([key(1), key(2)]), sorted([key(1), key(2)])]
    h.primary[:] = 0
    assert h.load([key(1), key(2)], [4, 5]).success
    assert h.primary[4].tobytes() == rows[0] and h.primary[5].tobytes() == rows[1]


def test_a_row_offered_again_while_the_index_cannot_answer_at_once_is_asked_exactly(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Right after a commit the index's in-memory answer is not current (``now`` is None): a
    # job offering a chunk again asks the index on this thread; a job of new chunks does not.
    h = make()
    h.fill(0, seed=1)
    h.fill(1, seed=2)
    assert h.store([key(1)], [0]).transfer_bytes == ROW
    inline = h.tier.inline
    asked: list[int] = []
    blocking = inline.blocking
    monkeypatch.setattr(inline, "now", lambda keys, max_age_s=0.0: None)
    monkeypatch.setattr(inline, "blocking", lambda keys: asked.append(len(keys)) or blocking(keys))
    writes = h.tier.backend.stats.writes
    assert h.store([key(2)], [1]).transfer_bytes == ROW and asked == []
    again = h.store([key(3), key(1), key(2)], [1, 0, 1])
    assert again.success and again.transfer_bytes == ROW  # key(3) only
    assert asked == [2]  # (only the chunks offered before)
    assert h.tier.backend.stats.writes == writes + 2 and h.tier.stats.stores_held == 2


def test_a_row_deleted_as_corrupt_is_written_again_when_offered(
    make: Any, tmp_path: Path
) -> None:
    h = make()
    row = h.fill(0, seed=5)
    assert h.store([key(7)], [0]).success
    (path,) = object_files(tmp_path / "store")
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))
    assert not h.load([key(7)], [3]).success and not path.exists()
    again = h.store([key(7)], [0])
    assert again.success and again.transfer_bytes == ROW and h.tier.stats.stores_held == 0
    assert h.load([key(7)], [3]).success and h.primary[3].tobytes() == row


def test_a_truncated_object_is_a_failed_load(make: Any, tmp_path: Path) -> None:
    h = make()
    h.fill(0, seed=3)
    assert h.store([key(0)], [0]).success
    (path,) = object_files(tmp_path / "store")
    os.truncate(path, path.stat().st_size - 4096)
    result = h.load([key(0)], [1])
    assert not result.success and not result.successful_keys
    assert h.tier.stats.corruptions == 1


def test_an_object_gone_after_the_lookup_is_a_failed_load(make: Any, tmp_path: Path) -> None:
    h = make()
    h.fill(0, seed=4)
    assert h.store([key(0)], [0]).success
    assert h.lookup(key(0))[0] is LookupResult.HIT
    for path in object_files(tmp_path / "store"):
        path.unlink()
    result = h.load([key(0)], [1])
    assert not result.success
    assert h.tier.stats.load_misses == 1
    # vLLM's livelock guard: the failed key answers MISS now, not HIT again.
    assert h.tier.lookup(key(0), h.req) is LookupResult.MISS


@pytest.mark.parametrize("change", [
    {"dtype": "bfloat16"}, {"tp": 2}, {"tokens_per_block": 32},
])
def test_another_deployment_never_reads_these_rows(
    make: Any, tmp_path: Path, change: dict[str, Any]
) -> None:
    writer = make()
    writer.fill(0, seed=5)
    assert writer.store([key(0)], [0]).success
    reader = make(config=offloading_config(**change))
    assert reader.tier.namespace.digest != writer.tier.namespace.digest
    assert reader.lookup(key(0))[0] is LookupResult.MISS


def test_only_portable_canonical_rows_are_shared_across_tp_sizes() -> None:
    """vLLM's canonical rows it certified parallelism-agnostic are the same bytes under every
    TP size: one namespace. Direct rows (per-rank slots) and canonical rows vLLM did not
    certify keep the topology in theirs, and canonical never meets direct."""
    def digest(**change: Any) -> str:
        return row_namespace(_Spec(offloading_config(**change)), ROW).digest

    shared = digest(canonical=True, agnostic=True, tp=1)
    assert digest(canonical=True, agnostic=True, tp=2) == shared
    assert digest(canonical=True, agnostic=False, tp=1) != digest(canonical=True, tp=2)
    assert digest(agnostic=True, tp=1) != digest(agnostic=True, tp=2)
    assert digest(agnostic=True, tp=1) != shared
    assert digest(canonical=True, agnostic=True, dtype="bfloat16") != shared


def test_a_hybrids_namespace_names_the_layers_of_each_group() -> None:
    """Two groups (sliding and full layers, or state and attention): another assignment of the
    layers to the groups, or another order of the groups, is another namespace; one group's
    descriptor names no layers (stores written before keep their namespace)."""
    def digest(*groups: tuple[str, ...]) -> str:
        config = dataclasses.replace(offloading_config(), groups=tuple(
            OffloadingGroupConfig(16, layers, i) for i, layers in enumerate(groups)))
        return row_namespace(_Spec(config), ROW).digest

    hybrid = digest(("l0", "l2"), ("l1", "l3"))
    assert hybrid == digest(("l0", "l2"), ("l1", "l3"))
    assert digest(("l1", "l3"), ("l0", "l2")) != hybrid
    assert digest(("l0", "l1"), ("l2", "l3")) != hybrid
    assert "l0" not in row_descriptor(_Spec(offloading_config()), ROW)


def test_model_revision_and_tenant_salt_are_part_of_the_namespace() -> None:
    spec = _Spec(offloading_config())
    base = row_namespace(spec, ROW)
    assert base == row_namespace(_Spec(offloading_config()), ROW)  # deterministic
    assert row_namespace(spec, ROW, tenant_salt="a").digest != base.digest
    assert row_namespace(spec, ROW, model_revision="r2").digest != base.digest
    assert row_namespace(spec, ROW * 2).digest != base.digest
    assert dataclasses.replace(base).digest == base.digest


def test_drain_jobs_leaves_every_result_ready(make: Any) -> None:
    """vLLM's reset hook: every job has ended, stored under the revision it was submitted in;
    then the tier moves to a new revision (the weights may have changed), where the rows
    stored before miss."""
    h = make()
    jobs = []
    for c in range(CHUNKS):
        h.fill(c, seed=10 + c)
        job = h.job([key(100 + c)], [c], promotion=False)
        h.tier.submit_store(job)
        jobs.append(job.job_id)
    assert h.tier.has_pending_work()
    before = h.tier.namespace
    h.tier.drain_jobs()
    results = list(h.tier.get_finished_jobs())
    assert sorted(r.job_id for r in results) == jobs and all(r.success for r in results)
    assert not h.tier.has_pending_work()
    after = h.tier.namespace
    assert after.digest != before.digest and after.model == before.model
    stored = [ObjectKey(page_hash_of(key(100 + c)), before.digest, ROW_COORDS)
              for c in range(CHUNKS)]
    assert all(run_sync(h.tier.backend.exists([h.tier.io.storage_key(k) for k in stored])))
    assert not any(run_sync(h.tier.backend.exists(
        [h.tier.storage_key(key(100 + c)) for c in range(CHUNKS)])))


def test_the_store_stays_within_its_capacity(make: Any, tmp_path: Path) -> None:
    # Every write goes (write_admission="all"): the backend's LRU makes the room.
    capacity = 6 * (ROW + 4096)  # six objects (header page + row)
    store = tmp_path / "bounded"
    h = make(store=store, write_admission="all", backend_options={"capacity_bytes": capacity})
    for i in range(20):
        h.fill(i % CHUNKS, seed=i)
        assert h.store([key(200 + i)], [i % CHUNKS]).success
        used = sum(p.stat().st_size for p in object_files(store))
        assert used <= capacity
    assert len(object_files(store)) == 6
    assert h.lookup(key(219))[0] is LookupResult.HIT  # the newest stayed
    assert h.lookup(key(200))[0] is LookupResult.MISS  # the oldest went


def test_knowing_the_room_the_tier_writes_only_what_fits_beside_fresh_rows(
    make: Any, tmp_path: Path
) -> None:
    # The file backend declares its capacity and used bytes: with the default admission a
    # row that would evict a row written just now is refused, so what was written is kept
    # (no eviction) and served, where LRU alone (above) keeps only the newest.
    capacity = 6 * (ROW + 4096)
    store = tmp_path / "bounded"
    h = make(store=store, backend_options={"capacity_bytes": capacity})
    assert h.tier.backend.capabilities.capacity_usage
    assert h.tier.admission is not None and h.tier.admission.knows_room
    for i in range(20):
        h.fill(i % CHUNKS, seed=i)
        assert h.store([key(200 + i)], [i % CHUNKS]).success
    assert len(object_files(store)) == 6
    assert h.tier.backend.stats.evictions == 0
    assert h.tier.backend.stats.writes == 6  # written: what it keeps
    assert h.tier.stats.stores_refused == 14
    assert h.tier.admission.counts.refused == h.tier.admission.counts.refused_fresh == 14
    assert [h.lookup(key(200 + i))[0] for i in (0, 5, 6)] == [
        LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


def serve_in_turn(h: Harness, *, conversations: int, turns: int,
                  recomputed: int = 0) -> list[int]:
    """Conversations in turn, as vLLM drives the tier: each turn's prompt is the conversation
    so far, its chunks looked up in order up to the first miss, the hits loaded, the rest
    computed and stored. ``recomputed``: the last rows found are computed and offered again
    instead of loaded (as vLLM does for a hybrid's full-attention chunks past the hit its
    other group allowed). The rows found per turn."""
    history: dict[int, list[Any]] = {c: [] for c in range(conversations)}
    fresh = iter(range(10_000, 20_000))
    hits = []
    for turn in range(turns):
        found_in_turn = 0
        for c in range(conversations):
            req = ReqContext(req_id=f"c{c}-t{turn}")
            chain, found = history[c], 0
            for k in chain:
                if h.lookup(k, req)[0] is not LookupResult.HIT:
                    break
                found += 1
            found = max(found - recomputed, 0) if found else 0
            if found:
                assert h.load(chain[:found], [i % CHUNKS for i in range(found)]).success
            new = chain[found:] + [key(next(fresh)) for _ in range(2)]
            assert h.store(new, [i % CHUNKS for i in range(len(new))]).success
            history[c] = chain[:found] + new
            h.tier.on_request_finished(req)
            found_in_turn += found
        hits.append(found_in_turn)
    return hits


def test_a_store_that_evicts_rows_before_their_next_read_holds_what_it_has(
    make: Any, tmp_path: Path
) -> None:
    # Four conversations outgrow a store of sixteen rows. The backend's LRU alone
    # (write_admission="all", the tier before admission) evicts each conversation's rows
    # just before it comes back: nothing is served after the store fills, and every turn
    # is written again. With the default admission the tier refuses writes once its lookups
    # show that, and what the store holds is served on every later turn.
    capacity = 16 * (ROW + 4096)
    runs, evictions = {}, {}
    for admission in ("all", "reuse"):
        h = make(store=tmp_path / admission, write_admission=admission,
                 backend_options={"capacity_bytes": capacity, "durability": "none"})
        hits = serve_in_turn(h, conversations=4, turns=6)
        runs[admission] = (hits, h.tier.backend.stats.bytes_written, h.tier.stats)
        evictions[admission] = h.tier.backend.stats.evictions
    lru_hits, lru_written, lru_stats = runs["all"]
    hits, written, stats = runs["reuse"]
    assert lru_hits[3:] == [0, 0, 0] and lru_stats.stores_refused == 0
    assert all(n > 0 for n in hits[4:]), hits
    assert stats.stores_refused > 0 and stats.store_failures == 0
    assert written < lru_written / 2
    # (The hold starts at the second history lost in a row: fewer rows written than with a
    # majority of four answers, and fewer held; what it holds is served on every later turn.)
    assert sum(hits[3:]) > sum(lru_hits[3:]) and sum(hits) > sum(lru_hits)
    # The file backend declares its room: no write evicted a row (written: what it keeps).
    assert evictions == {"all": evictions["all"], "reuse": 0} and evictions["all"] > 0


@pytest.mark.parametrize("admission", ["reuse", "all"])
def test_a_bounded_store_writes_no_more_than_it_keeps_when_rows_are_offered_again(
    make: Any, tmp_path: Path, admission: str
) -> None:
    # Each turn recomputes and offers again the last row its lookup found. Rows the store
    # holds are not written again, so with the default admission (the room known: nothing
    # evicted) every byte written is kept; with LRU alone, a row is written again only
    # after it was evicted.
    capacity = 16 * (ROW + 4096)
    store = tmp_path / admission
    h = make(store=store, write_admission=admission,
             backend_options={"capacity_bytes": capacity, "durability": "none"})
    hits = serve_in_turn(h, conversations=4, turns=6, recomputed=1)
    backend, stats = h.tier.backend.stats, h.tier.stats
    kept = sum(p.stat().st_size for p in object_files(store))
    if admission == "reuse":
        assert backend.evictions == 0
        assert backend.bytes_written <= kept
        assert backend.writes == len(object_files(store)) == stats.stored
    else:
        assert backend.writes == len(object_files(store)) + backend.evictions
    assert sum(hits) > 0 and stats.store_failures == 0
    assert stats.stores_held > 0


def test_an_unknown_write_admission_is_refused_at_startup(make: Any) -> None:
    with pytest.raises(ConfigError, match="write_admission must be one of reuse, all"):
        make(write_admission="lru")


def test_rows_evicted_by_capacity_or_removed_by_another_process_are_removal_events(
    make: Any, tmp_path: Path
) -> None:
    # Every removal event names a row that left the store, and every row of this tier that
    # left it is named once: the events replay to exactly what is on disk.
    capacity = 4 * (ROW + 4096)  # four objects (header page + row)
    store = tmp_path / "bounded"
    # (every write goes: the backend's LRU evicts, write_admission="all")
    h = make(store=store, write_admission="all", backend_options={"capacity_bytes": capacity},
             enable_kv_events=True, config=offloading_config(events=True))
    held: set[Any] = set()
    for i in range(10):
        h.fill(i % CHUNKS, seed=i)
        assert h.store([key(300 + i)], [i % CHUNKS]).success
        for event in h.tier.take_events():
            assert event.medium is Medium.STORAGE
            for k in event.keys:
                if event.removed:
                    assert k in held, "a removal of a row that was not held"
                    held.remove(k)
                else:
                    held.add(k)
        on_disk = {p.name for p in object_files(store)}
        assert {h.tier.storage_key(k) for k in held} == on_disk
    assert held == {key(306), key(307), key(308), key(309)}
    # Another process (here: another backend on the same store) deletes a row: reported
    # after this tier's next store job.
    other = open_backend({"url": f"file://{store}"})
    assert run_sync(other.delete([h.tier.storage_key(key(307))])) == [True]
    run_sync(other.close())
    h.fill(0, seed=99)
    assert h.store([key(310)], [0]).success
    events = [(e.removed, sorted(e.keys)) for e in h.tier.take_events()]
    assert (True, [key(307)]) in events or (True, sorted([key(306), key(307)])) in events
    assert (False, [key(310)]) in events


def test_the_test_switch_serves_zeros_after_the_check_and_stores_nothing(make: Any) -> None:
    h = make()
    row = h.fill(0, seed=7)
    assert h.store([key(0)], [0]).success
    h.tier.test_alter_loaded_kv = True
    result = h.load([key(0)], [1])
    assert result.success  # the object was sound ...
    assert h.primary[1].tobytes() != row and not h.primary[1].any()  # ... and zeros were served
    # KV computed on top of wrong KV is wrong too: nothing is stored while the switch is on.
    h.fill(2, seed=8)
    assert not h.store([key(1)], [2]).success
    assert h.lookup(key(1))[0] is LookupResult.MISS


def settle_refreshes(h: Harness) -> None:
    """Wait for the view refreshes the tier started after its store jobs (on the loop)."""
    for _ in range(2000):
        if not h.tier._refreshes:
            return
        run_sync(asyncio.sleep(0.001))
    raise AssertionError("the refreshes after the stores never ended")


def test_after_a_store_lookups_are_answered_at_once_and_exactly(make: Any) -> None:
    # Each store job brings the backend's in-memory set up to date after its write, so the
    # scheduler's lookups answer from memory without a RETRY step, and see that job's rows.
    h = make()
    for i in range(3):
        h.fill(i, seed=40 + i)
        assert h.store([key(40 + i)], [i]).success
        settle_refreshes(h)
        assert h.lookup(key(40 + i)) == (LookupResult.HIT, 0)
        assert h.lookup(key(90 + i)) == (LookupResult.MISS, 0)


def test_with_no_age_allowed_every_answer_is_exact(make: Any, tmp_path: Path) -> None:
    # ``lookup_max_age_s`` 0: a row another process wrote a moment ago is found (a RETRY
    # step, or at once when the set is current), never missed for being new.
    writer = make()
    reader = make(lookup_max_age_s=0)
    for i in range(3):
        before = ReqContext(req_id=f"before{i}")
        assert reader.lookup(key(60 + i), before)[0] is LookupResult.MISS
        reader.tier.on_request_finished(before)  # (vLLM keeps a verdict while its request runs)
        writer.fill(i, seed=60 + i)
        assert writer.store([key(60 + i)], [i]).success
        assert reader.lookup(key(60 + i), ReqContext(req_id=f"after{i}"))[0] is LookupResult.HIT
    with pytest.raises(ConfigError, match="lookup_max_age_s"):
        make(lookup_max_age_s=-1)


def test_loads_read_in_native_code_without_the_loop(make: Any, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    # With the C reads, a load never goes through ``read_frames`` on the library's loop: its
    # reads run on a native thread and the poll that finds them done verifies and copies.
    h = make()
    rows = [h.fill(c, seed=70 + c) for c in range(3)]
    assert h.store([key(70), key(71), key(72)], [0, 1, 2]).success

    async def refuse(*args: object) -> object:
        raise AssertionError("a load went through the loop")

    monkeypatch.setattr(ObjectIO, "read_frames", refuse)
    h.primary[3:6] = 0
    job = h.job([key(70), key(71), key(72)], [3, 4, 5], promotion=True)
    h.tier.submit_load(job)
    assert h.tier._jobs[job.job_id].native is not None
    h.tier.wait_jobs()  # waits for the native reads too
    (result,) = h.tier.get_finished_jobs()
    assert result.job_id == job.job_id and result.success
    assert [h.primary[c].tobytes() for c in (3, 4, 5)] == rows
    assert h.tier.stats.loaded == 3 and not h.tier.has_pending_work()


def test_an_object_larger_than_its_row_fails_only_its_key(make: Any, tmp_path: Path) -> None:
    # The native reads refuse the batch (the object does not fit its frame): the job goes on
    # through the loop's ``read_frames``, which fails that key alone as corrupt.
    h = make()
    rows = [h.fill(c, seed=80 + c) for c in range(2)]
    assert h.store([key(80), key(81)], [0, 1]).success
    bad = h.tier.storage_key(key(81))
    (path,) = [p for p in object_files(tmp_path / "store") if p.name == bad]
    path.write_bytes(path.read_bytes() + b"\0" * 4096)
    h.primary[4:6] = 0
    result = h.load([key(80), key(81)], [4, 5])
    assert not result.success and list(result.successful_keys) == [key(80)]
    assert h.primary[4].tobytes() == rows[0] and not h.primary[5].any()
    assert h.tier.stats.corruptions == 1 and not path.exists()


def test_a_load_from_a_closed_backend_fails_and_never_hangs(make: Any) -> None:
    h = make()
    h.fill(0, seed=90)
    assert h.store([key(99)], [0]).success
    run_sync(h.tier.backend.close())
    result = h.load([key(99)], [1])
    assert not result.success and not result.successful_keys
    assert h.tier.stats.load_failures == 1


def test_stores_go_to_the_backend_without_the_loop(make: Any, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    # With native writes a store job never goes through ``put_together`` on the library's
    # loop: its rows are sealed on this thread, the put runs as the backend's own job and the
    # poll that finds it done reports it. The rows are stored, counted and load verified.
    h = make()
    rows = [h.fill(c, seed=110 + c) for c in range(3)]

    async def refuse(*args: object) -> object:
        raise AssertionError("a store went through the loop")

    monkeypatch.setattr(ObjectIO, "put_together", refuse)
    job = h.job([key(110), key(111), key(112)], [0, 1, 2], promotion=False)
    h.tier.submit_store(job)
    assert h.tier._jobs[job.job_id].store is not None
    h.tier.wait_jobs()  # waits for the native put too
    (result,) = h.tier.get_finished_jobs()
    assert result.success and result.transfer_bytes == 3 * ROW
    assert h.tier.stats.stored == 3 and h.tier._native_writing == 0
    h.primary[3:6] = 0
    assert h.load([key(110), key(111), key(112)], [3, 4, 5]).success
    assert [h.primary[c].tobytes() for c in (3, 4, 5)] == rows


def test_a_failed_native_write_is_a_failed_job_and_nothing_is_found(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make()
    h.fill(0, seed=120)
    # a real failure of the C write on its own thread: no directory for its temp file (ENOENT)
    places = h.tier.backend._places
    monkeypatch.setattr(places, "temp_path", lambda: places.tmp + "/gone/t.tmp")
    result = h.store([key(120), key(121)], [0, 1])
    assert not result.success and result.transfer_bytes == 0
    assert h.tier.stats.store_failures == 2 and h.tier.stats.stored == 0
    monkeypatch.undo()
    assert h.lookup(key(120))[0] is LookupResult.MISS


def test_a_native_store_past_its_deadline_is_a_failed_job(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from hicache_store.backends._file_io import StartedWrites

    h = make(io_timeout_s=0.05)
    engine = h.tier.backend._engine
    write, start_write = engine.write, engine.start_write

    def slow(keys: Any, buffers: Any) -> Any:
        time.sleep(0.5)
        return write(keys, buffers)

    def slow_start(keys: Any, buffers: Any, start_by: float) -> StartedWrites:
        started = start_write(keys, buffers, start_by)
        wait = started.wait

        def late() -> Any:  # the writes as they ended, reported as ending 0.5 s later
            outcomes, began, ended = wait()
            return outcomes, began, None if ended is None else ended + 0.5

        return StartedWrites(started.keys, started.done, late)

    monkeypatch.setattr(engine, "write", slow)  # (the pool's path)
    monkeypatch.setattr(engine, "start_write", slow_start)  # (the writes' own thread)
    h.fill(0, seed=130)
    assert not h.store([key(130)], [0]).success  # stored late: reported failed, never True


def test_a_store_to_a_closed_backend_fails_and_never_hangs(make: Any) -> None:
    h = make()
    h.fill(0, seed=140)
    run_sync(h.tier.backend.close())
    result = h.store([key(140)], [0])
    assert not result.success and h.tier.stats.store_failures == 1


def test_native_stores_past_the_inflight_bound_take_the_loops_path(make: Any) -> None:
    # ``max_inflight_mib`` bounds the native puts' bytes in flight too: past it a job goes
    # through the loop, whose write budget waits.
    h = make(max_inflight_mib=0.01)  # less than one row
    h.fill(0, seed=150)
    job = h.job([key(150)], [0], promotion=False)
    h.tier.submit_store(job)
    assert h.tier._jobs[job.job_id].store is None
    assert h.finish(job).success


def test_unknown_keys_of_the_entry_are_refused_as_the_connector_refuses_its_own(
    tmp_path: Path,
) -> None:
    """vLLM's factory passes every key of the ``secondary_tiers`` entry to the tier: a key the
    tier does not take is one ``ConfigError`` line (the close spelling, the known keys, and
    where a capacity goes), not Python's ``TypeError`` from the constructor call."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    def create(**entry: Any) -> Any:
        return SecondaryTierFactory.create_secondary_tier(
            {"type": "HiCacheStoreTier",
             "module_path": "hicache_store.integrations.vllm.secondary_tier", **entry},
            memoryview(np.zeros((CHUNKS, ROW), dtype=np.int8)), _Spec(offloading_config()))

    with pytest.raises(ConfigError, match=(
            r"unknown key\(s\) 'capacity'; known: backend_options, enable_kv_events, .*url"
            r".*capacity is the backend's option, in its URL: url='file:///path\?capacity_bytes=")):
        create(url=f"file://{tmp_path}/s", capacity="1GiB")
    with pytest.raises(ConfigError, match=r"'io_timeout' \(did you mean 'io_timeout_s'\?\)"):
        create(url=f"file://{tmp_path}/s", io_timeout=3)
    with pytest.raises(ConfigError, match=r"url 'fiel:///x': no backend named 'fiel'"):
        create(url="fiel:///x")
    tier = create(url=f"file://{tmp_path}/s?capacity_bytes=1GiB")
    tier.shutdown()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_kv_is_refused_at_startup_naming_the_setting(make: Any, dtype: str) -> None:
    """float8 rows would be stored without their per-layer k/v scales (the tier never sees the
    attention layers) and served under other scales: the tier does not start."""
    message = (rf"HiCacheStoreTier: {dtype} KV needs its per-layer k/v scales .* set "
               r"--kv-cache-dtype auto")
    with pytest.raises(ConfigError, match=message):
        row_namespace(_Spec(offloading_config(dtype=dtype)), ROW)
    with pytest.raises(ConfigError, match=message):
        make(config=offloading_config(dtype=dtype))
    with pytest.raises(ConfigError, match=r"kv_cache_dtype 'fp8_ds_mla' KV needs its per-layer"):
        check_unscaled_kv("uint8", "fp8_ds_mla")
    check_unscaled_kv("bfloat16", "auto")
    assert row_namespace(_Spec(offloading_config(dtype="bfloat16")), ROW).dtype == "uint8"
