"""The cache tier: L1 (device pool), L2 (host pool), L3 (any backend) under one radix tree.

Primitives, in the order an engine calls them for each request (all on the engine's thread)::

    req = tier.match(tokens)      # walk the tree; find what L3 holds beyond; start a prefetch
    prep = tier.prepare(req)      # settle the prefetch (policy), agree on the prefix across
                                  # ranks, allocate L1 pages, start the layer-wise load
    model.prefill(tokens[prep.start:], prep.start, prep.slots, pool, wait_layer=prep.wait_layer)
    tier.complete(req)            # insert the new pages, apply the write policy, release locks

    tier.poll()                   # apply finished background work (called by the above too)
    tier.flush()                  # wait until queued L3 backups are done (tools, tests)

Two more for a worker that does not compute the whole request itself (a P/D decode worker,
``hicache_store.pd``): ``tier.extend(req, tokens)`` between ``prepare`` and ``complete`` grows
the request by tokens it decodes (their pages join the tree at ``complete``), and
``tier.abort(req)`` instead of ``complete`` gives back everything ``match`` and ``prepare`` took
without inserting anything (its promised KV could not be supplied). ``match(tokens,
reuse=False)`` ignores every cached page (a retry that must not trust the cache).

Every state change is prepare-then-complete: pages are locked (``PageNode.lock`` for their L1
copy, ``host_lock`` for their L2 copy) from ``match`` until ``complete``, and L2 copies that an
L3 transfer reads or fills are locked until the transfer's completion is applied in ``poll``,
so nothing is evicted or reused while in flight. Policy (what to keep, when to wait) lives
here; bytes move in ``kernels`` (L1<->L2) and ``objects`` (L2<->L3).

Failure model: an L3 error, timeout, miss or corrupt object shortens the prefix that hits and
is counted; the request then recomputes more. Nothing in the engine's path raises because of
L3, nothing waits longer than the prefetch policy allows, and every host page taken for a
transfer is returned when the transfer ends.

Abandoned reads (issue 17): when the engine stops waiting for a prefetch (its policy's
deadline, or ranks agreeing on a shorter prefix), the host rows of pages still being read are
*quarantined*, not freed: they return to the pool only when their ``L3Link.read_page`` has
returned, which the ``Backend`` buffer-lifetime contract makes the moment no I/O into the row
is in flight any more, even when that is later than ``io_timeout_s`` (a backend's I/O cannot
always be stopped). A late read therefore never lands in a row that holds another page, and an
L3 backup never reads a row that a read can still change (backups read rows locked by their
node, and a quarantined row belongs to no node). ``quarantined_host_pages()`` counts the rows
held so now; ``metrics.host_pages_quarantined`` counts every row ever held so.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hicache_store._sync import run_sync, submit
from hicache_store.backends.base import Backend
from hicache_store.kernels.ops import Backend as KernelBackend
from hicache_store.kernels.ops import pack_pages, unpack_pages
from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.topology import Topology, shard_of
from hicache_store.objects import IOStats, L3Link
from hicache_store.tenant import KeyRing

from .config import TierConfig, prefetch_timeout
from .eviction import EvictionPolicy, make_eviction_policy
from .group import LocalGroup, RankGroup
from .host_pool import HostPagePool
from .metrics import TierMetrics
from .radix import PageNode, PageTree, Tier

log = logging.getLogger(__name__)

#: L3 backups written concurrently in one batch of the backup worker.
_BACKUP_BATCH_PAGES = 16
#: an L2 -> L1 load over more runs of consecutive host rows than this gathers them first.
_MAX_ROW_RUNS = 8


def _policy(config: TierConfig, capacity: int) -> EvictionPolicy[PageNode]:
    """The eviction policy of one pool of ``capacity`` pages (``config.eviction_policy``)."""
    return make_eviction_policy(
        config.eviction_policy, capacity, lambda n: n.depth, lambda n: n.page_hash
    )


def _consecutive_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first page, count)`` of each run of consecutive ascending pages, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, page in enumerate(pages):
        if runs and page == runs[-1][1] + runs[-1][2]:
            index, first, count = runs[-1]
            runs[-1] = (index, first, count + 1)
        else:
            runs.append((i, page, 1))
    return runs


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
    """What the tier needs from an engine's L1 pool (``hicache_store.engine.DeviceKVPool``)."""

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


