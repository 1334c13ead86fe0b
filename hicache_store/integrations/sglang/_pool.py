"""What the SGLang adapter reads from an SGLang host pool, in one place.

The adapter touches an SGLang host KV pool (``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost`` in ``sglang.srt.mem_cache.pool_host``) only through the attributes
listed in ``HOST_POOL_ATTRIBUTES``; nothing else of SGLang's pool API is used (no pointer
tables, no ``get_page_buffer_meta``, no transfer kernels). A test checks these names against
SGLang's own class source, so an object with exactly these attributes is a faithful stand-in
where SGLang's pool cannot be constructed (on CPU its module imports torchvision).

From those attributes ``describe_host_pool`` builds the kernels' ``HostPool``: the whole pool
tensor plus the layout layer's ``PoolLayout`` (which validates shape and strides), and the
pool's KV geometry for the namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from hicache_store.kernels._pages import slot_table
from hicache_store.kernels.pools import HostPool
from hicache_store.layout.dtypes import normalize_dtype
from hicache_store.layout.host import POOL_LAYOUTS, PoolLayout, PoolLayoutName, UnifiedPageLayout
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.plans import WritePlan
from hicache_store.layout.topology import Topology
from hicache_store.objects import L3Link

#: attributes the adapter reads, per KV kind (MLA pools are recognised by ``kv_cache_dim``).
HOST_POOL_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "mha": ("layout", "page_size", "dtype", "kv_buffer", "layer_num", "head_num", "head_dim"),
    "mla": ("layout", "page_size", "dtype", "kv_buffer", "layer_num", "kv_cache_dim"),
}
#: read when present (PP stages): the first global layer the pool holds.
OPTIONAL_ATTRIBUTES: tuple[str, ...] = ("start_layer",)

#: torch dtypes whose bytes name a KV dtype without help; uint8 pools (SGLang's fp8 storage)
#: need ``kv_dtype`` in the extra-config.
_TORCH_KV_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


@dataclass(frozen=True)
class PoolGeometry:
    """The KV geometry of one rank's host pool (local layers and heads)."""

    kv_kind: Literal["mha", "mla"]
    layout: PoolLayoutName
    num_layers: int
    num_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    torch_dtype: torch.dtype
    start_layer: int | None

    def kv_dtype(self, override: str | None) -> str:
        """The logical KV dtype name: ``override`` when given, else from the pool's dtype.

        An override that contradicts a pool whose dtype names its KV (a bfloat16 pool said to
        hold float16) raises ``ValueError``: the two have the same element size, so nothing
        else would catch it, and the bytes would be read and written as the other dtype's.
        """
        name = _TORCH_KV_DTYPES.get(self.torch_dtype)
        if override is not None:
            if name is not None and normalize_dtype(override) != name:
                raise ValueError(
                    f'"kv_dtype" {override!r} contradicts the host pool, which holds {name} '
                    "KV; remove it (it is only needed for float8 KV kept in uint8 buffers)"
                )
            return override
        if name is None:
            raise ValueError(
                f"host pool dtype {self.torch_dtype} does not name a KV dtype (SGLang keeps "
                "float8 KV in uint8 buffers); set \"kv_dtype\" in the extra-config, e.g. "
                '"float8_e4m3fn"'
            )
        return name

    def pool_layout(self, num_pages: int | None = None) -> PoolLayout:
        return PoolLayout(
            self.layout,
            self.kv_kind,
            self.num_layers,
            self.num_heads,
            self.head_dim,
            self.page_size,
            self.num_pages if num_pages is None else num_pages,
        )


def _require(pool: Any, name: str) -> Any:
    if not hasattr(pool, name):
        raise ValueError(
            f"host pool {type(pool).__name__} has no attribute {name!r}; the hicache-store "
            f"adapter needs {HOST_POOL_ATTRIBUTES}"
        )
    return getattr(pool, name)


