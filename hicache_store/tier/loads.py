"""The L2 -> L1 loads of the KV pages requests compute with, and the L1 copies each is filling.

One ``Loads`` per tier, on the engine's thread; the copies run on one loader thread, layer by
layer (``pools.LayerLoad``), so the engine computes layer ``i`` while later layers are copied.
A request's L1 copy being filled by another request's load is *borrowed*: the request waits
for that load too, and fails with it. An entry in ``filling`` lasts while a request that
prepared the copy is in flight; for a failed load, while a request still holds the copy, so
that a later request using it fails too rather than trusting it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

from .components import KV
from .pools import LayerLoad, Pools, wait_for_loads
from .radix import PageNode, l1_of
from .request import Request, timed_io


class Loads:
    """The loads of one tier's KV pool ``kv``; ``layers``: the global layer range this rank
    holds (``None``: one copy of every layer, not layer by layer)."""

    def __init__(self, kv: Pools, layers: range | None) -> None:
        self._kv = kv
        self._layers = layers
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hicache-load")
        #: id(node) -> the load filling its L1 copy (module docstring)
        self.filling: dict[int, LayerLoad] = {}

    def start(self, req: Request) -> Callable[[int], None] | None:
        """``prepare``, once ``req.loading`` (its pages without an L1 copy) have their L1
        pages: note the loads of other requests it borrows, start its own, and return the
        ``wait_layer`` over all of them (None: nothing to wait for)."""
        req.borrowed = [(n, load) for n in req.nodes if (load := self.filling.get(id(n)))]
        if req.loading:
            req.load = self._load(req)
        return wait_for_loads(self.of(req))

    def _load(self, req: Request) -> LayerLoad:
        nodes, kv = req.loading, self._kv
        with timed_io(req):
            rows = kv.host_runs([n.held(KV.tag).l2 for n in nodes])  # type: ignore[union-attr,misc]
        slots = [l1_of(n, KV.tag) for n in nodes]

        def copy(layers: tuple[int, int] | None) -> None:
            kv.unpack(rows, slots, layers)  # type: ignore[arg-type]

        if self._layers is None:
            load = LayerLoad(self._loader, lambda _layer: copy(None), range(1), per_layer=False)
        else:
            load = LayerLoad(self._loader, lambda layer: copy((layer, layer + 1)), self._layers)
        for node in nodes:
            self.filling[id(node)] = load
        return load

    @staticmethod
    def of(req: Request) -> list[LayerLoad]:
        """The loads ``req`` computes with: other requests' it borrows, then its own."""
        loads = list({id(load): load for _, load in req.borrowed}.values())
        return loads if req.load is None else [*loads, req.load]

    def finish(self, req: Request) -> None:
        """``complete``: wait for every load ``req`` computed with (raises if a copy it
        computed with failed), then forget the copies its own load filled."""
        loads = self.of(req)
        if loads:
            with timed_io(req):
                for load in loads:
                    load.wait_all()
        if req.load is not None:
            self.forget(req.load, req.loading)
        req.borrowed = []

    def forget(self, load: LayerLoad, nodes: Sequence[PageNode]) -> None:
        """The copies of ``nodes`` that ``load`` was filling are good (or gone)."""
        for node in nodes:
            if self.filling.get(id(node)) is load:
                del self.filling[id(node)]

    def discard(self, node: PageNode) -> None:
        """``node``'s L1 copy is gone: no load fills it."""
        self.filling.pop(id(node), None)

    def close(self) -> None:
        """Stop the loader (the loads started end first)."""
        self._loader.shutdown(wait=True)
