"""``L3Link`` reads: one scatter read per whole object, two ranges for a layer sub-range, and a
corrupt, short or absent object is a failed page, never wrong bytes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from hicache_store.backends import Backend, aligned_buffer, open_backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.backends.file import FileBackend
from hicache_store.backends.memory import MemoryBackend
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.objects import DEFAULT_IO_TIMEOUT_S, IOStats, L3Link

# 4 layers in one object per head group of 2 heads (two objects per page), fp16.
NS = Namespace.create("m", ModelShape.mha(4, 4, 8), "float16", 4, Grid(4, 2))
WRITER = Topology(1, 1)
PAGE = f"{7:064x}"


def link(backend: Backend, topology: Topology = WRITER, rank: int = 0) -> L3Link:
    return L3Link(backend, NS, topology, rank, max_inflight_bytes=1 << 20,
                  io_timeout_s=DEFAULT_IO_TIMEOUT_S)


def full_page(seed: int = 0) -> np.ndarray:
    nbytes = UnifiedPageLayout.full_page(NS).page_bytes
    row = np.frombuffer(aligned_buffer(nbytes), dtype=np.uint8)
    row[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return row


def expected_shard(page: np.ndarray, reader: UnifiedPageLayout) -> np.ndarray:
    """The reader's page, element by element from the full page (``element_offsets``)."""
    coords = np.meshgrid(
        np.arange(reader.layer_start, reader.layer_stop),
        np.arange(NS.kv_planes),
        np.arange(NS.page_size),
        np.arange(reader.head_start, reader.head_stop),
        np.arange(NS.head_dim),
        indexing="ij",
    )
    full = page.view(np.uint16)
    out = np.zeros(reader.page_bytes // 2, dtype=np.uint16)
    out[reader.element_offsets(*coords)] = full[
        UnifiedPageLayout.full_page(NS).element_offsets(*coords)
    ]
    return out.view(np.uint8)


def new_row(target: L3Link) -> np.ndarray:
    return np.frombuffer(aligned_buffer(target.read_plan.page.page_bytes), dtype=np.uint8)



async def test_whole_objects_are_one_read_each(store: FileBackend) -> None:
    page = full_page()
    writer = link(store)
    assert await writer.write_page(PAGE, page, IOStats())
    before = store.stats.reads
    row = new_row(writer)
    assert await writer.read_page(PAGE, row, IOStats())
    assert np.array_equal(row, page)
    assert store.stats.reads - before == 2, "one scatter read per object (two objects)"


@pytest.mark.parametrize(
    ("topology", "rank"),
    [
        (Topology(1, 2), 1),  # layers 2-3 of each object: header, then a payload sub-range
        (Topology(1, 2), 0),  # layers 0-1: contiguous with the header
        (Topology(4, 1), 3),  # one head of a two-head group, through scratch memory
        (Topology(4, 2), 7),  # both
    ],
)
async def test_shard_reads_assemble_exact_bytes(
    store: FileBackend, topology: Topology, rank: int
) -> None:
    page = full_page(1)
    assert await link(store).write_page(PAGE, page, IOStats())
    reader = link(store, topology, rank)
    row = new_row(reader)
    assert await reader.read_page(PAGE, row, IOStats())
    assert np.array_equal(row, expected_shard(page, reader.read_plan.page))


@pytest.mark.parametrize("where", ["header", "padding", "payload", "last_byte", "truncated"])
@pytest.mark.parametrize(("topology", "rank"), [(WRITER, 0), (Topology(1, 2), 1)])
async def test_damaged_object_fails_the_page(
    store: FileBackend, where: str, topology: Topology, rank: int
) -> None:
    page = full_page(2)
    writer = link(store)
    assert await writer.write_page(PAGE, page, IOStats())
    victim = store.path_of(writer.write_plan.object_keys(PAGE)[1])  # type: ignore[union-attr]
    raw = bytearray(victim.read_bytes())
    if where == "truncated":
        raw = raw[:-100]
    else:
        # Every reader here fetches the header and the last layer (the object's last 256 bytes).
        offset = {"header": 40, "padding": 3000, "payload": -200, "last_byte": -1}[where]
        raw[offset] ^= 0x01
    victim.write_bytes(bytes(raw))
    reader = link(store, topology, rank)
    io = IOStats()
    assert not await reader.read_page(PAGE, new_row(reader), io)
    assert io.corruptions == 1
    # Named for the caller to delete or overwrite (the tier's and the connectors' repair).
    assert io.corrupt_keys == [writer.write_names(PAGE)[1]] and io.errors == 0


async def test_damaged_object_outside_the_fetched_layers_is_not_read(store: FileBackend) -> None:
    page = full_page(3)
    writer = link(store)
    assert await writer.write_page(PAGE, page, IOStats())
    victim = store.path_of(writer.write_plan.object_keys(PAGE)[0])  # type: ignore[union-attr]
    raw = bytearray(victim.read_bytes())
    raw[4096 + 10] ^= 0x01  # layer 0 of the first object
    victim.write_bytes(bytes(raw))
    stage1 = link(store, Topology(1, 2), 1)  # reads layers 2-3 only
    row = new_row(stage1)
    assert await stage1.read_page(PAGE, row, IOStats())
    assert np.array_equal(row, expected_shard(page, stage1.read_plan.page))
    stage0 = link(store, Topology(1, 2), 0)
    io = IOStats()
    assert not await stage0.read_page(PAGE, new_row(stage0), io)
    assert io.corruptions == 1


async def test_missing_object_is_a_miss_not_a_corruption(store: FileBackend) -> None:
    writer = link(store)
    assert await writer.write_page(PAGE, full_page(4), IOStats())
    await store.delete([writer.write_plan.object_keys(PAGE)[1]])  # type: ignore[union-attr]
    io = IOStats()
    assert not await writer.read_page(PAGE, new_row(writer), io)
    assert io.corruptions == 0 and not io.corrupt_keys and io.errors == 0


async def test_a_failing_backend_is_an_error_not_a_corruption() -> None:
    store = FaultyBackend(MemoryBackend())
    writer = link(store)
    assert await writer.write_page(PAGE, full_page(4), IOStats())
    store.faults = FaultConfig(read_error_rate=1.0)
    io = IOStats()
    assert not await writer.read_page(PAGE, new_row(writer), io)
    assert io.errors == 1 and io.corruptions == 0 and not io.corrupt_keys


async def test_any_backend_takes_the_scatter_read() -> None:
    # The memory backend has no scatter read of its own: the base class's per-buffer ranges.
    store = open_backend("memory://")
    writer = link(store)
    page = full_page(5)
    assert await writer.write_page(PAGE, page, IOStats())
    row = new_row(writer)
    assert await writer.read_page(PAGE, row, IOStats())
    assert np.array_equal(row, page)
    await store.close()


@pytest.mark.parametrize("deadline", [None, 0.005])
async def test_failed_page_returns_only_once_no_read_into_the_row_is_in_flight(
    deadline: float | None,
) -> None:
    # Two objects per page; one is missing (its answer comes back first or second, at random)
    # and every read lands 0-20 ms late from I/O nobody can stop. Whether the page fails on
    # the miss or on its deadline, ``read_page`` returns only when the other object's bytes
    # are in: afterwards the row is the caller's (issue 17; plain ``gather`` broke this).
    store = FaultyBackend(MemoryBackend())
    writer = L3Link(store, NS, WRITER, 0, max_inflight_bytes=1 << 20,
                    io_timeout_s=DEFAULT_IO_TIMEOUT_S)
    reader = L3Link(store, NS, WRITER, 0, max_inflight_bytes=1 << 20,
                    io_timeout_s=DEFAULT_IO_TIMEOUT_S if deadline is None else deadline)
    assert await writer.write_page(PAGE, full_page(6), IOStats())
    await store.delete([writer.write_plan.object_keys(PAGE)[1]])  # type: ignore[union-attr]
    rows = []
    for seed in range(8):
        store.faults = FaultConfig(seed=seed, inflight_jitter_s=0.02)
        row = new_row(reader)
        assert not await reader.read_page(PAGE, row, IOStats())
        row[:] = 0xA5
        rows.append(row)
    await asyncio.sleep(0.06)
    for row in rows:
        assert (row == 0xA5).all(), "a read landed in the row after read_page returned"


async def test_exists_prefix_of_a_long_prompt_probes_tens_of_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 4,000 pages of which the first 2,500 are stored (two objects each): the link finds the
    # boundary without asking for the 8,000 keys one by one (the SGLang adapter's
    # ``batch_exists`` and the tier's prefetch both go through ``exists_prefix``).
    backend = open_backend("memory://")
    reader = link(backend)
    hashes = [f"{i:064x}" for i in range(4000)]
    stored = [k for h in hashes[:2500] for k in reader.read_plan.object_keys(h)]
    await backend.put(stored, [b"x"] * len(stored))
    asked: list[int] = []
    real = backend._exists

    async def counting(keys: list[str]) -> list[bool]:
        asked.append(len(keys))
        return await real(keys)

    monkeypatch.setattr(backend, "_exists", counting)
    assert await reader.exists_prefix(hashes) == 2500
    assert sum(asked) <= 2 * 60 and len(asked) <= 8, asked
    assert await reader.exists_prefix(hashes[2500:]) == 0
    assert await reader.exists_prefix([]) == 0
    # A page with one of its two objects missing ends the prefix.
    await backend.delete([reader.read_plan.object_keys(hashes[2499])[1]])
    assert await reader.exists_prefix(hashes) == 2499
    await backend.close()
