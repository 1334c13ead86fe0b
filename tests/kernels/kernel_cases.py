"""Shared builders and oracles for the kernel tests.

The oracles compute expected bytes straight from the layout layer's ``element_offsets``
(unified pages and SGLang host pools), element by element, independently of the views and
index tables the kernels build, so a test that compares against them checks the kernels against
the single source of truth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from hicache_store.kernels import DevicePool, HostPool
from hicache_store.kernels.pools import as_bits
from hicache_store.layout.host import PoolLayout, UnifiedPageLayout
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Topology, shards

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
    torch.int8,
]
DTYPE_NAME = {d: str(d).removeprefix("torch.") for d in DTYPES}
POOL_FORMS = ("stacked", "plane_major", "separate", "strided")


def namespace(
    kind: str,
    dtype: torch.dtype,
    *,
    layers: int = 4,
    heads: int = 4,
    dim: int = 8,
    page_size: int = 4,
    grid: Grid | None = None,
) -> Namespace:
    shape = ModelShape.mha(layers, heads, dim) if kind == "mha" else ModelShape.mla(layers, dim)
    return Namespace.create(
        "kernels-test",
        shape,
        DTYPE_NAME[dtype],
        page_size,
        grid or Grid(2, 2 if kind == "mha" else 1),
    )


def shard_layouts(ns: Namespace, topologies: list[str]) -> list[UnifiedPageLayout]:
    """The unified layout of every distinct shard of every topology."""
    seen: dict[tuple[int, int, int, int], UnifiedPageLayout] = {}
    for text in topologies:
        for shard in shards(ns, Topology.parse(text)):
            layout = UnifiedPageLayout.for_shard(ns, shard)
            seen.setdefault(
                (layout.layer_start, layout.layer_stop, layout.head_start, layout.head_stop), layout
            )
    return list(seen.values())


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs and float8 specials included), never all zeros."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * item), dtype=torch.uint8, generator=gen)
    raw[..., 0] |= 1  # never zero, so an unwritten (zeroed) element can never pass for data
    return raw.view(dtype)


@dataclass
class PoolCase:
    """A device pool built over ``parents`` (the allocations), rebuildable over clones."""

    parents: list[torch.Tensor]
    build: Callable[[list[torch.Tensor]], DevicePool]

    @property
    def pool(self) -> DevicePool:
        return self.build(self.parents)

    def snapshot(self) -> list[torch.Tensor]:
        return [as_bits(p).clone() for p in self.parents]


def device_pool(
    layout: UnifiedPageLayout, dtype: torch.dtype, num_slots: int, form: str, gen: torch.Generator
) -> PoolCase:
    ns = layout.namespace
    L, planes, H, D = layout.num_layers, ns.kv_planes, layout.num_heads, ns.head_dim

    def make(parts: list[list[torch.Tensor]]) -> DevicePool:
        return DevicePool.mha(parts[0], parts[1]) if planes == 2 else DevicePool.mla(parts[0])

    if form == "stacked":
        parents = [random_bytes((L, planes, num_slots, H, D), dtype, gen)]
        return PoolCase(
            parents, lambda ps: make([[ps[0][l, p] for l in range(L)] for p in range(planes)])
        )
    if form == "plane_major":  # SGLang-style [2, L, slots, H, D]
        parents = [random_bytes((planes, L, num_slots, H, D), dtype, gen)]
        return PoolCase(
            parents, lambda ps: make([[ps[0][p, l] for l in range(L)] for p in range(planes)])
        )
    if form == "separate":
        parents = [random_bytes((num_slots, H, D), dtype, gen) for _ in range(planes * L)]
        return PoolCase(
            parents, lambda ps: make([[ps[p * L + l] for l in range(L)] for p in range(planes)])
        )
    assert form == "strided"  # head subset of wider separate buffers: non-contiguous slots
    parents = [random_bytes((num_slots, H + 2, D), dtype, gen) for _ in range(planes * L)]
    return PoolCase(
        parents,
        lambda ps: make([[ps[p * L + l][:, 1 : 1 + H] for l in range(L)] for p in range(planes)]),
    )


def host_pool(
    ns: Namespace,
    layout: UnifiedPageLayout,
    name: str,
    dtype: torch.dtype,
    num_pages: int,
    gen: torch.Generator,
) -> HostPool:
    pl = PoolLayout(
        name,
        ns.kv_kind,
        layout.num_layers,
        layout.num_heads,
        ns.head_dim,  # type: ignore[arg-type]
        ns.page_size,
        num_pages,
    )
    return HostPool(random_bytes(pl.shape, dtype, gen).contiguous(), pl)


def unified_offsets(layout: UnifiedPageLayout) -> np.ndarray:
    """``[L, planes, P, H, D]`` element offsets of every local coordinate, from the layout layer."""
    ns = layout.namespace
    l, p, t, h, d = np.meshgrid(
        np.arange(layout.layer_start, layout.layer_stop),
        np.arange(ns.kv_planes),
        np.arange(ns.page_size),
        np.arange(layout.head_start, layout.head_stop),
        np.arange(ns.head_dim),
        indexing="ij",
    )
    return layout.element_offsets(l, p, t, h, d)


def device_values(pool: DevicePool, table: torch.Tensor) -> list[list[torch.Tensor]]:
    """``values[l][p][i]`` = the ``[P, H, D]`` bits of page ``i`` of buffer (l, p)."""
    return [
        [as_bits(pool.planes[p][l])[table] for p in range(len(pool.planes))]
        for l in range(pool.num_layers)
    ]


def host_values(host: HostPool, table: torch.Tensor) -> list[list[torch.Tensor]]:
    """Same as ``device_values`` for a host pool, addressed by ``PoolLayout.element_offsets``."""
    pl = host.layout
    flat = as_bits(host.buffer).reshape(-1)
    planes = 2 if pl.kv_kind == "mha" else 1
    out = []
    for l in range(pl.num_layers):
        row = []
        for p in range(planes):
            slot, h, d = np.meshgrid(
                table.numpy().reshape(-1),
                np.arange(pl.num_heads),
                np.arange(pl.head_dim),
                indexing="ij",
            )
            offs = torch.from_numpy(pl.element_offsets(p, slot, l, h, d))
            row.append(flat[offs].reshape(*table.shape, pl.num_heads, pl.head_dim))
        out.append(row)
    return out


def expected_staging(
    initial: torch.Tensor,
    values: list[list[torch.Tensor]],
    layout: UnifiedPageLayout,
    layers: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``initial`` (staging bits) with the selected layers of every page written per the oracle."""
    offs = torch.from_numpy(unified_offsets(layout))
    out = initial.clone()
    lo, hi = layers or (layout.layer_start, layout.layer_stop)
    for i in range(out.shape[0]):
        for l in range(lo - layout.layer_start, hi - layout.layer_start):
            for p in range(len(values[0])):
                out[i][offs[l, p].reshape(-1)] = values[l][p][i].reshape(-1)
    return out


