"""Launchers validate: every bad argument is a ValueError that names it; kernels trust."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kernel_cases import device_pool, namespace, staging

from hicache_store.kernels import (
    DevicePool,
    HostPool,
    host_to_unified,
    pack_pages,
    unpack_pages,
)
from hicache_store.layout.host import PoolLayout, UnifiedPageLayout

NS = namespace("mha", torch.bfloat16)
LAYOUT = UnifiedPageLayout.full_page(NS)
SLOTS = 32


@pytest.fixture
def pool(gen: torch.Generator) -> DevicePool:
    return device_pool(LAYOUT, torch.bfloat16, SLOTS, "separate", gen).pool


@pytest.fixture
def stage(gen: torch.Generator) -> torch.Tensor:
    return staging(LAYOUT, 2, torch.bfloat16, gen)[0]


# Validation happens before either implementation runs, so the Triton case needs no triton.
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(
    ("pages", "match"),
    [
        (torch.tensor([0.0, 4.0]), "pages: dtype"),
        (torch.tensor([[0, 4]]), r"pages: shape"),
        (torch.tensor([0, 30]), r"outside the pool's \[0, 32\)"),
        (torch.tensor([-4, 0]), "outside the pool"),
        (torch.tensor([0, 1, 2]), r"staging: shape"),
    ],
)
def test_bad_pages(impl, pool, stage, pages, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        pack_pages(pool, pages, stage, LAYOUT, backend=impl)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(
    "pages", [torch.tensor([4, 4]), torch.tensor([4, 6])], ids=["same", "overlap"]
)
def test_overlapping_pages_cannot_be_unpacked(impl, pool, stage, pages) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="a slot appears twice"):
        unpack_pages(stage, pool, pages, LAYOUT, backend=impl)


def test_staging_checks(pool: DevicePool, gen: torch.Generator) -> None:
    pages = torch.tensor([0, 8])
    page_bytes = LAYOUT.page_bytes
    with pytest.raises(ValueError, match="staging: rows of"):
        pack_pages(pool, pages, torch.empty(2, page_bytes - 2, dtype=torch.uint8), LAYOUT)
    with pytest.raises(ValueError, match="staging: strides"):
        pack_pages(pool, pages, torch.empty(page_bytes, 2, dtype=torch.uint8).t(), LAYOUT)
    with pytest.raises(ValueError, match="staging: dtype"):
        pack_pages(pool, pages, torch.empty(2, page_bytes // 8, dtype=torch.float64), LAYOUT)
    odd = torch.empty(2 * page_bytes + 1, dtype=torch.uint8)[1:].view(2, page_bytes)
    with pytest.raises(ValueError, match="staging: cannot view"):
        pack_pages(pool, pages, odd, LAYOUT)
    # a float32 staging buffer of the right byte size is fine (bytes are bytes)
    pack_pages(pool, pages, torch.empty(2, page_bytes // 4, dtype=torch.float32), LAYOUT)


def test_staging_may_not_alias_the_pool(gen: torch.Generator) -> None:
    case = device_pool(LAYOUT, torch.bfloat16, SLOTS, "stacked", gen)
    alias = case.parents[0].view(torch.uint8).reshape(-1)[: 2 * LAYOUT.page_bytes].view(2, -1)
    with pytest.raises(ValueError, match="shares memory with the pool"):
        pack_pages(case.pool, torch.tensor([0, 4]), alias, LAYOUT)


def test_pool_must_match_the_layout(gen: torch.Generator) -> None:
    shard = UnifiedPageLayout(NS, 0, 4, 0, 2)
    pool = device_pool(LAYOUT, torch.bfloat16, SLOTS, "separate", gen).pool
    stage = torch.empty(1, shard.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"heads 4 \(layout needs 2\)"):
        pack_pages(pool, torch.tensor([0]), stage, shard)
    f32 = device_pool(LAYOUT, torch.float32, SLOTS, "separate", gen).pool
    with pytest.raises(ValueError, match=r"itemsize 4 \(layout needs 2\)"):
        pack_pages(
            f32, torch.tensor([0]), torch.empty(1, LAYOUT.page_bytes, dtype=torch.uint8), LAYOUT
        )
    with pytest.raises(ValueError, match="layers: "):
        unpack_pages(
            torch.empty(1, LAYOUT.page_bytes, dtype=torch.uint8),
            pool,
            torch.tensor([0]),
            LAYOUT,
            layers=(3, 5),
        )


def test_device_pool_construction() -> None:
    k = [torch.zeros(8, 2, 4, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match="plane 1 layer 1: shape"):
        DevicePool.mha(k, [k[0], torch.zeros(8, 3, 4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="dim axis must be contiguous"):
        DevicePool.mha(k, [t.transpose(0, 2).contiguous().transpose(0, 2) for t in k])
    wide = torch.zeros(8, 3, 4, dtype=torch.bfloat16)[:, :2]
    with pytest.raises(ValueError, match="plane 1 layer 1: strides"):
        DevicePool.mha(k, [k[0], wide])
    with pytest.raises(ValueError, match="same, non-zero number of layers"):
        DevicePool.mha(k, k[:1])
    with pytest.raises(ValueError, match="expected \\[num_slots, heads, dim\\]"):
        DevicePool.mla([torch.zeros(8, 4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="MLA buffer has one head"):
        DevicePool.mla(k)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        DevicePool.mla([torch.zeros(8, 1, 4, dtype=torch.float64)])


def test_host_pool_construction() -> None:
    pl = PoolLayout("page_head", "mha", 2, 2, 4, 4, 3)
    HostPool(torch.zeros(pl.shape, dtype=torch.bfloat16), pl)
    with pytest.raises(ValueError, match="not the page_head shape"):
        HostPool(torch.zeros(2, 3, 4, 2, 2, 4, dtype=torch.bfloat16), pl)
    with pytest.raises(ValueError, match="contiguous page_head strides"):
        HostPool(
            torch.zeros(tuple(reversed(pl.shape)), dtype=torch.bfloat16).permute(5, 4, 3, 2, 1, 0),
            pl,
        )


def test_ops_check_the_pool_kind(pool: DevicePool, stage: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="must be a HostPool"):
        host_to_unified(pool, torch.tensor([0, 4]), stage, LAYOUT)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend: 'cuda'"):
        pack_pages(pool, torch.tensor([0, 4]), stage, LAYOUT, backend="cuda")  # type: ignore[arg-type]


def test_package_imports_and_runs_without_triton() -> None:
    """``import hicache_store.kernels`` needs neither triton nor CUDA; CPU ops use torch."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from hicache_store.kernels import DevicePool, pack_pages\n"
        "from hicache_store.kernels import ops\n"
        "from hicache_store.layout.host import UnifiedPageLayout\n"
        "from hicache_store.layout.namespace import Grid, ModelShape, Namespace\n"
        "ns = Namespace.create('m', ModelShape.mla(2, 8), 'float16', 4, Grid(1))\n"
        "layout = UnifiedPageLayout.full_page(ns)\n"
        "pool = DevicePool.mla([torch.ones(8, 1, 8, dtype=torch.float16)] * 2)\n"
        "out = torch.zeros(1, layout.page_bytes, dtype=torch.uint8)\n"
        "pack_pages(pool, torch.tensor([4]), out, layout)\n"
        "assert out.view(torch.float16).eq(1).all()\n"
        "assert ops.implementation('auto', torch.device('cuda')).__name__.endswith('reference') "
        "or ops.triton_available()\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
