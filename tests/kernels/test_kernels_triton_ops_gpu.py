"""The Triton kernels compiled for a CUDA device, against the torch reference on the same device.

Marked ``gpu``; skipped cleanly without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, PoolCase, device_pool, namespace, page_lists, staging

from hicache_store.kernels import (
    HostPool,
    host_to_unified,
    pack_pages,
    unified_to_host,
    unpack_pages,
)
from hicache_store.kernels.pools import as_bits
from hicache_store.layout.host import PoolLayout, UnifiedPageLayout
from hicache_store.layout.namespace import Grid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _to_cuda(case: PoolCase) -> PoolCase:
    return PoolCase([p.cuda() for p in case.parents], case.build)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("form", ["separate", "plane_major"])
def test_triton_equals_reference_on_cuda(
    dtype: torch.dtype, kind: str, form: str, gen: torch.Generator
) -> None:
    ns = namespace(
        kind,
        dtype,
        layers=4,
        heads=8,
        dim=128 if kind == "mha" else 576,
        page_size=64,
        grid=Grid(2, 2 if kind == "mha" else 1),
    )
    layout = UnifiedPageLayout(ns, 0, 4, 2, 6) if kind == "mha" else UnifiedPageLayout.full_page(ns)
    slots = 64 * 40
    case = _to_cuda(device_pool(layout, dtype, slots, form, gen))
    pages = page_lists(slots, 64, 17, "ragged", gen).cuda()
    ref, _ = staging(layout, 17, dtype, gen)
    ref = ref.cuda()
    tri = ref.clone()
    pack_pages(case.pool, pages, ref, layout, backend="torch")
    pack_pages(case.pool, pages, tri, layout, backend="triton")
    assert torch.equal(as_bits(ref), as_bits(tri))

    target = _to_cuda(device_pool(layout, dtype, slots, form, gen))
    twin = PoolCase([p.clone() for p in target.parents], target.build)
    unpack_pages(ref, target.pool, pages, layout, backend="torch")
    unpack_pages(ref, twin.pool, pages, layout, backend="triton", layers=(0, 2))
    unpack_pages(ref, twin.pool, pages, layout, backend="triton", layers=(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(target.snapshot(), twin.snapshot(), strict=True))


@pytest.mark.parametrize("name", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_host_relayouts_on_cuda(name: str, gen: torch.Generator) -> None:
    ns = namespace("mha", torch.bfloat16, layers=4, heads=8, dim=128, page_size=64, grid=Grid(2, 4))
    layout = UnifiedPageLayout.full_page(ns)
    pl = PoolLayout(name, "mha", 4, 8, 128, 64, 12)  # type: ignore[arg-type]
    host = HostPool(
        torch.randint(-(2**15), 2**15, pl.shape, dtype=torch.int16, generator=gen)
        .view(torch.bfloat16)
        .cuda(),
        pl,
    )
    pages = (torch.randperm(12, generator=gen)[:5] * 64).cuda()
    ref = torch.empty(5, layout.page_bytes, dtype=torch.uint8, device="cuda")
    tri = torch.empty_like(ref)
    host_to_unified(host, pages, ref, layout, backend="torch")
    host_to_unified(host, pages, tri, layout, backend="triton")
    assert torch.equal(ref, tri)
    back = HostPool(torch.zeros_like(host.buffer), pl)
    unified_to_host(tri, back, pages, layout, backend="triton")
    again = torch.empty_like(ref)
    host_to_unified(back, pages, again, layout, backend="torch")
    assert torch.equal(again, ref)