def staging_values(stage_bits: torch.Tensor, layout: UnifiedPageLayout) -> list[list[torch.Tensor]]:
    """Inverse of ``expected_staging``: ``values[l][p][i]`` read from unified rows."""
    offs = torch.from_numpy(unified_offsets(layout))
    ns = layout.namespace
    return [
        [
            stage_bits[:, offs[l, p].reshape(-1)].reshape(
                -1, ns.page_size, layout.num_heads, ns.head_dim
            )
            for p in range(ns.kv_planes)
        ]
        for l in range(layout.num_layers)
    ]


def staging(
    layout: UnifiedPageLayout,
    num_pages: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    *,
    pitch: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a poisoned staging buffer, its whole allocation); ``pitch`` extra bytes per row."""
    whole = random_bytes((num_pages, layout.page_bytes + pitch), torch.uint8, gen)
    rows = whole[:, : layout.page_bytes]
    return (rows.view(dtype) if dtype.itemsize == layout.namespace.itemsize else rows), whole


def page_lists(
    num_slots: int, page_size: int, count: int, form: str, gen: torch.Generator
) -> torch.Tensor:
    """Non-overlapping, shuffled pages in one of four forms.

    ``aligned``: first slots on the page grid; ``residue``: first slots all offset by the same
    residue; ``ragged``: first slots at arbitrary, non-overlapping positions; ``table``: a
    slot table of scattered, distinct slots.
    """
    if form == "table":
        return torch.randperm(num_slots, generator=gen)[: count * page_size].reshape(
            count, page_size
        )
    if form == "ragged":
        # cut the slot line into `count` runs of page_size plus random gaps
        gaps = torch.randint(0, 3, (count,), generator=gen)
        starts = torch.cumsum(gaps + page_size, 0) - page_size
        assert int(starts[-1]) + page_size <= num_slots
        return starts[torch.randperm(count, generator=gen)]
    residue = 0 if form == "aligned" else 1
    pages = torch.randperm((num_slots - residue) // page_size, generator=gen)[:count]
    return pages * page_size + residue


@st.composite
def random_case(draw: st.DrawFn) -> tuple[UnifiedPageLayout, str, str, int]:
    """A random unified layout (any namespace, layer and head sub-range), pool form, page form
    and page count: the space the kernels must cover."""
    kind = draw(st.sampled_from(["mha", "mla"]))
    layers = draw(st.integers(1, 5))
    heads = draw(st.sampled_from([1, 2, 4, 6])) if kind == "mha" else 1
    hpg = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    dtype = draw(st.sampled_from(DTYPES))
    ns = namespace(
        kind,
        dtype,
        layers=layers,
        heads=heads,
        dim=draw(st.sampled_from([1, 3, 8])),
        page_size=draw(st.sampled_from([1, 2, 3, 4])),
        grid=Grid(draw(st.integers(1, layers)), hpg),
    )
    l0 = draw(st.integers(0, layers - 1))
    l1 = draw(st.integers(l0 + 1, layers))
    h0 = draw(st.integers(0, ns.num_kv_heads - 1))
    h1 = draw(st.integers(h0 + 1, ns.num_kv_heads))
    layout = UnifiedPageLayout(ns, l0, l1, h0, h1)
    return (
        layout,
        draw(st.sampled_from(POOL_FORMS)),
        draw(st.sampled_from(["aligned", "residue", "ragged", "table"])),
        draw(st.integers(1, 5)),
    )
