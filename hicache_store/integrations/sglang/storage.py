"""SGLang HiCache storage backend: unified, topology-free L3 on any hicache-store backend.

Launch SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache_store",
        "module_path": "hicache_store.integrations.sglang", "class_name": "HiCacheStoreStorage",
        "interface_v1": 1, "url": "file:///var/cache/kv", "grid": "1x1"}'

(the extra-config keys are documented in ``hicache_store.sglang_config``). SGLang's ``StorageBackendFactory``
imports this module, checks that ``HiCacheStoreStorage`` subclasses its ``HiCacheStorage`` (it
does whenever SGLang is importable; without SGLang it is a plain class with the same methods),
builds it as ``cls(storage_config, kwargs)`` and calls ``register_mem_pool_host(host_pool)``.

**What a page becomes.** SGLang's page keys are the sha256 page-hash chain of
``layout.hashing``, used as they are. At registration the adapter derives the namespace
(model, the weights' revision, KV kind, dtype, layers, KV heads, head or latent dim, page size,
grid, tenant salt, sealed or not) and this rank's shard (TP/PP rank and size; MLA and
DP-attention pools are replicated across TP, so only TP rank 0 writes). A page moves between SGLang's host pool
(``layer_first``, ``page_first``, ``page_first_direct``, ``page_head``; MHA and MLA) and
unified objects through the kernels' host relayouts; object keys carry the namespace digest,
never a rank, so a deployment with another TP/PP size reads the same objects, and other
weights, another dtype, model, grid or salt never hit. The weights' revision follows SGLang's
online weight updates (``_weights``; ``weights_updated`` for the ones SGLang does not
record): after one, the namespace is derived again and pages stored before miss.

**Tenants.** With a tenant key ring (``tenant_key_file``) the namespace is sealed: SGLang's
page hashes are keyed with the tenant's secret before they name objects, and every object is
encrypted and authenticated per layer block (``hicache_store.objects.sealed``), in place in
the staging buffer. Without a ring, keys and bytes are exactly as above (SGLang's hashes as
they are). Objects that fail authentication are misses counted as ``tamper``.

**Data path.** Pages move through page-aligned staging (``objects.arena``), never straight
between the pool and the store: writes relayout a batch into framed buffers and put them (a
rank that writes several objects per page: ``L3Link.write_in_order``); reads assemble each page
into a staging row from verified objects (``L3Link.read_page``), a window of up to 16 rows in
flight, and relayout each row into the pool as it lands. Only the calling thread writes into
the pool, and only before it returns. A row is reused once its read has returned; staging
that I/O may still touch after a call is dropped, never reused. The read window is made at
registration. Why each of these: ``docs/design/sglang.md``.

**Deadlines.** A ``batch_get_v1``, and each chunk of a ``batch_set_v1`` (the whole call, unless
it holds more than ``staging_mib``), has one deadline from the bytes it moves:
``io_timeout_s + bytes / min_bandwidth_mib_s`` (``objects.io.Deadline``, the one rule). When
it passes, the batch ends with what it moved: a page read and verified by then is True and in
the pool, and reads not begun are never begun; a write's pages not started by then are never
started, and a leading run of them, those stored, is True. Pages are written through the
backend's one write queue, oldest first across every thread, in runs, each run within the
deadline of its own bytes from its start (``objects.writes``), so on a slow store the leading
pages finish first and SGLang's next hit query finds them: a slow disk gives fewer backups,
not none. The calling thread waits past a deadline at most ``io_timeout_s + 5`` s for I/O
that cannot end (a hung mount).

**Threads and failures.** SGLang calls from its prefetch, I/O and backup threads at once.
Each call runs its I/O on the one sync bridge loop (``hicache_store._sync``) and keeps its own
staging buffers (per thread; the first reading thread adopts the window made at
registration). No data method raises or returns None into SGLang: an error, a timeout, a miss
or a corrupt object is ``False`` (per page) or ``0``, logged and counted in ``counters``.
Configuration errors (a missing ``url``, a pool that does not match the namespace, a hybrid
model's sidecar pool the adapter does not store) raise at construction or registration, so that a misconfigured server
fails at startup instead of silently recomputing. ``get_stats`` returns SGLang's
``StorageMetrics`` (``_metrics``); ``clear`` deletes nothing unless ``allow_clear``.

**Not supported** (refused at startup with a message): attention context parallelism and DCP
(``attn_cp_size``/``dcp_size`` > 1), the ``page_unified`` and NPU host layouts, the sidecar
pools of SGLang's v2 multi-pool interface other than ``swa`` and ``mamba`` (those are stored
as cache components, see ``_v2``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from hicache_store import _sync
from hicache_store.backends import Backend, open_backend
from hicache_store.backends.aio import result_within, timeout_at
from hicache_store.kernels.ops import host_to_unified, unified_to_host
from hicache_store.kernels.pools import HostPool
from hicache_store.layout.keys import ObjectKey, validate_page_hash
from hicache_store.layout.namespace import ModelShape, Namespace
from hicache_store.layout.plans import WritePlan
from hicache_store.objects import Frame, IOStats, L3Link, PageWrite
from hicache_store.objects.arena import Arenas, round_up
from hicache_store.sglang_config import AdapterConfig
from hicache_store.tenant import KeyRing, load_key_ring

from ._events import AdapterEvents
from ._metrics import AdapterMetrics
from ._namespace import NamespaceWatch
from ._pool import Registered as _Registered
from ._pool import describe_host_pool, host_slots, page_view
from ._v2 import (
    KV_POOL,
    Deployment,
    PagedSidecar,
    Sidecar,
    check_keys,
    make_sidecar,
    pool_name,
    refuse,
    restorable_prefixes,
    transfer_result,
    transfer_spec,
)
from ._weights import WeightsWatch

log = logging.getLogger(__name__)
T = TypeVar("T")
#: Reads: pages in flight at once, each read into its own staging row and relaid out into the
#: pool as soon as it lands (within ``staging_mib``). A window, not chunks: no read waits for
#: a slower neighbour of its chunk, and the staging is smaller (16 rows = 128 MiB for 8 MiB
#: pages, against three 64 MiB chunk buffers). 16 is the file backend's I/O thread count.
#: Figures: BENCHMARKS.md, "SGLang".
_READ_WINDOW_PAGES = 16

if TYPE_CHECKING:
    _HiCacheStorage = object
else:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _HiCacheStorage
    except Exception:  # not installed, or its imports fail: work as a plain class
        _HiCacheStorage = object

#: whether ``HiCacheStoreStorage`` subclasses SGLang's ``HiCacheStorage`` in this process.
SGLANG_AVAILABLE = _HiCacheStorage is not object

__all__ = ["SGLANG_AVAILABLE", "HiCacheStoreStorage"]


_Buffer = tuple[memoryview, torch.Tensor]
_StagingKey = tuple[str, int, int]  # (purpose, slot, bytes)


class _Staging(threading.local):
    """Per-thread, page-aligned staging buffers, reused across calls.

    Their memory is slots of arenas (``objects.arena``) shared by every thread: ``reads`` (the
    ``get`` buffers) populated, since DMA into pages the CPU never touched is slow (see
    ``aligned_buffer``); ``writes`` (``set``) not, the CPU fills them first and faults their
    pages in as it writes. A thread keeps the slot of each (purpose, slot) until ``buffers`` is
    cleared (I/O may still land in it: the slot is dropped, never reused) or it needs another
    size there (the old slot is given back).
    """

    def __init__(self, reads: Arenas, writes: Arenas) -> None:
        self.buffers: dict[_StagingKey, _Buffer] = {}
        self.reads = reads
        self.writes = writes

    def get(self, purpose: str, slot: int, nbytes: int) -> _Buffer:
        """The thread's ``purpose`` (``get`` or ``set``) buffer ``slot`` of ``nbytes`` or more."""
        key = (purpose, slot, nbytes)
        found = self.buffers.get(key)
        if found is None:
            arenas = self.reads if purpose == "get" else self.writes
            for stale in [k for k in self.buffers if k[:2] == (purpose, slot)]:
                view, _ = self.buffers.pop(stale)
                arenas.arena(len(view)).give(view)
            view = arenas.arena(nbytes).take()
            found = self.buffers[key] = view, torch.frombuffer(view, dtype=torch.uint8)
        return found


