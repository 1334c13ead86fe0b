"""SGLang's bare ``page-unified-v1`` objects (the ``sglang-ukv1`` key scheme's format).

An object is exactly its payload, stored under SGLang's key; pages round-trip through
``L3Link`` for any reader topology; a wrong size is caught, and (the documented loss) a flipped
byte is not. SGLang's own ``PageUnifiedLayout`` and keys are held to these objects in
``tests/sglang/test_sglang_storage_ukv1.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from hicache_store.backends import Backend, aligned_buffer, open_backend
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key
from hicache_store.layout.namespace import ModelShape, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.layout.ukv1 import ukv1_grid
from hicache_store.objects import (
    DEFAULT_IO_TIMEOUT_S,
    FRAMED,
    PAGE_UNIFIED,
    IOStats,
    L3Link,
    ObjectIO,
    format_for,
)

SHAPE = ModelShape.mha(6, 4, 8)
WRITER = Topology(2, 2, (3, 3))
NS = Namespace.create("org/model", SHAPE, "float16", 4, ukv1_grid(SHAPE, WRITER),
                      key_scheme="sglang-ukv1")
PAGE = f"{7:064x}"



def link(backend: Backend, topology: Topology, rank: int) -> L3Link:
    return L3Link(backend, NS, topology, rank, max_inflight_bytes=1 << 20,
                  io_timeout_s=DEFAULT_IO_TIMEOUT_S)


def row_of(layout: UnifiedPageLayout, seed: int) -> np.ndarray:
    row = np.frombuffer(aligned_buffer(layout.page_bytes), dtype=np.uint8)
    row[:] = np.random.default_rng(seed).integers(0, 256, layout.page_bytes, dtype=np.uint8)
    return row


async def write_page(store: Backend) -> dict[int, np.ndarray]:
    rows = {}
    for rank in range(WRITER.world_size):
        writer = link(store, WRITER, rank)
        rows[rank] = row_of(writer.write_plan.page, rank)  # type: ignore[union-attr]
        assert await writer.write_page(PAGE, rows[rank], IOStats())
    return rows


def test_the_format_is_chosen_by_the_keyspace() -> None:
    assert format_for(NS) is PAGE_UNIFIED
    assert format_for(Namespace.create("m", SHAPE, "float16", 4, NS.grid)) is FRAMED
    assert format_for(ObjectKey(PAGE, NS.digest, ObjectCoords(0, 3, 0))) is PAGE_UNIFIED
    assert ObjectIO(open_backend("memory://"), NS).header_bytes(3) == 0


async def test_objects_are_the_bare_payload_under_sglangs_keys(store: Backend) -> None:
    rows = await write_page(store)
    keys = sorted([k async for k in store.list_prefix("")])
    assert keys == sorted(f"{PAGE}_{NS.digest}_L{a}-{b}_H{h}" for a, b in ((0, 3), (3, 6))
                          for h in (0, 1))
    for rank, row in rows.items():
        plan = link(store, WRITER, rank).write_plan
        assert plan is not None
        (obj,) = plan.objects
        stored = await store.get_bytes(format_key(ObjectKey(PAGE, NS.digest, obj.coords)))
        assert stored == row[obj.page_offset : obj.page_offset + obj.nbytes].tobytes()


@pytest.mark.parametrize("reader", [Topology(1, 1), Topology(4, 1), Topology(1, 3, (2, 2, 2))])
async def test_pages_read_back_for_any_reader(store: Backend, reader: Topology) -> None:
    rows = await write_page(store)
    full = UnifiedPageLayout.full_page(NS)
    whole = np.zeros(full.page_bytes, dtype=np.uint8)
    for rank, row in rows.items():  # the writers' shards, placed into the full page
        shard = link(store, WRITER, rank).read_plan.page
        coords = np.meshgrid(*(np.arange(a, b) for a, b in (
            (shard.layer_start, shard.layer_stop), (0, 2), (0, 4),
            (shard.head_start, shard.head_stop), (0, 8))), indexing="ij")
        whole.view(np.uint16)[full.element_offsets(*coords)] = row.view(np.uint16)[
            shard.element_offsets(*coords)]
    for rank in range(reader.world_size):
        target = link(store, reader, rank)
        layout = target.read_plan.page
        got = np.frombuffer(aligned_buffer(layout.page_bytes), dtype=np.uint8)
        assert await target.read_page(PAGE, got, IOStats())
        coords = np.meshgrid(*(np.arange(a, b) for a, b in (
            (layout.layer_start, layout.layer_stop), (0, 2), (0, 4),
            (layout.head_start, layout.head_stop), (0, 8))), indexing="ij")
        assert np.array_equal(got.view(np.uint16)[layout.element_offsets(*coords)],
                              whole.view(np.uint16)[full.element_offsets(*coords)])


async def test_a_wrong_size_is_caught_a_flipped_byte_is_not(store: Backend) -> None:
    rows = await write_page(store)
    reader = link(store, Topology(1, 1), 0)
    key = f"{PAGE}_{NS.digest}_L3-6_H1"
    good = await store.get_bytes(key)
    assert good is not None
    got = np.frombuffer(aligned_buffer(reader.read_plan.page.page_bytes), dtype=np.uint8)
    await store.put([key], [memoryview(good[:-2])])  # short: the range read fails
    stats = IOStats()
    assert not await reader.read_page(PAGE, got, stats)
    assert stats.corruptions == 1
    await store.put([key], [memoryview(good + b"xx")])  # long: a whole-object read refuses it
    io = ObjectIO(store, NS)
    frame = memoryview(bytearray(len(good)))
    (refused,) = await io.read_frames([ObjectKey(PAGE, NS.digest, ObjectCoords(3, 6, 1))], [frame])
    assert isinstance(refused, Exception) and re.search("larger|stored", str(refused))
    flipped = bytearray(good)
    flipped[5] ^= 0xFF
    await store.put([key], [memoryview(bytes(flipped))])
    assert await reader.read_page(PAGE, got, IOStats())  # no checksum: served as KV
    assert rows  # (the other objects were untouched)
