"""The cache tier: L1 (device pools), L2 (host pools), L3 (any backend) under one page tree,
for full-attention KV and every other cache component of the model.

Primitives, in the order an engine calls them for each request (all on the engine's thread)::

    req = tier.match(tokens)      # walk the tree; find what L3 holds beyond; start a prefetch
    prep = tier.prepare(req)      # settle the prefetch (policy), agree on the prefix across
                                  # ranks, allocate L1 pages and slots, start the layer-wise load
    model.prefill(tokens[prep.start:], prep.start, prep.slots, pool, wait_layer=prep.wait_layer)
                                  # + each component's restored / produce slots
                                  #   (prep.components[name])
    tier.complete(req)            # insert the new pages and objects, write policy, release

    tier.poll()                   # apply finished background work (called by the above too)
    tier.drain_events()           # finished L3 backups, typed (``BackupEvent``)
    tier.flush()                  # wait until queued L3 transfers are done (tools, tests)
    tier.close()

Two more for a worker that does not compute the whole request itself (a P/D decode worker,
``hicache_store.pd``): ``tier.extend(req, tokens)`` between ``prepare`` and ``complete`` grows
the request by tokens it decodes (their pages join the tree at ``complete``), and
``tier.abort(req)`` instead of ``complete`` gives back everything ``match`` and ``prepare`` took
without inserting anything (its promised KV could not be supplied). ``match(tokens,
reuse=False)`` ignores every cached page (a retry that must not trust the cache).

**Components** (``tier.components``): sliding-window KV, recurrent checkpoints, a sidecar
draft model's KV, ... are pool adapters (``Component``) the tier keeps beside the KV on the
same page tree: their L1 slots, L2 rows and L3 objects, in one eviction order with the KV (each
pool evicts by the KV's policy, fed the same history of each page: ``tier.radix``). The prefix a request reuses is the longest at which
*every* component it needs can resume (``match_components``: every KV page, the window pages
before the end, the checkpoint at the end); their L3 objects are prefetched with the KV pages
and loaded into L1 at ``prepare``. The L2 copies of the objects a request's plan resumes with
are held from ``match`` until ``prepare`` has restored them (or ``abort``), and every object
the resume needs is locked before ``prepare`` makes room for any of them. ``Prepared.components[name]`` tells the engine which slots
hold the restored objects and which slots to fill with the objects the request produces (a
checkpoint at the request's last full page, at a branch point and every ``checkpoint_every``
pages; the window pages before each new checkpoint; every new page of a draft's KV).

Every state change is prepare-then-complete: pages and objects are locked from ``match`` (KV)
or ``prepare`` (components) until ``complete``, and L2 copies an L3 transfer reads or fills are
locked until its completion is applied in ``poll``, so nothing is evicted or reused in flight.
Policy (what to keep, when to wait) lives here; bytes move in ``kernels`` (L1 <-> L2, through
``tier.pools``) and ``objects`` (L2 <-> L3, through ``tier.transfers``).

**Ranks** (``group``, e.g. ``distributed.TorchGroup``): every number that changes what is
computed is agreed as the minimum over ranks at the same point on every rank, and every request
reaches the same agreements (``backup_acks`` in ``match``, ``prefetch_pages`` and
``prefix_pages`` in ``prepare``, ``backup_acks`` in ``complete``). With components the prefix
agreement descends (``prefix_pages:components``) until every rank can resume there, since a
checkpoint one rank lacks may be below another's best. KV backup completions are applied in the
order and number the first PP stage decides (seed 000 §2.1: its writing ranks' ready counts, one
``agree_min`` in which the other ranks vote ``NO_VOTE``); a rank whose transfer is not finished
waits for it (bounded). ``flush`` ends on every rank together.

Failure model: an L3 error, timeout, miss or corrupt object shortens the prefix that hits and is
counted; the request then recomputes more. Nothing in the engine's path raises because of L3,
nothing waits longer than the prefetch policy allows, and every host row taken for a transfer is
returned when the transfer ends; rows of reads the engine stopped waiting for are *quarantined*
until the read has ended (issue 17: ``quarantined_host_pages``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hicache_store._sync import run_sync, submit
from hicache_store.backends.base import Backend
from hicache_store.kernels.ops import Backend as KernelBackend
from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.topology import Topology, shard_of
from hicache_store.objects import IOStats, L3Link
from hicache_store.objects.manifest import ensure_manifest
from hicache_store.tenant import KeyRing

from .components import KV, Component, ComponentMatch, HitRule, Placement, match_components
from .config import TierConfig, prefetch_timeout
from .eviction import EvictionPolicy, make_eviction_policy
from .group import (
    NO_VOTE,
    CacheEventDivergenceError,
    LocalGroup,
    RankGroup,
    ack_deciders,
    context,
    note,
)
from .host_pool import HostPagePool
from .metrics import TierMetrics
from .pools import LayerLoad, Pools
from .radix import PageNode, PageTree, Tier
from .transfers import BackupDone, BackupEvent, Fetch, Prefetch, ReadEnded, Transfers

log = logging.getLogger(__name__)

#: ``metrics.extra`` counters of requests with components that resumed before the prefix every
#: component allowed (``limited_by_<component>`` count the components that shortened it):
#: because what L3 holds was not in L2 at ``prepare`` (not fetched: the prefetch threshold, its
#: policy's wait, no free row; or a memory copy went meanwhile) ...
LIMITED_BY_PREFETCH = "limited_by_prefetch"
#: ... or because another rank could resume less.
LIMITED_BY_RANKS = "limited_by_ranks"


def page_slots(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """Token slots of device ``pages`` in order: page ``p`` holds slots
    ``p * page_size .. p * page_size + page_size - 1``."""
    return (
        torch.tensor(list(pages), dtype=torch.int64).repeat_interleave(page_size) * page_size
        + torch.arange(page_size, dtype=torch.int64).repeat(len(pages))
    )


@contextlib.contextmanager
def _timed(req: Request) -> Iterator[None]:
    """Count the enclosed time as the request's I/O (data movement), not bookkeeping."""
    started = time.perf_counter()
    try:
        yield
    finally:
        req.io_s += time.perf_counter() - started


class TierCapacityError(RuntimeError):
    """L1 cannot hold what one request needs, even after evicting everything unlocked."""