class LayerLoad:
    """An L2 -> L1 load that completes layer by layer.

    ``wait(layer)`` returns once that (local) layer's KV of every loaded page is in L1, so the
    engine computes layer ``i`` while later layers are still being copied. A failed copy
    raises from ``wait`` (host-to-device copies do not fail in practice; the tier never
    hides one).
    """

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        copy_layer: Callable[[int], None],
        layers: range,
    ) -> None:
        self._layers = layers
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
        self._events[layer].wait()
        if self._error is not None:
            raise RuntimeError("loading cached KV into L1 failed") from self._error

    def wait_all(self) -> None:
        self._future.result()


@dataclass
class _Prefetch:
    """An L3 -> L2 fetch of consecutive pages; ``done[i]`` is True/False once page i ends."""

    hashes: list[str]
    host_pages: list[int]
    done: list[bool | None]
    finished: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future[None] | None = None
    abandoned_from: int | None = None
    io: IOStats = field(default_factory=IOStats)

    def completed_prefix(self) -> int:
        for i, ok in enumerate(self.done):
            if ok is not True:
                return i
        return len(self.done)


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
    prefetch: _Prefetch | None = None
    l3_pages: int = 0
    prefix_pages: int = 0
    new_device_pages: list[int] = field(default_factory=list)
    loading: list[PageNode] = field(default_factory=list)
    host_locked: list[PageNode] = field(default_factory=list)
    load: LayerLoad | None = None
    bookkeeping_s: float = 0.0
    io_s: float = 0.0


@dataclass(frozen=True)
class Prepared:
    """What the engine needs to compute a request: where to start and where KV lives."""

    start: int
    slots: torch.Tensor
    wait_layer: Callable[[int], None] | None


