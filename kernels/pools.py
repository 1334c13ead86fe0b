"""The KV pools the kernels move pages between, described as tensors plus validated geometry.

Two kinds of pool hold KV by token slot:

* ``DevicePool``: an engine's device pool, one buffer per (plane, local layer). MHA:
  ``k[l]`` and ``v[l]`` of shape ``[num_slots, local_kv_heads, head_dim]``; MLA: ``kv[l]`` of
  shape ``[num_slots, 1, kv_dim]``. The buffers may be separate allocations (SGLang allocates one
  per layer) or views of one tensor; only the innermost axis must be contiguous.
* ``HostPool``: one of SGLang's host pools (``layer_first``, ``page_first``,
  ``page_first_direct``, ``page_head``), a single contiguous tensor whose shape is given by the
  layout layer's ``PoolLayout``. Its per-axis strides are *derived* from
  ``PoolLayout.element_offsets`` (the single source of truth), never restated here.

Both expose the same view of their contents to the kernels: for each (local layer, plane) a
buffer addressed by ``(slot, head, dim)``; the host pool additionally is page structured, so its
slots are ``(page, token)`` pairs. Construction validates everything that does not depend on the
pages being moved (shapes, strides, dtypes, devices); ``check_against`` validates the pool
against a unified page layout.

Dtypes: the kernels move bytes, so any dtype of 1, 2 or 4 bytes from ``SUPPORTED_DTYPES`` is
accepted, and the pool's dtype only has to match the namespace's *item size*: SGLang stores
float8 KV in ``uint8`` buffers, and those bytes are exactly the namespace's float8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from hicache_store.layout.host import PoolLayout, UnifiedPageLayout

#: dtypes a pool or staging buffer may have; all are moved as raw bytes.
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint8,
        torch.int8,
    }
)
#: the integer dtype used to move elements of each item size bit-exactly.
_INT_OF_SIZE: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as the integer dtype of the same item size.

    Index ops on integer views copy bit patterns, so float8 values and NaN payloads survive
    exactly, and ops missing for float8 on some devices are never needed.
    """
    return tensor.view(_INT_OF_SIZE[tensor.element_size()])


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        known = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
        raise ValueError(f"{name}: dtype {tensor.dtype} is not supported; expected one of {known}")


