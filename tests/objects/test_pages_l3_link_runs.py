"""``L3Link`` runs of pages: ``write_pages`` stores a chain's pages in one backend call and
``read_prefix`` reads them back in one, and both keep the single-page guarantees: exact bytes,
a damaged, missing or refused object ends the prefix there (never wrong bytes past it), a
rotated key ring still reads what older keys wrote, and a rank that reads part of each object
gets exactly its shard."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache_store.backends import aligned_buffer, open_backend
from hicache_store.backends.file import FileBackend
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.objects import DEFAULT_IO_TIMEOUT_S, IOStats, L3Link, PageWrite
from hicache_store.tenant import KeyRing, parse_key_ring, rotate_text

NS = Namespace.create("m", ModelShape.mha(4, 4, 8), "float16", 4, Grid(4, 2))
SEALED = dataclasses.replace(
    Namespace.create("m", ModelShape.mha(4, 4, 8), "float16", 4, Grid(4, 2), tenant_salt="t"),
    sealed=True,
)
WRITER = Topology(1, 1)
PAGES = 12
HASHES = page_hashes(list(range(PAGES * 4)), 4)


def link(
    backend: FileBackend,
    ns: Namespace = NS,
    topology: Topology = WRITER,
    rank: int = 0,
    keys: KeyRing | None = None,
) -> L3Link:
    return L3Link(backend, ns, topology, rank, max_inflight_bytes=1 << 20,
                  io_timeout_s=DEFAULT_IO_TIMEOUT_S, keys=keys)


def pages(seed: int) -> list[np.ndarray]:
    nbytes = UnifiedPageLayout.full_page(NS).page_bytes
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(PAGES):
        row = np.frombuffer(aligned_buffer(nbytes), dtype=np.uint8)
        row[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out.append(row)
    return out


def new_rows(target: L3Link, count: int = PAGES) -> list[np.ndarray]:
    nbytes = target.read_plan.page.page_bytes
    return [np.frombuffer(aligned_buffer(nbytes), dtype=np.uint8) for _ in range(count)]


async def write_chain(target: L3Link, rows: Sequence[np.ndarray]) -> None:
    parents = [None, *HASHES[:-1]]
    batch = [PageWrite(h, r, p) for h, r, p in zip(HASHES, rows, parents, strict=True)]
    io = IOStats()
    assert await target.write_pages(batch, io)
    assert io.bytes_moved > sum(r.nbytes for r in rows)  # headers included



def count_calls(store: FileBackend, monkeypatch: pytest.MonkeyPatch, names: list[str]) -> list[str]:
    """Record each call of ``store``'s methods ``names`` (by name)."""
    calls: list[str] = []
    for name in names:
        method = getattr(store, name)

        def counted(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            calls.append(_name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(store, name, counted)
    return calls


async def test_a_run_is_one_write_and_one_read_and_reads_back_exactly(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = pages(1)
    target = link(store)
    puts = count_calls(store, monkeypatch, ["put"])
    await write_chain(target, rows)
    assert puts == ["put"], "one backend call for the run"
    # Every object is there, each page read back by itself too.
    assert await target.exists_prefix(HASHES) == PAGES
    single = new_rows(target, 1)[0]
    assert await target.read_page(HASHES[3], single, IOStats())
    assert np.array_equal(single, rows[3])
    # every read of the public API and of ``native_reads()`` runs one of these cores once
    reads = count_calls(store, monkeypatch, ["_get_into", "_get_into_summed", "_get_scatter"])
    got = new_rows(target)
    io = IOStats()
    assert await target.read_prefix(HASHES, got, io) == PAGES
    for want, row in zip(rows, got, strict=True):
        assert np.array_equal(row, want)
    assert io.bytes_fetched == PAGES * target.read_plan.bytes_fetched
    assert len(reads) == 1, f"one backend call for the run, not {reads}"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
async def test_a_damaged_page_ends_the_prefix_there(store: FileBackend, damage: str) -> None:
    rows = pages(2)
    target = link(store)
    await write_chain(target, rows)
    bad = 7
    assert target.write_plan is not None
    victim = store.path_of(target.write_plan.object_keys(HASHES[bad])[1])
    if damage == "delete":
        victim.unlink()
    else:
        raw = bytearray(victim.read_bytes())
        if damage == "truncate":
            raw = raw[:-64]
        else:
            raw[-10] ^= 0x01
        victim.write_bytes(bytes(raw))
    got = new_rows(target)
    io = IOStats()
    assert await target.read_prefix(HASHES, got, io) == bad
    for want, row in zip(rows[:bad], got[:bad], strict=True):
        assert np.array_equal(row, want)
    assert io.corruptions == (0 if damage == "delete" else 1)
    # The damaged object is named, for the caller to delete or overwrite; a miss is no error.
    named = [] if damage == "delete" else [target.write_names(HASHES[bad])[1]]
    assert io.corrupt_keys == named and io.errors == 0


@pytest.mark.parametrize(("topology", "rank"), [(Topology(4, 1), 3), (Topology(1, 2), 1)])
async def test_a_shard_reader_takes_its_part_of_each_page(
    store: FileBackend, topology: Topology, rank: int
) -> None:
    rows = pages(3)
    await write_chain(link(store), rows)
    reader = link(store, topology=topology, rank=rank)
    got = new_rows(reader)
    assert await reader.read_prefix(HASHES, got, IOStats()) == PAGES
    # Each page equals what the page-by-page path assembles (exact shards: test_pages_l3_link.py).
    for row, h in zip(got, HASHES, strict=True):
        one = new_rows(reader, 1)[0]
        assert await reader.read_page(h, one, IOStats())
        assert np.array_equal(row, one)


async def test_a_rotated_key_ring_reads_a_run_written_under_the_old_key(
    store: FileBackend,
) -> None:
    text = f"active {'11' * 32}\n"
    old = parse_key_ring(text)
    rows = pages(4)
    before = link(store, SEALED, keys=old)
    # The first half under the old key, the rest under the new one.
    half = PAGES // 2
    parents = [None, *HASHES[:-1]]
    assert await before.write_pages(
        [PageWrite(h, r, p) for h, r, p in zip(HASHES[:half], rows[:half], parents, strict=False)],
        IOStats(),
    )
    after = link(store, SEALED, keys=parse_key_ring(rotate_text(text)))
    assert await after.write_pages(
        [PageWrite(h, r, p) for h, r, p in zip(HASHES[half:], rows[half:], parents[half:],
                                               strict=True)],
        IOStats(),
    )
    got = new_rows(after)
    assert await after.read_prefix(HASHES, got, IOStats()) == PAGES
    for want, row in zip(rows, got, strict=True):
        assert np.array_equal(row, want)
    # The old key alone reads only its half.
    assert await before.read_prefix(HASHES, new_rows(before), IOStats()) == half


async def test_a_refused_write_of_a_run_reports_every_page_unstored(tmp_path: Path) -> None:
    # A store that cannot take the run (a shard directory is a file): the whole run is False.
    store = open_backend(f"file://{tmp_path}/s")
    assert isinstance(store, FileBackend)
    target = link(store)
    rows = pages(5)
    assert target.write_plan is not None
    blocker = store.path_of(target.write_plan.object_keys(HASHES[4])[0]).parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_bytes(b"not a directory")
    parents = [None, *HASHES[:-1]]
    io = IOStats()
    ok = await target.write_pages(
        [PageWrite(h, r, p) for h, r, p in zip(HASHES, rows, parents, strict=True)], io
    )
    assert not ok and io.bytes_moved == 0
    await store.close()