class HiCache:
    """A three-tier KV cache for one rank. See the module docstring for the call order."""

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
        keys: KeyRing | None = None,
    ) -> None:
        """``keys``: the tenant key ring of a sealed namespace (``hicache_store.tenant``)."""
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
        self.shard = shard_of(namespace, self.topology, rank)
        self.layout = UnifiedPageLayout.for_shard(namespace, self.shard)
        self.device = DevicePool.mha(device_pool.k_buffers, device_pool.v_buffers)
        self.tree = PageTree(
            _policy(config, config.l1_pages),
            _policy(config, max(config.l2_pages, 1)),
            l3_record_limit=config.l3_record_limit,
        )
        self.metrics = TierMetrics()
        self.host = HostPagePool(config.l2_pages, self.layout.page_bytes)
        self.l3: L3Link | None = None
        self._registered = False
        if backend is not None and config.l2_pages == 0:
            raise ValueError(
                "an L3 backend needs L2: set TierConfig(l2_pages=...) > 0 (L3 pages move "
                "through host memory; buffer_only mode keeps L2 to in-flight pages)"
            )
        if backend is not None:
            self.l3 = L3Link(
                backend,
                namespace,
                self.topology,
                rank,
                max_inflight_bytes=config.max_inflight_bytes,
                io_timeout_s=config.io_timeout_s,
                keys=keys,
            )
            self.l3.trusted_hashes = True  # the tier hashes tokens itself
            if self.l3.can_write:
                self._write_manifest(backend)
            self._registered = self._register_host_pool(backend)
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hicache-load")
        # Completions from the I/O loop, applied on the engine thread by ``poll``.
        self._acks: collections.deque[tuple[str, Any]] = collections.deque()
        self._backups_in_flight = 0
        self._backup_queue: collections.deque[tuple[PageNode, str, Any]] = collections.deque()
        self._backup_worker_lock = threading.Lock()
        self._backup_worker_running = False
        self._prefetches: list[_Prefetch] = []
        #: completion events of L3 backups: each is called with ``(page_hash, ok)`` on the
        #: engine thread when ``poll`` applies a finished backup (components that ride along a
        #: page, e.g. a sidecar draft, join their own outcome to the page's here).
        self.backup_listeners: list[Callable[[str, bool], None]] = []

    def _register_host_pool(self, backend: Backend) -> bool:
        """Offer the L2 pool to backends that read into registered memory without a copy
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

    def _write_manifest(self, backend: Backend) -> None:
        """Record the namespace in L3 (``M_{digest}``) so operators' tools can describe it.

        Best effort: a store that cannot take it now still serves KV; tools then show the
        namespace as unknown.
        """
        from hicache_store.ops.manifest import ensure_manifest

        try:
            run_sync(ensure_manifest(backend, self.namespace), timeout=self.config.io_timeout_s)
        except Exception as exc:
            log.warning("could not write the namespace manifest: %s", exc)

    # == the request path ===================================================================

    def match(self, tokens: Sequence[int] | torch.Tensor, *, reuse: bool = True) -> Request:
        """Find the cached prefix of ``tokens`` in every tier and start an L3 prefetch.

        ``reuse=False``: use no cached page and start no prefetch (the request computes, or
        receives, everything; ``complete`` still inserts its pages)."""
        started = time.perf_counter()
        self.poll()
        token_tensor = torch.as_tensor(tokens, dtype=torch.int64)
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
        held = nodes[:in_memory]
        req = Request(token_tensor, hashes, [], l1, in_memory - l1)
        self._hold(req, held)
        self.tree.touch(held)
        if reuse and self.l3 is not None and in_memory < len(hashes):
            self._start_prefetch(req)
        req.bookkeeping_s += time.perf_counter() - started - req.io_s
        return req

    def prepare(self, req: Request) -> Prepared:
        """Settle the prefetch, fix the prefix, allocate L1 pages and start loading."""
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
        usable = self.group.agree_min(usable, "prefix_pages")
        self._release(req, req.nodes[usable:])
        del req.nodes[usable:]
        req.prefix_pages = usable
        req.loading = [n for n in req.nodes if n.device_page is None]
        new_pages = math.ceil(len(req.tokens) / page) - usable
        self._make_room_l1(len(req.loading) + new_pages)
        load_pages = self.pool.alloc(len(req.loading))
        for node, device_page in zip(req.loading, load_pages, strict=True):
            self.tree.set_device(node, device_page)
        req.new_device_pages = self.pool.alloc(new_pages)
        wait_layer = self._start_load(req) if req.loading else None
        slots = self._slots(req)
        self._count_hits(req)
        req.bookkeeping_s += time.perf_counter() - started - waited - (req.io_s - io_before)
        return Prepared(usable * page, slots, wait_layer)

    def extend(self, req: Request, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Grow a prepared request by ``tokens`` that follow its sequence (tokens a decode
        worker generates after the prompt); return the slots of the whole sequence.

        Call between ``prepare`` and ``complete`` (or ``abort``), any number of times. The
        device pages the new tokens need are allocated now (evicting like ``prepare``;
        ``TierCapacityError`` if L1 cannot hold them), the slots of earlier tokens do not
        change, and ``complete`` inserts every full page of the extended sequence.
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
        it may have stopped half way; the request's new device pages are freed; every lock is
        released. Prefetched L2 pages stay cached (their reads were verified). Afterwards the
        request is dead: neither ``complete`` nor ``extend`` it.
        """
        op = req.prefetch
        if op is not None and op.abandoned_from is None:  # matched, never prepared
            # As in _settle_prefetch: mark first, then free what has ended (the rest is freed
            # when its read's completion is polled), so each page is freed exactly once.
            op.abandoned_from = 0
            for i in range(len(op.hashes)):
                if op.done[i] is not None:
                    self._apply_abandoned_page(op, i)
        if req.load is not None:
            with contextlib.suppress(Exception):
                req.load.wait_all()
            req.load = None
        for node in req.host_locked:
            self.tree.release_host(node)
        req.host_locked.clear()
        for node in reversed(req.loading):  # deepest first: L1 stays prefix-closed
            if node.device_page is not None:
                self.pool.free([node.device_page])
                self.tree.set_device(node, None)
        self.pool.free(req.new_device_pages)
        req.new_device_pages = []
        held, req.loading = list(req.nodes), []
        self._release(req, held)
        req.nodes = []
        for node in reversed(held):
            self.tree.prune(node)
        self.poll()

    def _slots(self, req: Request) -> torch.Tensor:
        """Token slots of ``req``'s whole sequence: its prefix pages, then its new pages."""
        device_pages = [n.device_page for n in req.nodes] + req.new_device_pages
        return page_slots(device_pages, self.namespace.page_size)[: len(req.tokens)]  # type: ignore[arg-type]

    def complete(self, req: Request) -> None:
        """Insert the request's new pages, apply the write policy, release everything."""
        started = time.perf_counter()
        page = self.namespace.page_size
        io_before = req.io_s
        if req.load is not None:
            with _timed(req):
                req.load.wait_all()
            self.metrics.bytes_l2_to_l1 += len(req.loading) * self.layout.page_bytes
        for node in req.host_locked:
            self.tree.release_host(node)
        req.host_locked.clear()
        if self.config.host_mode == "buffer_only":
            for node in req.loading:
                self._drop_host_copy(node)
        full = len(req.tokens) // page
        new_nodes = self.tree.insert(req.hashes[:full])[req.prefix_pages :]
        spare = req.new_device_pages[len(new_nodes) :]  # the partial last page
        for node, device_page in zip(new_nodes, req.new_device_pages, strict=False):
            if node.device_page is None:
                self.tree.set_device(node, device_page)
                node.hits = max(node.hits, 1)
            else:  # cached meanwhile by another request: keep that copy
                spare.append(device_page)
        self.pool.free(spare)
        path = req.nodes + new_nodes
        self.tree.touch(path)
        self._release(req, req.nodes)
        threshold = self.config.backup_threshold
        if threshold and self.config.l2_pages:
            hot = [n for n in path if n.hits >= threshold]
            if hot:
                with _timed(req):  # the L1 -> L2 copy is data movement, not bookkeeping
                    self._backup_to_host(hot[-1])
        self.poll()
        req.bookkeeping_s += time.perf_counter() - started - (req.io_s - io_before)

    def evict_device(self) -> None:
        """Evict every unlocked page from L1 (lower tiers keep theirs; write-back backs up
        first). Pages locked by requests in flight stay. For tools and tests that need a
        cold L1, and for wrappers that keep other components beside the KV."""
        with contextlib.suppress(TierCapacityError):  # locked pages cannot go: that is fine
            self._make_room_l1(self.pool.num_pages)

    # == background work =====================================================================

    def poll(self) -> None:
        """Apply completed L3 transfers (engine thread only)."""
        while self._acks:
            kind, payload = self._acks.popleft()
            if kind == "backup":
                self._apply_backup(*payload)
            elif kind == "prefetch_page":
                self._apply_abandoned_page(*payload)
        self._prefetches = [op for op in self._prefetches if not self._prefetch_retired(op)]
        self.tree.trim_l3_record()

    @staticmethod
    def _prefetch_retired(op: _Prefetch) -> bool:
        if op.abandoned_from is None or not op.finished.is_set():
            return False
        return all(p < 0 for p in op.host_pages[op.abandoned_from :])

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued L3 backup and prefetch has finished, then ``poll``."""
        deadline = time.monotonic() + timeout
        while self._backups_in_flight or any(not p.finished.is_set() for p in self._prefetches):
            if time.monotonic() > deadline:
                raise TimeoutError("L3 transfers did not finish in time")
            time.sleep(0.002)
            self.poll()
        self.poll()

    def close(self) -> None:
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

    # == accounting (tests and the leak check) ==============================================

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the tier's bookkeeping is inconsistent (tests, debugging).

        L1 is prefix-closed; so is L2 in ``cache`` mode (in ``buffer_only`` mode L2 holds only
        pages in transit, released as each transfer ends, in any order); every host page in use
        is referenced by the tree or a prefetch.
        """
        tiers = (Tier.L1,) if self.config.host_mode == "buffer_only" else (Tier.L1, Tier.L2)
        self.tree.check_prefix_closed(tiers)
        self.tree.check_queues()
        used, referenced = self.host.used, self.host_pages_referenced()
        if used != referenced:
            raise AssertionError(f"{used} host pages in use, {referenced} referenced")

    def quarantined_host_pages(self) -> int:
        """Host rows held by abandoned prefetch reads that have not ended yet (see the module
        docstring); they return to the pool as each read ends."""
        held = 0
        for op in self._prefetches:
            if op.abandoned_from is None:
                continue
            held += sum(
                1
                for i in range(op.abandoned_from, len(op.hashes))
                if op.done[i] is None and op.host_pages[i] >= 0
            )
        return held

    def host_pages_referenced(self) -> int:
        """Host pages the tree or a prefetch holds (must always equal ``host.used``)."""
        in_tree = sum(1 for n in self.tree.nodes() if n.host_page is not None)
        in_flight = 0
        for op in self._prefetches:
            first = 0 if op.abandoned_from is None else op.abandoned_from
            in_flight += sum(1 for p in op.host_pages[first:] if p >= 0)
        return in_tree + in_flight

    # == internals ===========================================================================

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

    # -- L1 -------------------------------------------------------------------------------

    def _make_room_l1(self, needed: int) -> None:
        if self.pool.num_free_pages >= needed:
            return
        write_back = self.config.write_policy == "write_back" and self.config.l2_pages
        while (node := self.tree.pop_victim(Tier.L1)) is not None:
            if write_back and node.host_page is None:
                self._backup_to_host(node)
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

    def _start_load(self, req: Request) -> Callable[[int], None] | None:
        nodes = req.loading
        with _timed(req):
            parts = self._host_runs([n.host_page for n in nodes])  # type: ignore[misc]
        first_slots = (
            torch.tensor([n.device_page for n in nodes], dtype=torch.int64)
            * self.namespace.page_size
        )
        layout, device, kernel = self.layout, self.device, self.kernel_backend

        def copy(layers: tuple[int, int] | None) -> None:
            for first, rows in parts:
                slots = first_slots[first : first + rows.shape[0]]
                unpack_pages(rows, device, slots, layout, layers=layers, backend=kernel)

        start, stop = self.layout.layer_start, self.layout.layer_stop
        if not self.config.layerwise_load:
            req.load = LayerLoad(self._loader, lambda _layer: copy(None), range(1))
            only = req.load
            return lambda _layer: only.wait(0)
        req.load = LayerLoad(self._loader, lambda layer: copy((layer, layer + 1)), range(start, stop))
        return req.load.wait

    def _host_runs(self, pages: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
        """``pages`` of the host pool as ``(index of the first, rows)`` views, one per run of
        consecutive pages, so the kernels copy straight from and into the pool. Rows scattered
        over more than ``_MAX_ROW_RUNS`` runs are gathered into one staging tensor instead (a
        copy, but one kernel call per layer instead of one per run): read-only use."""
        runs = _consecutive_runs(pages)
        if len(runs) <= _MAX_ROW_RUNS:
            return [(i, self.host.data[p : p + n]) for i, p, n in runs]
        index = torch.tensor(list(pages), dtype=torch.int64)
        return [(0, self.host.data.index_select(0, index))]

    # -- L2 -------------------------------------------------------------------------------

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
        missing = [
            n
            for n in node.path()
            if n.host_page is None
            and n.device_page is not None
            # In buffer-only mode L2 is only a staging area on the way to L3.
            and not (buffer_only and (n.in_l3 or n.l3_pending))
        ]
        if any(n.host_page is None and n.device_page is None for n in node.path()):
            return  # a hole above: this chain cannot be backed up as a prefix
        if missing:
            # Pin the chain's existing L2 copies: evicting one to make room would leave a hole.
            pinned = [n for n in node.path() if n.host_page is not None]
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
            first_slots = (
                torch.tensor([n.device_page for n in missing], dtype=torch.int64)
                * self.namespace.page_size
            )
            # Straight into the host rows, one kernel call per run of consecutive rows.
            for i, page, count in _consecutive_runs(pages):
                pack_pages(
                    self.device,
                    first_slots[i : i + count],
                    self.host.data[page : page + count],
                    self.layout,
                    backend=self.kernel_backend,
                )
            for n, host_page in zip(missing, pages, strict=True):
                self.tree.set_host(n, host_page)
            self.metrics.backups_l2 += len(missing)
            self.metrics.bytes_l1_to_l2 += len(missing) * self.layout.page_bytes
        self._queue_l3_backup(node.path())

    # -- L3 -------------------------------------------------------------------------------

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
            if self._backups_in_flight + len(todo) >= self.config.max_queued_backup_pages:
                self.metrics.backups_dropped += 1
                break
            todo.append(node)
        if self.config.host_mode == "buffer_only":
            queued = {id(n) for n in todo}
            for node in path:
                if id(node) not in queued:
                    self._drop_host_copy(node)
        if not todo:
            return
        for node in todo:
            self.tree.set_l3_pending(node, True)
            self.tree.hold_host(node)
        self._backups_in_flight += len(todo)
        rows = [self.host.row(n.host_page) for n in todo]  # type: ignore[arg-type]
        self._backup_queue.extend(
            (node, node.page_hash, row) for node, row in zip(todo, rows, strict=True)
        )
        with self._backup_worker_lock:
            if not self._backup_worker_running:
                self._backup_worker_running = True
                submit(self._backup_worker(link))

    async def _backup_worker(self, link: L3Link) -> None:
        """Drain the backup queue in FIFO batches, one batch at a time.

        Pages of different chains are written concurrently; within a chain a page's write
        starts only after its parent's succeeded (and is skipped if the parent's failed), so
        what this instance writes to L3 is always a prefix of each chain. Outcomes are kept on
        the nodes (``l3_write_ok``, touched only by this worker) and acknowledged in FIFO
        order for ``_apply_backup``.
        """
        while True:
            with self._backup_worker_lock:
                if not self._backup_queue:
                    self._backup_worker_running = False
                    return
                count = min(len(self._backup_queue), _BACKUP_BATCH_PAGES)
                batch = [self._backup_queue.popleft() for _ in range(count)]
            tasks: dict[int, asyncio.Task[bool]] = {}
            ios = [IOStats() for _ in batch]

            async def write(
                node: PageNode,
                page_hash: str,
                row: Any,
                io: IOStats,
                tasks: dict[int, asyncio.Task[bool]] = tasks,
            ) -> bool:
                parent = node.parent
                if parent is not None and parent.depth >= 0 and not parent.in_l3:
                    before = tasks.get(id(parent))
                    parent_ok = await before if before is not None else parent.l3_write_ok
                    if not parent_ok:
                        return False
                try:
                    known = parent is not None and parent.depth >= 0
                    return await link.write_page(
                        page_hash, row, io, parent.page_hash if known and parent else None
                    )
                except Exception:  # write_page reports failures; this is belt and braces
                    return False

            for (node, page_hash, row), io in zip(batch, ios, strict=True):
                tasks[id(node)] = asyncio.ensure_future(write(node, page_hash, row, io))
            for (node, _hash, _row), io in zip(batch, ios, strict=True):
                ok = await tasks[id(node)]
                node.l3_write_ok = ok
                self._acks.append(("backup", (node, ok, io)))

    def _apply_backup(self, node: PageNode, ok: bool, io: IOStats) -> None:
        for listener in self.backup_listeners:
            listener(node.page_hash, ok)
        self._backups_in_flight -= 1
        self.tree.release_host(node)
        if ok:
            self.tree.set_in_l3(node, True)
            self.metrics.backups_l3 += 1
            self.metrics.bytes_l2_to_l3 += io.bytes_moved
        else:
            self.metrics.backups_l3_failed += 1
        self.tree.set_l3_pending(node, False)
        if self.config.host_mode == "buffer_only":
            self._drop_host_copy(node)
        else:
            self.tree.prune(node)

    def _start_prefetch(self, req: Request) -> None:
        link = self.l3
        assert link is not None
        start = len(req.nodes)
        candidates = req.hashes[start:]
        try:
            with _timed(req):  # a round trip to the backend: I/O, not bookkeeping
                available = run_sync(
                    link.exists_prefix(candidates), timeout=self.config.io_timeout_s
                )
        except Exception as exc:
            log.warning("L3 existence check failed, recomputing instead: %s", exc)
            available = 0
        if available * self.namespace.page_size < self.config.prefetch_threshold_tokens:
            return
        host_pages = self._alloc_host(available)
        while host_pages is None and available > 0:
            available = min(available - 1, self.host.free_pages)
            host_pages = self.host.alloc(available) if available else None
        if not host_pages:
            return
        hashes = candidates[: len(host_pages)]
        op = _Prefetch(hashes, host_pages, [None] * len(hashes))
        rows = [self.host.row(p) for p in host_pages]
        self.metrics.prefetch_started += 1

        def finish(i: int, ok: bool) -> None:
            # Set the outcome, then look at abandonment: together with the engine thread doing
            # the opposite in _settle_prefetch, every abandoned page is freed exactly once.
            op.done[i] = ok
            if op.abandoned_from is not None and i >= op.abandoned_from:
                self._acks.append(("prefetch_page", (op, i)))

        async def run() -> None:
            try:
                failed = False
                for i, (page_hash, row) in enumerate(zip(hashes, rows, strict=True)):
                    abandoned = op.abandoned_from is not None and i >= op.abandoned_from
                    ok = (
                        False
                        if failed or abandoned
                        else await link.read_page(page_hash, row, op.io)
                    )
                    failed = failed or not ok  # past a failure no page can extend the prefix
                    finish(i, ok)
            finally:
                op.finished.set()

        op.future = submit(run())
        self._prefetches.append(op)
        req.prefetch = op

    def _settle_prefetch(self, req: Request) -> float:
        """Wait as the policy says, take the completed prefix, and return the seconds waited."""
        op = req.prefetch
        assert op is not None
        policy = self.config.prefetch_policy
        started = time.perf_counter()
        timed_out = False
        if policy == "wait_complete":
            timed_out = not op.finished.wait(self.config.io_timeout_s)
        elif policy == "timeout":
            limit = prefetch_timeout(self.config, len(op.hashes) * self.namespace.page_size)
            timed_out = not op.finished.wait(limit)
        waited = time.perf_counter() - started
        done = op.completed_prefix()
        agreed = self.group.agree_min(done, "prefetch_pages")
        m = self.metrics
        if agreed == len(op.hashes):
            m.prefetch_complete += 1
        elif timed_out:
            m.prefetch_timed_out += 1
        else:
            m.prefetch_partial += 1
        m.prefetch_failed_pages += sum(1 for ok in op.done if ok is False)
        m.corruptions += op.io.corruptions
        m.tampered += op.io.tampered
        m.bytes_l3_to_l2 += op.io.bytes_moved
        m.l3_fetched_bytes += op.io.bytes_fetched
        m.l3_needed_bytes += op.io.bytes_needed
        op.io = IOStats()
        # Pages past the agreed prefix are abandoned: their host pages come back once their
        # reads have ended (now, or when the read's completion is polled).
        op.abandoned_from = agreed
        for i in range(agreed, len(op.hashes)):
            if op.done[i] is not None:
                self._apply_abandoned_page(op, i)
            else:
                # Quarantined: its read may still be writing into the row. ``finish`` queues
                # the row's release once ``read_page`` has returned (the I/O has ended).
                m.host_pages_quarantined += 1
        nodes = self.tree.insert(req.hashes[: len(req.nodes) + agreed])[len(req.nodes) :]
        for node, host_page in zip(nodes, op.host_pages[:agreed], strict=True):
            if node.host_page is None:
                self.tree.set_host(node, host_page)
            else:
                self.host.free([host_page])
            self.tree.set_in_l3(node, True)
        self._hold(req, nodes)
        self.tree.touch(nodes)
        req.l3_pages = agreed
        return waited

    def _apply_abandoned_page(self, op: _Prefetch, index: int) -> None:
        """Free the row of abandoned page ``index`` (its read has ended: ``done`` is set)."""
        assert op.done[index] is not None, "a row freed while its read may still write into it"
        if op.host_pages[index] >= 0:
            self.host.free([op.host_pages[index]])
            op.host_pages[index] = -1
