"""Writer/reader topology matrix: every reader element holds exactly its own coordinates.

A logical page whose every element encodes its own (layer, plane, token, head, dim) is split into
objects by each writer topology's plans (through the real object framing), then reassembled by
each reader topology's plans. Any wrong offset, stride, range or ownership shows up as an element
holding someone else's coordinates.
"""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest

from hicache_store.layout.errors import GridMismatchError
from hicache_store.layout.framing import decode_header, encode_object, verify_blocks
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.keys import ObjectKey, format_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.plans import apply_segments, plan_reads, plan_writes, suggest_grid
from hicache_store.layout.topology import Topology, shard_of

PAGE_HASH = "ab" * 32
MHA = ModelShape.mha(num_layers=60, num_kv_heads=8, head_dim=2)
MLA = ModelShape.mla(num_layers=61, kv_dim=3)
MHA_TOPOLOGIES = [Topology(tp, pp) for tp, pp in itertools.product((1, 2, 4, 8, 16), (1, 2, 3, 4))]
MLA_TOPOLOGIES = [Topology(tp, pp) for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 3, 4))]


def namespace(shape: ModelShape, grid: Grid) -> Namespace:
    # float32 so every element can hold a unique uint32 coordinate id.
    return Namespace.create("matrix-model", shape, "float32", page_size=2, grid=grid)


def coordinate_ids(ns: Namespace, layout: UnifiedPageLayout) -> tuple[np.ndarray, np.ndarray]:
    """(element offsets in ``layout``, expected ids) for every element the layout holds."""
    grids = np.meshgrid(
        np.arange(layout.layer_start, layout.layer_stop),
        np.arange(ns.kv_planes),
        np.arange(ns.page_size),
        np.arange(layout.head_start, layout.head_stop),
        np.arange(ns.head_dim),
        indexing="ij",
    )
    layer, plane, token, head, dim = (g.ravel() for g in grids)
    ids = ((layer * ns.kv_planes + plane) * ns.page_size + token) * ns.num_kv_heads + head
    ids = ids * ns.head_dim + dim
    return layout.element_offsets(layer, plane, token, head, dim), ids.astype(np.uint32)


def writer_objects(ns: Namespace, writer: Topology) -> dict[str, bytes]:
    """Every framed object the writer topology produces for one page, by key."""
    objects: dict[str, bytes] = {}
    for rank in range(writer.world_size):
        plan = plan_writes(ns, writer, rank)
        page = np.full(plan.page.page_bytes // 4, 0xDEADBEEF, dtype=np.uint32)
        offsets, ids = coordinate_ids(ns, plan.page)
        page[offsets] = ids
        raw = page.view(np.uint8)
        for obj in plan.objects:
            key = ObjectKey(PAGE_HASH, ns.digest, obj.coords)
            assert format_key(key) not in objects, f"{key} written twice"
            payload = raw[obj.page_offset : obj.page_offset + obj.nbytes]
            objects[format_key(key)] = encode_object(key, payload, ns.kv_planes)
    assert len(objects) == ns.objects_per_page
    return objects


@cache
def cached_objects(shape: ModelShape, writer: Topology) -> tuple[Namespace, dict[str, bytes]]:
    ns = namespace(shape, suggest_grid(shape, [writer]))
    return ns, writer_objects(ns, writer)


def read_and_check(ns: Namespace, objects: dict[str, bytes], reader: Topology) -> float:
    """Assemble every reader rank's page from ``objects``; return the worst read amplification."""
    worst = 1.0
    for rank in range(reader.world_size):
        plan = plan_reads(ns, reader, rank)
        page = np.full(plan.page.page_bytes, 0xFF, dtype=np.uint8)  # poisoned
        for obj in plan.objects:
            key = ObjectKey(PAGE_HASH, ns.digest, obj.coords)
            stored = np.frombuffer(objects[format_key(key)], dtype=np.uint8)
            header = decode_header(stored, expected=key, object_length=stored.size)
            ranges = obj.object_ranges()
            data_start, data_stop = ranges[-1]
            if len(ranges) == 1:
                data_start = header.payload_offset
            fetched = stored[data_start:data_stop]
            verify_blocks(header, fetched, obj.layer_start, obj.layer_stop)
            apply_segments(obj.segments, fetched, page)
        offsets, ids = coordinate_ids(ns, plan.page)
        got = page.view(np.uint32)[offsets]
        bad = np.flatnonzero(got != ids)
        assert bad.size == 0, f"{reader} rank {rank}: {bad.size} wrong elements"
        assert plan.bytes_needed == plan.page.page_bytes
        worst = max(worst, plan.read_amplification)
    return worst


@pytest.mark.parametrize("writer", MHA_TOPOLOGIES, ids=str)
def test_mha_every_reader_gets_its_own_coordinates(writer: Topology) -> None:
    ns, objects = cached_objects(MHA, writer)
    for reader in MHA_TOPOLOGIES:
        read_and_check(ns, objects, reader)


@pytest.mark.parametrize("writer", MLA_TOPOLOGIES, ids=str)
def test_mla_every_reader_gets_its_own_coordinates(writer: Topology) -> None:
    ns, objects = cached_objects(MLA, writer)
    for reader in MLA_TOPOLOGIES:
        read_and_check(ns, objects, reader)


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        (Topology(16, 3), Topology(1, 1)),
        (Topology(2, 4), Topology(8, 3)),
        (Topology(4, 2), Topology(2, 1)),
    ],
    ids=str,
)
def test_a_grid_suggested_for_both_reads_without_amplification(
    writer: Topology, reader: Topology
) -> None:
    ns = namespace(MHA, suggest_grid(MHA, [writer, reader]))
    objects = writer_objects(ns, writer)
    assert read_and_check(ns, objects, reader) == 1.0
    assert read_and_check(ns, objects, writer) == 1.0


