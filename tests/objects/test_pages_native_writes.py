"""``L3Link.start_write_pages``: a run of pages framed on the caller's thread and stored by one
backend job, polled without a loop. What it stores reads back exactly and names each page's
parent; the rows are the caller's again at once (the frames are the handle's own memory); a
failed put is not stored, said the same way from any thread; where there is no native path (a
sealed format, a backend without native writes) it stores nothing and says so."""

from __future__ import annotations

import threading
import time

import numpy as np
from test_pages_l3_link_runs import HASHES, PAGES, SEALED, link, new_rows, pages

from hicache_store.backends.faulty import FaultyBackend
from hicache_store.backends.file import FileBackend
from hicache_store.layout.framing import decode_header
from hicache_store.objects import IOStats, PageWrite, PendingPageWrites
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