@dataclass(frozen=True, eq=False)
class DevicePool:
    """Per-(plane, layer) KV buffers of one rank: ``planes[p][l]`` is ``[num_slots, H, D]``.

    Build with ``DevicePool.mha(k_buffers, v_buffers)`` or ``DevicePool.mla(kv_buffers)``. Local
    layer ``l`` holds global layer ``layout.layer_start + l`` of the unified layout it is used
    with, and local head ``h`` holds global head ``layout.head_start + h``.
    """

    kv_kind: str
    planes: tuple[tuple[torch.Tensor, ...], ...]

    @classmethod
    def mha(cls, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> DevicePool:
        return cls("mha", (tuple(k), tuple(v)))

    @classmethod
    def mla(cls, kv: Sequence[torch.Tensor]) -> DevicePool:
        return cls("mla", (tuple(kv),))

    def __post_init__(self) -> None:
        expected_planes = {"mha": 2, "mla": 1}.get(self.kv_kind)
        if expected_planes is None or len(self.planes) != expected_planes:
            raise ValueError(
                f"device pool: kv_kind {self.kv_kind!r} needs "
                f"{expected_planes or '1 (mla) or 2 (mha)'} planes, got {len(self.planes)}"
            )
        first = self.planes[0][0] if self.planes[0] else None
        if first is None or any(len(p) != len(self.planes[0]) for p in self.planes):
            raise ValueError("device pool: every plane needs the same, non-zero number of layers")
        check_dtype("device pool", first)
        for p, buffers in enumerate(self.planes):
            for layer, buf in enumerate(buffers):
                where = f"device pool plane {p} layer {layer}"
                if buf.dim() != 3:
                    raise ValueError(f"{where}: expected [num_slots, heads, dim], got {buf.shape}")
                if (buf.shape, buf.dtype, buf.device) != (first.shape, first.dtype, first.device):
                    raise ValueError(
                        f"{where}: shape {tuple(buf.shape)} dtype {buf.dtype} device "
                        f"{buf.device} differs from layer 0's {tuple(first.shape)} "
                        f"{first.dtype} {first.device}"
                    )
                if buf.stride(2) != 1:
                    raise ValueError(
                        f"{where}: the dim axis must be contiguous, strides {buf.stride()}"
                    )
                if buf.stride() != first.stride():
                    # one (slot, head) stride pair addresses every buffer in the kernels
                    raise ValueError(
                        f"{where}: strides {tuple(buf.stride())} differ from layer 0's "
                        f"{tuple(first.stride())}"
                    )
        if self.kv_kind == "mla" and first.shape[1] != 1:
            raise ValueError(
                f"device pool: an MLA buffer has one head, got shape {tuple(first.shape)}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.planes[0])

    @property
    def num_slots(self) -> int:
        return int(self.planes[0][0].shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.planes[0][0].shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.planes[0][0].shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.planes[0][0].dtype

    @property
    def device(self) -> torch.device:
        return self.planes[0][0].device

    def check_against(self, layout: UnifiedPageLayout) -> None:
        """Raise ``ValueError`` unless this pool holds exactly ``layout``'s layers and heads."""
        _check_geometry(
            "device pool",
            layout,
            kv_kind=self.kv_kind,
            layers=self.num_layers,
            heads=self.num_heads,
            head_dim=self.head_dim,
            itemsize=self.planes[0][0].element_size(),
        )

    @cached_property
    def stacked(self) -> torch.Tensor | None:
        """All buffers as one ``[layers, planes, slots, H, D]`` view, when that is possible.

        Possible when every buffer is a view of one storage with the same strides and the
        buffers' starts form a lattice ``base + l * s_layer + p * s_plane`` with non-negative
        steps (one tensor sliced per layer, or SGLang-style ``[2, L, ...]`` buffers). Then a
        whole pack or unpack is a single index op. Separate allocations return ``None``: no
        single torch call can address several storages, so the reference loops over them.
        """
        first = self.planes[0][0]
        storage = first.untyped_storage().data_ptr()
        item = first.element_size()
        for buffers in self.planes:
            for buf in buffers:
                if buf.untyped_storage().data_ptr() != storage or buf.stride() != first.stride():
                    return None

        def step(a: torch.Tensor, b: torch.Tensor) -> int | None:
            delta = b.data_ptr() - a.data_ptr()
            return delta // item if delta % item == 0 and delta >= 0 else None

        s_layer = step(first, self.planes[0][1]) if self.num_layers > 1 else 0
        s_plane = step(first, self.planes[1][0]) if len(self.planes) > 1 else 0
        if s_layer is None or s_plane is None:
            return None
        for p, buffers in enumerate(self.planes):
            for layer, buf in enumerate(buffers):
                if buf.data_ptr() != first.data_ptr() + (layer * s_layer + p * s_plane) * item:
                    return None
        shape = (self.num_layers, len(self.planes), *first.shape)
        strides = (s_layer, s_plane, *first.stride())
        try:
            return first.as_strided(shape, strides, first.storage_offset())
        except RuntimeError:
            return None


@dataclass(frozen=True, eq=False)
class HostPool:
    """An SGLang host pool: ``buffer`` is the whole contiguous pool tensor of ``layout.shape``."""

    buffer: torch.Tensor
    layout: PoolLayout

    def __post_init__(self) -> None:
        check_dtype("host pool", self.buffer)
        if tuple(self.buffer.shape) != self.layout.shape:
            raise ValueError(
                f"host pool: buffer shape {tuple(self.buffer.shape)} is not the "
                f"{self.layout.name} shape {self.layout.shape}"
            )
        if tuple(self.buffer.stride()) != self.layout.strides:
            raise ValueError(
                f"host pool: buffer strides {tuple(self.buffer.stride())} are not the "
                f"contiguous {self.layout.name} strides {self.layout.strides}"
            )

    @property
    def kv_kind(self) -> str:
        return self.layout.kv_kind

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def check_against(self, layout: UnifiedPageLayout) -> None:
        """Raise ``ValueError`` unless this pool holds exactly ``layout``'s layers and heads."""
        if self.layout.page_size != layout.namespace.page_size:
            raise ValueError(
                f"host pool: page_size {self.layout.page_size} != namespace page_size "
                f"{layout.namespace.page_size}"
            )
        _check_geometry(
            "host pool",
            layout,
            kv_kind=self.layout.kv_kind,
            layers=self.layout.num_layers,
            heads=self.layout.num_heads,
            head_dim=self.layout.head_dim,
            itemsize=self.buffer.element_size(),
        )

    @cached_property
    def axis_strides(self) -> tuple[int, int, int, int, int, int]:
        """Element strides of (layer, plane, page, token, head, dim), from the layout layer.

        Each stride is the difference of two ``PoolLayout.element_offsets`` one step apart on
        that axis, so the view below is correct for every layout the layout layer defines
        (they are all affine in these six coordinates). An axis of size 1 gets stride 0.
        """
        pl = self.layout
        planes = 2 if pl.kv_kind == "mha" else 1

        def offset(
            plane: int = 0, slot: int = 0, layer: int = 0, head: int = 0, dim: int = 0
        ) -> int:
            return int(pl.element_offsets(plane, slot, layer, head, dim))

        def diff(size: int, **step: int) -> int:
            return offset(**step) - offset() if size > 1 else 0

        return (
            diff(pl.num_layers, layer=1),
            diff(planes, plane=1),
            diff(pl.num_pages, slot=pl.page_size),
            diff(pl.page_size, slot=1),
            diff(pl.num_heads, head=1),
            diff(pl.head_dim, dim=1),
        )

    @property
    def paged(self) -> torch.Tensor:
        """The pool as a ``[layers, planes, pages, page_size, H, D]`` strided view."""
        pl = self.layout
        planes = 2 if pl.kv_kind == "mha" else 1
        shape = (pl.num_layers, planes, pl.num_pages, pl.page_size, pl.num_heads, pl.head_dim)
        return self.buffer.as_strided(shape, self.axis_strides, self.buffer.storage_offset())


def _check_geometry(
    what: str,
    layout: UnifiedPageLayout,
    *,
    kv_kind: str,
    layers: int,
    heads: int,
    head_dim: int,
    itemsize: int,
) -> None:
    ns = layout.namespace
    expected = {
        "kv_kind": (kv_kind, ns.kv_kind),
        "layers": (layers, layout.num_layers),
        "heads": (heads, layout.num_heads),
        "head_dim": (head_dim, ns.head_dim),
        "itemsize": (itemsize, ns.itemsize),
    }
    wrong = [
        f"{k} {got} (layout needs {want})" for k, (got, want) in expected.items() if got != want
    ]
    if wrong:
        raise ValueError(
            f"{what} does not match the unified layout of layers [{layout.layer_start}, "
            f"{layout.layer_stop}) heads [{layout.head_start}, {layout.head_stop}) of "
            f"{ns.model}/{ns.dtype}: " + "; ".join(wrong)
        )
