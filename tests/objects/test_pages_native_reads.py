"""``L3Link.start_read_pages``: pages read in the backend's native code, polled without a
loop. Every page whose objects all arrived and passed is copied exactly into its row; a
damaged or missing object fails only its own page (counted and named as ``read_page`` does,
its row untouched); where there is no native path (a rank reading part of each object, a
sealed format) it reads nothing and says so."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_pages_l3_link_runs import HASHES, PAGES, SEALED, link, new_rows, pages, write_chain

from hicache_store.backends.errors import InvalidRangeError
from hicache_store.backends.file import FileBackend
from hicache_store.layout.topology import Topology
from hicache_store.objects import IOStats, PendingPages
from hicache_store.tenant import parse_key_ring


def settle(reads: PendingPages, io: IOStats) -> list[bool]:
    """Poll as the connector does (``done()`` never waits), then take the result."""
    while not reads.done():
        time.sleep(0.001)
    return reads.result(io)


async def test_pages_arrive_exactly_without_the_loop(store: FileBackend) -> None:
    rows = pages(11)
    target = link(store)
    await write_chain(target, rows)
    got = new_rows(target)
    reads = target.start_read_pages(HASHES, got)
    assert reads is not None, "the file backend reads natively"
    io = IOStats()
    assert settle(reads, io) == [True] * PAGES
    for want, row in zip(rows, got, strict=True):
        assert np.array_equal(row, want)
    assert io.bytes_fetched == PAGES * target.read_plan.bytes_fetched
    assert io.corruptions == 0 and io.errors == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "delete"])
async def test_a_damaged_object_fails_its_page_only(store: FileBackend, damage: str) -> None:
    rows = pages(12)
    target = link(store)
    await write_chain(target, rows)
    bad = 5
    assert target.write_plan is not None
    victim = store.path_of(target.write_plan.object_keys(HASHES[bad])[1])
    if damage == "delete":
        victim.unlink()
    else:
        raw = bytearray(victim.read_bytes())
        if damage == "truncate":
            raw = raw[:-64]
        elif damage == "extend":
            raw += b"\0" * 64
        else:
            raw[-10] ^= 0x01
        victim.write_bytes(bytes(raw))
    got = new_rows(target)
    for row in got:
        row[:] = 0xAB
    reads = target.start_read_pages(HASHES, got)
    assert reads is not None
    io = IOStats()
    if damage == "extend":
        # stored larger than its frame: the batch raises, and no row was written
        with pytest.raises(InvalidRangeError):
            settle(reads, io)
        assert all(bool((row == 0xAB).all()) for row in got)
        return
    outcome = settle(reads, io)
    assert outcome == [i != bad for i in range(PAGES)]
    for i, (want, row) in enumerate(zip(rows, got, strict=True)):
        if i == bad:
            assert (row == 0xAB).all(), "a failed page's row is not written"
        else:
            assert np.array_equal(row, want)
    named = [] if damage == "delete" else [target.write_names(HASHES[bad])[1]]
    assert io.corrupt_keys == named and io.corruptions == len(named) and io.errors == 0


async def test_a_shard_reader_takes_its_part_natively_where_it_reads_whole_objects(
    store: FileBackend,
) -> None:
    await write_chain(link(store), pages(13))
    # TP 4, rank 3: whole objects, its heads sliced out after the checks
    shard = link(store, topology=Topology(4, 1), rank=3)
    got = new_rows(shard)
    reads = shard.start_read_pages(HASHES, got)
    assert reads is not None
    assert settle(reads, IOStats()) == [True] * PAGES
    for row, h in zip(got, HASHES, strict=True):
        one = new_rows(shard, 1)[0]
        assert await shard.read_page(h, one, IOStats())
        assert np.array_equal(row, one)
    # PP 2, rank 1: a layer range of each object, which only ``read_page`` reads
    layers = link(store, topology=Topology(1, 2), rank=1)
    assert not all(obj.is_whole for obj in layers.read_plan.objects)
    assert layers.start_read_pages(HASHES, new_rows(layers)) is None


def test_a_sealed_namespace_has_no_native_path(store: FileBackend) -> None:
    sealed = link(store, SEALED, keys=parse_key_ring(f"active {'22' * 32}\n"))
    assert sealed.start_read_pages(HASHES, new_rows(sealed)) is None


def test_pages_and_rows_must_pair(store: FileBackend) -> None:
    target = link(store)
    with pytest.raises(ValueError, match="pages but"):
        target.start_read_pages(HASHES, new_rows(target, PAGES - 1))
