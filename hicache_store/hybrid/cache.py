"""A hybrid cache: the KV tier (``HiCache``, component 0) plus the model's other components, a
sliding-window KV store (component 1, optional) and a recurrent-checkpoint store (component 2).

Call order per request (one rank, the engine's thread)::

    hreq = cache.match(tokens)
    prep = cache.prepare(hreq)              # prefix: every component resumable there
    logits, _, snaps = model.prefill(tokens[prep.start:], prep.start, prep.slots, cache.pool,
                                     prep.state, wait_layer=prep.wait_layer,
                                     snapshot_at=prep.snapshot_at, window=prep.window)
    cache.complete(hreq, snaps, prep.window)  # save snapshots and window pages, back them up

How the prefix is fixed: ``HiCache.prepare`` settles its prefetch and then fixes the KV prefix at
its rank agreement (``RankGroup.agree_min(.., "prefix_pages")``). ``HybridCache`` gives the tier a
group that, at that point, lowers the KV prefix to the longest one at which every component is
available (``match_components``: the window pages inside the sliding window before the prefix
end, the recurrent snapshot exactly at it) and whose objects actually load from L1, L2 or L3. A
missing or corrupt object moves the prefix to the previous usable end, down to 0 = recompute from
the start. The objects are loaded right there, so the prefix is never promised without its state.

Snapshots are taken at the request's last full page, at the branch point (the end of the
longest KV prefix already in the tree, when computation started before it) and, with
``checkpoint_interval_pages``, every that many pages (so a KV prefix that lost its tail can still
resume at a checkpoint inside it). With
``backup_snapshots_on_existing_prefix`` (default), every new snapshot is backed up to L2/L3 if it
misses there, also when its prefix's KV was already backed up (the seed's write-through fix);
False reproduces the old behaviour (only snapshots on pages this request inserted are backed
up), for comparison. The window pages a new snapshot needs (those inside the window before it,
computed by this request) are saved and backed up the same way (only what misses below L1
moves); no other window page is kept, since a resume happens only at a checkpoint.

Several ranks: the prefix is agreed in rounds until it is resumable on every rank
(``_ComponentGroup``); each rank's component objects are its shard, under its own keys.

Component objects go to L3 in the background (``async_component_io``): ``poll`` applies the
finished puts and keeps their completion events (``drain_events``), ``flush`` waits for them.

Limits of this slice: component loads are synchronous at ``prepare`` (no prefetch of component
objects ahead of the request); component objects are keyed by rank, so unlike KV pages they are read back
only by a deployment of the same topology.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hicache_store.backends.base import Backend
from hicache_store.engine.kv_pool import DeviceKVPool
from hicache_store.engine.model import WindowKV
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.topology import Topology
from hicache_store.tier.cache import HiCache, Request
from hicache_store.tier.config import TierConfig
from hicache_store.tier.group import LocalGroup, RankGroup

from .components import ComponentSpec, HitRule, Location, match_components
from .model import HybridMiniLlama, WindowComponent
from .state_l3 import StateL3
from .store import BackupEvent, ComponentStore, EventLog

#: the recurrent checkpoint component of ``HybridMiniLlama``.
RECURRENT = ComponentSpec("recurrent", 2, HitRule.CHECKPOINT)


class _ComponentGroup:
    """The tier's rank group, with the prefix agreement lowered to a prefix every rank can
    resume at (its components' objects loaded).

    Each rank's usable prefixes are its own (a snapshot or window page may be missing on one
    rank only), and a checkpoint prefix below one rank's best need not be usable on another. So
    the agreement is a descent: the ranks agree on the KV prefix ``v`` as before, then each
    proposes the longest prefix ``<= v`` it can resume at (``cap``) and they agree on the
    minimum; repeated until the minimum equals ``v``. Every rank sees the same sequence of agreed
    values, so all run the same number of rounds; ``v`` decreases strictly each round, so it ends
    (at worst at 0, where every rank can resume).
    """

    def __init__(self, inner: RankGroup) -> None:
        self.inner = inner
        self.cap: Callable[[int], int] | None = None
        self.rounds = 0  # agreement rounds of the last prefix decision (1 = no descent)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def agree_min(self, value: int, what: str) -> int:
        agreed = self.inner.agree_min(value, what)
        if what != "prefix_pages" or self.cap is None:
            return agreed
        if self.inner.size == 1:
            self.rounds = 1
            return self.cap(agreed)
        self.rounds = 0
        while True:
            self.rounds += 1
            proposal = self.cap(agreed)
            lowered = self.inner.agree_min(proposal, "prefix_pages:components")
            if lowered == agreed:
                return agreed
            agreed = lowered


@dataclass
class HybridRequest:
    tokens: list[int]
    kv: Request
    hashes: list[str]
    tree_pages: int = 0
    prefix_pages: int = 0
    state: torch.Tensor | None = None
    window: WindowKV | None = None
    #: (store, page hash) of every component object locked until ``complete``.
    locked: list[tuple[ComponentStore, str]] = field(default_factory=list)


@dataclass(frozen=True)
class HybridPrepared:
    start: int
    slots: torch.Tensor
    wait_layer: Callable[[int], None] | None
    state: torch.Tensor | None
    snapshot_at: tuple[int, ...]
    #: the window layers' KV buffer (restored rows filled), None without window layers.
    window: WindowKV | None = None


@dataclass
class HybridMetrics:
    """Counters of a ``HybridCache``.

    ``component_tokens[name]``: over all requests, the prefix tokens that component alone could
    have resumed after (across L1/L2/L3, within the prompt's usable pages); divided by
    ``prompt_tokens`` it is that component's hit rate. ``limited_by[name]``: requests whose
    prefix that component shortened below what the others allowed.
    """

    requests: int = 0
    prompt_tokens: int = 0
    kv_prefix_tokens: int = 0  # what the KV tier alone could have reused
    hit_tokens: int = 0  # what was reused (every component)
    snapshot_hits: int = 0
    snapshot_backups: int = 0
    window_pages_restored: int = 0
    window_pages_saved: int = 0
    window_backups: int = 0
    load_failures: int = 0  # objects that were listed but did not load (corrupt, gone)
    component_tokens: dict[str, int] = field(default_factory=dict)
    limited_by: dict[str, int] = field(default_factory=dict)

    def hit_rates(self) -> dict[str, float]:
        """Per component, and ``"all"`` for the prefix actually reused: tokens / prompt tokens."""
        total = max(self.prompt_tokens, 1)
        rates = {name: tokens / total for name, tokens in self.component_tokens.items()}
        rates["all"] = self.hit_tokens / total
        return rates


class HybridCache:
    def __init__(
        self,
        namespace: Namespace,
        config: TierConfig,
        pool: DeviceKVPool,
        state_shape: Sequence[int],
        *,
        snapshot_l1_slots: int,
        snapshot_l2_slots: int,
        backend: Backend | None = None,
        backup_snapshots_on_existing_prefix: bool = True,
        checkpoint_interval_pages: int = 0,
        spec: ComponentSpec = RECURRENT,
        window: WindowComponent | None = None,
        window_l1_slots: int = 0,
        window_l2_slots: int = 0,
        topology: Topology | None = None,
        rank: int = 0,
        group: RankGroup | None = None,
        async_component_io: bool = True,
    ) -> None:
        """``checkpoint_interval_pages``: besides the request's end and the branch point, take a
        snapshot every that many pages of the computed range (0: none). Without them, a KV prefix
        that lost its tail (L1 evicted the newest pages, L2 kept the older ones) is useless: no
        snapshot sits at its end, so the match falls to the previous request end or to 0.

        ``async_component_io``: component objects are put to L3 in the background (applied
        by ``poll``/``complete``, awaited by ``flush``), like the tier's KV pages; False puts
        them on the engine thread.

        ``window``: the sliding-window component (``HybridMiniLlama.window_component``), with
        its own L1/L2 pools of ``window_l1_slots`` / ``window_l2_slots`` pages; L1 must hold at
        least one window's pages plus one (``ValueError`` otherwise).

        Several ranks: ``topology``, ``rank`` and ``group`` as for ``HiCache``. The KV pages go
        through the tier's plans; the other components are this rank's shard of them, stored
        under the rank's own keys (``StateL3`` ``shard``), and the prefix is agreed so that it is
        a resumable prefix on every rank (``_ComponentGroup``)."""
        if spec.rule is not HitRule.CHECKPOINT:
            raise ValueError("HybridCache manages one checkpoint component")
        self._group = _ComponentGroup(group or LocalGroup())
        # A rank's component objects are its own shard: keyed by its rank in the group.
        shard = self._group.rank if self._group.size > 1 else None
        self.tier = HiCache(
            namespace,
            config,
            pool,
            backend=backend,
            topology=topology,
            rank=rank,
            group=self._group,
        )
        self.pool = pool
        self.page_size = namespace.page_size
        with_l2 = config.l2_pages > 0

        def state_l3(component: ComponentSpec) -> StateL3 | None:
            if backend is None or not with_l2:
                return None
            return StateL3(
                backend, namespace, component, io_timeout_s=config.io_timeout_s, shard=shard
            )

        self.snapshots = ComponentStore(
            spec,
            state_shape,
            torch.float32,
            l1_slots=snapshot_l1_slots,
            l2_slots=snapshot_l2_slots if with_l2 else 0,
            l3=state_l3(spec),
            device=pool.device,
            async_l3=async_component_io,
        )
        self.window = window
        self.windows: ComponentStore | None = None
        if window is not None:
            needed = -(-window.spec.window_tokens // self.page_size) + 2
            if window_l1_slots < needed:
                raise ValueError(
                    f"window_l1_slots={window_l1_slots}: a window of "
                    f"{window.spec.window_tokens} tokens needs at least {needed} L1 pages"
                )
            if window.page_shape[2] != self.page_size:
                raise ValueError("window component page size differs from the namespace's")
            self.windows = ComponentStore(
                window.spec,
                window.page_shape,
                window.dtype,
                l1_slots=window_l1_slots,
                l2_slots=window_l2_slots if with_l2 else 0,
                l3=state_l3(window.spec),
                device=pool.device,
                async_l3=async_component_io,
            )
        #: the components of every match, KV first (its availability is the tier's answer).
        self.kv_spec = ComponentSpec("kv", 0, HitRule.FULL, num_layers=pool.num_layers)
        self.stores = [s for s in (self.windows, self.snapshots) if s is not None]
        self.specs = [self.kv_spec, *(s.spec for s in self.stores)]
        self.backup_on_existing = backup_snapshots_on_existing_prefix
        if checkpoint_interval_pages < 0:
            raise ValueError("checkpoint_interval_pages must be >= 0")
        self.checkpoint_interval = checkpoint_interval_pages
        self._events = EventLog()
        self.metrics = HybridMetrics(
            component_tokens={spec.name: 0 for spec in self.specs},
            limited_by={spec.name: 0 for spec in self.specs},
        )

    # -- the request path -------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> HybridRequest:
        toks = list(tokens)
        kv = self.tier.match(toks)
        tree_pages = len(self.tier.tree.match(kv.hashes))
        return HybridRequest(toks, kv, list(kv.hashes), tree_pages)

    def prepare(self, hreq: HybridRequest) -> HybridPrepared:
        usable = max(0, (len(hreq.tokens) - 1) // self.page_size)
        listed: dict[str, list[Location | None]] = {}  # filled by the first cap call
        self._group.cap = lambda kv_pages: self._settle_components(hreq, kv_pages, usable, listed)
        try:
            prep = self.tier.prepare(hreq.kv)
        finally:
            self._group.cap = None
        hreq.prefix_pages = prep.start // self.page_size
        if hreq.prefix_pages == 0:
            hreq.state = None
        else:
            self.metrics.snapshot_hits += 1
        self.metrics.requests += 1
        self.metrics.prompt_tokens += len(hreq.tokens)
        self.metrics.hit_tokens += prep.start
        full = len(hreq.tokens) // self.page_size
        ends = {full}
        if hreq.prefix_pages < hreq.tree_pages <= full:
            ends.add(hreq.tree_pages)  # the branch point
        if self.checkpoint_interval:  # periodic checkpoints inside the computed range
            step = self.checkpoint_interval
            ends.update(range(step * (hreq.prefix_pages // step + 1), full, step))
        snapshot_at = tuple(sorted(p * self.page_size for p in ends if p > hreq.prefix_pages))
        return HybridPrepared(
            prep.start, prep.slots, prep.wait_layer, hreq.state, snapshot_at, hreq.window
        )

    def _settle_components(
        self,
        hreq: HybridRequest,
        kv_pages: int,
        usable: int,
        listed: dict[str, list[Location | None]],
    ) -> int:
        """The tier's prefix cap: the longest prefix ``<= kv_pages`` at which every component's
        objects are available and load; they are loaded (and locked) into ``hreq``.

        ``listed``: where each component's objects are, per page, found by the first call of a
        request (L3 existence included) and kept for the next ones, with the objects that failed
        to load marked absent. Called again when the ranks agreed on a shorter prefix: what the
        last call loaded is released first, and the hit counters keep the first call's view."""
        for store, page_hash in hreq.locked:
            store.unlock(page_hash)
        hreq.locked.clear()
        hreq.state, hreq.window = None, None
        hashes = hreq.hashes[:usable]
        first = not listed
        if first:
            self.metrics.kv_prefix_tokens += kv_pages * self.page_size
            for store in self.stores:
                listed[store.spec.name] = store.availability(hashes, check_l3=True)
        availability = {
            self.kv_spec.name: [Location.L1 if i < kv_pages else None for i in range(usable)],
            **listed,
        }
        while True:
            found = match_components(self.specs, availability, self.page_size)
            loaded, failed = self._load_components(hreq, found.restore)
            if failed is None:
                break
            # Listed but not loadable (corrupt, gone): absent from now on, so the loop ends.
            self.metrics.load_failures += 1
            name, index = failed
            availability[name][index] = None
        # Per-component hit rates, on what actually loads (a corrupt object counts as absent).
        if first:
            for name, pages in found.alone.items():
                self.metrics.component_tokens[name] += pages * self.page_size
            for name in found.limited_by:
                self.metrics.limited_by[name] += 1
        hreq.state = loaded.get((self.snapshots.spec.name, found.prefix_pages - 1))
        if self.window is not None:
            buffer = self.window.buffer(len(hreq.tokens), self.pool.device)
            for index, _ in found.restore[self.window.spec.name]:
                self.window.put_page(buffer, index, loaded[(self.window.spec.name, index)])
            self.metrics.window_pages_restored += len(found.restore[self.window.spec.name])
            hreq.window = buffer
        return found.prefix_pages

    def _load_components(
        self, hreq: HybridRequest, restore: Mapping[str, tuple[tuple[int, Location], ...]]
    ) -> tuple[dict[tuple[str, int], torch.Tensor], tuple[str, int] | None]:
        """Load and lock every listed component object: ``(objects by (component, page index),
        None)``; on the first failure unlock what this call locked and return ``({}, (component,
        page index))``."""
        loaded: dict[tuple[str, int], torch.Tensor] = {}
        locked: list[tuple[ComponentStore, str]] = []
        for store in self.stores:
            for index, _ in restore[store.spec.name]:
                page_hash = hreq.hashes[index]
                obj = store.load(page_hash)
                if obj is None:
                    for done, locked_hash in locked:
                        done.unlock(locked_hash)
                    return {}, (store.spec.name, index)
                store.lock(page_hash)
                locked.append((store, page_hash))
                loaded[(store.spec.name, index)] = obj
        hreq.locked.extend(locked)
        return loaded, None

    def complete(
        self,
        hreq: HybridRequest,
        snapshots: Mapping[int, torch.Tensor],
        window: WindowKV | None = None,
    ) -> None:
        """Insert the KV pages (the tier's write policy); save and back up the snapshots and the
        window pages of every full page this request computed (``window``: the buffer the
        model's prefill filled, required with a window component)."""
        if (window is None) != (self.window is None):
            raise ValueError(
                "complete: pass the window KV buffer exactly when the model has window layers"
            )
        existed = hreq.tree_pages
        self.tier.complete(hreq.kv)
        for store, page_hash in hreq.locked:
            store.unlock(page_hash)
        hreq.locked.clear()
        backups = bool(self.tier.config.l2_pages)
        for pos, state in sorted(snapshots.items()):
            if pos % self.page_size:
                raise ValueError(f"snapshot at token {pos} is not at a page boundary")
            pages = pos // self.page_size
            page_hash = hreq.hashes[pages - 1]
            self.snapshots.save(page_hash, state, parent_hash=self._parent(hreq, pages - 1))
            on_existing_prefix = pages <= existed
            if backups and (self.backup_on_existing or not on_existing_prefix):
                self.metrics.snapshot_backups += self._backup(self.snapshots, page_hash)
        if window is not None:
            assert self.window is not None
            assert self.windows is not None
            # A resume happens only at a checkpoint, so only the window pages before each new
            # snapshot can ever be read: keep those (their retention then follows the
            # snapshots' instead of competing with pages no resume needs).
            wanted = sorted(
                {
                    index
                    for pos in snapshots
                    for index in self.window.spec.pages_needed(
                        pos // self.page_size, self.page_size
                    )
                    if index >= hreq.prefix_pages
                }
            )
            for index in wanted:
                page_hash = hreq.hashes[index]
                self.windows.save(
                    page_hash,
                    self.window.page(window, index),
                    parent_hash=self._parent(hreq, index),
                )
                self.metrics.window_pages_saved += 1
                if backups:
                    self.metrics.window_backups += self._backup(self.windows, page_hash)
        for store in self.stores:  # apply component puts that finished meanwhile
            self._events.extend(store.poll())

    @staticmethod
    def _parent(hreq: HybridRequest, index: int) -> str | None:
        return hreq.hashes[index - 1] if index >= 1 else None

    @staticmethod
    def _backup(store: ComponentStore, page_hash: str) -> bool:
        """Back up one object; True when something moved (L1 -> L2 or -> L3)."""

        def moved() -> int:
            m = store.metrics
            return m.backups_l2 + m.backups_l3 + m.backups_l3_queued

        before = moved()
        store.backup(page_hash)
        return moved() > before

    @property
    def agreement_rounds(self) -> int:
        """Rounds the last prefix agreement took (1: the ranks agreed at once; 0: none yet)."""
        return self._group.rounds

    # -- maintenance --------------------------------------------------------------------------

    def evict_device(self) -> None:
        """Drop every unlocked L1 copy (KV pages and snapshots); lower tiers keep theirs."""
        self.tier.evict_device()
        for store in self.stores:
            store.evict_all(Location.L1)

    def poll(self) -> None:
        """Apply finished background transfers: the tier's, and the components' L3 backups
        (their completion events are kept for ``drain_events``)."""
        self.tier.poll()
        for store in self.stores:
            self._events.extend(store.poll())

    def drain_events(self) -> list[BackupEvent]:
        """The component backups that finished since the last call (completion events)."""
        return self._events.drain()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for every queued L3 transfer (KV pages and component objects), then poll."""
        self.tier.flush(timeout)
        for store in self.stores:
            self._events.extend(store.flush(timeout))

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.tier.close()

    def check_invariants(self) -> None:
        self.tier.check_invariants()
        for store in self.stores:
            store.check_invariants()


def run_request(
    cache: HybridCache, model: HybridMiniLlama, tokens: Sequence[int]
) -> tuple[torch.Tensor, HybridRequest, HybridPrepared]:
    """One request through ``cache`` and ``model`` in the documented call order (match,
    prepare, prefill of the suffix with its snapshots and window KV, complete). Returns the
    suffix's logits (rows ``prep.start ..``), the request and what ``prepare`` decided."""
    toks = list(tokens)
    hreq = cache.match(toks)
    prep = cache.prepare(hreq)
    logits, _, snapshots = model.prefill(
        torch.tensor(toks[prep.start :]),
        prep.start,
        prep.slots,
        cache.pool,
        prep.state,
        wait_layer=prep.wait_layer,
        snapshot_at=prep.snapshot_at,
        window=prep.window,
    )
    cache.complete(hreq, snapshots, prep.window)
    return logits, hreq, prep