def describe_host_pool(pool: Any) -> tuple[PoolGeometry, HostPool]:
    """The geometry of an SGLang host pool and the kernels' view of its ``kv_buffer``.

    Raises ``ValueError`` naming what does not fit: a layout the kernels do not move
    (``page_unified``, ``page_first_kv_split``, ...), a buffer whose shape is not the layout's.
    """
    kind: Literal["mha", "mla"] = "mla" if hasattr(pool, "kv_cache_dim") else "mha"
    values = {name: _require(pool, name) for name in HOST_POOL_ATTRIBUTES[kind]}
    layout = values["layout"]
    if layout not in POOL_LAYOUTS:
        raise ValueError(
            f"host pool layout {layout!r} is not supported by the hicache-store adapter; "
            f"use --hicache-mem-layout one of {', '.join(POOL_LAYOUTS)}"
        )
    buffer = values["kv_buffer"]
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"host pool kv_buffer is a {type(buffer).__name__}, not a tensor")
    page_size = int(values["page_size"])
    layers = int(values["layer_num"])
    heads = int(values["head_num"]) if kind == "mha" else 1
    dim = int(values["head_dim"]) if kind == "mha" else int(values["kv_cache_dim"])
    # The page count comes from the buffer itself: the slot axis of layer_first/page_first,
    # the page axis of the paged layouts.
    slot_axis = {"layer_first": 1, "page_first": 0, "page_first_direct": 0, "page_head": 0}
    axis = slot_axis[layout] + (1 if kind == "mha" else 0)
    extent = int(buffer.shape[axis]) if buffer.dim() > axis else 0
    pages = extent // page_size if layout in ("layer_first", "page_first") else extent
    start = getattr(pool, "start_layer", None)
    geometry = PoolGeometry(
        kv_kind=kind,
        layout=layout,
        num_layers=layers,
        num_heads=heads,
        head_dim=dim,
        page_size=page_size,
        num_pages=max(pages, 1),
        torch_dtype=buffer.dtype,
        start_layer=int(start) if isinstance(start, int) else None,
    )
    return geometry, HostPool(buffer, geometry.pool_layout())


def host_slots(
    host_indices: Any, pages: int, page_size: int, num_slots: int, *, writes_pool: bool
) -> torch.Tensor:
    """The ``[pages, page_size]`` host slots of one SGLang transfer, checked before any I/O.

    ``host_indices`` must be a tensor of one integer slot per token of each page, every slot
    inside ``[0, num_slots)`` (a negative one would index from the end of SGLang's pool) and,
    when the transfer writes the pool (a read from L3), no slot twice: two pages read into one
    slot would both be reported loaded while it holds only one of them. A backup may read a
    slot twice. ``ValueError`` naming the problem otherwise (the kernels' ``slot_table`` check).
    """
    if not isinstance(host_indices, torch.Tensor):
        raise ValueError(f"host_indices: a {type(host_indices).__name__}, not a tensor")
    flat = host_indices.reshape(-1)
    if flat.numel() != pages * page_size:
        raise ValueError(f"{pages} keys need {pages * page_size} host indices, got {flat.numel()}")
    if flat.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"host_indices: dtype {flat.dtype}, not an integer slot index")
    cpu = torch.device("cpu")  # SGLang's host pools live in host memory
    return slot_table(
        flat.to(device=cpu, dtype=torch.int64).view(pages, page_size),
        page_size=page_size,
        num_slots=num_slots,
        device=cpu,
        writes_pool=writes_pool,
        check_indices=True,
    )


def page_view(geometry: PoolGeometry, flat: torch.Tensor) -> HostPool:
    """A one-page ``HostPool`` over a flat page of SGLang's generic path.

    SGLang's ``get_data_page(index, flat=True)`` is the page's slice of the pool tensor,
    flattened, so it is exactly a one-page pool of the same layout, and
    ``set_from_flat_data_page`` reads the same order back.
    """
    layout = geometry.pool_layout(num_pages=1)
    if flat.numel() != layout.numel:
        raise ValueError(f"flat page of {flat.numel()} elements, a page has {layout.numel}")
    return HostPool(flat.contiguous().view(layout.shape), layout)


@dataclass
class Registered:
    """A registered pool: everything derived from it at registration (the KV pool at
    ``register_mem_pool_host``; a KV-shaped sidecar pool, SWA, at ``register_mem_host_pool_v2``)."""

    geometry: PoolGeometry
    host: HostPool
    namespace: Namespace
    topology: Topology
    rank: int
    layout: UnifiedPageLayout
    link: L3Link
    fused_write: bool  # one object per page, framed in place

    @classmethod
    def build(
        cls, geometry: PoolGeometry, host: HostPool, topology: Topology, rank: int, link: L3Link
    ) -> Registered:
        """The registration of ``host`` moved through ``link`` (this rank's plans of its
        namespace); ``ValueError`` when the pool's pages are not the plans' page."""
        layout = link.read_plan.page
        host.check_against(layout)
        return cls(
            geometry=geometry,
            host=host,
            namespace=link.namespace,
            topology=topology,
            rank=rank,
            layout=layout,
            link=link,
            fused_write=single_object(link.write_plan, layout),
        )


def single_object(plan: WritePlan | None, layout: UnifiedPageLayout) -> bool:
    """Whether the rank writes each page as one object holding the whole unified page."""
    return (
        plan is not None
        and len(plan.objects) == 1
        and plan.objects[0].page_offset == 0
        and plan.objects[0].nbytes == layout.page_bytes
    )
