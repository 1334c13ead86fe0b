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
``tier.pools``) and ``objects`` (L2 <-> L3, through ``tier.transfers``). Every copy of every
component is one ``Held`` on the page tree (``tier.radix``); the primitives that make room for
copies and give them up (``tier.residency``: make room, evict, take and drop rows, back up,
apply a backup; L2 admission in the simulator's order) are written once for the KV and every
component. The request protocol here and each collaborator are built with that one
``Residency``:
``tier.prefetch`` (the prefetch protocol), ``tier.prefix`` (the prefix over every component
and across ranks), ``tier.restore`` (component objects on the request path), ``tier.loads``
(L2 -> L1 loads), ``tier.hinting`` (the engine's hints); none of them knows ``HiCache``.

**Ranks** (``group``, e.g. ``distributed.TorchGroup``): every number that changes what is
computed is agreed as the minimum over ranks at the same point on every rank, and every request
reaches the same agreements (``backup_acks`` in ``match``, ``prefetch_pages`` and
``prefix_pages`` in ``prepare``, ``backup_acks`` in ``complete``). With components the prefix
agreement descends (``prefix_pages:components``) until every rank can resume there, since a
checkpoint one rank lacks may be below another's best. KV backup completions are applied in the
order and number the first PP stage decides (its writing ranks' ready counts, one
``agree_min`` in which the other ranks vote ``NO_VOTE``); a rank whose transfer is not finished
waits for it (bounded). ``flush`` ends on every rank together.

Failure model: an L3 error, timeout, miss or corrupt object shortens the prefix that hits and is
counted; the request then recomputes more. Nothing in the engine's path raises because of L3,
nothing waits longer than the prefetch policy allows, and every host row taken for a transfer is
returned when the transfer ends; rows of reads the engine stopped waiting for are *quarantined*
until the read has ended (counted in ``quarantined_host_pages``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from collections.abc import Collection, Sequence

import torch

from hicache_store._sync import submit
from hicache_store.backends.base import Backend
from hicache_store.backends.protocols import HostBuffers
from hicache_store.kernels.ops import Backend as KernelBackend
from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.topology import Topology, shard_of
from hicache_store.objects import L3Link
from hicache_store.tenant import KeyRing

from . import checks
from .components import KV, Component, Placement
from .config import TierConfig
from .events import TierEvents
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
from .hinting import Hinting
from .hints import RequestHints, ResponseEnd
from .host_pool import HostPagePool
from .links import open_link, register_host_pool, unregister_host_pool
from .loads import Loads
from .metrics import TierMetrics
from .pools import Pools, SlotList
from .prefetch import Prefetcher
from .prefix import LIMITED_BY_PREFETCH, LIMITED_BY_RANKS, Prefixes
from .radix import PageNode, PageTree, Tier, branch_points, l1_of, l2_of
from .request import (
    ComponentSlots,
    DevicePagePool,
    Prepared,
    Request,
    TierCapacityError,
    page_slots,
    timed_io,
    tokens_digest,
)
from .residency import Residency
from .restore import Restorer
from .transfers import BackupDone, BackupEvent, ReadEnded, Transfers

__all__ = [
    "ComponentSlots",
    "DevicePagePool",
    "HiCache",
    "Prepared",
    "Request",
    "TierCapacityError",
    "page_slots",
]

log = logging.getLogger(__name__)


def _policy(name: str, capacity: int) -> EvictionPolicy[PageNode]:
    """An eviction policy for a pool of ``capacity`` pages (``TierConfig.eviction_policy``)."""
    return make_eviction_policy(name, max(capacity, 1), lambda n: n.depth, lambda n: n.page_hash)


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
        #: where the host pool is registered (``links.register_host_pool``), if anywhere
        self._registered: HostBuffers | None = None
        self._backend = backend
        self._keys = keys
        if backend is not None:
            self.l3 = open_link(
                backend, namespace, self.topology, rank, config, keys, tag=KV.tag, read_only=False
            )
            self._registered = register_host_pool(backend, self.host, config.io_timeout_s)
        # The KV's pools: prefix-closed, their backups acknowledged in the deciding stage's
        # order (``Pools``); L1 is the engine's page pool.
        self.kv = Pools(
            KV, namespace, self.layout, self.device, self.host, self.l3, kernel_backend,
            slots=device_pool, prefix_closed=True, ordered=True,
        )
        self.parts: dict[int, Pools] = {KV.tag: self.kv}
        self.components: dict[str, Component] = {}
        for component in components:
            self._add_component(component)
        self._closed = False  # set by ``close``: requests are refused from then on
        self._transfers = Transfers(submit)
        self.ack_wait_s = ack_wait_s if ack_wait_s is not None else 2 * config.io_timeout_s + 10
        # The residency primitives, and the collaborators built with them.
        self.residency = Residency(self.tree, self.parts, config, self.metrics, self._transfers)
        page = namespace.page_size
        self.prefixes = Prefixes(self.residency, page, self.group)
        self.prefetcher = Prefetcher(self.residency, self.prefixes, self.group, self.ack_wait_s)
        self.restorer = Restorer(self.residency, self.components, page)
        owned = [namespace.digest, *(c.namespace.digest for c in self.components.values())]
        self.hinting = Hinting(self.residency, owned, page)
        self._ready: list[BackupDone] = []  # ordered completions awaiting the agreement
        # Bounded: an engine that never drains them cannot grow it (the oldest go first).
        self._events: collections.deque[BackupEvent] = collections.deque(maxlen=1 << 16)
        self._last_rounds = 0
        self._decides_acks = self.group.size == 1 or rank in ack_deciders(
            namespace, self.topology
        )
        self.requests_seen = 0
        layers = range(self.layout.layer_start, self.layout.layer_stop)
        self.loads = Loads(self.kv, layers if config.layerwise_load else None)
        # KV events (``tier.events``): rank 0 publishes; the tree reports every L2/L3 change.
        self.events: TierEvents | None = None
        if config.events_endpoint is not None and rank == 0:
            self.events = TierEvents(config.events_config(), namespace, keys=keys)
            self.tree.observer = self.events.changed

    # == construction ========================================================================

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
            link = open_link(
                self._backend, ns, topology, rank, self.config, self._keys, tag=spec.tag,
                read_only=read_only,
            )
        count = component.slots
        self.parts[spec.tag] = Pools(
            spec, ns, layout, component.device, host, link, self.kernel_backend,
            slots=None if count is None else SlotList(count),
            follows=KV.tag if count is None else None,
        )
        # The KV's policy, one instance per pool: one eviction order across components
        # (``tier.radix``, "One eviction order").
        name = self.config.eviction_policy
        self.tree.add_component(
            spec.tag,
            _policy(name, host.num_pages),
            None if count is None else _policy(name, count),
            follows=KV.tag,
        )
        self.components[component.name] = component

    # == the request path ===================================================================

    def match(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        need: Collection[str] | None = None,
        reuse: bool = True,
        hints: RequestHints | None = None,
    ) -> Request:
        """Find the cached prefix of ``tokens`` in every tier and start an L3 prefetch.

        ``need``: the components this request resumes with (default: all; a request that does
        not speculate leaves out a draft model's KV). ``reuse=False``: use no cached page or
        object and start no prefetch (the request computes, or receives, everything;
        ``complete`` still inserts its pages and produced objects). ``hints``: what the engine
        knows of the request (``tier.hints``; what the tier does with them: ``tier.hinting``);
        hints about another namespace, or a range outside the prompt, raise ``ValueError``,
        pins past the pin budget ``PinBudgetError``, both before anything is taken."""
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
        reserved = 0
        if hints is not None:
            reserved = self.hinting.arrive(int(token_tensor.numel()), hashes, hints)
        if self.events is not None:
            self.events.note_tokens(hashes, token_tensor.tolist())
        self.tree.begin_request()
        nodes = self.tree.match(hashes) if reuse else []
        l1 = PageTree.resident_prefix(nodes, Tier.L1, KV.tag)
        in_memory = 0
        for node in nodes:
            held = node.held(KV.tag)
            if held is None or not held.in_memory:
                break
            in_memory += 1
        wanted = self.components if need is None else need
        unknown = set(wanted) - set(self.components)
        if unknown:
            self.hinting.unreserve(reserved)
            raise ValueError(f"need: no component named {sorted(unknown)}")
        tags = tuple(self.components[name].tag for name in wanted)
        if reuse:
            self.metrics.count_lookup("l1", len(hashes), l1)
            self.metrics.count_lookup("l2", len(hashes) - l1, in_memory - l1)
        req = Request(token_tensor, hashes, [], l1, in_memory - l1, tags, branch_points(nodes))
        req.hints, req.pin_reserved = hints, reserved
        self.hinting.announce(req)
        held_nodes = nodes[:in_memory]
        self.residency.hold(req, held_nodes)
        self.tree.touch(held_nodes)
        if reuse and self.l3 is not None and (in_memory < len(hashes) or tags):
            self.prefetcher.start(req)
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
            waited = self.prefetcher.settle(req)
            if self.group.size > 1:
                self._drain()  # its ended reads' rows are back before the request computes
        else:
            # Every rank must reach every agreement, in the same order: a rank that started no
            # prefetch (nothing in L3, or its existence check failed) joins with 0, so the
            # group uses no prefetched page. Skipping it would pair this rank's next collective
            # with another rank's prefetch agreement: a wrong minimum, then a hang.
            self.group.agree_min(0, "prefetch_pages")
        # A prompt must leave at least one token to compute (its logits are the output).
        usable = min(len(req.nodes), (len(req.tokens) - 1) // page)
        prefix, self._last_rounds = self.prefixes.agree(req, usable)
        self.residency.release(req, req.nodes[prefix:])
        del req.nodes[prefix:]
        req.prefix_pages = prefix
        req.loading = [n for n in req.nodes if l1_of(n, KV.tag) is None]
        new_pages = math.ceil(len(req.tokens) / page) - prefix
        self.residency.make_room(self.kv, len(req.loading) + new_pages)
        for node, device_page in zip(req.loading, self.pool.alloc(len(req.loading)), strict=True):
            self.tree.set_copy(node, KV.tag, Tier.L1, device_page)
        req.new_device_pages = self.pool.alloc(new_pages)
        # L1 copies another request's load is still filling: this request waits for it too.
        wait_layer = self.loads.start(req)
        with timed_io(req):
            restored = self.restorer.restore(req, self.prefetcher.unpin)
        for tag in req.need:
            part = self.parts[tag]
            req.components[part.name] = ComponentSlots(
                restored[tag], self.restorer.produce(req, part)
            )
        slots = self._slots(req)
        self._count_hits(req)
        if self.group.size > 1:
            note(self.group, prefix * page, "prefix_tokens")
        if self.events is not None:
            self.events.flush()
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
            self.residency.make_room(self.kv, needed)
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
        self.prefetcher.drop(req)
        if req.hints is not None:
            self.hinting.abort(req)
        for load in self.loads.of(req):
            with contextlib.suppress(Exception):
                load.wait_all()
        for node in req.host_locked:
            self.tree.release_host(node, KV.tag)
        req.host_locked.clear()
        self.prefetcher.unpin(req)
        self.restorer.release(req)
        for name, slots in req.components.items():  # slots taken for objects never produced
            part = self.parts[self.components[name].tag]
            if part.slots is not None:
                part.slots.free([slot for _, slot in slots.produce])
        req.components.clear()
        self.pool.free(req.new_device_pages)
        req.new_device_pages = []
        self.residency.release(req, list(req.nodes))
        # Its own load's L1 copies, and copies another request's failed load filled. One that
        # another request still holds stays (that request waits for the same load: it fails
        # with it, or the copy is good) and so does its failed load's entry, so that a later
        # request using the copy fails too rather than trusting it.
        suspect = [*req.loading, *(n for n, load in req.borrowed if load.failed)]
        for node in sorted(suspect, key=lambda n: -n.depth):  # deepest first: prefix-closed
            held = node.held(KV.tag)
            if held is None or held.l1 is None or held.lock or held.l1_children:
                continue
            self.pool.free([held.l1])
            self.tree.set_copy(node, KV.tag, Tier.L1, None)  # drops objects restored beside it
            self.loads.discard(node)
        if req.load is not None and not req.load.failed:  # copies others hold are good
            self.loads.forget(req.load, req.loading)
        req.load, req.borrowed, req.loading, req.nodes = None, [], [], []
        self.poll()

    def _slots(self, req: Request) -> torch.Tensor:
        """Token slots of ``req``'s whole sequence: its prefix pages, then its new pages."""
        device_pages = [l1_of(n, KV.tag) for n in req.nodes] + req.new_device_pages
        return page_slots(device_pages, self.namespace.page_size)[: len(req.tokens)]  # type: ignore[arg-type]

    def complete(self, req: Request) -> None:
        """Insert the request's new pages and objects, apply the write policy, release all."""
        started = time.perf_counter()
        page = self.namespace.page_size
        io_before = req.io_s
        self.loads.finish(req)  # raises if a copy the request computed with failed
        if req.load is not None:
            self.metrics.bytes_l2_to_l1 += len(req.loading) * self.layout.page_bytes
        for node in req.host_locked:
            self.tree.release_host(node, KV.tag)
        req.host_locked.clear()
        if self.config.host_mode == "buffer_only":
            for node in req.loading:
                self.residency.drop(node, self.kv)
        self.hinting.resume(req)
        full = len(req.tokens) // page
        path = self.tree.insert(req.hashes[:full])
        new_nodes = path[req.prefix_pages :]
        spare = req.new_device_pages[len(new_nodes) :]  # the partial last page
        for node, device_page in zip(new_nodes, req.new_device_pages, strict=False):
            if l1_of(node, KV.tag) is None:
                self.tree.set_copy(node, KV.tag, Tier.L1, device_page)
                node.hits = max(node.hits, 1)
            else:  # cached meanwhile by another request: keep that copy
                spare.append(device_page)
        produced = self.restorer.keep_produced(req, path)
        self.pool.free(spare)
        self.tree.touch(path)
        self.residency.release(req, req.nodes)
        self.restorer.release(req)
        threshold = self.config.backup_threshold
        if threshold and self.config.l2_pages:
            hot = [n for n in path if n.hits >= threshold]
            restored = [
                (path[i], self.components[name].tag)
                for name, slots in req.components.items()
                for i, _ in slots.restored
            ]
            with timed_io(req):  # the L1 -> L2 copies are data movement, not bookkeeping
                if hot:
                    self.residency.backup(hot[-1], self.kv)
                # New objects, and used ones a backup missed (only what is missing moves).
                for node, tag in [*produced, *restored]:
                    if node.hits >= threshold:
                        self.residency.backup(node, self.parts[tag])
        if req.hints is not None:
            self.hinting.complete(req, path)
        self.poll()
        req.bookkeeping_s += time.perf_counter() - started - (req.io_s - io_before)

    def response_end(self, end: ResponseEnd) -> None:
        """A response of ``end.session`` has ended (hand it over no earlier: ``tier.hints``)."""
        self.hinting.response_end(end)

    def evict_device(self) -> None:
        """Evict every unlocked copy from L1 (KV and components; lower tiers keep theirs;
        write-back backs up first). For tools and tests that need a cold L1."""
        for part in self.parts.values():
            if part.slots is not None:
                while (node := self.tree.pop_victim(Tier.L1, part.tag)) is not None:
                    self.residency.evict(node, part)

    def drop(self, page_hash: str, component: str) -> bool:
        """Drop this rank's L1 and L2 copies of one component object (a rank that lost state;
        tools and tests). False when it has none, a request or transfer is using one, or a
        hint pins it."""
        part = self.parts[self.components[component].tag]
        node = self.tree.get(page_hash)
        held = None if node is None else node.held(part.tag)
        if (
            node is None or held is None or not held.in_memory or held.lock or held.host_lock
            or held.pins
        ):
            return False
        if held.l1 is not None and part.slots is not None:
            part.slots.free([held.l1])
            self.tree.set_copy(node, part.tag, Tier.L1, None)
        self.residency.drop(node, part)
        if self.events is not None:
            self.events.flush()
        return True

    # == background work =====================================================================

    def poll(self) -> None:
        """Apply completed L3 transfers (engine thread only). With several ranks, ordered
        backup completions (the KV's) are applied in the order and number the first PP stage
        decides."""
        self._drain()
        if self.group.size > 1:
            vote = len(self._ready) if self._decides_acks else NO_VOTE
            agreed = self.group.agree_min(vote, "backup_acks")
            agreed = 0 if agreed == NO_VOTE else agreed
            self._await_ready(agreed)
        else:
            agreed = len(self._ready)
        for done in self._ready[:agreed]:
            self._applied(done)
        del self._ready[:agreed]
        self.prefetcher.retire()
        self.hinting.poll()
        self.tree.trim_l3_record()
        if self.events is not None:
            self.events.flush()

    def _drain(self) -> None:
        """Take completions off the I/O queue: ordered backups wait for the agreement; other
        backups and returns of abandoned rows are rank-local and applied at once."""
        acks = self._transfers.acks
        while acks:
            ack = acks.popleft()
            if isinstance(ack, ReadEnded):
                self.prefetcher.return_row(ack.fetch)
            elif self.parts[ack.tag].ordered:
                self._ready.append(ack)
            else:
                self._applied(ack)

    def _applied(self, done: BackupDone) -> None:
        """Apply a finished backup and report it (``drain_events``; the hints' L3 holds)."""
        event = self.residency.apply_backup(done)
        self._events.append(event)
        if done.tag == KV.tag:
            self.hinting.backed_up(done.node, event.ok)

    def _await_ready(self, agreed: int) -> None:
        deadline = time.monotonic() + self.ack_wait_s
        while len(self._ready) < agreed:
            if self.residency.ordered_in_flight < agreed:
                raise CacheEventDivergenceError(
                    f"rank {self.rank}: the first stage applied {agreed} backup completions "
                    f"but this rank has only {self.residency.ordered_in_flight} backups queued"
                )
            if time.monotonic() > deadline:
                raise CacheEventDivergenceError(
                    f"rank {self.rank}: {agreed - len(self._ready)} backups did not "
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
        return not self._transfers.in_flight and self.prefetcher.idle() and self.hinting.idle()

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
            self.loads.close()
            if self.events is not None:
                events, self.events = self.events, None
                self.tree.observer = None
                events.close([n for n in self.tree.nodes() if l2_of(n, KV.tag) is not None])
            if self._registered is not None:
                unregister_host_pool(self._registered, self.host, self.config.io_timeout_s)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"HiCache.{call}: the cache tier is closed (close() was called: its "
                               "loader and backups are stopped); open a new HiCache")

    # == accounting (tests and the leak check) ==============================================

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the tier's bookkeeping is inconsistent (tests, debugging).

        The pages pinned in the tree are the pin table's (``tier.pins``). Prefix-closed pools
        are prefix-closed in L1, and in L2 in ``cache`` mode (in
        ``buffer_only`` mode L2 holds only pages in transit); the tree's policies and counters
        agree with a full scan; every host row in use is referenced by the tree or a prefetch,
        and every component slot is free or referenced.
        """
        checks.check_tier(self.residency, self.loads.filling, self.hinting.pins, self.prefetcher)

    def host_pages_referenced(self) -> int:
        """KV host rows the tree or a prefetch holds (must always equal ``host.used``)."""
        return checks.rows_referenced(self.residency, self.prefetcher, KV.tag)

    def quarantined_host_pages(self) -> int:
        """Host rows held by abandoned prefetch reads that have not ended yet; they return to
        their pools as each read ends."""
        return self.prefetcher.quarantined()

    @property
    def agreement_rounds(self) -> int:
        """Values the last prefix agreement went through (1: the ranks agreed at once; each
        further one: some rank could not resume at the previous value and lowered it)."""
        return self._last_rounds

    # == internals: the request's KV pages ===================================================

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
