"""A hybrid cache: the KV tier (``HiCache``, component 0) plus a recurrent-checkpoint store.

Call order per request (one rank, the engine's thread)::

    hreq = cache.match(tokens)
    prep = cache.prepare(hreq)              # prefix = longest KV prefix ending at a checkpoint
    logits, _, snaps = model.prefill(tokens[prep.start:], prep.start, prep.slots, cache.pool,
                                     prep.state, wait_layer=prep.wait_layer,
                                     snapshot_at=prep.snapshot_at)
    cache.complete(hreq, snaps)             # save snapshots, back them up, release

How the prefix is fixed: ``HiCache.prepare`` settles its prefetch and then fixes the KV prefix at
its rank agreement (``RankGroup.agree_min(.., "prefix_pages")``). ``HybridCache`` gives the tier a
group that, at that point, lowers the KV prefix to the longest one whose recurrent snapshot it
can actually load (L1, L2 or L3; a missing or corrupt snapshot moves to the previous
checkpoint, down to 0 = recompute from the start). The snapshot is loaded right there, so the
prefix is never promised without its state.

Snapshots are taken at the request's last full page and at the branch point (the end of the
longest KV prefix already in the tree, when computation started before it). With
``backup_snapshots_on_existing_prefix`` (default), every new snapshot is backed up to L2/L3 if it
misses there, also when its prefix's KV was already backed up (the seed's write-through fix);
False reproduces the old behaviour (only snapshots on pages this request inserted are backed
up), for comparison.

Limits of this first slice: one rank (the cap is not yet agreed across ranks), one checkpoint
component (no sliding-window pools yet), synchronous snapshot I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hicache_store.backends.base import Backend
from hicache_store.engine.kv_pool import DeviceKVPool
from hicache_store.layout.namespace import Namespace
from hicache_store.tier.cache import HiCache, Request
from hicache_store.tier.config import TierConfig

from .components import ComponentSpec, HitRule, Location
from .state_l3 import StateL3
from .store import ComponentStore

#: the recurrent checkpoint component of ``HybridMiniLlama``.
RECURRENT = ComponentSpec("recurrent", 2, HitRule.CHECKPOINT)


class _CheckpointGroup:
    """A one-rank group whose prefix agreement is lowered to a loadable checkpoint."""

    rank = 0
    size = 1

    def __init__(self) -> None:
        self.cap: Callable[[int], int] | None = None

    def agree_min(self, value: int, what: str) -> int:
        if what == "prefix_pages" and self.cap is not None:
            return self.cap(value)
        return value


@dataclass
class HybridRequest:
    tokens: list[int]
    kv: Request
    hashes: list[str]
    tree_pages: int = 0
    prefix_pages: int = 0
    state: torch.Tensor | None = None
    locked: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class HybridPrepared:
    start: int
    slots: torch.Tensor
    wait_layer: Callable[[int], None] | None
    state: torch.Tensor | None
    snapshot_at: tuple[int, ...]


@dataclass
class HybridMetrics:
    requests: int = 0
    kv_prefix_tokens: int = 0  # what the KV tier alone could have reused
    hit_tokens: int = 0  # what was reused (KV and snapshot)
    snapshot_hits: int = 0
    snapshot_backups: int = 0


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
        spec: ComponentSpec = RECURRENT,
    ) -> None:
        if spec.rule is not HitRule.CHECKPOINT:
            raise ValueError("HybridCache manages one checkpoint component")
        self._group = _CheckpointGroup()
        self.tier = HiCache(namespace, config, pool, backend=backend, group=self._group)
        self.pool = pool
        self.page_size = namespace.page_size
        l3 = None
        if backend is not None and config.l2_pages > 0:
            l3 = StateL3(backend, namespace, spec, io_timeout_s=config.io_timeout_s)
        self.snapshots = ComponentStore(
            spec,
            state_shape,
            torch.float32,
            l1_slots=snapshot_l1_slots,
            l2_slots=snapshot_l2_slots if config.l2_pages > 0 else 0,
            l3=l3,
            device=pool.device,
        )
        self.backup_on_existing = backup_snapshots_on_existing_prefix
        self.metrics = HybridMetrics()

    # -- the request path -------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> HybridRequest:
        toks = list(tokens)
        kv = self.tier.match(toks)
        tree_pages = len(self.tier.tree.match(kv.hashes))
        return HybridRequest(toks, kv, list(kv.hashes), tree_pages)

    def prepare(self, hreq: HybridRequest) -> HybridPrepared:
        def cap(kv_pages: int) -> int:
            self.metrics.kv_prefix_tokens += kv_pages * self.page_size
            known = self.snapshots.availability(hreq.hashes[:kv_pages], check_l3=True)
            for p in range(kv_pages, 0, -1):
                if known[p - 1] is None:
                    continue
                state = self.snapshots.load(hreq.hashes[p - 1])  # None: corrupt or gone
                if state is not None:
                    self.snapshots.lock(hreq.hashes[p - 1])
                    hreq.locked.append(hreq.hashes[p - 1])
                    hreq.state = state
                    return p
            return 0

        self._group.cap = cap
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
        self.metrics.hit_tokens += prep.start
        full = len(hreq.tokens) // self.page_size
        ends = {full}
        if hreq.prefix_pages < hreq.tree_pages <= full:
            ends.add(hreq.tree_pages)  # the branch point
        snapshot_at = tuple(sorted(p * self.page_size for p in ends if p > hreq.prefix_pages))
        return HybridPrepared(prep.start, prep.slots, prep.wait_layer, hreq.state, snapshot_at)

    def complete(self, hreq: HybridRequest, snapshots: Mapping[int, torch.Tensor]) -> None:
        """Insert the KV pages (the tier's write policy), save and back up the snapshots."""
        existed = hreq.tree_pages
        self.tier.complete(hreq.kv)
        for h in hreq.locked:
            self.snapshots.unlock(h)
        hreq.locked.clear()
        for pos, state in sorted(snapshots.items()):
            if pos % self.page_size:
                raise ValueError(f"snapshot at token {pos} is not at a page boundary")
            pages = pos // self.page_size
            page_hash = hreq.hashes[pages - 1]
            parent = hreq.hashes[pages - 2] if pages >= 2 else None
            self.snapshots.save(page_hash, state, parent_hash=parent)
            on_existing_prefix = pages <= existed
            if self.tier.config.l2_pages and (self.backup_on_existing or not on_existing_prefix):
                before = self.snapshots.metrics.backups_l2 + self.snapshots.metrics.backups_l3
                self.snapshots.backup(page_hash)
                after = self.snapshots.metrics.backups_l2 + self.snapshots.metrics.backups_l3
                self.metrics.snapshot_backups += after > before

    # -- maintenance --------------------------------------------------------------------------

    def evict_device(self) -> None:
        """Drop every unlocked L1 copy (KV pages and snapshots); lower tiers keep theirs."""
        self.tier.evict_device()
        self.snapshots.evict_all(Location.L1)

    def flush(self) -> None:
        self.tier.flush()

    def close(self) -> None:
        self.tier.close()

    def check_invariants(self) -> None:
        self.tier.check_invariants()
        self.snapshots.check_invariants()
