"""Draft-model state beside the target's KV, in both organisations of seed 000 §3.

A prefix hit lets the target skip prefill, but a speculative-decoding draft model still needs
its own KV of that prefix, or its acceptance rate drops. Two ways to keep it with the target:

**Packed** (``PackedDraftCache``): when the draft's KV rows have the target's shape and dtype
(``num_kv_heads``, ``head_dim``, ``dtype``), the draft's layers are appended to the target's
layers. The tier's namespace is built with ``num_layers = target + draft`` (``packed_namespace``)
and one device pool holds ``target + draft`` per-layer K/V buffers (``make_packed_pool``): the
draft keeps its own per-layer device buffers (separate GPU tensors), but shares the target's
page allocator and slot mapping. Every unified page object (L2 rows and L3 objects,
``_L0-{T+D-1}``) therefore carries the draft's layers ``T..T+D-1`` inside the *same* object as
the target's: backup, restore, layer-wise load, checksums and completion events are the tier's
own, and a target hit is a draft hit by construction (one component, nothing to match
separately). The engine runs each model on a layer view of the pool (``target_view`` /
``draft_view``, sharing the buffers) and the draft waits on the load of its layers ``T + i``.
Cost: every page moves the draft's bytes too, also for requests that do not speculate.

**Sidecar** (``SidecarDraftCache``): the draft's KV is its own cache component (``draft_spec``,
rule ``full``, tag 3 by default) with its own pools: an L1 device pool of the draft's geometry
whose *page indices follow the target's* (the draft reads and writes the same slots the tier
hands out for the target, so no second allocator or slot mapping exists), and L2/L3 through a
``ComponentStore`` keyed by the *target's page hashes* (one object per page: the draft's
``num_layers`` layers of K and V, framed and namespaced in the draft's own namespace, ``_C3``).
The draft's shapes and dtypes are free. Draft pages are backed up with the target's at
``complete`` (only what misses below, as for snapshots) and restored at ``prepare`` into the
draft pool at the target's new device pages. A speculative request's prefix is the longest at
which *both* components are available (``match_components`` with the target's and the draft's
``full`` rules): a prefix whose draft pages are gone is not a full hit for it
(``DraftRequest.match.limited_by == ("draft",)``), while a request that does not speculate
matches on the target alone.

Which draft pages the L1 draft pool holds is tracked per device page (``device page -> page
hash``): every device page the tier allocates goes through ``prepare`` (loaded pages and new
pages), where the entry is overwritten (restored or computed) or dropped, so a stale draft page
is never taken for a valid one (a request that does not speculate leaves no draft entry).

Completion events (sidecar): the draft's L3 puts run in the background like the tier's KV
backups; a page yields one event (``drain_events``) once *both* its target object and its draft
object have finished their backup, ``ok`` only when both are stored, so "this page is in L3"
always means both models' KV (packed: the tier's own events cover both by construction).

Limits of this slice: one rank; draft restores are synchronous at ``prepare``; decode-time KV of
either model is not cached.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hicache_store.backends.base import Backend
from hicache_store.engine.config import MiniLlamaConfig
from hicache_store.engine.kv_pool import DeviceKVPool
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.cache import HiCache, Request
from hicache_store.tier.config import TierConfig
from hicache_store.tier.group import LocalGroup
from hicache_store.tier.radix import PageNode

from .cache import _ComponentGroup
from .components import ComponentSpec, HitRule, HybridMatch, Location, match_components
from .state_l3 import StateL3
from .store import BackupEvent, ComponentStore, EventLog

#: the target's full-attention KV (the tier's own pages) in a draft-aware match.
TARGET = ComponentSpec("target", 0, HitRule.FULL)


def draft_spec(num_layers: int, component: int = 3) -> ComponentSpec:
    """The sidecar draft KV component: every page of the prefix is needed (``full`` rule)."""
    return ComponentSpec("draft", component, HitRule.FULL, num_layers=num_layers)


def draft_config(target: MiniLlamaConfig, *, num_layers: int = 2, seed: int = 1) -> MiniLlamaConfig:
    """A small draft model for ``target``: fewer layers, another seed, the same vocabulary and
    the same KV row shape and dtype (so it is packable as well)."""
    if seed == target.seed:
        raise ValueError("the draft model needs a seed of its own")
    return target.with_(num_layers=num_layers, seed=seed)


def layer_view(pool: DeviceKVPool, start: int, stop: int) -> DeviceKVPool:
    """A ``DeviceKVPool`` over layers ``[start, stop)`` of ``pool``: the same buffers and
    allocator (a shallow copy), presenting ``stop - start`` layers to a model."""
    if not 0 <= start < stop <= pool.num_layers:
        raise ValueError(f"layers [{start}, {stop}) outside the pool's {pool.num_layers}")
    view = copy.copy(pool)
    view.k_buffers = pool.k_buffers[start:stop]
    view.v_buffers = pool.v_buffers[start:stop]
    view.num_layers = stop - start
    return view


def _offset_wait(
    wait_layer: Callable[[int], None] | None, offset: int
) -> Callable[[int], None] | None:
    if wait_layer is None:
        return None
    return lambda layer: wait_layer(layer + offset)


@dataclass(frozen=True)
class DraftPrepared:
    """What the engine needs to run both models on a request.

    Both models use ``slots`` (the draft's page indices follow the target's); the target waits
    on ``target_wait``, the draft on ``draft_wait``. ``speculative``: whether the draft's KV of
    the prefix ``[0, start)`` is in the draft pool (False: run only the target).
    """

    start: int
    slots: torch.Tensor
    target_wait: Callable[[int], None] | None
    draft_wait: Callable[[int], None] | None
    speculative: bool


# == packed ======================================================================================


def check_packable(target: MiniLlamaConfig, draft: MiniLlamaConfig) -> None:
    """``ValueError`` unless the draft's KV rows have the target's shape and dtype."""
    mine = (target.num_kv_heads, target.head_dim, target.dtype)
    theirs = (draft.num_kv_heads, draft.head_dim, draft.dtype)
    if mine != theirs:
        raise ValueError(
            f"draft KV rows (kv_heads, head_dim, dtype) {theirs} differ from the target's {mine}: "
            "use the sidecar organisation"
        )


def packed_namespace(
    model: str, target: MiniLlamaConfig, draft: MiniLlamaConfig, page_size: int
) -> Namespace:
    """The tier namespace of target + draft packed: ``target + draft`` layers in one object per
    page. The draft's identity is part of the model name (another draft, another namespace)."""
    check_packable(target, draft)
    layers = target.num_layers + draft.num_layers
    shape = ModelShape.mha(layers, target.num_kv_heads, target.head_dim)
    name = f"{model}+draft-L{draft.num_layers}-s{draft.seed}"
    return Namespace.create(name, shape, target.dtype, page_size, Grid(layers, target.num_kv_heads))


