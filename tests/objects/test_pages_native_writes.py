"""``L3Link.start_write_pages``: a run of pages framed on the caller's thread and stored by one
backend job, polled without a loop. What it stores reads back exactly and names each page's
parent; the rows are the caller's again at once (the frames are the handle's own memory); a
failed put is not stored, said the same way from any thread; where there is no native path (a
sealed format, a backend without native writes) it stores nothing and says so.
``start_write_links``: several links' pages (a model's cache components, each its own
namespace) stored by ONE backend job, each read back under its own namespace, counted per
link; any link without a native path, or links over two backends, start nothing. Pages packed
straight into ``L3Link.frame_rows``' memory are framed in place (no copy) and read back
exactly; a row that is not its frame row is refused."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_pages_l3_link_runs import HASHES, PAGES, SEALED, link, new_rows, pages

from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultyBackend
from hicache_store.backends.file import FileBackend
from hicache_store.backends.protocols import PendingWrites
from hicache_store.layout.framing import decode_header
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.objects import (
    DEFAULT_IO_TIMEOUT_S,
    IOStats,
    L3Link,
    PageWrite,
    PendingPageWrites,
    start_write_links,
)
from hicache_store.tenant import parse_key_ring


def chain(rows: list[np.ndarray]) -> list[PageWrite]:
    parents = [None, *HASHES[:-1]]
    return [PageWrite(h, r, p) for h, r, p in zip(HASHES, rows, parents, strict=True)]


def settle(writes: PendingPageWrites) -> bool:
    """Poll as the connector does (``done()`` never waits), then take the outcome."""
    while not writes.done():
        time.sleep(0.001)
    return writes.stored()


async def test_pages_stored_natively_read_back_exactly(store: FileBackend) -> None:
    rows = pages(21)
    target = link(store)
    writes = target.start_write_pages(chain(rows))
    assert writes is not None, "the file backend writes natively"
    for row in rows:  # the frames are copies: the rows may be reused at once
        row[:] = 0
    assert settle(writes) and writes.ended is not None
    assert writes.pages == PAGES
    assert writes.nbytes > PAGES * target.write_plan.page.page_bytes  # type: ignore[union-attr]
    got = new_rows(target)
    io = IOStats()
    assert await target.read_prefix(HASHES, got, io) == PAGES
    for want, row in zip(pages(21), got, strict=True):
        assert np.array_equal(row, want)
    assert target.write_plan is not None
    for i, h in enumerate(HASHES):  # every object names its chain parent
        name = target.write_plan.object_keys(h)[0]
        header = decode_header(store.path_of(name).read_bytes())
        assert header.parent_hash == (HASHES[i - 1] if i else None)


async def test_a_failed_put_is_not_stored_and_says_so_once(store: FileBackend) -> None:
    target = link(store)
    writes = target.start_write_pages(chain(pages(22)))
    assert writes is not None
    writes.wait()
    # The outcome, asked from two threads at once, is judged once and the same for both.
    writes._writes._writes._outcome = OSError("disk gone")  # the put raised
    answers: list[bool] = []
    threads = [threading.Thread(target=lambda: answers.append(writes.stored()))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [False, False] and writes.stored() is False


async def test_no_native_path_stores_nothing(store: FileBackend) -> None:
    sealed = link(store, SEALED, keys=parse_key_ring(f"active {'22' * 32}\n"))
    assert sealed.start_write_pages(chain(pages(23))) is None
    wrapped = link(FaultyBackend(store))  # (its abilities are not offered through it)
    assert wrapped.start_write_pages(chain(pages(23))) is None
    plain = link(store)
    assert plain.start_write_pages([]) is None
    assert not any(await store.exists(plain.write_names(HASHES[0])))


def component(store: FileBackend) -> L3Link:
    """A second cache component's link: another namespace (another page size), tag 1."""
    ns = Namespace.create("m", ModelShape.mha(2, 4, 8), "float16", 4, Grid(2, 2))
    return L3Link(store, ns, Topology(1, 1), 0, max_inflight_bytes=1 << 20,
                  io_timeout_s=DEFAULT_IO_TIMEOUT_S, component=1)


