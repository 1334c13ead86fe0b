"""The connector's saves through the backend's native writes (``L3Link.start_write_pages``),
on the worker side, without an engine: the connector's own ``_save`` and polls over a real
file store, a stand-in for vLLM's cache (``pack`` copies the pages out of a tensor).

* A step's pages are stored by one backend job started on the calling thread (vLLM's engine
  thread): nothing crosses the library's loop per page, and they read back exactly.
* A save whose put fails, or runs past its deadline, is counted failed (never saved) and
  trips the breaker; shutdown does not wait on a put that never ends.
* Chain order: a later save whose chain parent an earlier save did not store keeps nothing
  (its objects are deleted, its pages counted failed); another chain's save is kept.
* The write admission's evidence: the evictions the saves caused, reported exactly.
* A model of several KV cache groups (parts, each its own namespace): a step's pages of every
  part are ONE backend job, judged as one save whose pages count per part; chain order holds
  per part (a page whose parent in its own part was lost is deleted, the other part's kept).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "objects"))
from test_pages_l3_link_runs import HASHES, NS, PAGES, link

import hicache_store.integrations.vllm.connector as connector_module
from hicache_store.backends import open_backend
from hicache_store.backends.file import FileBackend
from hicache_store.backends.protocols import PendingWrites
from hicache_store.integrations.vllm.connector import (
    HiCacheStoreConnector,
    HiCacheStoreMetadata,
    PageSave,
    _Breaker,
)
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.objects import DEFAULT_IO_TIMEOUT_S, IOStats, L3Link

HALF = PAGES // 2


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    backend = open_backend(f"file://{tmp_path}/s")
    assert isinstance(backend, FileBackend)
    yield backend
    await backend.close()


class Cache:
    """vLLM's blocks, as the connector's part cache sees them: block ``b`` is page row ``b``."""

    def __init__(self, target: L3Link, blocks: int, seed: int) -> None:
        assert target.write_plan is not None
        self.page_bytes = target.write_plan.page.page_bytes
        rng = np.random.default_rng(seed)
        self.rows = torch.from_numpy(
            rng.integers(0, 256, (blocks, self.page_bytes), dtype=np.uint8))

    def pack(self, blocks: torch.Tensor, staging: torch.Tensor) -> None:
        staging.copy_(self.rows[blocks])


def worker(backend: FileBackend) -> Any:
    """A worker-side connector's save state (what ``__init__`` and ``register_kv_caches`` set)."""
    conn: Any = object.__new__(HiCacheStoreConnector)
    conn.backend = backend
    conn.config = SimpleNamespace(max_pending_save_bytes=1 << 30, io_timeout_s=20.0)
    conn._breaker = _Breaker(3600.0)
    conn.metrics, conn._interval, conn._lock = Counter(), Counter(), threading.Lock()
    conn._save_chain = None
    conn._pending_save_bytes = 0
    conn._native_saves, conn._abandoned, conn._lost = deque(), [], set()
    conn._l2 = None
    conn._failed_pages, conn._refuted_pages = set(), set()
    conn._evictions_reported = 0
    return conn


def chain_save(req: str, first: int, stop: int, hashes: list[str] = HASHES) -> PageSave:
    """Pages ``[first, stop)`` of one chain, in blocks of the same numbers."""
    return PageSave(req, list(range(first, stop)), hashes[first:stop],
                    [hashes[i - 1] if i else None for i in range(first, stop)])


async def stored(backend: FileBackend, target: L3Link, hashes: list[str]) -> list[bool]:
    return [all(await backend.exists(target.write_names(h))) for h in hashes]


class Spied:
    """Counts the calls of the connector module's ``submit`` (each a coroutine on the loop)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        inner = connector_module.submit

        def submit(coro: Any) -> Any:
            self.calls += 1
            return inner(coro)

        monkeypatch.setattr(connector_module, "submit", submit)


class Held(PendingWrites):
    """A put that ends when ``release`` is set, then raises ``error`` (None: never ends)."""

    def __init__(self, release: threading.Event | None, error: BaseException) -> None:
        super().__init__(lambda: None)
        self.release, self.error = release, error

    def done(self) -> bool:
        return self.release is not None and self.release.is_set()

    def wait(self) -> None:
        while not self.done():
            time.sleep(0.001)

    def _result(self) -> None:
        self.wait()
        raise self.error


def fail_next_put(monkeypatch: pytest.MonkeyPatch, backend: FileBackend,
                  release: threading.Event | None, error: BaseException) -> None:
    """The backend's next native put is ``Held(release, error)``; the ones after it real."""
    real = backend._start_put

    def start(*args: Any, **kwargs: Any) -> PendingWrites:
        monkeypatch.setattr(backend, "_start_put", real)
        return Held(release, error)

    monkeypatch.setattr(backend, "_start_put", start)


