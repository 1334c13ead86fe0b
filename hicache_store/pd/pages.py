"""Registered page rows: where suffix KV is staged for sending and where it lands.

Both workers move the suffix as whole pages in the unified page layout
(``layout.host.UnifiedPageLayout``, the tier's host-row format): the prefill worker packs its
device pages into ``send`` rows, the transport copies them into the decode worker's ``landing``
rows, and the decode worker unpacks them into the device pages it reserved. Packing first turns
``pages x layers x 2`` small device regions into one contiguous write per run of rows: a
transport pays per op (TCP: a round of headers, RDMA: a work request), and Mooncake over TCP
moves small ops at a fraction of its large-op rate (``BENCHMARKS.md``, P/D).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache_store.kernels.ops import Backend as KernelBackend
from hicache_store.kernels.ops import pack_pages, unpack_pages
from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.tier.host_pool import HostPagePool

from .transport import Transport


class PageRows:
    """``num_rows`` registered rows of one page each: an allocator plus the addresses.

    ``alloc`` is all-or-nothing and returns ascending rows (so a fresh pool hands out runs that
    move as one op); ``address(row)`` is what a peer writes to or this side sends from.
    """

    def __init__(self, transport: Transport, num_rows: int, page_bytes: int) -> None:
        if num_rows < 1:
            raise ValueError(f"page rows: need at least one row, got {num_rows}")
        self.pool = HostPagePool(num_rows, page_bytes)
        self.page_bytes = page_bytes
        self._transport = transport
        self.base = transport.register(self.pool.data)

    @property
    def num_rows(self) -> int:
        return self.pool.num_pages

    def alloc(self, count: int) -> list[int] | None:
        return self.pool.alloc(count)

    def free(self, rows: list[int]) -> None:
        self.pool.free(rows)

    def address(self, row: int) -> int:
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row {row} outside [0, {self.num_rows})")
        return self.base + row * self.page_bytes

    def rows(self, rows: Sequence[int]) -> torch.Tensor:
        """The rows as one ``[len(rows), page_bytes]`` uint8 tensor: a view when they are
        consecutive (the usual case), else a gathered copy (read-only use)."""
        first = rows[0]
        if list(rows) == list(range(first, first + len(rows))):
            return self.pool.data[first : first + len(rows)]
        return self.pool.data.index_select(0, torch.tensor(list(rows), dtype=torch.int64))

    def close(self) -> None:
        self._transport.unregister(self.pool.data)


def first_slots(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """The first token slot of each device page (what the pack/unpack kernels index by)."""
    return torch.tensor(list(pages), dtype=torch.int64) * page_size


def pack_into(
    device: DevicePool,
    pages: Sequence[int],
    rows: torch.Tensor,
    layout: UnifiedPageLayout,
    *,
    valid_tokens: int,
    backend: KernelBackend = "auto",
) -> None:
    """Pack device ``pages`` into ``rows`` (one row each). The last page holds only
    ``valid_tokens`` tokens of the request: its other token rows are zeroed, so bytes of
    whatever else the sender's page held never leave the process."""
    page_size = layout.namespace.page_size
    pack_pages(device, first_slots(pages, page_size), rows, layout, backend=backend)
    if valid_tokens < page_size:
        last = rows[len(pages) - 1]
        for block in layout.blocks:
            layers, planes, tokens = layout.block_shape(block)[:3]
            view = last[block.offset : block.offset + block.nbytes].view(layers, planes, tokens, -1)
            view[:, :, valid_tokens:] = 0


def unpack_from(
    rows: torch.Tensor,
    device: DevicePool,
    pages: Sequence[int],
    layout: UnifiedPageLayout,
    *,
    backend: KernelBackend = "auto",
) -> None:
    """Unpack ``rows`` (one per page) into device ``pages``."""
    unpack_pages(rows, device, first_slots(pages, layout.namespace.page_size), layout, backend=backend)