def rows_of(target: L3Link, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, target.read_plan.page.page_bytes, dtype=np.uint8)
            for _ in range(count)]


async def test_several_links_pages_are_one_job_each_under_its_namespace(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    full, window = link(store), component(store)
    puts: list[int] = []
    real = store._start_put

    def start(keys: list[str], *args: Any, **kwargs: Any) -> PendingWrites:
        puts.append(len(keys))
        return real(keys, *args, **kwargs)

    monkeypatch.setattr(store, "_start_put", start)
    full_rows = pages(24)
    window_pages = chain(rows_of(window, PAGES, 25))[:2]  # (a sliding window: a page a step)
    window_rows = [page.row for page in window_pages]
    writes = start_write_links([(full, chain(full_rows)), (window, window_pages)])
    assert writes is not None and settle(writes)
    assert len(puts) == 1 and puts[0] == len(full.write_names(HASHES[0])) * PAGES + len(
        window.write_names(HASHES[0])) * 2
    assert [pages for pages, _ in writes.parts] == [PAGES, 2]
    assert writes.pages == PAGES + 2 and writes.nbytes == sum(n for _, n in writes.parts)
    assert writes.parts[0][1] > PAGES * full.read_plan.page.page_bytes  # framed: headers too
    for target, want in ((full, full_rows), (window, window_rows)):
        got = new_rows(target, len(want))
        assert await target.read_prefix(HASHES[:len(want)], got, IOStats()) == len(want)
        for row, expected in zip(got, want, strict=True):
            assert np.array_equal(row, expected)


async def test_several_links_start_nothing_without_a_path_for_each(
    store: FileBackend, tmp_path: Path
) -> None:
    sealed = link(store, SEALED, keys=parse_key_ring(f"active {'22' * 32}\n"))
    plain = link(store)
    assert start_write_links([(plain, chain(pages(26))), (sealed, chain(pages(26)))]) is None
    assert start_write_links([(plain, []), (component(store), [])]) is None
    assert not any(await store.exists(plain.write_names(HASHES[0])))
    other = open_backend(f"file://{tmp_path}/other")
    try:
        with pytest.raises(ValueError, match="one backend"):
            start_write_links([(plain, chain(pages(27))), (link(other), chain(pages(27)))])
    finally:
        await other.close()
    assert not any(await store.exists(plain.write_names(HASHES[0])))


def one_object(store: FileBackend) -> L3Link:
    """A link whose page is one object (every layer and head): its rows can be its frames'."""
    ns = Namespace.create("m", ModelShape.mha(2, 2, 8), "float16", 4, Grid(2, 2))
    return L3Link(store, ns, Topology(1, 1), 0, max_inflight_bytes=1 << 20,
                  io_timeout_s=DEFAULT_IO_TIMEOUT_S)


async def test_pages_packed_into_frame_rows_are_framed_in_place(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = one_object(store)
    assert link(store).frame_rows(3) is None  # two objects a page: payloads not contiguous
    mem = target.frame_rows(3)
    assert mem is not None and mem.rows.shape == (3, target.read_plan.page.page_bytes)
    want = rows_of(target, 3, 28)
    for row, data in zip(mem.rows, want, strict=True):
        row[:] = data  # (the caller's pack)
    writes = [PageWrite(h, mem.rows[i], HASHES[i - 1] if i else None)
              for i, h in enumerate(HASHES[:3])]

    def copied(*args: object) -> None:
        raise AssertionError("a page framed by a copy")

    monkeypatch.setattr(L3Link, "_frame_page", copied)
    started = start_write_links([(target, writes)], [mem])
    assert started is not None and settle(started)
    assert started.parts == ((3, mem.frames.nbytes),)
    got = new_rows(target, 3)
    assert await target.read_prefix(HASHES[:3], got, IOStats()) == 3
    for row, expected in zip(got, want, strict=True):
        assert np.array_equal(row, expected)
    other = target.frame_rows(1)
    assert other is not None
    with pytest.raises(ValueError, match="not its frame row"):  # a copy of the row
        start_write_links([(target, [PageWrite(HASHES[5], want[0], None)])], [other])
    assert not any(await store.exists(target.write_names(HASHES[5])))