def make_packed_pool(
    target: MiniLlamaConfig,
    draft: MiniLlamaConfig,
    num_pages: int,
    page_size: int,
    device: torch.device | str = "cpu",
) -> DeviceKVPool:
    """One pool of ``target + draft`` layers (per-layer buffers: the draft's are its own)."""
    check_packable(target, draft)
    return DeviceKVPool(
        num_layers=target.num_layers + draft.num_layers,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        num_pages=num_pages,
        page_size=page_size,
        dtype=target.torch_dtype,
        device=device,
    )


class PackedDraftCache:
    """The tier over a packed pool: draft layers travel inside the target's page objects.

    Call order per request: ``match``, ``prepare``, ``target.prefill(.., target_pool, ..)`` and
    ``draft.prefill(.., draft_pool, ..)`` with ``DraftPrepared``'s slots and waits, ``complete``.
    """

    def __init__(
        self,
        target: MiniLlamaConfig,
        draft: MiniLlamaConfig,
        config: TierConfig,
        page_size: int,
        *,
        model: str = "mini",
        backend: Backend | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.namespace = packed_namespace(model, target, draft, page_size)
        self.pool = make_packed_pool(target, draft, config.l1_pages, page_size, device)
        self.target_layers = target.num_layers
        self.target_pool = layer_view(self.pool, 0, target.num_layers)
        self.draft_pool = layer_view(self.pool, target.num_layers, self.pool.num_layers)
        self.tier = HiCache(self.namespace, config, self.pool, backend=backend)

    def match(self, tokens: Sequence[int]) -> Request:
        return self.tier.match(list(tokens))

    def prepare(self, req: Request) -> DraftPrepared:
        prep = self.tier.prepare(req)
        return DraftPrepared(
            prep.start,
            prep.slots,
            prep.wait_layer,
            _offset_wait(prep.wait_layer, self.target_layers),
            True,
        )

    def complete(self, req: Request) -> None:
        self.tier.complete(req)

    def evict_device(self) -> None:
        """Drop every unlocked L1 page (both models' layers: they share the pages)."""
        self.tier.evict_device()

    def flush(self) -> None:
        self.tier.flush()

    def close(self) -> None:
        self.tier.close()

    def check_invariants(self) -> None:
        self.tier.check_invariants()


# == sidecar =====================================================================================


@dataclass
class DraftRequest:
    tokens: list[int]
    kv: Request
    hashes: list[str]
    speculative: bool
    prefix_pages: int = 0
    match: HybridMatch | None = None
    restored: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class DraftMetrics:
    requests: int = 0
    speculative_requests: int = 0
    target_prefix_tokens: int = 0  # what the target's KV alone allowed (speculative requests)
    hit_tokens: int = 0  # what was reused
    limited_by_draft: int = 0  # speculative requests whose prefix the draft shortened
    draft_pages_restored: int = 0
    draft_pages_backed_up: int = 0


class SidecarDraftCache:
    """The tier for the target plus a draft KV component with its own pools.

    ``target_pool`` and ``draft_pool`` must have the same number of pages and page size (the
    draft's page indices follow the target's); their layer counts, head shapes and dtypes are
    free. ``draft_namespace`` names the draft's objects in L3 (its own model and shape; the
    target's page size and hash algorithm, since its objects are keyed by the target's page
    hashes). ``store_l1_slots`` is the store's staging area on the device (the draft pool itself
    is the draft's L1).
    """

    def __init__(
        self,
        namespace: Namespace,
        config: TierConfig,
        target_pool: DeviceKVPool,
        draft_pool: DeviceKVPool,
        draft_namespace: Namespace,
        *,
        store_l2_pages: int,
        store_l1_slots: int = 4,
        backend: Backend | None = None,
        spec: ComponentSpec | None = None,
    ) -> None:
        if (draft_pool.num_pages, draft_pool.page_size) != (
            target_pool.num_pages,
            target_pool.page_size,
        ):
            raise ValueError("the draft pool's pages must follow the target pool's (same count)")
        if draft_namespace.page_size != namespace.page_size:
            raise ValueError("the draft namespace needs the target's page size")
        if draft_namespace.hash_algo != namespace.hash_algo:
            raise ValueError("the draft namespace needs the target's page-hash algorithm")
        self.spec = spec or draft_spec(draft_pool.num_layers)
        if self.spec.rule is not HitRule.FULL or self.spec.component == 0:
            raise ValueError("the sidecar draft component is a full-rule component other than 0")
        if self.spec.num_layers != draft_pool.num_layers:
            raise ValueError("the draft component's num_layers must be the draft pool's")
        self._group = _ComponentGroup(LocalGroup())
        self.tier = HiCache(namespace, config, target_pool, backend=backend, group=self._group)
        self.pool = target_pool
        self.draft_pool = draft_pool
        self.page_size = namespace.page_size
        page_shape = (
            draft_pool.num_layers,
            2,
            self.page_size,
            draft_pool.num_kv_heads,
            draft_pool.head_dim,
        )
        l3 = None
        if backend is not None and config.l2_pages > 0:
            l3 = StateL3(backend, draft_namespace, self.spec, io_timeout_s=config.io_timeout_s)
        self.store = ComponentStore(
            self.spec,
            page_shape,
            draft_pool.dtype,
            l1_slots=store_l1_slots,
            l2_slots=store_l2_pages if config.l2_pages > 0 else 0,
            l3=l3,
            device=draft_pool.device,
            async_l3=True,
        )
        self._draft_l1: dict[int, str] = {}  # device page -> page hash whose draft KV it holds
        self.metrics = DraftMetrics()
        #: pages whose draft object is on its way to L3 -> the target's backup outcome once
        #: known (None: its backup is still in flight)
        self._awaiting: dict[str, bool | None] = {}
        #: target outcomes applied during the ``complete`` in progress (before its pages are
        #: registered as awaiting)
        self._fresh_outcomes: dict[str, bool] = {}
        self._events = EventLog()
        self.tier.backup_listeners.append(self._on_target_backup)

    # -- the request path ---------------------------------------------------------------------

    def match(self, tokens: Sequence[int], *, speculative: bool = True) -> DraftRequest:
        toks = list(tokens)
        kv = self.tier.match(toks)
        return DraftRequest(toks, kv, list(kv.hashes), speculative)

    def prepare(self, dreq: DraftRequest) -> DraftPrepared:
        def cap(kv_pages: int) -> int:
            if not dreq.speculative:
                return kv_pages
            self.metrics.target_prefix_tokens += kv_pages * self.page_size
            nodes = dreq.kv.nodes[:kv_pages]
            target = [Location.L1 if n.device_page is not None else Location.L2 for n in nodes]
            draft = self._availability(dreq.hashes[:kv_pages], nodes)
            match = match_components(
                [TARGET, self.spec],
                {TARGET.name: target, self.spec.name: draft},
                self.page_size,
            )
            best = match.prefix_pages
            for i, loc in match.restore[self.spec.name]:
                if loc is Location.L1:
                    continue
                state = self.store.load(dreq.hashes[i])  # None: corrupt or gone meanwhile
                if state is None:
                    best = i
                    break
                dreq.restored[i] = state
            dreq.restored = {i: s for i, s in dreq.restored.items() if i < best}
            if best < match.prefix_pages:
                match = HybridMatch(
                    best, best * self.page_size, match.restore, match.alone, (self.spec.name,)
                )
            dreq.match = match
            return best

        self._group.cap = cap
        try:
            prep = self.tier.prepare(dreq.kv)
        finally:
            self._group.cap = None
        dreq.prefix_pages = prep.start // self.page_size
        nodes = dreq.kv.nodes
        # every device page the tier just allocated holds no draft KV unless restored below
        for node in dreq.kv.loading:
            assert node.device_page is not None
            self._draft_l1.pop(node.device_page, None)
        for page in dreq.kv.new_device_pages:
            self._draft_l1.pop(page, None)
        if dreq.speculative:
            for i, state in sorted(dreq.restored.items()):
                if i >= dreq.prefix_pages:
                    break
                device_page = nodes[i].device_page
                assert device_page is not None
                self._write_page(device_page, state)
                self._draft_l1[device_page] = dreq.hashes[i]
                self.metrics.draft_pages_restored += 1
            if dreq.match is not None and dreq.match.limited_by == (self.spec.name,):
                self.metrics.limited_by_draft += 1
            self.metrics.speculative_requests += 1
        dreq.restored.clear()
        self.metrics.requests += 1
        self.metrics.hit_tokens += prep.start
        return DraftPrepared(prep.start, prep.slots, prep.wait_layer, None, dreq.speculative)

    def complete(self, dreq: DraftRequest) -> None:
        """Insert the target's pages (the tier's write policy); record the draft's new pages
        and back up every draft page of the request that misses below L1."""
        new_pages = list(dreq.kv.new_device_pages)
        self.tier.complete(dreq.kv)
        if not dreq.speculative:
            return
        full = len(dreq.tokens) // self.page_size
        nodes = self.tier.tree.match(dreq.hashes[:full])
        for i in range(dreq.prefix_pages, len(nodes)):
            computed = new_pages[i - dreq.prefix_pages]  # where the draft wrote this page
            kept = nodes[i].device_page
            if kept == computed:
                self._draft_l1[computed] = dreq.hashes[i]
            elif kept is not None and self._draft_l1.get(kept) != dreq.hashes[i]:
                # The target's page was already cached (the tier keeps that copy and has just
                # freed ``computed``), but without the draft's KV (a prefix the draft limited,
                # or cached by a request that did not speculate). ``computed`` still holds the
                # draft's rows (nothing ran since it was freed): copy them beside the target's.
                self._write_page(kept, self._read_page(computed))
                self._draft_l1[kept] = dreq.hashes[i]
        if not self.tier.config.l2_pages:
            return
        for i, node in enumerate(nodes):
            page_hash = dreq.hashes[i]
            if self.store.location(page_hash) in (Location.L2, Location.L3):
                continue  # backed up already: nothing moves
            if node.device_page is None or self._draft_l1.get(node.device_page) != page_hash:
                continue
            parent = dreq.hashes[i - 1] if i else None
            self.store.save(page_hash, self._read_page(node.device_page), parent_hash=parent)
            if self.store.backup(page_hash):
                self.metrics.draft_pages_backed_up += 1
            if self.store.l3_pending(page_hash):
                if node.in_l3 and not node.l3_pending:
                    self._awaiting[page_hash] = True  # the target was stored before
                elif node.l3_pending:
                    self._awaiting[page_hash] = None
                elif page_hash in self._fresh_outcomes:  # its backup ended during complete
                    self._awaiting[page_hash] = self._fresh_outcomes[page_hash]
        self._fresh_outcomes.clear()
        self.poll()

    def _on_target_backup(self, page_hash: str, ok: bool) -> None:
        if page_hash in self._awaiting:
            self._awaiting[page_hash] = ok
        else:
            self._fresh_outcomes[page_hash] = ok

    # -- maintenance ----------------------------------------------------------------------------

    def draft_location(self, page_hash: str) -> Location | None:
        """Where the draft's KV of a page is (L1: in the draft pool at the target's page)."""
        for node in self.tier.tree.nodes():
            page = node.device_page
            if page is not None and node.page_hash == page_hash == self._draft_l1.get(page):
                return Location.L1
        return self.store.location(page_hash)

    def evict_device(self) -> None:
        """Drop every unlocked L1 page of the target, and the draft's with them."""
        self.tier.evict_device()
        self.store.evict_all(Location.L1)
        self._drop_stale()

    def poll(self) -> None:
        """Apply finished transfers; a page whose target and draft objects have both ended
        their L3 backup yields one completion event (``ok``: both stored)."""
        self.tier.poll()
        self._fresh_outcomes.clear()  # outcomes of pages no draft object waits for
        self.store.poll()
        for page_hash, target_ok in list(self._awaiting.items()):
            if target_ok is None or self.store.l3_pending(page_hash):
                continue
            del self._awaiting[page_hash]
            ok = target_ok and self.store.in_l3(page_hash)
            self._events.extend([BackupEvent("target+draft", page_hash, ok)])

    def drain_events(self) -> list[BackupEvent]:
        """Pages whose target and draft backups both finished since the last call."""
        return self._events.drain()

    def flush(self, timeout: float = 60.0) -> None:
        self.tier.flush(timeout)
        self.store.flush(timeout)
        self.poll()

    def close(self) -> None:
        try:
            self.store.flush()
            self.poll()
        finally:
            self.tier.close()

    def check_invariants(self) -> None:
        self.tier.check_invariants()
        self.store.check_invariants()
        # a device page the tree holds carries no other page's draft KV
        for node in self.tier.tree.nodes():
            if node.device_page is not None and node.device_page in self._draft_l1:
                assert self._draft_l1[node.device_page] == node.page_hash

    # -- internals ------------------------------------------------------------------------------

    def _availability(
        self, hashes: Sequence[str], nodes: Sequence[PageNode]
    ) -> list[Location | None]:
        out = self.store.availability(hashes, check_l3=True)
        for i, node in enumerate(nodes):
            page = node.device_page
            if page is not None and self._draft_l1.get(page) == hashes[i]:
                out[i] = Location.L1
        return out

    def _drop_stale(self) -> None:
        held = {n.device_page for n in self.tier.tree.nodes() if n.device_page is not None}
        for page in [p for p in self._draft_l1 if p not in held]:
            del self._draft_l1[page]

    def _page_slots(self, device_page: int) -> torch.Tensor:
        return self.draft_pool.slots_of([device_page])

    def _read_page(self, device_page: int) -> torch.Tensor:
        slots = self._page_slots(device_page)
        pool = self.draft_pool
        return torch.stack(
            [
                torch.stack([k.index_select(0, slots), v.index_select(0, slots)])
                for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True)
            ]
        )

    def _write_page(self, device_page: int, state: torch.Tensor) -> None:
        slots = self._page_slots(device_page)
        pool = self.draft_pool
        state = state.to(pool.device)
        for layer, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers, strict=True)):
            k.index_copy_(0, slots, state[layer, 0])
            v.index_copy_(0, slots, state[layer, 1])