async def test_a_steps_pages_are_one_native_job_not_a_loop_hop_per_page(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, target = worker(store), link(store)
    cache = Cache(target, PAGES, seed=1)
    spy = Spied(monkeypatch)
    monkeypatch.setattr(target, "write_page", None)  # (the loop's path, page by page)
    conn._save([chain_save("a", 0, HALF)], [(cache, target)])
    conn._save([chain_save("a", HALF, PAGES)], [(cache, target)])
    conn.flush(60.0)
    assert spy.calls == 0, "no save crossed the library's loop"
    assert conn.metrics["pages_saved"] == PAGES and conn.metrics["saves_failed"] == 0
    assert conn.metrics["bytes_saved"] > PAGES * cache.page_bytes  # framed: headers too
    assert conn._pending_save_bytes == 0
    rows = [np.empty(cache.page_bytes, dtype=np.uint8) for _ in range(PAGES)]
    assert await target.read_prefix(HASHES, rows, IOStats()) == PAGES
    for i, row in enumerate(rows):
        assert np.array_equal(row, cache.rows[i].numpy())


async def test_a_failed_native_save_is_counted_failed_and_trips_the_breaker(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, target = worker(store), link(store)
    cache = Cache(target, PAGES, seed=2)
    done = threading.Event()
    done.set()
    fail_next_put(monkeypatch, store, done, OSError("no space left on device"))
    conn._save([chain_save("a", 0, HALF)], [(cache, target)])
    conn.flush(60.0)
    assert conn.metrics["pages_saved"] == 0 and conn.metrics["saves_failed"] == HALF
    assert conn.metrics["bytes_saved"] == 0 and conn._pending_save_bytes == 0
    assert conn._breaker.open
    conn._save([chain_save("a", HALF, PAGES)], [(cache, target)])  # dropped while it is open
    conn.flush(60.0)
    assert conn.metrics["saves_dropped"] == PAGES - HALF
    assert await stored(store, target, HASHES) == [False] * PAGES


async def test_a_save_after_its_parents_failed_save_keeps_nothing_another_chain_is_kept(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, target = worker(store), link(store)
    cache = Cache(target, 2 * PAGES, seed=3)
    other = page_hashes(list(range(1000, 1000 + PAGES * 4)), 4)  # another prompt's chain
    release = threading.Event()
    fail_next_put(monkeypatch, store, release, OSError("I/O error"))
    conn._save([chain_save("a", 0, HALF)], [(cache, target)])  # its put fails, later
    # The next step's save starts while the first is in flight: the children of its pages,
    # and the first pages of another prompt (blocks PAGES.., no parent in flight).
    later = [chain_save("a", HALF, PAGES),
             PageSave("b", list(range(PAGES, PAGES + HALF)), other[:HALF],
                      [None, *other[:HALF - 1]])]
    conn._save(later, [(cache, target)])
    conn._native_saves[-1].writes.wait()  # stored (not judged: its parent's first)
    assert all(await stored(store, target, HASHES[HALF:]))
    release.set()
    conn.flush(60.0)
    assert conn.metrics["pages_saved"] == HALF  # the other chain's
    assert conn.metrics["saves_failed"] == PAGES
    assert await stored(store, target, HASHES) == [False] * PAGES, (
        "no page stays stored after a missing parent")
    assert all(await stored(store, target, other[:HALF]))
    assert conn._pending_save_bytes == 0


async def test_a_put_past_its_deadline_is_failed_and_shutdown_does_not_wait_for_it(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = worker(store)
    target = L3Link(store, NS, Topology(1, 1), 0, max_inflight_bytes=1 << 20,
                    io_timeout_s=0.2)  # a short deadline
    cache = Cache(target, PAGES, seed=4)
    fail_next_put(monkeypatch, store, None, OSError("never"))  # a put that never ends
    conn._save([chain_save("a", 0, HALF)], [(cache, target)])
    with pytest.raises(TimeoutError):
        conn.flush(0.05)  # not past its deadline yet: still running
    conn._finish_saves(wait_s=60.0)  # past it: judged without waiting for the put
    assert conn.metrics["saves_failed"] == HALF and conn.metrics["pages_saved"] == 0
    assert not conn._native_saves and len(conn._abandoned) == 1
    assert conn._breaker.open and conn._pending_save_bytes == 0
    conn.flush(1.0)  # nothing left to wait for


async def test_the_evictions_native_saves_cause_are_reported_exactly(tmp_path: Path) -> None:
    capacity = 256 << 10
    backend = open_backend(f"file://{tmp_path}/b?capacity_bytes={capacity}")
    assert isinstance(backend, FileBackend)
    try:
        conn, target = worker(backend), link(backend)
        many = page_hashes(list(range(128 * 4)), 4)  # several times the capacity
        cache = Cache(target, len(many), seed=5)
        for first in range(0, len(many), 4):
            conn._save([chain_save("a", first, first + 4, many)], [(cache, target)])
        conn.flush(60.0)
        assert conn.metrics["pages_saved"] == len(many)
        assert backend.stats.evictions > 0
        meta = conn.build_connector_worker_meta()
        assert meta is not None and meta.store_evictions == backend.stats.evictions
        assert conn.build_connector_worker_meta() is None  # each eviction reported once
    finally:
        await backend.close()


# -- a model of two KV cache groups (Gemma-2: a full part and a sliding-window part) ----------

#: the second part's namespace: another shape (its pages another size), its own objects.
NS_B = Namespace.create("m", ModelShape.mha(2, 4, 8), "float16", 4, Grid(2, 2))


def part_b(backend: FileBackend) -> L3Link:
    return L3Link(backend, NS_B, Topology(1, 1), 0, max_inflight_bytes=1 << 20,
                  io_timeout_s=DEFAULT_IO_TIMEOUT_S, component=1)


def two_parts(backend: FileBackend) -> tuple[Any, list[L3Link], list[Cache]]:
    """A worker of a two-part model: its part links and caches (``register_kv_caches``)."""
    conn = worker(backend)
    links = [link(backend), part_b(backend)]
    caches = [Cache(links[0], PAGES, seed=11), Cache(links[1], PAGES, seed=12)]
    conn.parts, conn._caches, conn._part_links = [None, None], caches, links
    conn._step = None
    conn.config.test_alter_loaded_kv = False
    return conn, links, caches


def step(conn: Any, *saves: PageSave) -> None:
    """One engine step's saves, as vLLM ends a step (``wait_for_save``)."""
    conn._connector_metadata = HiCacheStoreMetadata(saves=list(saves))
    conn.wait_for_save()


def part_save(part: int, first: int, stop: int) -> PageSave:
    return dataclasses.replace(chain_save("a", first, stop), part=part)


def count_puts(monkeypatch: pytest.MonkeyPatch, backend: FileBackend) -> list[int]:
    """The backend's native puts started (one entry per job: its objects)."""
    puts: list[int] = []
    real = backend._start_put

    def start(keys: list[str], *args: Any, **kwargs: Any) -> PendingWrites:
        puts.append(len(keys))
        return real(keys, *args, **kwargs)

    monkeypatch.setattr(backend, "_start_put", start)
    return puts


def framed_bytes(target: L3Link, pages: int) -> int:
    assert target.write_plan is not None
    return pages * sum(target.io.header_bytes(o.coords.num_layers) + o.nbytes
                       for o in target.write_plan.objects)


async def test_a_two_part_step_is_one_native_job_counted_per_part(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, (a, b), caches = two_parts(store)
    puts = count_puts(monkeypatch, store)
    step(conn, part_save(0, 0, HALF), part_save(1, 0, 1))  # (the window part: a page a step)
    step(conn, part_save(0, HALF, PAGES), part_save(1, 1, 2))
    conn.flush(60.0)
    assert len(puts) == 2, f"one backend job per step across both parts, got {puts}"
    assert conn.metrics["pages_saved"] == PAGES + 2 and conn.metrics["saves_failed"] == 0
    assert conn.metrics["bytes_saved"] == framed_bytes(a, PAGES) + framed_bytes(b, 2)
    assert conn._pending_save_bytes == 0
    for target, cache, count in ((a, caches[0], PAGES), (b, caches[1], 2)):
        rows = [np.empty(cache.page_bytes, dtype=np.uint8) for _ in range(count)]
        assert await target.read_prefix(HASHES[:count], rows, IOStats()) == count
        for i, row in enumerate(rows):  # each under its own part's namespace
            assert np.array_equal(row, cache.rows[i].numpy())


async def test_a_failed_two_part_job_fails_both_parts_and_their_children(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, (a, b), _ = two_parts(store)
    release = threading.Event()
    fail_next_put(monkeypatch, store, release, OSError("I/O error"))
    step(conn, part_save(0, 0, HALF), part_save(1, 0, 1))  # its one put fails, later
    step(conn, part_save(0, HALF, PAGES), part_save(1, 1, 2))  # children in both parts
    conn._native_saves[-1].writes.wait()  # stored (not judged: its parents' first)
    release.set()
    conn.flush(60.0)
    assert conn.metrics["pages_saved"] == 0
    assert conn.metrics["saves_failed"] == PAGES + 2
    assert conn.metrics["bytes_saved"] == 0 and conn._pending_save_bytes == 0
    assert conn._breaker.open
    assert await stored(store, a, HASHES) == [False] * PAGES
    assert await stored(store, b, HASHES[:2]) == [False] * 2, (
        "no page of either part stays stored after a missing parent")


async def test_a_page_whose_parent_in_its_part_was_lost_is_deleted_the_other_part_kept(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, (a, b), _ = two_parts(store)
    step(conn, part_save(0, 0, HALF))  # part A's parents: stored
    conn.flush(60.0)
    release = threading.Event()
    fail_next_put(monkeypatch, store, release, OSError("I/O error"))
    step(conn, part_save(1, 0, HALF))  # part B's parents (the same hashes): lost, later
    step(conn, part_save(0, HALF, PAGES), part_save(1, HALF, PAGES))  # both parts' children
    conn._native_saves[-1].writes.wait()
    release.set()
    conn.flush(60.0)
    assert conn.metrics["pages_saved"] == PAGES  # part A's, both steps
    assert conn.metrics["saves_failed"] == PAGES  # part B's, both steps
    assert conn.metrics["bytes_saved"] == framed_bytes(a, PAGES)
    assert all(await stored(store, a, HASHES))
    assert await stored(store, b, HASHES) == [False] * PAGES
    assert conn._pending_save_bytes == 0
