"""The Triton kernels against the torch reference, byte for byte.

Without a GPU the kernels run on CPU tensors through Triton's interpreter (``conftest`` sets
``TRITON_INTERPRET=1`` before the kernel module is imported); it is about 1000x slower than
torch, so the shapes are tiny. Both implementations start from identical poisoned destinations,
so an element the kernel fails to write, or writes where it should not, makes them differ.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    DTYPES,
    POOL_FORMS,
    PoolCase,
    device_pool,
    host_pool,
    namespace,
    page_lists,
    random_case,
    staging,
)

from hicache_store.kernels import host_to_unified, pack_pages, unified_to_host, unpack_pages
from hicache_store.kernels.pools import as_bits
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Grid


def _interpreted() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from hicache_store.kernels import _triton_kernel

    return _triton_kernel.INTERPRETED


pytestmark = pytest.mark.skipif(
    not _interpreted(), reason="needs triton running in interpreter mode (TRITON_INTERPRET=1)"
)
SLOTS = 40


def _clone_case(case: PoolCase) -> PoolCase:
    return PoolCase([p.clone() for p in case.parents], case.build)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _check_pack_unpack(
    layout: UnifiedPageLayout,
    dtype: torch.dtype,
    form: str,
    pages: torch.Tensor,
    gen: torch.Generator,
    layers: tuple[int, int] | None = None,
    slots: int = SLOTS,
) -> None:
    n = pages.shape[0]
    case = device_pool(layout, dtype, slots, form, gen)
    source = case.snapshot()
    ref_stage, _ = staging(layout, n, dtype, gen)
    tri_stage = ref_stage.clone()
    pack_pages(case.pool, pages, ref_stage, layout, layers=layers, backend="torch")
    pack_pages(case.pool, pages, tri_stage, layout, layers=layers, backend="triton")
    assert torch.equal(as_bits(tri_stage), as_bits(ref_stage))
    assert _same(case.snapshot(), source)

    # unpack the packed rows into two identical poisoned pools
    ref_pool = device_pool(layout, dtype, slots, form, gen)
    tri_pool = _clone_case(ref_pool)
    stage_before = as_bits(ref_stage).clone()
    unpack_pages(ref_stage, ref_pool.pool, pages, layout, layers=layers, backend="torch")
    unpack_pages(ref_stage, tri_pool.pool, pages, layout, layers=layers, backend="triton")
    assert _same(tri_pool.snapshot(), ref_pool.snapshot())
    assert torch.equal(as_bits(ref_stage), stage_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_every_dtype(dtype: torch.dtype, kind: str, gen: torch.Generator) -> None:
    ns = namespace(kind, dtype, layers=2, dim=6 if kind == "mha" else 12)  # non-power-of-two dims
    layout = UnifiedPageLayout.full_page(ns)
    _check_pack_unpack(
        layout, dtype, "separate", page_lists(SLOTS, ns.page_size, 3, "aligned", gen), gen
    )


SHARDS = [
    ("tp-shard", (0, 3, 2, 4), Grid(2, 2)),
    ("pp-stage", (1, 3, 0, 4), Grid(2, 2)),
    ("cut-group", (0, 3, 1, 4), Grid(2, 2)),
    ("hpg1-full", (0, 3, 0, 4), Grid(3, 1)),
]


@pytest.mark.parametrize(("name", "coords", "grid"), SHARDS, ids=[c[0] for c in SHARDS])
@pytest.mark.parametrize("form", POOL_FORMS)
@pytest.mark.parametrize("pages_form", ["aligned", "residue", "ragged", "table"])
def test_shards_pool_forms_and_page_forms(
    name: str,
    coords: tuple[int, int, int, int],
    grid: Grid,
    form: str,
    pages_form: str,
    gen: torch.Generator,
) -> None:
    ns = namespace("mha", torch.bfloat16, layers=3, dim=4, grid=grid)
    layout = UnifiedPageLayout(ns, *coords)
    pages = page_lists(SLOTS, ns.page_size, 5, pages_form, gen)
    _check_pack_unpack(layout, torch.bfloat16, form, pages, gen)


def test_layer_range(gen: torch.Generator) -> None:
    ns = namespace("mha", torch.float16, layers=3, dim=4)
    layout = UnifiedPageLayout.full_page(ns)
    pages = page_lists(SLOTS, ns.page_size, 3, "aligned", gen)
    _check_pack_unpack(layout, torch.float16, "separate", pages, gen, layers=(1, 2))


HOST = [("mha", n) for n in ("layer_first", "page_first", "page_first_direct", "page_head")]
HOST += [("mla", n) for n in ("layer_first", "page_first", "page_first_direct")]


@pytest.mark.parametrize(("kind", "name"), HOST, ids=[f"{k}-{n}" for k, n in HOST])
def test_host_relayouts(kind: str, name: str, gen: torch.Generator) -> None:
    ns = namespace(kind, torch.bfloat16, layers=2, dim=4 if kind == "mha" else 6)
    layout = UnifiedPageLayout(ns, 0, 2, 0, 2) if kind == "mha" else UnifiedPageLayout.full_page(ns)
    host = host_pool(ns, layout, name, torch.bfloat16, 6, gen)
    source = host.buffer.clone()
    pages = page_lists(host.num_slots, ns.page_size, 3, "aligned", gen)
    ref, _ = staging(layout, 3, torch.bfloat16, gen)
    tri = ref.clone()
    host_to_unified(host, pages, ref, layout, backend="torch")
    host_to_unified(host, pages, tri, layout, backend="triton")
    assert torch.equal(as_bits(tri), as_bits(ref))
    assert torch.equal(as_bits(host.buffer), as_bits(source))

    ref_host = host_pool(ns, layout, name, torch.bfloat16, 6, gen)
    tri_host = type(ref_host)(ref_host.buffer.clone(), ref_host.layout)
    unified_to_host(ref, ref_host, pages, layout, backend="torch")
    unified_to_host(ref, tri_host, pages, layout, backend="triton")
    assert torch.equal(as_bits(tri_host.buffer), as_bits(ref_host.buffer))


@settings(max_examples=60, deadline=None)
@given(case=random_case(), seed=st.integers(0, 2**32))
def test_random_geometries(case: tuple[UnifiedPageLayout, str, str, int], seed: int) -> None:
    """Odd page sizes and head dims (masked tiles), sub-ranges, every pool and page form."""
    layout, form, pages_form, count = case
    ns = layout.namespace
    dtype = next(d for d in DTYPES if str(d).removeprefix("torch.") == ns.dtype)
    gen = torch.Generator().manual_seed(seed)
    slots = (count + 2) * (ns.page_size + 2)
    pages = page_lists(slots, ns.page_size, count, pages_form, gen)
    _check_pack_unpack(layout, dtype, form, pages, gen, slots=slots)
