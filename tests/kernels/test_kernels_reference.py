"""The torch reference against the layout layer, and the pack/unpack identities.

Every expected byte comes from ``UnifiedPageLayout.element_offsets`` and, for host pools,
``PoolLayout.element_offsets`` (see ``kernel_cases``): the reference provably follows the
single source of truth. Data is fresh random bit patterns every run; destinations are poisoned
with other random bytes, so an element the op failed to write cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    DTYPES,
    POOL_FORMS,
    device_pool,
    device_values,
    expected_staging,
    host_pool,
    host_values,
    namespace,
    page_lists,
    random_case,
    shard_layouts,
    staging,
    staging_values,
)

from hicache_store.kernels import host_to_unified, pack_pages, unified_to_host, unpack_pages
from hicache_store.kernels._pages import slot_table
from hicache_store.kernels.pools import as_bits
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Grid

MHA_TOPOLOGIES = [
    "tp=1,pp=1",
    "tp=2,pp=1",
    "tp=4,pp=1",
    "tp=8,pp=1",
    "tp=2,pp=2",
    "tp=1,pp=3",
    "tp=1,pp=2,layers=1/3",
]
MLA_TOPOLOGIES = ["tp=1,pp=1", "tp=2,pp=2", "tp=1,pp=3"]
SLOTS = 64  # 16 pages of 4 tokens


def _layouts() -> list[tuple[str, UnifiedPageLayout]]:
    ns = namespace("mha", torch.bfloat16)
    cases = [
        (f"mha-{l.layer_start}-{l.layer_stop}-h{l.head_start}-{l.head_stop}", l)
        for l in shard_layouts(ns, MHA_TOPOLOGIES)
    ]
    # A head range that cuts a head group: blocks of 1 and 2 heads (several runs).
    cases.append(("mha-cut-group", UnifiedPageLayout(ns, 0, 4, 1, 4)))
    # One head per group: a full page is four evenly spaced blocks (one run of four).
    cases.append(("mha-hpg1", UnifiedPageLayout.full_page(ns.with_grid(Grid(3, 1)))))
    mla = namespace("mla", torch.bfloat16, dim=12)
    cases += [
        (f"mla-{l.layer_start}-{l.layer_stop}", l) for l in shard_layouts(mla, MLA_TOPOLOGIES)
    ]
    return cases


LAYOUTS = _layouts()


def _with_dtype(layout: UnifiedPageLayout, dtype: torch.dtype) -> UnifiedPageLayout:
    ns = layout.namespace
    import dataclasses

    other = dataclasses.replace(ns, dtype=str(dtype).removeprefix("torch."))
    return UnifiedPageLayout(
        other, layout.layer_start, layout.layer_stop, layout.head_start, layout.head_stop
    )


@pytest.mark.parametrize(("name", "layout"), LAYOUTS, ids=[n for n, _ in LAYOUTS])
@pytest.mark.parametrize("form", POOL_FORMS)
@pytest.mark.parametrize("pages_form", ["aligned", "residue", "ragged", "table"])
def test_pack_matches_layout_offsets_and_unpack_inverts_it(
    name: str, layout: UnifiedPageLayout, form: str, pages_form: str, gen: torch.Generator
) -> None:
    ns = layout.namespace
    case = device_pool(layout, torch.bfloat16, SLOTS, form, gen)
    pages = page_lists(SLOTS, ns.page_size, 5, pages_form, gen)  # odd count, shuffled
    table = slot_table(
        pages,
        page_size=ns.page_size,
        num_slots=SLOTS,
        device=pages.device,
        writes_pool=True,
        check_indices=True,
    )
    source = case.snapshot()
    stage, whole = staging(layout, 5, torch.bfloat16, gen, pitch=6)
    before = whole.clone()

    pack_pages(case.pool, pages, stage, layout, backend="torch")

    expected = expected_staging(
        as_bits(before[:, : layout.page_bytes]).view(torch.int16),
        device_values(case.pool, table),
        layout,
    )
    assert torch.equal(whole[:, : layout.page_bytes].view(torch.int16), expected)
    assert torch.equal(whole[:, layout.page_bytes :], before[:, layout.page_bytes :])  # row gaps
    assert all(torch.equal(a, b) for a, b in zip(case.snapshot(), source, strict=True))

    # unpack into a poisoned copy of another pool: exactly the selected slots change.
    target = device_pool(layout, torch.bfloat16, SLOTS, form, gen)
    poisoned = target.snapshot()
    packed = whole.clone()
    unpack_pages(stage, target.pool, pages, layout, backend="torch")
    assert torch.equal(whole, packed)  # the staging source is unchanged
    expected_pool = _expected_pool(target, poisoned, table, case)
    assert all(torch.equal(a, b) for a, b in zip(target.snapshot(), expected_pool, strict=True))


def _expected_pool(target, poisoned, table, source_case):  # type: ignore[no-untyped-def]
    """``poisoned`` parents with the selected slots of every buffer taken from the source pool."""
    from kernel_cases import PoolCase

    clone = PoolCase(
        [p.clone().view(t.dtype) for p, t in zip(poisoned, target.parents, strict=True)],
        target.build,
    )
    pool = clone.pool
    src = source_case.pool
    for p, buffers in enumerate(pool.planes):
        for l, buf in enumerate(buffers):
            as_bits(buf)[table] = as_bits(src.planes[p][l])[table]
    return clone.snapshot()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_every_dtype_is_byte_exact(dtype: torch.dtype, kind: str, gen: torch.Generator) -> None:
    ns = namespace(kind, dtype, dim=8)
    layout = UnifiedPageLayout.full_page(ns)
    case = device_pool(layout, dtype, SLOTS, "separate", gen)
    pages = page_lists(SLOTS, ns.page_size, 7, "aligned", gen)
    table = pages[:, None] + torch.arange(ns.page_size)
    stage, _ = staging(layout, 7, dtype, gen)
    before = as_bits(stage).clone()
    pack_pages(case.pool, pages, stage, layout)  # auto: the reference on CPU
    assert torch.equal(
        as_bits(stage), expected_staging(before, device_values(case.pool, table), layout)
    )
    target = device_pool(layout, dtype, SLOTS, "separate", gen)
    poisoned = target.snapshot()
    unpack_pages(stage, target.pool, pages, layout)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            target.snapshot(), _expected_pool(target, poisoned, table, case), strict=True
        )
    )


def test_float8_nan_payloads_survive(gen: torch.Generator) -> None:
    ns = namespace("mha", torch.float8_e4m3fn)
    layout = UnifiedPageLayout.full_page(ns)
    case = device_pool(layout, torch.float8_e4m3fn, SLOTS, "stacked", gen)
    # 0x7f and 0xff are the two e4m3fn NaN encodings; a float copy could canonicalise them.
    case.parents[0].view(torch.uint8)[..., ::2] = 0x7F
    case.parents[0].view(torch.uint8)[..., 1::2] = 0xFF
    pages = torch.tensor([4, 0, 12])
    stage, _ = staging(layout, 3, torch.float8_e4m3fn, gen)
    pack_pages(case.pool, pages, stage, layout)
    raw = stage.view(torch.uint8)
    assert set(torch.unique(raw).tolist()) == {0x7F, 0xFF}


@pytest.mark.parametrize("form", ["stacked", "separate"])
def test_layer_wise_unpack_writes_one_layer_at_a_time(form: str, gen: torch.Generator) -> None:
    ns = namespace("mha", torch.float16)
    layout = UnifiedPageLayout(ns, 1, 4, 0, 4)  # a PP stage holding global layers 1..3
    case = device_pool(layout, torch.float16, SLOTS, form, gen)
    pages = page_lists(SLOTS, ns.page_size, 3, "aligned", gen)
    table = pages[:, None] + torch.arange(ns.page_size)
    stage, _ = staging(layout, 3, torch.float16, gen)
    pack_pages(case.pool, pages, stage, layout)
    target = device_pool(layout, torch.float16, SLOTS, form, gen)
    poisoned = [p.clone() for p in target.snapshot()]
    for layer in range(1, 4):
        unpack_pages(stage, target.pool, pages, layout, layers=(layer, layer + 1))
        pool = target.pool
        for local in range(layout.num_layers):
            for p in range(2):
                got = as_bits(pool.planes[p][local])[table]
                want = as_bits(case.pool.planes[p][local])[table]
                assert torch.equal(got, want) == (local <= layer - 1), (layer, local, p)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            target.snapshot(), _expected_pool(target, poisoned, table, case), strict=True
        )
    )


def test_partial_pack_leaves_other_layers_of_the_row_alone(gen: torch.Generator) -> None:
    ns = namespace("mha", torch.bfloat16)
    layout = UnifiedPageLayout.full_page(ns)
    case = device_pool(layout, torch.bfloat16, SLOTS, "stacked", gen)
    pages = page_lists(SLOTS, ns.page_size, 3, "aligned", gen)
    table = pages[:, None] + torch.arange(ns.page_size)
    stage, _ = staging(layout, 3, torch.bfloat16, gen)
    before = as_bits(stage).clone()
    pack_pages(case.pool, pages, stage, layout, layers=(2, 3))
    expected = expected_staging(before, device_values(case.pool, table), layout, layers=(2, 3))
    assert torch.equal(as_bits(stage), expected)


def test_duplicate_pages_may_be_packed(gen: torch.Generator) -> None:
    ns = namespace("mha", torch.bfloat16)
    layout = UnifiedPageLayout.full_page(ns)
    case = device_pool(layout, torch.bfloat16, SLOTS, "stacked", gen)
    stage, _ = staging(layout, 2, torch.bfloat16, gen)
    pack_pages(case.pool, torch.tensor([8, 8]), stage, layout)
    assert torch.equal(as_bits(stage[0]), as_bits(stage[1]))


def test_empty_page_list_is_a_no_op(gen: torch.Generator) -> None:
    ns = namespace("mha", torch.bfloat16)
    layout = UnifiedPageLayout.full_page(ns)
    case = device_pool(layout, torch.bfloat16, SLOTS, "separate", gen)
    snap = case.snapshot()
    empty = torch.empty(0, layout.page_bytes, dtype=torch.uint8)
    pack_pages(case.pool, torch.empty(0, dtype=torch.int64), empty, layout)
    unpack_pages(empty, case.pool, torch.empty(0, dtype=torch.int64), layout)
    assert all(torch.equal(a, b) for a, b in zip(case.snapshot(), snap, strict=True))


HOST_LAYOUTS = [("mha", n) for n in ("layer_first", "page_first", "page_first_direct", "page_head")]
HOST_LAYOUTS += [("mla", n) for n in ("layer_first", "page_first", "page_first_direct")]


@pytest.mark.parametrize(("kind", "name"), HOST_LAYOUTS, ids=[f"{k}-{n}" for k, n in HOST_LAYOUTS])
@pytest.mark.parametrize("pages_form", ["aligned", "table"])
def test_host_relayout_follows_both_layouts_and_round_trips(
    kind: str, name: str, pages_form: str, gen: torch.Generator
) -> None:
    ns = namespace(kind, torch.bfloat16, dim=8 if kind == "mha" else 12)
    topologies = MHA_TOPOLOGIES if kind == "mha" else MLA_TOPOLOGIES
    for layout in shard_layouts(ns, topologies[:5]):
        host = host_pool(ns, layout, name, torch.bfloat16, 12, gen)
        pages = page_lists(host.layout.num_slots, ns.page_size, 5, pages_form, gen)
        table = slot_table(
            pages,
            page_size=ns.page_size,
            num_slots=host.num_slots,
            device=pages.device,
            writes_pool=True,
            check_indices=True,
        )
        source = host.buffer.clone()
        stage, _ = staging(layout, 5, torch.bfloat16, gen)
        before = as_bits(stage).clone()
        host_to_unified(host, pages, stage, layout)
        assert torch.equal(
            as_bits(stage), expected_staging(before, host_values(host, table), layout)
        )
        assert torch.equal(as_bits(host.buffer), as_bits(source))

        # round trip into a poisoned host pool: the selected pages come back, nothing else moves
        target = host_pool(ns, layout, name, torch.bfloat16, 12, gen)
        poisoned = as_bits(target.buffer).clone()
        unified_to_host(stage, target, pages, layout)
        got = host_values(target, table)
        want = host_values(host, table)
        assert all(
            torch.equal(g, w)
            for gl, wl in zip(got, want, strict=True)
            for g, w in zip(gl, wl, strict=True)
        )
        selected = torch.zeros_like(poisoned, dtype=torch.bool).reshape(-1)
        _mark_host(target, table, selected)
        flat_now = as_bits(target.buffer).reshape(-1)
        assert torch.equal(flat_now[~selected], poisoned.reshape(-1)[~selected])
        # and the unified rows read back equal what went in
        assert all(
            torch.equal(a, b)
            for la, lb in zip(staging_values(as_bits(stage), layout), got, strict=True)
            for a, b in zip(la, lb, strict=True)
        )


def _mark_host(host, table, selected):  # type: ignore[no-untyped-def]
    import numpy as np

    pl = host.layout
    planes = 2 if pl.kv_kind == "mha" else 1
    slot, layer, plane, head, dim = np.meshgrid(
        table.numpy().reshape(-1),
        np.arange(pl.num_layers),
        np.arange(planes),
        np.arange(pl.num_heads),
        np.arange(pl.head_dim),
        indexing="ij",
    )
    selected[torch.from_numpy(pl.element_offsets(plane, slot, layer, head, dim).reshape(-1))] = True


def test_host_and_device_relayouts_agree(gen: torch.Generator) -> None:
    """A host pool holding the same KV as a device pool packs to the same unified bytes."""
    ns = namespace("mha", torch.bfloat16)
    layout = UnifiedPageLayout(ns, 0, 4, 2, 4)
    case = device_pool(layout, torch.bfloat16, 48, "separate", gen)
    host = host_pool(ns, layout, "page_head", torch.bfloat16, 12, gen)
    all_pages = torch.arange(12) * ns.page_size
    device_stage, _ = staging(layout, 12, torch.bfloat16, gen)
    pack_pages(case.pool, all_pages, device_stage, layout)
    unified_to_host(device_stage, host, all_pages, layout)
    pages = torch.tensor([44, 0, 20])
    a, _ = staging(layout, 3, torch.bfloat16, gen)
    b, _ = staging(layout, 3, torch.bfloat16, gen)
    pack_pages(case.pool, pages, a, layout)
    host_to_unified(host, pages, b, layout)
    assert torch.equal(as_bits(a), as_bits(b))


@settings(max_examples=150, deadline=None)
@given(case=random_case(), seed=st.integers(0, 2**32))
def test_random_geometries_follow_the_layout_and_round_trip(
    case: tuple[UnifiedPageLayout, str, str, int], seed: int
) -> None:
    """Any namespace, any layer and head sub-range, any pool form and page form."""
    layout, form, pages_form, count = case
    ns = layout.namespace
    dtype = next(d for d in DTYPES if str(d).removeprefix("torch.") == ns.dtype)
    gen = torch.Generator().manual_seed(seed)
    slots = (count + 2) * (ns.page_size + 2)
    source = device_pool(layout, dtype, slots, form, gen)
    pages = page_lists(slots, ns.page_size, count, pages_form, gen)
    table = slot_table(
        pages,
        page_size=ns.page_size,
        num_slots=slots,
        device=pages.device,
        writes_pool=True,
        check_indices=True,
    )
    stage, _ = staging(layout, count, dtype, gen)
    before = as_bits(stage).clone()
    pack_pages(source.pool, pages, stage, layout)
    assert torch.equal(
        as_bits(stage), expected_staging(before, device_values(source.pool, table), layout)
    )
    target = device_pool(layout, dtype, slots, form, gen)
    poisoned = target.snapshot()
    unpack_pages(stage, target.pool, pages, layout)
    want = _expected_pool(target, poisoned, table, source)
    assert all(torch.equal(a, b) for a, b in zip(target.snapshot(), want, strict=True))
