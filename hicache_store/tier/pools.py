"""A component's pools on one rank, and the L1 <-> L2 copies between them.

Every component the tier keeps (full-attention KV is component 0) is a paged pool in the unified
layout of its own namespace: its L1 (the engine's device buffers, ``DevicePool``: slot ``s`` is
page ``s``), its L2 (a ``HostPagePool`` of ``page_unified`` rows of this rank's shard) and its L3
objects (an ``L3Link`` with its plans). ``Pools`` holds the three and copies between L1 and L2
with the kernels, straight from and into host rows (one kernel call per run of consecutive rows;
scattered rows of a read-only load are gathered first), and ``LayerLoad`` runs a load layer by
layer so compute on layer ``i`` overlaps the copy of later layers.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hicache_store.kernels.ops import Backend as KernelBackend
from hicache_store.kernels.ops import pack_pages, unpack_pages
from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Namespace
from hicache_store.objects import L3Link

from .components import ComponentSpec, SpecHolder
from .host_pool import HostPagePool

#: a load over more runs of consecutive host rows than this gathers the rows first.
MAX_ROW_RUNS = 8


def consecutive_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first page, count)`` of each run of consecutive ascending pages, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, page in enumerate(pages):
        if runs and page == runs[-1][1] + runs[-1][2]:
            index, first, count = runs[-1]
            runs[-1] = (index, first, count + 1)
        else:
            runs.append((i, page, 1))
    return runs


class LayerLoad:
    """An L2 -> L1 load that completes layer by layer.

    ``wait(layer)`` returns once that (local) layer of every loaded page is in L1, so the
    engine computes layer ``i`` while later layers are still being copied. A failed copy raises
    from ``wait`` (host-to-device copies do not fail in practice; the tier never hides one).
    """

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        copy_layer: Callable[[int], None],
        layers: range,
        *,
        per_layer: bool = True,
    ) -> None:
        """``per_layer=False``: one copy of every layer (``layers`` has one entry); ``wait``
        of any layer waits for it."""
        self._layers = layers
        self._per_layer = per_layer
        self._events = [threading.Event() for _ in layers]
        self._error: BaseException | None = None
        self._future = executor.submit(self._run, copy_layer)

    def _run(self, copy_layer: Callable[[int], None]) -> None:
        try:
            for i, layer in enumerate(self._layers):
                copy_layer(layer)
                self._events[i].set()
        except BaseException as exc:
            self._error = exc
            for event in self._events:
                event.set()
            raise

    def wait(self, layer: int) -> None:
        """Block until ``layer`` is loaded. ``layer`` is the index among the layers this rank
        holds (0 for its first layer), as the rank's engine numbers its pool's layers."""
        self._events[layer if self._per_layer else 0].wait()
        if self._error is not None:
            raise RuntimeError("loading cached KV into L1 failed") from self._error

    def wait_all(self) -> None:
        self._future.result()

    @property
    def failed(self) -> bool:
        """The copy raised (after ``wait_all`` returned or raised: whether it ended badly)."""
        return self._error is not None


class Slots(Protocol):
    """An allocator of L1 pages or slots: the engine's KV pool, or a component's ``SlotList``."""

    @property
    def num_free_pages(self) -> int: ...

    def alloc(self, count: int) -> list[int]: ...

    def free(self, pages: Sequence[int]) -> None: ...


class SlotList:
    """A component's own L1 slots: a free list, the last freed taken first."""

    def __init__(self, count: int) -> None:
        self.free_slots = list(range(count - 1, -1, -1))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_slots)

    def alloc(self, count: int) -> list[int]:
        if count > len(self.free_slots):
            raise RuntimeError(f"{count} slots asked, {len(self.free_slots)} free")
        return [self.free_slots.pop() for _ in range(count)]

    def free(self, pages: Sequence[int]) -> None:
        self.free_slots.extend(pages)


@dataclass
class Pools(SpecHolder):
    """One component's L1, L2 and L3 on this rank, and the two properties of its pools.

    ``slots``: its L1 allocator (the engine's pool for the KV; None for a component that
    follows the pages of component ``follows``: its L1 copy is at that component's page). ``writes``: this rank
    backs it up to L3. ``prefix_closed``: a page's L1 / L2 copy needs its parent's, so copies
    are made ancestors first, evicted leaves first and backed up as chains (the KV).
    ``ordered``: its backup completions are applied in the order and number the first PP stage
    decides, the same on every rank (the KV: its L3 knowledge decides what every rank backs
    up); other components' completions are rank-local.
    """

    spec: ComponentSpec
    namespace: Namespace
    layout: UnifiedPageLayout
    device: DevicePool
    host: HostPagePool
    link: L3Link | None
    kernel: KernelBackend
    slots: Slots | None = None
    follows: int | None = None
    prefix_closed: bool = False
    ordered: bool = False

    @property
    def writes(self) -> bool:
        return self.link is not None and self.link.can_write

    def first_slots(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64) * self.namespace.page_size

    def pack(self, slots: Sequence[int], rows: Sequence[int]) -> None:
        """Copy L1 ``slots`` into host ``rows`` (same order), straight into the rows."""
        first = self.first_slots(slots)
        for i, row, count in consecutive_runs(rows):
            pack_pages(
                self.device,
                first[i : i + count],
                self.host.data[row : row + count],
                self.layout,
                backend=self.kernel,
            )

    def host_runs(self, rows: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
        """``rows`` of the host pool as ``(index of the first, rows)`` views, one per run of
        consecutive rows, so the kernels copy straight from the pool; rows scattered over more
        than ``MAX_ROW_RUNS`` runs are gathered into one tensor instead (read-only use)."""
        runs = consecutive_runs(rows)
        if len(runs) <= MAX_ROW_RUNS:
            return [(i, self.host.data[r : r + n]) for i, r, n in runs]
        index = torch.tensor(list(rows), dtype=torch.int64)
        return [(0, self.host.data.index_select(0, index))]

    def unpack(
        self,
        parts: list[tuple[int, torch.Tensor]],
        slots: Sequence[int],
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Copy host rows (``host_runs`` of them) into L1 ``slots``; ``layers``: global range."""
        first = self.first_slots(slots)
        for i, rows in parts:
            unpack_pages(
                rows,
                self.device,
                first[i : i + rows.shape[0]],
                self.layout,
                layers=layers,
                backend=self.kernel,
            )

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy L1 slot ``src`` to slot ``dst`` (every plane and layer buffer)."""
        page = self.namespace.page_size
        s = torch.arange(src * page, (src + 1) * page)
        d = torch.arange(dst * page, (dst + 1) * page)
        for plane in self.device.planes:
            for buf in plane:
                buf.index_copy_(0, d.to(buf.device), buf.index_select(0, s.to(buf.device)))


def wait_for_loads(loads: Sequence[LayerLoad]) -> Callable[[int], None] | None:
    """One ``wait_layer`` over ``loads`` (None when there is nothing to wait for)."""
    if not loads:
        return None
    if len(loads) == 1:
        return loads[0].wait

    def wait(layer: int) -> None:
        for load in loads:
            load.wait(layer)

    return wait
