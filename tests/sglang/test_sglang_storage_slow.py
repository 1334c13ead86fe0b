"""A slow store, as SGLang 0.5.23's own controller meets it: fewer pages, never none, never wrong.

Issue 31: on a loaded machine every put of a backup ran past the per-call deadline, so a batch
of 128 pages stored none of them and the next prefetch hit nothing. A call now has one deadline
from the bytes it moves (``objects.io.Deadline``: ``io_timeout_s`` + bytes at
``min_bandwidth_mib_s``); the pages stored or loaded by then count, the rest are ``False``.

The slow device is ``faulty://``'s per-call latency over the file backend, with one object in
flight at a time (``max_inflight_mib`` of one frame): every call alone is slower than
``io_timeout_s``, and a batch needs more time than its deadline gives it.
Host pages are written and compared by plain indexing (``sglang_cpu``).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from hicache_store.backends.faulty import FaultConfig
from hicache_store.layout.framing import payload_offset

N = 8
FLOOR_S = 1.0  # io_timeout_s
PER_PAGE_S = 0.8  # what a page's bytes add to a deadline, at min_bandwidth_mib_s
# Latency per call: each one alone is past the floor (the per-call deadline every put and
# read failed against before), a read within its own deadline (FLOOR_S + PER_PAGE_S). The
# first page's margin (0.5 s for a read, 0.6 for a put) is what a loaded machine may add to
# one call (0.25 s was not enough at a load of 10).
PUT_S = 1.2
GET_S = 1.3


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def slow_rank(sglang: ModuleType, tmp_path: Path, layout: str) -> Any:
    g = sglang.Geometry()
    frame = payload_offset(g.layers) + 2 * g.layers * g.page_size * g.heads * g.head_dim * 2
    extra = {
        "io_timeout_s": FLOOR_S,
        "min_bandwidth_mib_s": frame / PER_PAGE_S / (1 << 20),
        "max_inflight_mib": frame / (1 << 20),  # one object in flight: a queue, as on a disk
    }
    return sglang.Rank(f"faulty://?inner=file://{tmp_path / 'kv'}", layout=layout, extra=extra)


def leading(results: list[bool]) -> int:
    return results.index(False) if False in results else len(results)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_backup_that_runs_out_of_time_keeps_and_reports_its_leading_pages(
    sglang: ModuleType, tmp_path: Path, layout: str
) -> None:
    rank = slow_rank(sglang, tmp_path, layout)
    storage = rank.storage
    tokens = sglang.tokens_for(N, 4, seed=31)
    hashes = rank.hashes(tokens)
    pages = [rank.random_page(s) for s in range(N)]
    host_indices = rank.stage(pages)
    storage.backend.faults = FaultConfig(latency_s=PUT_S)
    # the call SGLang's backup thread makes (``_page_set_zero_copy``)
    results = storage.batch_set_v1(hashes, host_indices)
    storage.backend.faults = FaultConfig()
    rank.group.free(host_indices)
    stored = leading(results)
    assert 0 < stored < N, results
    assert results == [True] * stored + [False] * (N - stored)
    assert storage.counters["set_pages"] == stored
    # those pages are in the store, byte for byte: SGLang's hit query and its prefetch
    # through the controller, and a direct read. Pages after the first one reported False
    # may have landed too: a put the deadline cut in flight cannot be called back, and a
    # later page whose own deadline (its bytes added to the floor) had not passed is still
    # started. Each is reported False, never True for a page that is not stored, and each
    # that landed is whole: every page SGLang finds is read back equal.
    # (A put cut in flight may still land between these calls: each one may find more than
    # the one before, never fewer, and never a page that is not whole.)
    landed = storage.batch_exists(hashes)
    assert stored <= landed <= N
    hit, loaded, got = rank.prefetch(tokens)
    assert hit == loaded
    assert hit % 4 == 0
    assert landed * 4 <= hit <= N * 4
    assert got is not None
    for i in range(hit // 4):
        assert same(rank.host_page_of(got, i), pages[i]), i
    rank.group.free(got)
    dst = rank.group.alloc(N * 4)
    read = storage.batch_get_v1(hashes, dst)
    found = leading(read)
    assert hit // 4 <= found
    assert read == [True] * found + [False] * (N - found)
    for i in range(found):
        assert same(rank.host_page_of(dst, i), pages[i]), i
    rank.close()


def test_a_read_that_runs_out_of_time_loads_what_it_read_and_nothing_later(
    sglang: ModuleType, tmp_path: Path
) -> None:
    rank = slow_rank(sglang, tmp_path, "page_first")
    storage = rank.storage
    tokens = sglang.tokens_for(N, 4, seed=32)
    hashes = rank.hashes(tokens)
    pages = [rank.random_page(s) for s in range(N)]
    assert rank.backup(tokens, pages) == N * 4
    dst = rank.group.alloc(N * 4)
    for i in range(N):
        rank.host_page_of(dst, i).fill_(7)
    marked = rank.host_page_of(dst, 0).clone()
    storage.backend.faults = FaultConfig(latency_s=GET_S)
    # the call SGLang's prefetch thread makes (``_page_get_zero_copy``)
    results = storage.batch_get_v1(hashes, dst)
    loaded = sum(results)
    assert 0 < loaded < N, results
    assert results[0], "the first page had the whole deadline to itself"
    time.sleep(2 * GET_S)  # reads cut at the deadline would have landed by now
    storage.backend.faults = FaultConfig()
    for i in range(N):
        expected = pages[i] if results[i] else marked
        assert same(rank.host_page_of(dst, i), expected), (i, results)
    rank.group.free(dst)
    # and SGLang's own prefetch, on the store answering at speed again, loads every page
    hit, done, got = rank.prefetch(tokens)
    assert (hit, done) == (N * 4, N * 4) and got is not None
    rank.close()