class DevicePagePool(Protocol):
    """What the tier needs from an engine's KV pool (L1): paged K/V buffers and an allocator."""

    page_size: int
    num_pages: int

    @property
    def k_buffers(self) -> Sequence[torch.Tensor]: ...

    @property
    def v_buffers(self) -> Sequence[torch.Tensor]: ...

    @property
    def num_free_pages(self) -> int: ...

    def alloc(self, count: int) -> list[int]: ...

    def free(self, pages: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class ComponentSlots:
    """A component's L1 slots for one request (page indices count from the prompt's start).

    ``restored``: (page index, slot) of the objects the resume needs, in L1 now (for a
    checkpoint: the snapshot after that page). ``produce``: (page index, slot) the engine fills
    while computing (a checkpoint after that page; a window or draft page).
    """

    restored: tuple[tuple[int, int], ...] = ()
    produce: tuple[tuple[int, int], ...] = ()


@dataclass
class Request:
    """One request's state between ``match`` and ``complete``.

    ``bookkeeping_s``: time the tier spent on the engine thread deciding (matching, planning,
    scheduling), excluding ``io_s``: time spent moving data or waiting for the backend
    (existence checks, L1 <-> L2 copies), and excluding prefetch waits.
    """

    tokens: torch.Tensor
    hashes: list[str]
    nodes: list[PageNode]
    l1_pages: int
    l2_pages: int
    need: tuple[int, ...] = ()
    branches: tuple[int, ...] = ()
    prefetch: Prefetch | None = None
    l3_pages: int = 0
    prefix_pages: int = 0
    new_device_pages: list[int] = field(default_factory=list)
    loading: list[PageNode] = field(default_factory=list)
    host_locked: list[PageNode] = field(default_factory=list)
    load: LayerLoad | None = None
    borrowed: list[tuple[PageNode, LayerLoad]] = field(default_factory=list)
    components: dict[str, ComponentSlots] = field(default_factory=dict)
    held: list[tuple[PageNode, int]] = field(default_factory=list)
    pinned: list[tuple[PageNode, int]] = field(default_factory=list)
    l3_found: dict[int, list[bool]] = field(default_factory=dict)
    l3_kv_pages: int = 0
    rounds: int = 0
    bookkeeping_s: float = 0.0
    io_s: float = 0.0


@dataclass(frozen=True)
class Prepared:
    """What the engine needs to compute a request: where to start, where KV lives, and each
    component's slots."""

    start: int
    slots: torch.Tensor
    wait_layer: Callable[[int], None] | None
    components: Mapping[str, ComponentSlots] = field(default_factory=dict)


def _policy(name: str, capacity: int) -> EvictionPolicy[PageNode]:
    """An eviction policy for a pool of ``capacity`` pages (``TierConfig.eviction_policy``)."""
    return make_eviction_policy(name, max(capacity, 1), lambda n: n.depth, lambda n: n.page_hash)


def tokens_digest(tokens: torch.Tensor) -> str:
    """A short digest of a request's tokens (an argument of its logged decisions)."""
    data = tokens.to(torch.int64).numpy().astype("<u4").tobytes()
    return hashlib.sha256(data).hexdigest()[:12]


class HiCache:
    """A three-tier cache for one rank: KV plus ``components``. See the module docstring.

    ``group``: the deployment's ranks (``LocalGroup`` for one process); ``rank`` is this rank's
    topology rank, equal to its rank in the group. ``ack_wait_s``: how long a rank waits for a
    completion the deciding stage already applied (default: twice the L3 timeout plus 10 s).
    ``keys``: the tenant key ring of a sealed namespace (``hicache_store.tenant``); it seals the
    components' objects too (their namespaces are sealed with the model's).
    """

    def __init__(
        self,
        namespace: Namespace,
        config: TierConfig,
        device_pool: DevicePagePool,
        *,
        backend: Backend | None = None,
        topology: Topology | None = None,
        rank: int = 0,
        group: RankGroup | None = None,
        kernel_backend: KernelBackend = "auto",
        components: Sequence[Component] = (),
        ack_wait_s: float | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        self.namespace = namespace
        self.config = config
        self.pool = device_pool
        self.topology = topology or Topology()
        self.rank = rank
        self.group: RankGroup = group or LocalGroup()
        self.kernel_backend: KernelBackend = kernel_backend
        if device_pool.page_size != namespace.page_size:
            raise ValueError(
                f"device pool page size {device_pool.page_size} != namespace's {namespace.page_size}"
            )
        if self.group.size > 1 and (
            self.group.size != self.topology.world_size or self.group.rank != rank
        ):
            raise ValueError(
                f"group rank {self.group.rank}/{self.group.size} does not match topology rank "
                f"{rank} of {self.topology} ({self.topology.world_size} ranks)"
            )
        if backend is not None and config.l2_pages == 0:
            raise ValueError(
                "an L3 backend needs L2: set TierConfig(l2_pages=...) > 0 (L3 pages move "
                "through host memory; buffer_only mode keeps L2 to in-flight pages)"
            )
        self.shard = shard_of(namespace, self.topology, rank)
        self.layout = UnifiedPageLayout.for_shard(namespace, self.shard)
        self.device = DevicePool.mha(device_pool.k_buffers, device_pool.v_buffers)
        self.tree = PageTree(
            _policy(config.eviction_policy, config.l1_pages),
            _policy(config.eviction_policy, config.l2_pages),
            l3_record_limit=config.l3_record_limit,
        )
        self.metrics = TierMetrics()
        self.host = HostPagePool(config.l2_pages, self.layout.page_bytes)
        self.l3: L3Link | None = None
        self._registered = False
        self._backend = backend
        self._keys = keys
        if backend is not None:
            self.l3 = self._link(namespace, self.topology, rank, 0, read_only=False)
            if self.l3.can_write:
                self._write_manifest(namespace)
            self._registered = self._register_host_pool(backend)
        kv = Pools(KV, namespace, self.layout, self.device, self.host, self.l3, kernel_backend)
        self.parts: dict[int, Pools] = {0: kv}
        self.components: dict[str, Component] = {}
        for component in components:
            self._add_component(component)
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hicache-load")
        self._closed = False  # set by ``close``: requests are refused from then on
        self._transfers = Transfers(submit)
        self._ready_kv: list[BackupDone] = []
        self._kv_in_flight = 0
        self._prefetches: list[Prefetch] = []
        # Bounded: an engine that never drains them cannot grow it (the oldest go first).
        self._events: collections.deque[BackupEvent] = collections.deque(maxlen=1 << 16)
        self._last_rounds = 0
        self._decides_acks = self.group.size == 1 or rank in ack_deciders(
            namespace, self.topology
        )
        self.ack_wait_s = ack_wait_s if ack_wait_s is not None else 2 * config.io_timeout_s + 10
        self.requests_seen = 0
        # id(node) -> the L2 -> L1 load filling its L1 copy, while a request that prepared it
        # is in flight (or, for a failed load, while a request still holds the copy): a later
        # request using that copy waits for the same load (and fails with it).
        self._filling: dict[int, LayerLoad] = {}

    # == construction ========================================================================

    def _link(
        self, namespace: Namespace, topology: Topology, rank: int, tag: int, *, read_only: bool
    ) -> L3Link:
        assert self._backend is not None
        link = L3Link(
            self._backend,
            namespace,
            topology,
            rank,
            max_inflight_bytes=self.config.max_inflight_bytes,
            io_timeout_s=self.config.io_timeout_s,
            keys=self._keys if namespace.sealed else None,
            component=tag,
            read_only=read_only,
        )
        link.trusted_hashes = True  # the tier hashes tokens itself
        return link

    def _add_component(self, component: Component) -> None:
        """Plug ``component``'s pools in: its shard, host pool, L3 link and tree policies."""
        spec, ns = component.spec, component.namespace
        if component.name in self.components or spec.tag in self.parts:
            raise ValueError(f"component {component.name!r} (tag {spec.tag}) is already there")
        if f"limited_by_{component.name}" in (LIMITED_BY_PREFETCH, LIMITED_BY_RANKS):
            raise ValueError(f"component name {component.name!r} is reserved (metrics)")
        if ns.hash_algo != self.namespace.hash_algo:
            raise ValueError(f"{component.name}: its namespace hashes pages differently")
        if component.follows_kv and ns.page_size != self.namespace.page_size:
            raise ValueError(f"{component.name}: following the KV pages needs their page size")
        if component.placement is Placement.GRID:
            topology, rank, read_only = self.topology, self.rank, False
        else:  # every rank holds all of it, rank 0 writes
            topology, rank, read_only = Topology(), 0, self.rank != 0
        layout = UnifiedPageLayout.for_shard(ns, shard_of(ns, topology, rank))
        host = HostPagePool(component.l2_slots if self.config.l2_pages else 0, layout.page_bytes)
        link = None
        if self._backend is not None and host.num_pages:
            link = self._link(ns, topology, rank, spec.tag, read_only=read_only)
            if link.can_write:
                self._write_manifest(ns)
        slots = component.slots
        self.parts[spec.tag] = Pools(
            spec,
            ns,
            layout,
            component.device,
            host,
            link,
            self.kernel_backend,
            free=None if slots is None else list(range(slots - 1, -1, -1)),
            num_slots=slots or 0,
            follows_kv=component.follows_kv,
        )
        # The KV's policy, one instance per pool: one eviction order across components
        # (``tier.radix``, "One eviction order").
        name = self.config.eviction_policy
        self.tree.add_component(
            spec.tag,
            _policy(name, host.num_pages),
            None if slots is None else _policy(name, slots),
        )
        self.components[component.name] = component

    def _register_host_pool(self, backend: Backend) -> bool:
        """Offer the KV's L2 pool to backends that read into registered memory without a copy
        (Mooncake's ``register_buffer``, 3FS's USRBIO iovec). Best effort: unregistered, the
        backend stages through its own buffers."""
        register = getattr(backend, "register_host_buffer", None)
        if register is None or self.host.num_pages == 0:
            return False
        try:
            run_sync(register(self.host.data.numpy().data), timeout=self.config.io_timeout_s)
        except Exception as exc:
            log.warning("could not register the host pool with the backend: %s", exc)
            return False
        return True

    def _write_manifest(self, namespace: Namespace) -> None:
        """Record ``namespace`` in L3 (``M_{digest}``) so operators' tools can describe it.
        Best effort: a store that cannot take it still serves KV; tools then show it unknown."""
        assert self._backend is not None
        try:
            run_sync(ensure_manifest(self._backend, namespace), timeout=self.config.io_timeout_s)
        except Exception as exc:
            log.warning("could not write the namespace manifest: %s", exc)

    # == the request path ===================================================================

    def match(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        need: Collection[str] | None = None,
        reuse: bool = True,
    ) -> Request:
        """Find the cached prefix of ``tokens`` in every tier and start an L3 prefetch.

        ``need``: the components this request resumes with (default: all; a request that does
        not speculate leaves out a draft model's KV). ``reuse=False``: use no cached page or
        object and start no prefetch (the request computes, or receives, everything;
        ``complete`` still inserts its pages and produced objects)."""
        self._check_open("match")
        started = time.perf_counter()
        token_tensor = torch.as_tensor(tokens, dtype=torch.int64)
        self.requests_seen += 1
        if self.group.size > 1:
            context(
                self.group,
                request=self.requests_seen,
                tokens=int(token_tensor.numel()),
                digest=tokens_digest(token_tensor),
            )
        self.poll()
        hashes = page_hashes(
            token_tensor.numpy().astype("<u4", copy=False),
            self.namespace.page_size,
            algo=self.namespace.hash_algo,
        )
        self.tree.begin_request()
        nodes = self.tree.match(hashes) if reuse else []
        l1 = PageTree.resident_prefix(nodes, Tier.L1)
        in_memory = 0
        for node in nodes:
            if node.device_page is None and node.host_page is None:
                break
            in_memory += 1
        wanted = self.components if need is None else need
        unknown = set(wanted) - set(self.components)
        if unknown:
            raise ValueError(f"need: no component named {sorted(unknown)}")
        tags = tuple(self.components[name].tag for name in wanted)
        req = Request(token_tensor, hashes, [], l1, in_memory - l1, tags, _branches(nodes))
        held = nodes[:in_memory]
        self._hold(req, held)
        self.tree.touch(held)
        if reuse and self.l3 is not None and (in_memory < len(hashes) or tags):
            self._start_prefetch(req)
        if self.group.size > 1:
            note(self.group, (req.l1_pages, req.l2_pages), "match_l1_l2_pages")
        req.bookkeeping_s += time.perf_counter() - started - req.io_s
        return req

    def prepare(self, req: Request) -> Prepared:
        """Settle the prefetch, fix the prefix, allocate L1 pages and slots, start loading.

        ``wait_layer`` also waits for the loads of other requests in flight that are still
        filling L1 copies this request uses (and raises if one of them failed)."""
        self._check_open("prepare")
        started = time.perf_counter()
        page = self.namespace.page_size
        waited = 0.0
        io_before = req.io_s
        if req.prefetch is not None:
            waited = self._settle_prefetch(req)
        else:
            # Every rank must reach every agreement, in the same order: a rank that started no
            # prefetch (nothing in L3, or its existence check failed) joins with 0, so the
            # group uses no prefetched page. Skipping it would pair this rank's next collective
            # with another rank's prefetch agreement: a wrong minimum, then a hang.
            self.group.agree_min(0, "prefetch_pages")
        # A prompt must leave at least one token to compute (its logits are the output).
        usable = min(len(req.nodes), (len(req.tokens) - 1) // page)
        prefix = self._agree_prefix(req, usable)
        self._release(req, req.nodes[prefix:])
        del req.nodes[prefix:]
        req.prefix_pages = prefix
        req.loading = [n for n in req.nodes if n.device_page is None]
        # L1 copies another request's load is still filling: this request waits for it too.
        req.borrowed = [(n, load) for n in req.nodes if (load := self._filling.get(id(n)))]
        new_pages = math.ceil(len(req.tokens) / page) - prefix
        self._make_room_l1(len(req.loading) + new_pages)
        for node, device_page in zip(req.loading, self.pool.alloc(len(req.loading)), strict=True):
            self.tree.set_device(node, device_page)
        req.new_device_pages = self.pool.alloc(new_pages)
        if req.loading:
            self._start_load(req)
        wait_layer = _wait_for(self._loads(req))
        with _timed(req):
            restored = self._restore_components(req)
        for tag in req.need:
            part = self.parts[tag]
            req.components[part.name] = ComponentSlots(restored[tag], self._produce(req, part))
        slots = self._slots(req)
        self._count_hits(req)
        if self.group.size > 1:
            note(self.group, prefix * page, "prefix_tokens")
        req.bookkeeping_s += time.perf_counter() - started - waited - (req.io_s - io_before)
        return Prepared(prefix * page, slots, wait_layer, dict(req.components))

    def extend(self, req: Request, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Grow a prepared request by ``tokens`` that follow its sequence (tokens a decode
        worker generates after the prompt); return the slots of the whole sequence.

        Call between ``prepare`` and ``complete`` (or ``abort``), any number of times. The
        device pages the new tokens need are allocated now (evicting like ``prepare``;
        ``TierCapacityError`` if L1 cannot hold them), the slots of earlier tokens do not
        change, and ``complete`` inserts every full page of the extended sequence. Component
        objects are produced as ``prepare`` planned them (for the prompt's pages): the
        extension adds KV pages only.
        """
        if not req.new_device_pages:
            raise ValueError("extend: the request is not prepared (or already completed)")
        page = self.namespace.page_size
        new = torch.as_tensor(tokens, dtype=torch.int64)
        if new.dim() != 1:
            raise ValueError(f"extend: tokens must be 1-D, got shape {tuple(new.shape)}")
        if not new.numel():
            return self._slots(req)
        full = len(req.tokens) // page
        req.tokens = torch.cat((req.tokens, new))
        req.hashes = req.hashes[:full] + page_hashes(
            req.tokens[full * page :].numpy().astype("<u4", copy=False),
            page,
            algo=self.namespace.hash_algo,
            prior_hash=req.hashes[full - 1] if full else None,
        )
        needed = math.ceil(len(req.tokens) / page) - req.prefix_pages - len(req.new_device_pages)
        if needed > 0:
            self._make_room_l1(needed)
            req.new_device_pages.extend(self.pool.alloc(needed))
        return self._slots(req)

    def abort(self, req: Request) -> None:
        """Give back everything ``match`` (and ``prepare``) took for ``req``, inserting nothing.

        For a request that will not be completed: its promised KV could not be supplied (a
        P/D decode worker's local restore or remote reception failed). Waits for its L2 -> L1
        load to end (bounded by the copy; a failed load is the usual reason to abort and is
        not re-raised); the L1 copies that load was filling are dropped, never trusted, since
        it may have stopped half way (a copy another request in flight still holds stays: that
        request waits for the same load, ``prepare``, and fails with it; so does any later one
        using the copy of a failed load); the request's new device pages are freed; every lock is
        released, the plan's holds on L2 copies of component objects too; component slots taken
        for objects to produce go back to their pools.
        Prefetched L2 pages and objects stay cached (their reads were verified). Afterwards the
        request is dead: neither ``complete`` nor ``extend`` it.
        """
        op = req.prefetch
        if op is not None and not op.settled:  # matched, never prepared
            for fetch in op.fetches():  # rows return now, or when their reads end
                self._abandon(fetch)
            op.settled = True
        for load in self._loads(req):
            with contextlib.suppress(Exception):
                load.wait_all()
        for node in req.host_locked:
            self.tree.release_host(node)
        req.host_locked.clear()
        self._unpin(req)
        self._release_components(req)
        for name, slots in req.components.items():  # slots taken for objects never produced
            part = self.parts[self.components[name].tag]
            if part.free is not None:
                part.free.extend(slot for _, slot in slots.produce)
        req.components.clear()
        self.pool.free(req.new_device_pages)
        req.new_device_pages = []
        held = list(req.nodes)
        self._release(req, held)
        # Its own load's L1 copies, and copies another request's failed load filled. One that
        # another request still holds stays (that request waits for the same load: it fails
        # with it, or the copy is good) and so does its failed load's entry, so that a later
        # request using the copy fails too rather than trusting it.
        suspect = [*req.loading, *(n for n, load in req.borrowed if load.failed)]
        for node in sorted(suspect, key=lambda n: -n.depth):  # deepest first: prefix-closed
            if node.device_page is None or node.lock or node.l1_children:
                continue
            self.pool.free([node.device_page])
            self.tree.set_device(node, None)  # drops the objects restored beside it too
            self._filling.pop(id(node), None)
        if req.load is not None and not req.load.failed:  # copies others hold are good
            for node in req.loading:
                if self._filling.get(id(node)) is req.load:
                    del self._filling[id(node)]
        req.load, req.borrowed, req.loading, req.nodes = None, [], [], []
        for node in reversed(held):
            self.tree.prune(node)
        self.poll()

    def _slots(self, req: Request) -> torch.Tensor:
        """Token slots of ``req``'s whole sequence: its prefix pages, then its new pages."""
        device_pages = [n.device_page for n in req.nodes] + req.new_device_pages
        return page_slots(device_pages, self.namespace.page_size)[: len(req.tokens)]  # type: ignore[arg-type]

    def complete(self, req: Request) -> None:
        """Insert the request's new pages and objects, apply the write policy, release all."""
        started = time.perf_counter()
        page = self.namespace.page_size
        io_before = req.io_s
        loads = self._loads(req)
        if loads:
            with _timed(req):
                for load in loads:  # raises if a copy the request computed with failed
                    load.wait_all()
        if req.load is not None:
            self.metrics.bytes_l2_to_l1 += len(req.loading) * self.layout.page_bytes
            for node in req.loading:
                if self._filling.get(id(node)) is req.load:
                    del self._filling[id(node)]
        req.borrowed = []
        for node in req.host_locked:
            self.tree.release_host(node)
        req.host_locked.clear()
        if self.config.host_mode == "buffer_only":
            for node in req.loading:
                self._drop_host_copy(node)
        full = len(req.tokens) // page
        path = self.tree.insert(req.hashes[:full])
        new_nodes = path[req.prefix_pages :]
        spare = req.new_device_pages[len(new_nodes) :]  # the partial last page
        for node, device_page in zip(new_nodes, req.new_device_pages, strict=False):
            if node.device_page is None:
                self.tree.set_device(node, device_page)
                node.hits = max(node.hits, 1)
            else:  # cached meanwhile by another request: keep that copy
                spare.append(device_page)
        produced = self._keep_produced(req, path)
        self.pool.free(spare)
        self.tree.touch(path)
        self._release(req, req.nodes)
        self._release_components(req)
        threshold = self.config.backup_threshold
        if threshold and self.config.l2_pages:
            hot = [n for n in path if n.hits >= threshold]
            restored = [
                (path[i], self.components[name].tag)
                for name, slots in req.components.items()
                for i, _ in slots.restored
            ]
            with _timed(req):  # the L1 -> L2 copies are data movement, not bookkeeping
                if hot:
                    self._backup_to_host(hot[-1])
                # New objects, and used ones a backup missed (only what is missing moves).
                for node, tag in [*produced, *restored]:
                    if node.hits >= threshold:
                        self._backup_held(node, tag)
        self.poll()
        req.bookkeeping_s += time.perf_counter() - started - (req.io_s - io_before)

    def evict_device(self) -> None:
        """Evict every unlocked copy from L1 (KV and components; lower tiers keep theirs;
        write-back backs up first). For tools and tests that need a cold L1."""
        with contextlib.suppress(TierCapacityError):  # locked pages cannot go: that is fine
            self._make_room_l1(self.pool.num_pages)
        for part in self.parts.values():
            if part.free is not None:
                while (node := self.tree.pop_victim(Tier.L1, part.tag)) is not None:
                    self._evict_held_l1(node, part)

    def drop(self, page_hash: str, component: str) -> bool:
        """Drop this rank's L1 and L2 copies of one component object (a rank that lost state;
        tools and tests). False when it has none or a request or transfer is using one."""
        part = self.parts[self.components[component].tag]
        node = self.tree.get(page_hash)
        held = None if node is None else node.held(part.tag)
        if node is None or held is None or not held.in_memory or held.lock or held.host_lock:
            return False
        if held.l1 is not None and part.free is not None:
            part.free.append(held.l1)
            self.tree.set_held(node, part.tag, Tier.L1, None)
        if held.l2 is not None:
            part.host.free([held.l2])
            self.tree.set_held(node, part.tag, Tier.L2, None)
        self.tree.prune(node)
        return True

    # == background work =====================================================================

    def poll(self) -> None:
        """Apply completed L3 transfers (engine thread only). With several ranks, KV backup
        completions are applied in the order and number the first PP stage decides."""
        self._drain()
        if self.group.size > 1:
            vote = len(self._ready_kv) if self._decides_acks else NO_VOTE
            agreed = self.group.agree_min(vote, "backup_acks")
            agreed = 0 if agreed == NO_VOTE else agreed
            self._await_ready(agreed)
        else:
            agreed = len(self._ready_kv)
        for done in self._ready_kv[:agreed]:
            self._apply_backup(done)
        del self._ready_kv[:agreed]
        self._prefetches = [op for op in self._prefetches if not op.retired()]
        self.tree.trim_l3_record()

    def _drain(self) -> None:
        """Take completions off the I/O queue: KV backups wait for the agreement; component
        backups and returns of abandoned rows are rank-local and applied at once."""
        acks = self._transfers.acks
        while acks:
            ack = acks.popleft()
            if isinstance(ack, ReadEnded):
                self._return_row(ack.fetch)
            elif ack.tag == 0:
                self._ready_kv.append(ack)
            else:
                self._apply_backup(ack)

    def _await_ready(self, agreed: int) -> None:
        deadline = time.monotonic() + self.ack_wait_s
        while len(self._ready_kv) < agreed:
            if self._kv_in_flight < agreed:
                raise CacheEventDivergenceError(
                    f"rank {self.rank}: the first stage applied {agreed} backup completions "
                    f"but this rank has only {self._kv_in_flight} backups queued"
                )
            if time.monotonic() > deadline:
                raise CacheEventDivergenceError(
                    f"rank {self.rank}: {agreed - len(self._ready_kv)} backups did not "
                    f"complete within {self.ack_wait_s}s"
                )
            time.sleep(0.0005)
            self._drain()

    def drain_events(self) -> list[BackupEvent]:
        """The L3 backups finished since the last call, oldest first (``BackupEvent``: page,
        component, stored or not)."""
        events = list(self._events)
        self._events.clear()
        return events

    def _idle(self) -> bool:
        return not self._transfers.in_flight and all(p.finished.is_set() for p in self._prefetches)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued L3 transfer has finished, then ``poll`` (every rank the same
        number of rounds)."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            idle = self._idle()
            if self.group.size > 1:
                state = 2 if idle else (0 if time.monotonic() > deadline else 1)
                agreed = self.group.agree_min(state, "flush_idle")
                if agreed == 2:
                    return
                if agreed == 0:
                    raise TimeoutError("L3 transfers did not finish in time on some rank")
            elif idle:
                return
            elif time.monotonic() > deadline:
                raise TimeoutError("L3 transfers did not finish in time")
            time.sleep(0.002)

    def close(self) -> None:
        """Finish the backups in flight (``flush``), stop the loader, unregister the host pool.
        Requests are refused from then on (``match`` / ``prepare`` raise); a second call is
        harmless."""
        self._closed = True
        try:
            self.flush()
        finally:
            self._loader.shutdown(wait=True)
            if self._registered and self.l3 is not None:
                unregister = getattr(self.l3.backend, "unregister_host_buffer", None)
                if unregister is not None:
                    try:
                        run_sync(
                            unregister(self.host.data.numpy().data),
                            timeout=self.config.io_timeout_s,
                        )
                    except Exception as exc:
                        log.warning("could not unregister the host pool: %s", exc)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"HiCache.{call}: the cache tier is closed (close() was called: its "
                               "loader and backups are stopped); open a new HiCache")

    # == accounting (tests and the leak check) ==============================================

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the tier's bookkeeping is inconsistent (tests, debugging).

        L1 is prefix-closed; so is L2 in ``cache`` mode (in ``buffer_only`` mode L2 holds only
        pages in transit); the tree's policies and counters agree with a full scan; every host
        row in use is referenced by the tree or a prefetch, and every component slot is free
        or referenced.
        """
        tiers = (Tier.L1,) if self.config.host_mode == "buffer_only" else (Tier.L1, Tier.L2)
        filled = {id(n): n for n in self.tree.nodes()}
        for key in self._filling:
            node = filled.get(key)
            assert node is not None, "a load is recorded for a page not in the tree"
            assert node.device_page is not None, "a load is recorded for a page not in L1"
            assert node.lock, "a load is recorded for a page no request holds"
        self.tree.check_prefix_closed(tiers)
        self.tree.check_queues()
        for part in self.parts.values():
            used, referenced = part.host.used, self._rows_referenced(part.tag)
            if used != referenced:
                raise AssertionError(f"{part.name}: {used} host rows in use, {referenced} held")
            if part.free is not None:
                slots = [h.l1 for n in self.tree.nodes() if (h := n.held(part.tag)) and h.l1 is not None]
                assert len(set(slots)) == len(slots), f"{part.name}: a slot held twice"
                assert not set(slots) & set(part.free), f"{part.name}: a held slot is free"

    def host_pages_referenced(self) -> int:
        """KV host rows the tree or a prefetch holds (must always equal ``host.used``)."""
        return self._rows_referenced(0)

    def _rows_referenced(self, tag: int) -> int:
        if tag == 0:
            in_tree = sum(1 for n in self.tree.nodes() if n.host_page is not None)
        else:
            in_tree = sum(
                1 for n in self.tree.nodes() if (h := n.held(tag)) and h.l2 is not None
            )
        in_flight = sum(
            1 for op in self._prefetches for f in op.fetches() if f.tag == tag and f.row >= 0
        )
        return in_tree + in_flight

    def quarantined_host_pages(self) -> int:
        """Host rows held by abandoned prefetch reads that have not ended yet; they return to
        their pools as each read ends."""
        return sum(
            1
            for op in self._prefetches
            for f in op.fetches()
            if f.abandoned and f.done is None and f.row >= 0
        )

    @property
    def agreement_rounds(self) -> int:
        """Values the last prefix agreement went through (1: the ranks agreed at once; each
        further one: some rank could not resume at the previous value and lowered it)."""
        return self._last_rounds

    # == internals: KV ========================================================================

    def _hold(self, req: Request, nodes: Sequence[PageNode]) -> None:
        """Lock ``nodes`` for ``req``: their L1 copy, and their L2 copy when it must be loaded."""
        for node in nodes:
            self.tree.lock(node)
            node.hits += 1
            if node.device_page is None:
                self.tree.hold_host(node)
                req.host_locked.append(node)
        req.nodes.extend(nodes)

    def _release(self, req: Request, nodes: Sequence[PageNode]) -> None:
        released = set(map(id, nodes))
        for node in nodes:
            self.tree.unlock(node)
        for node in [n for n in req.host_locked if id(n) in released]:
            self.tree.release_host(node)
        req.host_locked = [n for n in req.host_locked if id(n) not in released]

    def _count_hits(self, req: Request) -> None:
        page = self.namespace.page_size
        m = self.metrics
        m.requests += 1
        m.input_tokens += len(req.tokens)
        l1 = min(req.l1_pages, req.prefix_pages)
        l2 = min(req.l2_pages, req.prefix_pages - l1)
        l3 = req.prefix_pages - l1 - l2
        m.hit_tokens_l1 += l1 * page
        m.hit_tokens_l2 += l2 * page
        m.hit_tokens_l3 += l3 * page
        m.computed_tokens += len(req.tokens) - req.prefix_pages * page

    def _make_room_l1(self, needed: int) -> None:
        if self.pool.num_free_pages >= needed:
            return
        write_back = self.config.write_policy == "write_back" and self.config.l2_pages
        writes_l3 = self.l3 is not None and self.l3.can_write
        while (node := self.tree.pop_victim(Tier.L1)) is not None:
            if write_back:
                # An L2 copy alone is not a backup: its L3 write may have failed or been
                # dropped (a full queue), and L2 would then evict the only copy.
                dirty = writes_l3 and not (node.in_l3 or node.l3_pending)
                if node.host_page is None or dirty:
                    self._backup_to_host(node)
                for tag, held in (node.comps or {}).items():
                    if held.l1 is not None and self.parts[tag].follows_kv:
                        self._backup_held(node, tag)  # it loses its L1 copy with the page
            assert node.device_page is not None
            self.pool.free([node.device_page])
            self.tree.set_device(node, None)
            self.metrics.evictions_l1 += 1
            self.tree.prune(node)
            if self.pool.num_free_pages >= needed:
                return
        raise TierCapacityError(
            f"L1 holds {self.pool.num_free_pages} free pages after eviction; the request needs "
            f"{needed}: give the device pool more pages than the longest request"
        )

    def _loads(self, req: Request) -> list[LayerLoad]:
        """The L2 -> L1 loads ``req`` computes with: other requests' it borrows, then its own."""
        loads = list({id(load): load for _, load in req.borrowed}.values())
        return loads if req.load is None else [*loads, req.load]

    def _start_load(self, req: Request) -> None:
        nodes = req.loading
        kv = self.parts[0]
        with _timed(req):
            rows = kv.host_runs([n.host_page for n in nodes])  # type: ignore[misc]
        slots = [n.device_page for n in nodes]

        def copy(layers: tuple[int, int] | None) -> None:
            kv.unpack(rows, slots, layers)  # type: ignore[arg-type]

        if not self.config.layerwise_load:
            req.load = LayerLoad(self._loader, lambda _layer: copy(None), range(1), per_layer=False)
        else:
            start, stop = self.layout.layer_start, self.layout.layer_stop
            req.load = LayerLoad(
                self._loader, lambda layer: copy((layer, layer + 1)), range(start, stop)
            )
        for node in nodes:
            self._filling[id(node)] = req.load

    def _alloc_host(self, count: int) -> list[int] | None:
        pages = self.host.alloc(count)
        if pages is not None or self.config.host_mode == "buffer_only":
            return pages
        while self.host.free_pages < count and (node := self.tree.pop_victim(Tier.L2)):
            self._drop_host_copy(node)
            self.metrics.evictions_l2 += 1
        return self.host.alloc(count)

    def _drop_host_copy(self, node: PageNode) -> None:
        if node.host_page is None or node.host_lock > 0:
            return
        self.host.free([node.host_page])
        self.tree.set_host(node, None)
        self.tree.prune(node)

    def _backup_to_host(self, node: PageNode) -> None:
        """Copy ``node`` and every ancestor without an L2 copy from L1 to L2, then queue L3.

        Ancestors first, so L2 stays prefix-closed. Stops (and counts) when L2 is full.
        """
        buffer_only = self.config.host_mode == "buffer_only"
        path = node.path()
        missing = [
            n
            for n in path
            if n.host_page is None
            and n.device_page is not None
            # In buffer-only mode L2 is only a staging area on the way to L3.
            and not (buffer_only and (n.in_l3 or n.l3_pending))
        ]
        if any(n.host_page is None and n.device_page is None for n in path):
            return  # a hole above: this chain cannot be backed up as a prefix
        if missing:
            # Pin the chain's existing L2 copies: evicting one to make room would leave a hole.
            pinned = [n for n in path if n.host_page is not None]
            for n in pinned:
                self.tree.hold_host(n)
            try:
                pages = self._alloc_host(len(missing))
            finally:
                for n in pinned:
                    self.tree.release_host(n)
            if pages is None:  # L2 cannot take the whole chain: keep as long a prefix as fits
                fit = self.host.free_pages
                pages = self.host.alloc(fit) if fit else None
                self.metrics.backups_dropped += len(missing) - fit
                if pages is None:
                    return
                missing = missing[:fit]
            self.parts[0].pack([n.device_page for n in missing], pages)  # type: ignore[misc]
            for n, host_page in zip(missing, pages, strict=True):
                self.tree.set_host(n, host_page)
            self.metrics.backups_l2 += len(missing)
            self.metrics.bytes_l1_to_l2 += len(missing) * self.layout.page_bytes
        self._queue_l3_backup(path)

    def _queue_l3_backup(self, path: Sequence[PageNode]) -> None:
        link = self.l3
        if link is None or not link.can_write:
            if self.config.host_mode == "buffer_only":
                for node in path:
                    self._drop_host_copy(node)
            return
        todo: list[PageNode] = []
        for node in path:
            if node.in_l3 or node.l3_pending:
                continue
            if node.host_page is None:
                break
            todo.append(node)
        room = max(0, self.config.max_queued_backup_pages - self._transfers.in_flight)
        if len(todo) > room:  # the queue is full: the chain's tail waits for a later backup
            self.metrics.backups_dropped += len(todo) - room
            del todo[room:]
        if self.config.host_mode == "buffer_only":
            queued = {id(n) for n in todo}
            for node in path:
                if id(node) not in queued:
                    self._drop_host_copy(node)
        if not todo:
            return
        items = []
        for node in todo:
            self.tree.set_l3_pending(node, True)
            self.tree.hold_host(node)
            items.append((node, 0, self.host.row(node.host_page), _parent(node)))  # type: ignore[arg-type]
        self._kv_in_flight += len(todo)
        self._transfers.queue_backups(items, self._links())

    def _apply_backup(self, done: BackupDone) -> None:
        self._transfers.in_flight -= 1
        node, tag, ok = done.node, done.tag, done.ok
        m = self.metrics
        if ok:
            m.bytes_l2_to_l3 += done.io.bytes_moved
        part = self.parts[tag]
        self._events.append(BackupEvent(node.page_hash, part.name, ok))
        if tag:
            self.tree.release_held_host(node, tag)
            if ok:
                self.tree.set_held(node, tag, Tier.L3, True)
            self.tree.set_held_pending(node, tag, False)
            self._count(f"backups_l3_{part.name}" if ok else f"backups_l3_failed_{part.name}")
            if self.config.host_mode == "buffer_only":
                self._drop_held_host(node, tag)
            self.tree.prune(node)
            return
        self._kv_in_flight -= 1
        self.tree.release_host(node)
        if ok:
            self.tree.set_in_l3(node, True)
            m.backups_l3 += 1
        else:
            m.backups_l3_failed += 1
        self.tree.set_l3_pending(node, False)
        if self.config.host_mode == "buffer_only":
            self._drop_host_copy(node)
        else:
            self.tree.prune(node)

    def _links(self) -> dict[int, L3Link]:
        return {tag: part.link for tag, part in self.parts.items() if part.link is not None}

    def _count(self, name: str, n: int = 1) -> None:
        self.metrics.extra[name] = self.metrics.extra.get(name, 0) + n

    # == internals: the prefix over every component =========================================

    def _best(
        self,
        req: Request,
        cap: int,
        kv_pages: int,
        l3: Mapping[int, Sequence[bool]] | None = None,
        *,
        known_l3: bool = True,
    ) -> ComponentMatch:
        """The longest prefix ``<= cap`` at which the KV (present for its first ``kv_pages``
        pages) and every component ``req`` needs can resume: objects in L1/L2 count, and with
        ``l3`` (tag -> per page, from a probe) those L3 holds (and, with ``known_l3``, those the
        tree knows it holds)."""
        avail: dict[str, list[Tier | None]] = {
            KV.name: [Tier.L1 if i < kv_pages else None for i in range(cap)]
        }
        nodes = self.tree.match(req.hashes[:cap])
        for tag in req.need:
            part = self.parts[tag]
            probed = () if l3 is None else l3.get(tag, ())
            where: list[Tier | None] = []
            for i in range(cap):
                held = nodes[i].held(tag) if i < len(nodes) else None
                here = None if held is None else held.where()
                if here is Tier.L3 and (l3 is None or not known_l3):
                    here = None  # memory only, or the probe's word only
                if here is None and i < len(probed) and probed[i]:
                    here = Tier.L3
                where.append(here)
            avail[part.name] = where
        specs = [KV, *(self.parts[t].spec for t in req.need)]
        return match_components(specs, avail, self.namespace.page_size, max_pages=cap)

    def _local_prefix(self, req: Request, cap: int) -> int:
        """The longest prefix ``<= cap`` (KV pages held) this rank can resume at from L1/L2."""
        return self._best(req, cap, cap).prefix_pages if req.need else cap

    def _agree_prefix(self, req: Request, usable: int) -> int:
        """The prefix every rank can resume at: the minimum over ranks, lowered with
        components until no rank needs to go lower (the same rounds on every rank)."""
        best = usable
        if req.need:
            best = self._local_prefix(req, usable)
            # Per-component hit rates on what is there (L3 included, failed reads not).
            limit = min(
                max(len(req.nodes), req.l3_kv_pages),
                (len(req.tokens) - 1) // self.namespace.page_size,
            )
            found = self._best(req, limit, limit, req.l3_found)
            self._count_components(found)
            if best < found.prefix_pages:  # short of what every component allowed
                self._count(LIMITED_BY_PREFETCH)
        agreed = self.group.agree_min(best, "prefix_pages")
        rounds = 1
        if req.need and self.group.size > 1:
            while True:
                lowered = self.group.agree_min(
                    self._local_prefix(req, agreed), "prefix_pages:components"
                )
                if lowered == agreed:
                    break
                agreed = lowered
                rounds += 1
        if req.need and agreed < best:
            self._count(LIMITED_BY_RANKS)
        self._last_rounds = rounds
        return agreed

    def _count_components(self, found: ComponentMatch) -> None:
        page = self.namespace.page_size
        for name, pages in found.alone.items():
            self._count(f"component_hit_tokens_{name}", pages * page)
        for name in found.limited_by:
            self._count(f"limited_by_{name}")

    # == internals: component objects =======================================================

    def _restore_components(self, req: Request) -> dict[int, tuple[tuple[int, int], ...]]:
        """Bring the component objects the resume at ``req.prefix_pages`` needs into L1 and
        lock them; per component tag, their (page index, slot). Then release the plan's pins.

        Every object the resume needs is locked in L1 and its L2 copy held *before* any slot is
        taken: making room for one object (evicting an L1 copy, which write-back first backs
        up to L2, which may evict an L2 copy) must not evict another object of the same resume
        (it would be restored again, or, without an L2 copy, be lost)."""
        page = self.namespace.page_size
        needed = [
            (self.parts[tag], i, req.nodes[i])
            for tag in req.need
            for i in self.parts[tag].spec.pages_needed(req.prefix_pages, page)
        ]
        held_host: list[tuple[PageNode, int]] = []
        for part, i, node in needed:
            held = node.held(part.tag)
            assert held is not None, f"{part.name}: page {i} has no object to restore"
            assert held.in_memory, f"{part.name}: page {i}'s object is not in L1 or L2"
            self.tree.lock_held(node, part.tag)
            req.held.append((node, part.tag))
            if held.l2 is not None:
                self.tree.hold_held_host(node, part.tag)
                held_host.append((node, part.tag))
        out: dict[int, list[tuple[int, int]]] = {tag: [] for tag in req.need}
        from_l2: list[tuple[PageNode, int]] = []
        try:
            for part, i, node in needed:
                held = node.held(part.tag)
                assert held is not None
                if held.l1 is None:
                    slot = node.device_page if part.follows_kv else self._alloc_slot(part)
                    assert slot is not None
                    assert held.l2 is not None
                    part.unpack(part.host_runs([held.l2]), [slot])
                    self.tree.set_held(node, part.tag, Tier.L1, slot)
                    self._count(f"restored_l2_{part.name}")
                    from_l2.append((node, part.tag))
                out[part.tag].append((i, held.l1))  # type: ignore[arg-type]
        finally:
            for node, tag in held_host:
                self.tree.release_held_host(node, tag)
            self._unpin(req)
        if self.config.host_mode == "buffer_only":
            for node, tag in from_l2:
                self._drop_held_host(node, tag)
        return {tag: tuple(slots) for tag, slots in out.items()}

    def _produce(self, req: Request, part: Pools) -> tuple[tuple[int, int], ...]:
        """The (page index, slot) the engine fills with ``part``'s new objects: slots taken now,
        kept by the request until ``complete``. A slot that cannot be had (every one locked)
        drops that object (counted)."""
        page = self.namespace.page_size
        prefix, full = req.prefix_pages, len(req.tokens) // page
        spec = part.spec
        if spec.rule is HitRule.CHECKPOINT:
            indices = [e - 1 for e in self._checkpoint_ends(req, part)]
        elif spec.rule is HitRule.WINDOW and (ends := self._all_checkpoint_ends(req)):
            # A resume happens only at a checkpoint: keep the window pages before new ones.
            indices = sorted(
                {i for e in ends for i in spec.pages_needed(e, page) if i >= prefix}
            )
        else:
            indices = list(range(prefix, full))
        out: list[tuple[int, int]] = []
        for i in indices:
            if part.follows_kv:
                out.append((i, req.new_device_pages[i - prefix]))
                continue
            slot = self._alloc_slot(part, required=False)
            if slot is None:
                self._count(f"produce_dropped_{part.name}")
                continue
            out.append((i, slot))
        return tuple(out)

    def _checkpoint_ends(self, req: Request, part: Pools) -> list[int]:
        """Page counts after which the request takes a checkpoint: its last full page, the
        branch points it computes past (``_branches``) and every ``checkpoint_every`` pages of
        the computed range."""
        page = self.namespace.page_size
        prefix, full = req.prefix_pages, len(req.tokens) // page
        ends = {full}
        ends.update(b for b in req.branches if prefix < b <= full)
        step = self.components[part.name].checkpoint_every
        if step:
            ends.update(range(step * (prefix // step + 1), full, step))
        return sorted(e for e in ends if e > prefix)

    def _all_checkpoint_ends(self, req: Request) -> list[int]:
        ends: set[int] = set()
        for tag in req.need:
            part = self.parts[tag]
            if part.spec.rule is HitRule.CHECKPOINT:
                ends.update(self._checkpoint_ends(req, part))
        return sorted(ends)

    def _keep_produced(
        self, req: Request, path: Sequence[PageNode]
    ) -> list[tuple[PageNode, int]]:
        """Record the objects the engine wrote into its produce slots on their pages; an object
        the page already has keeps its copy (the new slot is freed)."""
        kept: list[tuple[PageNode, int]] = []
        for name, slots in req.components.items():
            part = self.parts[self.components[name].tag]
            for i, slot in slots.produce:
                node = path[i] if i < len(path) else None
                held = None if node is None else node.held(part.tag)
                if part.follows_kv:
                    assert node is not None
                    if held is not None and held.l1 is not None:
                        continue  # the page's copy is there already
                    if node.device_page != slot:
                        # The KV page was cached by another request meanwhile: the tier keeps
                        # that copy and frees ``slot``; the draft's rows are still in ``slot``
                        # (nothing ran since): copy them beside the kept KV.
                        part.copy_slot(slot, node.device_page)  # type: ignore[arg-type]
                    self.tree.set_held(node, part.tag, Tier.L1, node.device_page)
                elif node is None or (held is not None and held.l1 is not None):
                    assert part.free is not None
                    part.free.append(slot)
                    continue
                else:
                    self.tree.set_held(node, part.tag, Tier.L1, slot)
                kept.append((node, part.tag))
                self._count(f"produced_{part.name}")
        return kept

    def _release_components(self, req: Request) -> None:
        for node, tag in req.held:
            self.tree.unlock_held(node, tag)
        req.held.clear()

    def _alloc_slot(self, part: Pools, *, required: bool = True) -> int | None:
        """A free L1 slot of ``part`` (evicting its least valuable unlocked copy if needed)."""
        assert part.free is not None
        if not part.free:
            node = self.tree.pop_victim(Tier.L1, part.tag)
            if node is not None:
                self._evict_held_l1(node, part)
        if part.free:
            return part.free.pop()
        if required:
            raise TierCapacityError(f"{part.name}: every L1 slot is locked")
        return None

    def _evict_held_l1(self, node: PageNode, part: Pools) -> None:
        held = node.held(part.tag)
        assert held is not None
        assert held.l1 is not None
        assert part.free is not None
        if self.config.write_policy == "write_back" and self.config.l2_pages:
            self._backup_held(node, part.tag)
        part.free.append(held.l1)
        self.tree.set_held(node, part.tag, Tier.L1, None)
        self._count(f"evictions_l1_{part.name}")
        self.tree.prune(node)

    def _alloc_row(self, part: Pools) -> int | None:
        rows = part.host.alloc(1)
        if rows is None and self.config.host_mode != "buffer_only":
            node = self.tree.pop_victim(Tier.L2, part.tag)
            if node is not None:
                self._drop_held_host(node, part.tag)
                self._count(f"evictions_l2_{part.name}")
            rows = part.host.alloc(1)
        return None if rows is None else rows[0]

    def _drop_held_host(self, node: PageNode, tag: int) -> None:
        held = node.held(tag)
        if held is None or held.l2 is None or held.host_lock:
            return
        self.parts[tag].host.free([held.l2])
        self.tree.set_held(node, tag, Tier.L2, None)
        self.tree.prune(node)

    def _backup_held(self, node: PageNode, tag: int) -> None:
        """Copy ``node``'s object of component ``tag`` to the tiers below that miss it: L1 ->
        L2 if L2 has none, then L2 -> L3 if L3 has none (only what is missing moves)."""
        part = self.parts[tag]
        held = node.held(tag)
        if held is None or not part.host.num_pages:
            return
        if held.l2 is None and held.l1 is not None:
            if self.config.host_mode == "buffer_only" and (held.in_l3 or held.l3_pending):
                return
            row = self._alloc_row(part)
            if row is None:
                self._count(f"backups_dropped_{part.name}")
                return
            part.pack([held.l1], [row])
            self.tree.set_held(node, tag, Tier.L2, row)
            self._count(f"backups_l2_{part.name}")
        if held.l2 is None or held.in_l3 or held.l3_pending or not part.writes:
            if self.config.host_mode == "buffer_only":
                self._drop_held_host(node, tag)
            return
        if self._transfers.in_flight >= self.config.max_queued_backup_pages:
            self._count(f"backups_dropped_{part.name}")
            return
        self.tree.set_held_pending(node, tag, True)
        self.tree.hold_held_host(node, tag)
        row_view = part.host.row(held.l2)
        self._transfers.queue_backups([(node, tag, row_view, _parent(node))], self._links())

    # == internals: prefetch ==================================================================

    def _start_prefetch(self, req: Request) -> None:
        """Probe L3 beyond what memory holds, pick the prefix every needed component can
        resume at, and read its missing KV pages and component objects into L2."""
        link = self.l3
        assert link is not None
        page = self.namespace.page_size
        start = len(req.nodes)
        usable = (len(req.tokens) - 1) // page
        available = 0
        found: dict[int, list[bool]] = {}
        try:
            with _timed(req):  # round trips to the backend: I/O, not bookkeeping
                if start < len(req.hashes):
                    available = run_sync(
                        link.exists_prefix(req.hashes[start:]), timeout=self.config.io_timeout_s
                    )
                if req.need:
                    found = self._probe_components(req, min(start + available, usable))
        except Exception as exc:
            log.warning("L3 existence check failed, recomputing instead: %s", exc)
            available, found = 0, {}
        else:
            if start + available < len(req.hashes):  # the first page L3 says it lacks
                self._refute_l3(req.hashes[start + available])
        kv_end = start + available
        req.l3_found, req.l3_kv_pages = found, kv_end
        plans: list[ComponentMatch] = []
        if req.need:
            cap = min(kv_end, usable)
            plans = self._plans(req, cap, found)
            kv_end = max(start, plans[0].prefix_pages)
        if (kv_end - start) * page < self.config.prefetch_threshold_tokens:
            kv_end = start  # too little KV to fetch: resume where memory allows
            if req.need:
                plans = self._plans(req, min(start, usable), found)
        try:
            op = self._prefetch_op(req, start, kv_end, plans)
        except BaseException:
            self._unpin(req)
            raise
        if op is None:
            return
        self.metrics.prefetch_started += 1
        self._transfers.start_prefetch(
            op, self._links(), lambda f: self.parts[f.tag].host.row(f.row)
        )
        self._prefetches.append(op)
        req.prefetch = op

    def _unpin(self, req: Request) -> None:
        """Release the plan's pins (``_pin_planned``)."""
        for node, tag in req.pinned:
            self.tree.release_held_host(node, tag)
        req.pinned = []

    def _pin_planned(self, req: Request, plan: ComponentMatch) -> None:
        """Hold the L2 copies of the component objects ``plan`` restores (``req.pinned``)."""
        nodes = self.tree.match(req.hashes)
        pinned = {(id(node), tag) for node, tag in req.pinned}
        for tag in req.need:
            for i, _ in plan.restore[self.parts[tag].name]:
                held = nodes[i].held(tag) if i < len(nodes) else None
                if held is not None and held.l2 is not None and (id(nodes[i]), tag) not in pinned:
                    self.tree.hold_held_host(nodes[i], tag)
                    req.pinned.append((nodes[i], tag))

    def _prefetch_op(
        self, req: Request, start: int, kv_end: int, plans: Sequence[ComponentMatch]
    ) -> Prefetch | None:
        """Rows for the KV pages ``[start, kv_end)`` and the L3 objects ``plans`` restore, as
        one prefetch (None: nothing to fetch)."""
        kv_fetch: list[Fetch] = []
        if kv_end > start:
            host_pages = self._alloc_host(kv_end - start)
            count = kv_end - start
            while host_pages is None and count > 0:
                count = min(count - 1, self.host.free_pages)
                host_pages = self.host.alloc(count) if count else None
            kv_fetch = [
                Fetch(0, start + i, req.hashes[start + i], row)
                for i, row in enumerate(host_pages or [])
            ]
        extra: list[Fetch] = []
        wanted: set[tuple[int, int]] = set()
        # Plan by plan (the fallback gets rows only once the first has its own): pin the L2
        # copies of the objects it resumes with until ``prepare`` has restored them (or
        # ``abort``), so that neither making room for what is fetched nor other requests
        # served in between evict them (the prefix would fall short of the plan, to an earlier
        # checkpoint or to 0); then take rows for its objects in L3.
        for plan in plans:
            self._pin_planned(req, plan)
            for tag in req.need:
                part = self.parts[tag]
                for i, where in plan.restore[part.name]:
                    if where is not Tier.L3 or part.link is None or (tag, i) in wanted:
                        continue
                    wanted.add((tag, i))
                    row = self._alloc_row(part)
                    if row is None:
                        continue  # the prefix will end before this object (prepare recomputes)
                    extra.append(Fetch(tag, i, req.hashes[i], row))
        if not kv_fetch and not extra:
            return None
        return Prefetch(kv_fetch, extra)

    def _plans(
        self, req: Request, cap: int, found: Mapping[int, Sequence[bool]]
    ) -> list[ComponentMatch]:
        """The prefix to prefetch for (L1, L2 and L3 objects count), and the one to fall back to
        if the L3 component objects it reads fail (corrupt or gone): fetching both keeps a
        failed read from sending the request back to what memory holds."""
        first = self._best(req, cap, cap, found)
        fetched = {
            (self.components[name].tag, i)
            for name, objects in first.restore.items()
            if name != KV.name
            for i, where in objects
            if where is Tier.L3
        }
        if not fetched:
            return [first]
        without = {
            tag: [hit and (tag, i) not in fetched for i, hit in enumerate(flags)]
            for tag, flags in found.items()
        }
        return [first, self._best(req, cap, cap, without, known_l3=False)]

    def _probe_components(self, req: Request, pages: int) -> dict[int, list[bool]]:
        """Per needed component: which of the first ``pages`` pages' objects L3 holds (pages
        whose object is in memory are not probed)."""
        nodes = self.tree.match(req.hashes[:pages])
        out: dict[int, list[bool]] = {}
        for tag in req.need:
            link = self.parts[tag].link
            if link is None:
                continue
            todo = [
                i
                for i in range(pages)
                if i >= len(nodes) or (h := nodes[i].held(tag)) is None or not h.in_memory
            ]
            hits: list[bool] = []
            if todo:  # everything in memory: no round trip
                hits = run_sync(
                    link.exists_pages([req.hashes[i] for i in todo]),
                    timeout=self.config.io_timeout_s,
                )
            flags = [False] * pages
            for i, hit in zip(todo, hits, strict=True):
                flags[i] = hit
            out[tag] = flags
        return out

    def _settle_prefetch(self, req: Request) -> float:
        """Wait as the policy says, take what arrived, and return the seconds waited."""
        op = req.prefetch
        assert op is not None
        policy = self.config.prefetch_policy
        started = time.perf_counter()
        timed_out = False
        if policy == "wait_complete":
            timed_out = not op.finished.wait(self.config.io_timeout_s)
        elif policy == "timeout":
            limit = prefetch_timeout(self.config, len(op.kv) * self.namespace.page_size)
            timed_out = not op.finished.wait(limit)
        waited = time.perf_counter() - started
        done = op.completed_prefix()
        agreed = self.group.agree_min(done, "prefetch_pages")
        m = self.metrics
        if agreed == len(op.kv):
            m.prefetch_complete += 1
        elif timed_out:
            m.prefetch_timed_out += 1
        else:
            m.prefetch_partial += 1
        m.prefetch_failed_pages += sum(1 for f in op.kv if f.done is False)
        io, op.io = op.io, IOStats()
        m.corruptions += io.corruptions
        m.tampered += io.tampered
        m.bytes_l3_to_l2 += io.bytes_moved
        m.l3_fetched_bytes += io.bytes_fetched
        m.l3_needed_bytes += io.bytes_needed
        self._forget_failed_read(op, done)
        # KV pages past the agreed prefix are abandoned, and so are component objects whose
        # read has not ended: their rows come back once the reads have ended (now, or when
        # the read's completion is polled: quarantined until then).
        for fetch in op.kv[agreed:]:
            self._abandon(fetch)
        nodes = self.tree.insert(req.hashes[: len(req.nodes) + agreed])[len(req.nodes) :]
        for node, fetch in zip(nodes, op.kv[:agreed], strict=True):
            if node.host_page is None:
                self.tree.set_host(node, fetch.row)
            else:
                self.host.free([fetch.row])
            fetch.row = -1  # owned by the tree now
            self.tree.set_in_l3(node, True)
        self._hold(req, nodes)
        self.tree.touch(nodes)
        req.l3_pages = agreed
        op.settled = True
        known = self.tree.match(req.hashes)
        refuted: list[PageNode] = []
        for fetch in op.extra:
            if fetch.done is False:  # a corrupt or vanished object: absent from now on
                req.l3_found[fetch.tag][fetch.index] = False
                self._count(f"fetch_failed_{self.parts[fetch.tag].name}")
                if fetch.index < len(known):  # so that its next backup replaces it (KV: above)
                    self.tree.set_held(known[fetch.index], fetch.tag, Tier.L3, False)
                    refuted.append(known[fetch.index])
            if fetch.done is not True or fetch.index >= len(known):
                self._abandon(fetch)
                continue
            node, part = known[fetch.index], self.parts[fetch.tag]
            held = node.held(fetch.tag)
            if held is not None and held.in_memory:
                part.host.free([fetch.row])  # a copy arrived meanwhile
            else:
                self.tree.set_held(node, fetch.tag, Tier.L2, fetch.row)
            self.tree.set_held(node, fetch.tag, Tier.L3, True)
            fetch.row = -1
            self._count(f"restored_l3_{part.name}")
        for node in refuted:  # after the loop: a later fetch may land on the same page
            self.tree.prune(node)
        if self.group.size > 1:
            # Rows of abandoned reads come back before the request computes, so L2 free space
            # (and with it L2 eviction) does not depend on read timing (at most the reads in
            # flight remain: reads past the agreed prefix are skipped).
            if not op.finished.wait(self.ack_wait_s):
                raise CacheEventDivergenceError(
                    f"rank {self.rank}: a prefetch did not end within {self.ack_wait_s}s"
                )
            self._drain()
        return waited

    def _forget_failed_read(self, op: Prefetch, done: int) -> None:
        """Stop taking for stored the KV page whose L3 read failed (corrupt, torn, vanished,
        timed out). Only the first KV page not read (``done``: every one before it read well)
        was read and failed; those past it were skipped."""
        if done < len(op.kv) and op.kv[done].done is False:
            self._refute_l3(op.kv[done].page_hash)

    def _refute_l3(self, page_hash: str) -> None:
        """L3 answered that it does not hold this KV page (a failed read, a miss of the
        existence check): ``in_l3`` is an acknowledged write or a confirmed read, and this
        refutes it. Kept, it made every backup skip the page (``_queue_l3_backup``), so an
        object that went bad or went away (evicted by the backend, deleted) was never written
        again by this instance, and every request of every instance recomputed from there on.

        One rank only: with several, ``in_l3`` decides which backups each rank queues, and the
        ranks must queue alike (the backup-ack agreement), so a rank-local refutation would
        make them diverge.
        """
        if self.group.size > 1:
            return
        node = self.tree.get(page_hash)
        if node is not None and node.in_l3:
            self.tree.set_in_l3(node, False)
            self.tree.prune(node)

    def _abandon(self, fetch: Fetch) -> None:
        """The engine stops waiting for ``fetch``: its row returns now if its read has ended,
        else when it ends (``ReadEnded``): quarantined until then."""
        fetch.abandoned = True
        if fetch.done is not None:
            self._return_row(fetch)
        elif fetch.row >= 0:
            self.metrics.host_pages_quarantined += 1

    def _return_row(self, fetch: Fetch) -> None:
        """Free an abandoned fetch's row (once: row -1 afterwards); its read has ended."""
        assert fetch.done is not None, "a row freed while its read may still write into it"
        if fetch.row >= 0:
            self.parts[fetch.tag].host.free([fetch.row])
            fetch.row = -1


def _wait_for(loads: Sequence[LayerLoad]) -> Callable[[int], None] | None:
    """One ``wait_layer`` over ``loads`` (None when there is nothing to wait for)."""
    if not loads:
        return None
    if len(loads) == 1:
        return loads[0].wait

    def wait(layer: int) -> None:
        for load in loads:
            load.wait(layer)

    return wait


def _branches(nodes: Sequence[PageNode]) -> tuple[int, ...]:
    """Page counts at which a request's known path ``nodes`` branches: after each node with
    a child off the path (other requests went on from there), and the path's end.

    A request that computes past one takes a checkpoint there, so requests sharing the prefix
    up to it can resume. Every node with a child off the path counts, not only the path's end:
    a component object (a window page, a later checkpoint) keeps a node in the tree after its
    KV and its checkpoint were evicted, so the end of the known path can lie past the point
    where the requests sharing a prefix (a system prompt) part; taking the checkpoint only
    there, a shared prefix whose checkpoint was evicted would never get one again.
    """
    ends = [i + 1 for i, node in enumerate(nodes[:-1]) if node.children > 1]
    if nodes:
        ends.append(len(nodes))
    return tuple(ends)


def _parent(node: PageNode) -> str | None:
    parent = node.parent
    return parent.page_hash if parent is not None and parent.depth >= 0 else None