class HiCacheStoreStorage(_HiCacheStorage):
    """SGLang's ``HiCacheStorage`` contract on a hicache-store backend (see the module doc)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        extra.update(kwargs or {})
        self.config = AdapterConfig.from_extra_config(extra)
        self.storage_config = storage_config
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0))
        self.tp_size = int(getattr(storage_config, "tp_size", 1))
        self.pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        self.replicated = bool(getattr(storage_config, "is_mla_model", False))
        for name in ("attn_cp_size", "dcp_size"):
            if int(getattr(storage_config, name, 1) or 1) > 1:
                raise ValueError(f"hicache-store SGLang backend: {name} > 1 is not supported")
        # Loaded (and checked) at construction: a bad key file fails the server at startup.
        self.keys: KeyRing | None = load_key_ring(self.config.tenant_key_file)
        self.backend: Backend = open_backend(self.config.backend)
        self._registered: _Registered | None = None
        self._sidecars: dict[str, Sidecar] = {}
        # Read staging made at registration is adopted by the first thread that reads.
        self._staging = _Staging(Arenas(block_slots=1, populate=True), Arenas(block_slots=1))
        self._threads = threading.local()  # the weights each calling thread started under
        self._lock = threading.Lock()
        self._closed = False
        self.events: AdapterEvents | None = None  # KV events (TP rank 0, PP stage 0)
        labels = {"tp_rank": str(self.tp_rank), "pp_rank": str(self.pp_rank)}
        export = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics = AdapterMetrics(prometheus_labels=labels if export else None)

    # -- registration ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Derive the namespace and this rank's shard from the host pool; raise on mismatch."""
        self.mem_pool_host = mem_pool_host
        # The weights' revision (``_weights``): a model whose files cannot be read
        # fails the server here, at start.
        self._weights = WeightsWatch(
            self.config.model_revision, getattr(self.storage_config, "model_name", None))
        registered = self._registration(mem_pool_host, self._weights.revision)
        namespace, link = registered.namespace, registered.link
        # Before _registered is set: data calls (other threads) use the watch once it is.
        self._watch = NamespaceWatch(self.backend, namespace, self._run_startup)
        manifest = self._watch.at_start(writes=link.can_write)
        self._registered = registered
        if self.config.events is not None and self.tp_rank == 0 and self.pp_rank == 0:
            page_key = self.keys.active.page_key if namespace.sealed and self.keys else None
            self.events = AdapterEvents(self.config.events, namespace.page_size, page_key)
        self._make_read_staging(self._registered)
        log.info(
            "hicache-store: %s on %s, namespace %s (%s %s, %d layers, %d KV heads x %d, "
            "page %d, grid %s, salt %s, %s, weights %s; manifest %s in the store), %s rank "
            "%d, %s",
            type(self).__name__,
            self.config.backend.get("url", self.config.backend.get("backend")),
            namespace.digest,
            namespace.model,
            namespace.dtype,
            namespace.num_layers,
            namespace.num_kv_heads,
            namespace.head_dim,
            namespace.page_size,
            namespace.grid,
            "set" if namespace.tenant_salt else "none",
            f"sealed with key {self.keys.active.key_id}" if self.keys else "not sealed",
            self._weights.describe(),
            manifest,
            registered.topology,
            registered.rank,
            "writes" if link.can_write else "reads only",
        )

    def _registration(self, mem_pool_host: Any, revision: str) -> _Registered:
        """The KV pool's registration under the weights ``revision``; ``ValueError`` when the
        pool does not match the namespace and topology."""
        geometry, host = describe_host_pool(mem_pool_host)
        cfg = self.config
        mla = geometry.kv_kind == "mla"
        num_layers = cfg.num_layers
        if num_layers is None:
            if self.pp_size > 1 and cfg.pp_layers is None:
                raise ValueError(
                    'hicache-store: with PP, set "num_layers" (the model\'s layer count) or '
                    '"pp_layers" in the extra-config: a stage\'s pool holds only its layers'
                )
            num_layers = sum(cfg.pp_layers) if cfg.pp_layers else geometry.num_layers
        # PP stages as SGLang splits them (its rule differs from vLLM's for uneven splits)
        topology = cfg.topology(self.tp_size, self.pp_size, num_layers)
        rank = topology.rank_of(self.tp_rank, self.pp_rank)
        if mla:
            shape = ModelShape.mla(num_layers, geometry.head_dim)
        else:
            heads = cfg.num_kv_heads or (
                geometry.num_heads if self.replicated else geometry.num_heads * self.tp_size
            )
            shape = ModelShape.mha(num_layers, heads, geometry.head_dim)
        replication = "replicated" if (mla or self.replicated) else "head_sharded"
        grid = cfg.grid_for(shape, topology, replication)
        model = cfg.model or getattr(self.storage_config, "model_name", None) or ""
        if not model:
            raise ValueError('hicache-store: SGLang gave no model_name; set "model"')
        kv_dtype = geometry.kv_dtype(cfg.kv_dtype)
        namespace = Namespace.create(
            model,
            shape,
            kv_dtype,
            geometry.page_size,
            grid,
            replication=replication,
            model_revision=revision,
            tenant_salt=cfg.tenant_salt,
            key_scheme=cfg.key_scheme,
            sealed=self.keys is not None,
            kv_scales=cfg.kv_scales_for(kv_dtype, num_layers),
        )
        link = L3Link(
            self.backend,
            namespace,
            topology,
            rank,
            max_inflight_bytes=cfg.max_inflight_bytes,
            io_timeout_s=cfg.io_timeout_s,
            min_bandwidth_mib_s=cfg.min_bandwidth_mib_s,
            keys=self.keys,
        )
        shard = link.read_plan.shard
        if geometry.start_layer is not None and self.pp_size > 1 and (
            geometry.start_layer != shard.layer_start
        ):
            raise ValueError(
                f"hicache-store: PP stage {self.pp_rank} holds layers from "
                f"{geometry.start_layer}, the topology {topology} puts it at "
                f"{shard.layer_start}; set \"pp_layers\" to SGLang's split"
            )
        return _Registered.build(geometry, host, topology, rank, link)

    # -- the weights (``_weights``) --------------------------------------------------------

    def weights_updated(self, label: str | None = None) -> str:
        """Say that the served weights changed in a way SGLang does not record (an update from
        tensors, a process group or IPC without a ``weight_version``): the namespace moves to
        a new revision, so pages stored before miss. ``label`` names the new weights (the
        same on every rank, so the ranks agree on the namespace); None: a random one. Returns
        the new revision. The operator (or the RL framework driving the updates) must call
        it on every rank; ``update_weights_from_disk`` and updates with a ``weight_version``
        are followed without it."""
        revision = self._weights.bump(label)
        if self._registered is not None:
            self._follow_weights(self._registered)
        return revision

    def _follow_weights(self, reg: _Registered) -> _Registered:
        """The registration of the weights served now: ``reg`` while they are the ones it was
        made for, else the KV pool and every sidecar registered again under the new revision
        (pages stored before the update miss from then on)."""
        revision = self._weights.current()
        if revision == reg.namespace.model_revision:
            return reg
        with self._lock:
            current = self._registered
            if current is None or current.namespace.model_revision == revision:
                return current or reg
            fresh = self._registration(self.mem_pool_host, revision)
            watch = NamespaceWatch(self.backend, fresh.namespace, self._run_startup)
            watch.at_start(writes=fresh.link.can_write)
            sidecars = {
                label: make_sidecar(label, pool, self._sidecar_deployment(fresh))
                for label, pool in self.__dict__.get("registered_pools", {}).items()
                if label in self._sidecars
            }
            self._watch, self._sidecars, self._registered = watch, sidecars, fresh
        log.info("hicache-store: the served weights changed (%s): namespace %s -> %s",
                 self._weights.describe(), reg.namespace.digest, fresh.namespace.digest)
        return fresh

    def _thread_weights(self, reg: _Registered) -> bool:
        """Whether the calling thread started under the weights ``reg`` is for.

        A thread's pages were computed by the weights served when it started: SGLang's
        storage threads are stopped and started again by the cache flush that follows a
        weight update, and a backup still queued when the update is recorded holds KV of the
        old weights. Such a thread's writes are refused (``set_weights_changed``), never
        stored under the new revision; its reads use the new one (at worst a miss). Without a
        flush (``flush_cache=False``, a flush refused, a bare ``update_weight_version``)
        nothing is backed up until SGLang's ``/flush_cache``."""
        revision = reg.namespace.model_revision
        started = getattr(self._threads, "revision", None)
        if started is None:
            self._threads.revision = started = revision
        if started == revision:
            return True
        if not getattr(self._threads, "warned", False):
            self._threads.warned = True
            log.warning(
                "hicache-store: the served weights changed since this SGLang thread started "
                "(%s); its backups are not stored until SGLang flushes its cache "
                "(/flush_cache), which starts its storage threads again", self._weights.describe())
        return False

    def _sidecar_deployment(self, reg: _Registered) -> Deployment:
        return Deployment(reg, self.config, self.backend, self.keys, self.tp_rank, self.tp_size,
                          self.pp_size, self.replicated)

    @property
    def namespace(self) -> Namespace | None:
        reg = self._registered
        return None if reg is None else reg.namespace

    # -- the v1 interface ------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages from the start are stored whole for this rank (0 on any error)."""
        def go(reg: _Registered) -> int:
            hits = self._run(reg.link.exists_prefix(list(keys)), reg)
            self._metrics.lookup(len(keys), hits)
            self._watch.observe(hits, len(keys))
            return hits

        return self._guard("exists", 0, go)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Write pages from host slots; one bool per key (True: stored, or not ours to write)."""
        results = self._guard(
            "set", [False] * len(keys), lambda reg: self._set_pages(reg, keys, host_indices)
        )
        if self.events is not None:
            try:
                self.events.stored(keys, results, extra_info)
            except Exception as exc:  # events never fail a write
                log.warning("hicache-store: publishing KV events failed: %s", exc)
        return results

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read pages into host slots; one bool per key (False: miss, error or corruption)."""
        return self._guard(
            "get", [False] * len(keys), lambda reg: self._get_pages(reg, keys, host_indices)
        )

    # -- the v2 (multi-pool) interface: KV + SWA / Mamba sidecars, see _v2 -----------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Accept the KV pool again; make a sidecar pool a cache component (``swa``,
        ``mamba``); refuse any other pool with one clear error (start-up or attach)."""
        label = pool_name(host_pool_name)
        reg = self._registered
        if label == KV_POOL and host_pool is getattr(self, "mem_pool_host", None):
            pass
        elif reg is None:
            raise refuse(label, host_pool, "no KV pool was registered before it")
        else:
            sidecar = make_sidecar(label, host_pool, self._sidecar_deployment(reg))
            watch = NamespaceWatch(self.backend, sidecar.namespace, self._run_startup)
            manifest = watch.at_start(writes=sidecar.link.can_write)
            self._sidecars[label] = sidecar
            log.info(
                "hicache-store: %r pool stored as component namespace %s (%s; manifest %s)",
                label, sidecar.namespace.digest, sidecar.namespace.model, manifest,
            )
        pools: dict[str, Any] = self.__dict__.setdefault("registered_pools", {})
        pools[label] = host_pool

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        """The KV prefix, cut to the lengths every transfer's pool can resume at (its hit
        policy, ``_v2``), with every such length in ``restorable_prefix_pages``.
        A transfer of a pool that is not stored: no hit. Never raises."""

        def go(reg: _Registered) -> Any:
            transfers = list(pool_transfers or ())
            hashes = check_keys(keys)
            kv = int(self._run(reg.link.exists_prefix(hashes), reg))
            self._metrics.lookup(len(hashes), kv)
            hits: dict[str, int] = {KV_POOL: kv} if kv else {}
            page_size = reg.geometry.page_size
            specs = []
            present: dict[str, list[bool]] = {}
            for transfer in transfers:
                label = pool_name(transfer.name)
                if label == KV_POOL:
                    continue
                sidecar = self._sidecars.get(label)
                spec = transfer_spec(transfer, page_size)
                if sidecar is None or spec is None:
                    self._count("v2_refused")
                    return transfer_result(0, {}, [])
                present[label] = self._run(sidecar.link.exists_pages(hashes[:kv]), reg)
                specs.append(spec)
                alone = restorable_prefixes([spec], present, page_size, kv)
                if alone:
                    hits[label] = alone[-1]
            restorable = restorable_prefixes(specs, present, page_size, kv)
            final = restorable[-1] if restorable else 0
            self._watch.observe(final, len(keys))
            return transfer_result(final, hits, restorable if specs else None)

        return self._guard("exists", None, go) or transfer_result(0, {}, [])

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read each transfer's pages into its pool (KV as ``batch_get_v1``); per transfer one
        bool per key: False for a miss, a corrupt object or a pool that is not stored."""
        return self._transfer_v2("get", transfers)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Write each transfer's pages from its pool (KV as ``batch_set_v1``). Never raises."""
        return self._transfer_v2("set", transfers)

    def _transfer_v2(self, op: str, transfers: Any) -> dict[Any, list[bool]]:
        """One success list per transfer, keyed by its (SGLang) pool name."""
        results: dict[Any, list[bool]] = {}
        try:
            batch = list(transfers or ())
        except Exception:
            self._count(f"{op}_errors")
            return results
        for transfer in batch:
            try:
                name, keys = transfer.name, list(transfer.keys or ())
                host_indices = transfer.host_indices
            except Exception:  # not a PoolTransfer: nothing to report it under
                self._count(f"{op}_errors")
                continue
            label = pool_name(name)
            failed = [False] * len(keys)
            if label == KV_POOL:
                move = self.batch_get_v1 if op == "get" else self.batch_set_v1
                results[name] = move(keys, host_indices)
            elif label not in self._sidecars:
                self._count("v2_refused")
                results[name] = failed
            else:
                results[name] = self._guard(
                    op, failed, _bind(self._move_sidecar, op, self._sidecars[label], keys, host_indices)
                )
        return results

    def _move_sidecar(
        self, reg: _Registered, op: str, sidecar: Sidecar, keys: list[str], host_indices: Any
    ) -> list[bool]:
        """One transfer of a sidecar pool (``reg``: the KV's registration, for the deadline)."""
        if isinstance(sidecar, PagedSidecar):
            move = self._get_pages if op == "get" else self._set_pages
            done = move(sidecar.reg, keys, host_indices)
            self._count(f"{sidecar.name}_{op}_pages", sum(done))
            return done
        check_keys(keys)
        flat = sidecar.slots(host_indices, len(keys), writes_pool=op == "get")
        started = time.perf_counter()
        io = IOStats()
        if op == "get":
            rows = sidecar.rows(len(keys))
            results = self._run(sidecar.read(keys, rows, io), reg)
            sidecar.install(results, rows, flat)
        else:
            results = self._run(sidecar.write(keys, sidecar.stage(flat)), reg)
        if io.corruptions:
            self._count("corrupt_objects", io.corruptions)
        if io.tampered:
            self._count("tamper", io.tampered)
        self._count(f"{sidecar.name}_{op}_pages", sum(results))
        self._metrics.record(op, results, sidecar.state_bytes, time.perf_counter() - started)
        return results

    # -- the generic (legacy) interface ----------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Write flat pages as SGLang's ``get_data_page(index)`` returns them."""

        def go(reg: _Registered) -> bool:
            if values is None or len(values) != len(keys):
                raise ValueError("batch_set: one flat page tensor per key is required")
            slots = torch.arange(reg.geometry.page_size, dtype=torch.int64)
            return all(
                self._set_pages(reg, [key], slots, host=page_view(reg.geometry, value))[0]
                for key, value in zip(keys, values, strict=True)
            )

        return bool(self._guard("set", False, go))

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read flat pages (``set_from_flat_data_page`` order); None per missing page.

        A given target tensor of a page's size is filled and returned; otherwise a new one.
        """

        def go(reg: _Registered) -> list[torch.Tensor | None]:
            targets = list(target_locations) if target_locations is not None else []
            out: list[torch.Tensor | None] = []
            numel = reg.geometry.pool_layout(num_pages=1).numel
            slots = torch.arange(reg.geometry.page_size, dtype=torch.int64)
            for i, key in enumerate(keys):
                target = targets[i] if i < len(targets) else None
                fresh = torch.empty(numel, dtype=reg.host.dtype)
                ok = self._get_pages(reg, [key], slots, host=page_view(reg.geometry, fresh))[0]
                if not ok:
                    out.append(None)
                elif (
                    isinstance(target, torch.Tensor)
                    and target.is_contiguous()
                    and target.numel() * target.element_size() == fresh.numel() * fresh.element_size()
                ):
                    target.view(-1).view(torch.uint8).copy_(fresh.view(torch.uint8))
                    out.append(target)
                else:
                    out.append(fresh)
            return out

        missing: list[torch.Tensor | None] = [None] * len(keys)
        return self._guard("get", missing, go)

    # -- admin -----------------------------------------------------------------------------

    def clear(self) -> bool:
        """SGLang's ``POST /hicache/storage-backend/clear`` and P/D role switch. Never raises.

        By default nothing is deleted (logged and counted as ``clear_refused``): an L3 store
        is usually shared, by other servers of the deployment, by other deployments of the
        model, by ``prepopulate``, so one server's role switch must not wipe what all of them
        read. With ``"allow_clear": true`` in the extra-config this namespace's objects are
        deleted; other namespaces (another model, dtype, grid or tenant salt) are kept.
        Returns whether objects were deleted.
        """
        reg = self._registered
        if not self.config.allow_clear:
            self._count("clear_refused")
            log.warning(
                "hicache-store: clear() refused: the store may be shared by other servers and "
                'deployments; set "allow_clear": true in the extra-config to let SGLang '
                "delete this namespace's objects"
            )
            return False
        if reg is None or not self.backend.capabilities.listing:
            self._count("clear_failed")
            log.warning("hicache-store: clear() needs a registered pool and a listing backend")
            return False
        marker = f"_{reg.namespace.digest}_"

        async def go() -> int:
            keys = [k async for k in self.backend.list_prefix("") if marker in k]
            for s in range(0, len(keys), 1024):
                await self.backend.delete(keys[s : s + 1024])
            return len(keys)

        try:
            removed = _sync.run_sync(go(), timeout=max(60.0, self.config.io_timeout_s))
        except Exception as exc:
            self._count("clear_failed")
            log.warning("hicache-store: clear failed: %s", exc)
            return False
        log.info("hicache-store: clear removed %d objects of %s", removed, marker[1:-1])
        if self.events is not None:
            self.events.cleared()
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the last call (drained); never None.

        Our cumulative counters are ``counters`` (and Prometheus, see ``_metrics``).
        """
        return self._metrics.drain()

    @property
    def counters(self) -> dict[str, int]:
        """Cumulative event counts: ``set_pages``, ``get_pages``, ``*_failed``, ``*_errors``,
        ``corrupt_objects``, ``set_refused``, ``v2_refused``, ``clear_refused``,
        ``set_weights_changed`` (backups of a thread started before a weight update), per
        sidecar pool ``swa_set_pages``, ``mamba_get_pages``, ..., and the lookups' pages asked
        of the store and found (``lookup_pages_asked_l3``, ``lookup_pages_found_l3``)."""
        return self._metrics.counters()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.events is not None:
            self.events.close()
        try:
            _sync.run_sync(self.backend.close(), timeout=30.0)
        except Exception as exc:
            log.warning("hicache-store: closing the backend failed: %s", exc)

    # -- internals -------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self._metrics.count(name, n)

    def _guard(self, op: str, failed: T, fn: Callable[[_Registered], T]) -> T:
        """Run ``fn``; any exception becomes ``failed``, logged and counted. Never raises."""
        try:
            reg = self._registered
            if reg is None or self._closed:
                self._count(f"{op}_unavailable")
                return failed
            reg = self._follow_weights(reg)
            if not self._thread_weights(reg) and op == "set":
                self._count("set_weights_changed", 1)
                return failed
            return fn(reg)
        except BaseException as exc:  # SGLang's daemon threads die on any exception
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            self._count(f"{op}_errors")
            log.warning("hicache-store: %s failed: %r", op, exc)
            return failed

    def _run_startup(self, coro: Coroutine[Any, Any, T]) -> T:
        return _sync.run_sync(coro, timeout=self.config.io_timeout_s)

    def _run(self, coro: Coroutine[Any, Any, T], reg: _Registered) -> T:
        return _sync.run_sync(coro, timeout=_deadline(reg))

    @staticmethod
    def _first_slots(
        reg: _Registered,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        pool: HostPool,
        *,
        writes_pool: bool,
    ) -> torch.Tensor:
        """The call's ``[pages, page_size]`` slot table, keys and slots checked before any
        I/O (``host_slots``); ``ValueError`` / ``InvalidKeyError`` otherwise."""
        for key in keys:
            validate_page_hash(key)
        return host_slots(
            host_indices, len(keys), reg.geometry.page_size, pool.num_slots,
            writes_pool=writes_pool,
        )

    def _chunk_pages(self, row_bytes: int) -> int:
        return max(1, self.config.staging_bytes // row_bytes)

    def _read_staging(self, reg: _Registered) -> tuple[int, int, _StagingKey]:
        """(rows, row bytes, staging key) of the read window (one source for reads and the
        window made at registration)."""
        row = round_up(reg.layout.page_bytes)
        slots = max(1, min(_READ_WINDOW_PAGES, self.config.staging_bytes // row))
        return slots, row, ("get", 0, slots * row)

    def _make_read_staging(self, reg: _Registered) -> None:
        """Make a read window now, populated, for the first thread that reads to take: faulting
        it in costs about what reading the same bytes from disk does here, paid once at
        start-up instead of in the first prefetch."""
        arena = self._staging.reads.arena(self._read_staging(reg)[2][2])
        if not arena.free:
            arena.give(arena.take())

    # writes -------------------------------------------------------------------------------

    def _set_pages(
        self,
        reg: _Registered,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        host: HostPool | None = None,
    ) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        plan = reg.link.write_plan
        if plan is None:  # this rank's shard does not align with the grid
            self._count("set_refused", n)
            return [False] * n
        if not plan.objects:  # a replica that is not the writer: nothing to do
            return [True] * n
        write = self._set_fused if reg.fused_write else self._set_via_link

        def put(table: torch.Tensor, pool: HostPool) -> tuple[list[bool], bool]:
            results = write(reg, plan, keys, table, pool)
            return results, not all(results)  # a put that failed may still read them

        return self._staged("set", reg, keys, host_indices, host, plan.bytes_per_page, put)

    def _set_fused(
        self,
        reg: _Registered,
        plan: WritePlan,
        keys: Sequence[str],
        table: torch.Tensor,
        pool: HostPool,
    ) -> list[bool]:
        """One object per page: relayout into the payloads of aligned frames, then
        ``ObjectIO.put`` seals each header in place and stores it (under its byte budget),
        each chunk within its deadline (``Deadline`` of its bytes)."""
        (obj,) = plan.objects
        digest = reg.namespace.digest
        io = reg.link.io
        header = io.header_bytes(obj.coords.num_layers)
        payload = obj.nbytes
        stride = header + round_up(payload)
        per_chunk = self._chunk_pages(stride)
        results: list[bool] = []
        # each chunk's puts, and how long they may take
        inflight: list[tuple[concurrent.futures.Future[list[bool]], float]] = []
        try:
            for c, s in enumerate(range(0, len(keys), per_chunk)):
                e = min(s + per_chunk, len(keys))
                if len(inflight) >= 2:  # the buffer of chunk c-2 is free once its puts are done
                    results.extend(_outcome(reg, *inflight.pop(0)))
                view, tensor = self._staging.get("set", c % 2, per_chunk * stride)
                staging = tensor.as_strided((e - s, payload), (stride, 1), header)
                host_to_unified(pool, table[s:e], staging, reg.layout)
                frames = [
                    Frame(
                        ObjectKey(keys[s + i], digest, obj.coords),
                        view[i * stride : i * stride + header + payload],
                        _parent(keys, s + i),
                    )
                    for i in range(e - s)
                ]
                seconds = io.deadline.seconds((e - s) * (header + payload))
                inflight.append((_sync.submit(io.put(frames)), seconds))
            while inflight:
                results.extend(_outcome(reg, *inflight.pop(0)))
        finally:
            # A put stuck in I/O cannot be stopped; its staging is dropped by the caller
            # (``_staged``) and SGLang's backup thread gets False instead of waiting on it.
            for fut, _ in inflight:
                fut.cancel()
        return results

    def _set_via_link(
        self,
        reg: _Registered,
        plan: WritePlan,
        keys: Sequence[str],
        table: torch.Tensor,
        pool: HostPool,
    ) -> list[bool]:
        """Several objects per page: relayout, then ``L3Link.write_in_order`` frames each
        object and stores the chunk's pages oldest first, in runs; they share the chunk's
        deadline (``Deadline`` of its bytes) to start by."""
        link = reg.link
        row = round_up(reg.layout.page_bytes)
        per_chunk = self._chunk_pages(row)
        page_bytes = sum(link.io.frame_bytes(o.coords.num_layers, o.nbytes) for o in plan.objects)
        results: list[bool] = []
        for s in range(0, len(keys), per_chunk):
            e = min(s + per_chunk, len(keys))
            _view, tensor = self._staging.get("set", 0, per_chunk * row)
            staging = tensor.as_strided((e - s, reg.layout.page_bytes), (row, 1), 0)
            host_to_unified(pool, table[s:e], staging, reg.layout)
            rows = staging.numpy()
            io = IOStats()
            seconds = link.deadline.seconds((e - s) * page_bytes)

            async def go(
                rows: Any = rows, s: int = s, e: int = e, io: IOStats = io,
                seconds: float = seconds,
            ) -> list[bool]:
                pages = [PageWrite(keys[s + i], rows[i], _parent(keys, s + i))
                         for i in range(e - s)]
                return await link.write_in_order(pages, io, end=time.monotonic() + seconds)

            results.extend(_sync.run_sync(go(), timeout=seconds + _slack(reg)))
        return results

    # reads --------------------------------------------------------------------------------

    def _get_pages(
        self,
        reg: _Registered,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        host: HostPool | None = None,
    ) -> list[bool]:
        if not keys:
            return []

        def get(table: torch.Tensor, pool: HostPool) -> tuple[list[bool], bool]:
            return self._get_staged(reg, keys, table, pool)  # stuck: reads may still land

        return self._staged("get", reg, keys, host_indices, host, reg.layout.page_bytes, get)

    def _staged(
        self,
        op: str,
        reg: _Registered,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        host: HostPool | None,
        page_bytes: int,
        move: Callable[[torch.Tensor, HostPool], tuple[list[bool], bool]],
    ) -> list[bool]:
        """One batch ``op`` (``set`` or ``get``) of ``keys`` between the host slots of
        ``host_indices`` (in ``host``, else the registered pool) and the store, through this
        thread's staging buffers: ``move(first slots, pool)`` returns one bool per key and
        whether I/O may still touch the buffers, which are then dropped, as they are on any
        error (a timed-out read or write cannot be cancelled: never reuse its buffers). The
        batch is accounted under ``op``."""
        pool = reg.host if host is None else host
        table = self._first_slots(reg, keys, host_indices, pool, writes_pool=op == "get")
        started = time.perf_counter()
        try:
            results, touched = move(table, pool)
        except BaseException:
            self._staging.buffers.clear()
            raise
        if touched:
            self._staging.buffers.clear()
        self._account(op, results, page_bytes, started)
        return results

    def _get_staged(
        self, reg: _Registered, keys: Sequence[str], table: torch.Tensor, pool: HostPool
    ) -> tuple[list[bool], bool]:
        """Stream the pages through a window of staging rows, relaying each out as it lands.

        Every row holds one page read in flight; when a read completes this thread relays
        its row into the pool and at once reuses the row for the next page, so the device
        always has ``slots`` reads queued and no read waits for a slower neighbour.

        The call has one deadline, from the bytes it reads (``Deadline``): a page read and
        verified by then is relaid out and True; a read still running then is cut (it ends
        when its I/O has, ``read_page``) and False, and no page is started after it. Only
        this thread writes into the pool, and only before it returns, so a late read never
        reaches SGLang's host memory. Returns (results, stuck): ``stuck`` when reads did
        not end ``_slack`` past the deadline (I/O that cannot end): their rows must be
        dropped.
        """
        page_bytes = reg.layout.page_bytes
        n = len(keys)
        slots, row, key = self._read_staging(reg)
        _view, tensor = self._staging.get(*key)
        staging = tensor.as_strided((slots, page_bytes), (row, 1), 0)
        rows = staging.numpy()
        io = IOStats()
        results = [False] * n
        in_flight: dict[concurrent.futures.Future[bool], tuple[int, int]] = {}
        plan = reg.link.read_plan
        end = reg.link.deadline.end(n * (plan.bytes_fetched + plan.header_bytes))
        stuck = False

        def launch(page: int, slot: int) -> None:
            fut = _sync.submit(_by(end, reg.link.read_page(keys[page], rows[slot], io)))
            in_flight[fut] = (page, slot)

        for slot in range(min(slots, n)):
            launch(slot, slot)
        next_page = min(slots, n)
        try:
            while in_flight:
                timeout = _wait(reg, end)
                done, _ = concurrent.futures.wait(
                    in_flight, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
                )
                if not done:
                    stuck = True
                    self._count("get_errors")
                    log.warning(
                        "hicache-store: get: %d page reads did not end %.0f s past the call's "
                        "deadline (I/O that cannot end); %d of %d pages loaded",
                        len(in_flight), _slack(reg), sum(results), n,
                    )
                    break
                for fut in done:
                    page, slot = in_flight.pop(fut)
                    if fut.result():
                        unified_to_host(
                            staging[slot : slot + 1], pool, table[page : page + 1], reg.layout
                        )
                        results[page] = True
                    if next_page < n and time.monotonic() < end:
                        launch(next_page, slot)
                        next_page += 1
        finally:
            for fut in in_flight:
                fut.cancel()
            if io.corruptions:
                self._count("corrupt_objects", io.corruptions)
            if io.tampered:
                self._count("tamper", io.tampered)
        return results, stuck

    def _account(self, op: str, results: list[bool], page_bytes: int, started: float) -> None:
        self._metrics.record(op, results, page_bytes, time.perf_counter() - started)


def _deadline(reg: _Registered) -> float:
    """How long an SGLang thread waits on one backend call that moves no page (existence,
    sidecar state) before it gives up with a failure: past the call's ``io_timeout_s``
    by ``_slack``, so only I/O that cannot end (a hung device or mount) reaches it."""
    return reg.link.io_timeout_s + _slack(reg)


def _slack(reg: _Registered) -> float:
    """How long past a deadline an SGLang thread still waits for cut I/O to end (a cut put
    or read ends when its I/O does): another round trip and scheduling slack. Past it only
    I/O that cannot end is left, and the call returns without it."""
    return reg.link.io_timeout_s + 5


def _wait(reg: _Registered, end: float) -> float:
    """Seconds an SGLang thread may wait now on I/O of a call whose deadline is ``end``."""
    return max(0.0, end - time.monotonic()) + _slack(reg)


def _outcome(
    reg: _Registered, puts: concurrent.futures.Future[list[bool]], seconds: float
) -> list[bool]:
    """A chunk's put results, waited for at most its deadline (``seconds``) plus ``_slack``
    (``TimeoutError`` past it: I/O that cannot end)."""
    return result_within(puts, seconds + _slack(reg))


async def _by(end: float, read: Coroutine[Any, Any, bool]) -> bool:
    """``read``'s result, or False when it has not ended by ``end`` (``time.monotonic()``).

    A cut read is cancelled and ends when its I/O has (``L3Link.read_page``), so its row is
    free again when this returns; one not begun by ``end`` never starts."""
    if time.monotonic() >= end:
        read.close()
        return False
    try:
        async with timeout_at(end):
            return await read
    except TimeoutError:
        return False


def _bind(fn: Callable[..., T], *args: Any) -> Callable[[_Registered], T]:
    """``fn(reg, *args)`` as a ``_guard`` body (binds the loop's values now)."""
    return lambda reg: fn(reg, *args)


def _parent(keys: Sequence[str], index: int) -> str | None:
    """The chain predecessor of ``keys[index]`` for the object header (gc's chain links).

    SGLang's controller backs up one radix node's pages per call, in chain order, so the
    previous key of the batch is the page's parent; the first page's parent is not passed.
    A wrong guess would only make gc's order less good, never change what a read returns.
    """
    return keys[index - 1] if index > 0 else None