def test_seed_example_tp4_pp2_writer_tp2_pp1_reader() -> None:
    ns = namespace(MHA, Grid(layers_per_chunk=30, heads_per_group=2))
    writer, reader = Topology(4, 2), Topology(2, 1)
    assert ns.objects_per_page == 8
    written = [plan_writes(ns, writer, rank).objects for rank in range(writer.world_size)]
    assert [len(objs) for objs in written] == [1] * 8
    suffixes = {objs[0].coords.suffix for objs in written}
    assert suffixes == {f"L{a}-{b}_H{g}" for a, b in ((0, 29), (30, 59)) for g in range(4)}
    # TP0 combines H0 and H1 across both layer ranges; TP1 combines H2 and H3.
    for rank, groups in ((0, {0, 1}), (1, {2, 3})):
        plan = plan_reads(ns, reader, rank)
        assert len(plan.objects) == 4
        assert {o.coords.head_group for o in plan.objects} == groups
        assert all(o.is_whole for o in plan.objects)
        assert plan.read_amplification == 1.0
    read_and_check(ns, writer_objects(ns, writer), reader)


def test_misaligned_writer_is_refused_with_grids_that_work() -> None:
    ns = namespace(MHA, Grid(30, 2))
    with pytest.raises(
        GridMismatchError, match=r"tp=16,pp=1 rank 0 cannot write grid 30x2"
    ) as info:
        plan_writes(ns, Topology(16, 1), 0)
    assert (60, 1) in info.value.suggestions
    assert "60x1" in str(info.value)
    with pytest.raises(GridMismatchError, match="do not fall on chunks of 30") as info:
        plan_writes(ns, Topology(1, 4), 1)
    assert info.value.suggestions[0] == (15, 8)


def test_replicas_write_nothing_but_one_writes_everything() -> None:
    ns = namespace(MHA, Grid(60, 1))
    topology = Topology(16, 1)
    writers = [r for r in range(16) if plan_writes(ns, topology, r).objects]
    assert writers == [0, 2, 4, 6, 8, 10, 12, 14]
    assert all(shard_of(ns, topology, r).replica == r % 2 for r in range(16))


def test_head_subset_reads_whole_group_for_needed_layers() -> None:
    ns = namespace(MHA, Grid(30, 4))
    plan = plan_reads(ns, Topology(8, 4), 13)  # tp 5, pp 1: heads [5, 6), layers [15, 30)
    (obj,) = plan.objects
    assert obj.coords.suffix == "L0-29_H1"
    assert (obj.layer_start, obj.layer_stop) == (15, 30)
    assert obj.fetch_bytes == 15 * ns.layer_block_bytes(4)
    assert plan.read_amplification == 4.0


def test_plans_are_cached() -> None:
    ns = namespace(MHA, Grid(30, 2))
    assert plan_reads(ns, Topology(2, 1), 1) is plan_reads(ns, Topology(2, 1), 1)
    assert plan_writes(ns, Topology(4, 2), 3) is plan_writes(ns, Topology(4, 2), 3)


def test_plan_object_keys_equal_formatted_keys() -> None:
    ns = namespace(MHA, Grid(30, 2))
    plan = plan_reads(ns, Topology(2, 1), 1)
    expected = [format_key(ObjectKey(PAGE_HASH, ns.digest, o.coords)) for o in plan.objects]
    assert plan.object_keys(PAGE_HASH) == expected
    with pytest.raises(ValueError, match="page hash"):
        plan.object_keys("../x")
