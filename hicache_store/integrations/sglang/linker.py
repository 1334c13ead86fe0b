"""SGLang's external cache linker on hicache-store: direct L3 from the device pools.

SGLang 0.5.23's ``UnifiedRadixCache`` can skip the host tier and link its device pools straight
to an external store. Load this linker with::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "HiCacheStoreLinker",
        "linker_module_path": "hicache_store.integrations.sglang_linker",
        "linker_extra_config": {"url": "file:///var/cache/kv", "grid": "1x1"}}'

SGLang's ``linker_factory`` imports this module, checks that ``HiCacheStoreLinker`` is a
concrete ``UnifiedCacheLinker`` and builds it per worker as ``cls(server_args, params,
components=..., extra_config=..., forward_stream=...)``. ``linker_extra_config`` takes the
storage adapter's extra-config keys (``hicache_store.sglang_config``: ``url``, ``grid``, ``tenant_salt``,
``key_scheme``, ...), so the linker and the adapter derive the same namespace and share stored
pages, across TP/PP sizes as the adapter does.

**What it does.** ``lookup`` answers every restorable prefix length (a contiguous prefix here:
full-attention KV only). ``load`` queues a request; ``start_layer_wise_loading`` hands the queued
loads to a load thread, which reads the pages' objects (``objects.L3Link``: verified, bounded)
into staging and copies them into the request's device slots layer by layer, completing SGLang's
``LayerWiseLoadCounter`` after each layer (a failure fails the remaining layers; the tree aborts
the requests). ``offload`` queues a node's pages; an offload thread copies them out of the device
pool and stores them; completions are popped in order. Only the writer among replicas stores
(MLA: TP rank 0); the others report success at once. Nothing raises into SGLang's threads.
``counters`` counts pages loaded and offloaded, failures, refusals, and the lookups' pages
asked of the store and found (``lookup_pages_asked_l3`` / ``lookup_pages_found_l3``; in
Prometheus with SGLang's ``--enable-metrics``, ``_lookups``).

**Salt and extra key.** SGLang seeds each request's page-hash chain with its ``cache_salt`` and
``extra_key`` (``utils.storage_namespace_seed``), so the keys this linker receives already keep
tenants and LoRA adapters apart; ``tenant_salt`` in the extra-config separates whole
deployments on top.

**Not supported** (refused at start-up): components other than full attention (SWA, Mamba);
pools other than SGLang's MHA/MLA token pools (scaled fp8/fp4 caches, DSA, DeepSeek-V4);
attention context parallelism. Device copies are torch indexing on the pool's device, which is
what a CPU run measures; a GPU pipeline (pinned staging, copy streams) is not built here.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from hicache_store import _sync
from hicache_store.backends import aligned_buffer, open_backend
from hicache_store.integrations._lookups import LookupCounters
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.keys import validate_page_hash
from hicache_store.layout.namespace import ModelShape, Namespace
from hicache_store.objects import IOStats, L3Link, PageWrite
from hicache_store.sglang_config import AdapterConfig

from ._pool import _TORCH_KV_DTYPES
from ._weights import WeightsWatch

log = logging.getLogger(__name__)
T = TypeVar("T")

if TYPE_CHECKING:
    _Linker = object
else:
    try:
        from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
            UnifiedCacheLinker as _Linker,
        )
    except Exception:  # SGLang absent: a plain class with the same methods
        _Linker = object

__all__ = ["HiCacheStoreLinker"]
KV = "kv"


@dataclass
class _Job:
    """One request's load, or one node's offload: page hashes and device slots."""

    keys: list[str]
    slots: torch.Tensor  # page-aligned token slots, len(keys) * page_size
    link: L3Link | None = None  # an offload's: the weights its KV was computed by


class HiCacheStoreLinker(_Linker):
    """SGLang's ``UnifiedCacheLinker`` over a hicache-store backend (see the module doc)."""

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any = None,
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped]
            PoolName,
        )
        from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (  # type: ignore[import-untyped]
            LayerWiseLoadCounter,
        )

        self.forward_stream = forward_stream
        self.config = AdapterConfig.from_extra_config(dict(extra_config or {}))
        _check_components(components)
        if int(getattr(params, "attn_cp_size", 1) or 1) > 1:
            raise ValueError("hicache-store linker: attention context parallelism is not supported")
        self.page_size = int(params.page_size)
        self.device_pool = params.token_to_kv_pool_allocator.get_kvcache()
        self.mla = hasattr(self.device_pool, "kv_cache_dim")
        if not self.mla and not hasattr(self.device_pool, "k_buffer"):
            raise ValueError(
                f"hicache-store linker: device pool {type(self.device_pool).__name__} is not an "
                "MHA or MLA token pool (hybrid and compressed pools are not supported)"
            )
        for name in ("k_scale_buffer", "native_k_scale_buffer"):
            if getattr(self.device_pool, name, None) is not None:
                raise ValueError("hicache-store linker: scaled KV caches are not supported")
        self.pools = {PoolName.KV: self.device_pool}
        tp_rank, tp_size = _tp(params)
        self._weights = WeightsWatch(self.config.model_revision,
                                     getattr(server_args, "model_path", None))
        self.link = self._link(params, tp_rank, tp_size)
        self.namespace = self.link.namespace
        self.layout: UnifiedPageLayout = self.link.read_plan.page
        self.writer = self.link.can_write
        self.num_layers = self.layout.num_layers
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        self._pending: dict[str, _Job] = {}
        self._loads: queue.Queue[tuple[int, list[_Job]] | None] = queue.Queue()
        self._offloads: queue.Queue[_Job | None] = queue.Queue()
        self._results: queue.Queue[bool] = queue.Queue()
        self.counters: dict[str, int] = {}
        self._lock = threading.Lock()
        export = bool(getattr(server_args, "enable_metrics", False))
        self._lookups = LookupCounters("sglang_linker", labels={
            "tp_rank": str(tp_rank), "pp_rank": str(int(params.pp_rank))} if export else None)
        self._threads = [
            threading.Thread(target=self._load_loop, daemon=True, name="hicache-linker-load"),
            threading.Thread(target=self._offload_loop, daemon=True, name="hicache-linker-store"),
        ]
        for thread in self._threads:
            thread.start()
        log.info(
            "hicache-store linker: namespace %s, %d layers, rank %d/%d, %s, weights %s",
            self.namespace.digest, self.num_layers, tp_rank, tp_size,
            "writes" if self.writer else "reads only", self._weights.describe(),
        )

    def _link(self, params: Any, tp_rank: int, tp_size: int) -> L3Link:
        cfg = self.config
        pool = self.device_pool
        local_layers = int(pool.layer_num)
        pp_rank, pp_size = int(params.pp_rank), int(params.pp_size)
        num_layers = cfg.num_layers or (local_layers if pp_size == 1 else None)
        if num_layers is None:
            raise ValueError('hicache-store linker: with PP, set "num_layers" in linker_extra_config')
        if self.mla:
            shape = ModelShape.mla(num_layers, int(pool.kv_cache_dim))
        else:
            heads = cfg.num_kv_heads or int(pool.head_num) * tp_size
            shape = ModelShape.mha(num_layers, heads, int(pool.head_dim))
        replication = "replicated" if self.mla else "head_sharded"
        topology = cfg.topology(tp_size, pp_size, num_layers)
        dtype = cfg.kv_dtype or _TORCH_KV_DTYPES.get(pool.dtype)
        if dtype is None:
            raise ValueError(f'hicache-store linker: set "kv_dtype" for a {pool.dtype} pool')
        namespace = Namespace.create(
            cfg.model or _model_path(), shape, dtype, self.page_size,
            cfg.grid_for(shape, topology, replication), replication=replication,
            model_revision=self._weights.revision, tenant_salt=cfg.tenant_salt,
            key_scheme=cfg.key_scheme, kv_scales=cfg.kv_scales_for(dtype, num_layers),
        )
        self.backend = open_backend(cfg.backend)
        self._place = (topology, topology.rank_of(tp_rank, pp_rank))
        link = self._link_for(namespace)
        if link.read_plan.page.num_layers != local_layers:
            raise ValueError(
                f"hicache-store linker: the device pool holds {local_layers} layers, "
                f"{topology} puts {link.read_plan.page.num_layers} on this rank"
            )
        return link

    def _link_for(self, namespace: Namespace) -> L3Link:
        cfg = self.config
        topology, rank = self._place
        return L3Link(
            self.backend, namespace, topology, rank,
            max_inflight_bytes=cfg.max_inflight_bytes, io_timeout_s=cfg.io_timeout_s,
            min_bandwidth_mib_s=cfg.min_bandwidth_mib_s,
        )

    # -- the weights (``_weights``) -----------------------------------------------------------

    def weights_updated(self, label: str | None = None) -> str:
        """Say that the served weights changed in a way SGLang does not record (see
        ``HiCacheStoreStorage.weights_updated``): pages stored before miss. Returns the new
        revision; call it on every rank with the same ``label``."""
        revision = self._weights.bump(label)
        self._current_link()
        return revision

    def _current_link(self) -> L3Link:
        """The link of the weights served now: a new namespace once they changed."""
        revision = self._weights.current()
        link = self.link
        if revision == link.namespace.model_revision:
            return link
        with self._lock:
            if self.link.namespace.model_revision != revision:
                old = self.link.namespace.digest
                self.link = self._link_for(
                    dataclasses.replace(self.link.namespace, model_revision=revision))
                self.namespace = self.link.namespace
                log.info("hicache-store linker: the served weights changed (%s): namespace "
                         "%s -> %s", self._weights.describe(), old, self.namespace.digest)
            return self.link

    # -- the linker contract ------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[Any]) -> list[int]:
        """Every restorable prefix length in pages: 1..n for the stored leading pages."""
        try:
            keys = _kv_keys(transfers)
            if not keys:
                return []
            link = self._current_link()
            hit = int(_sync.run_sync(link.exists_prefix(keys), timeout=self._timeout()))
            for name, n in self._lookups.count("l3", len(keys), hit).items():
                self._count(name, n)
            return list(range(1, hit + 1))
        except Exception as exc:
            self._count("lookup_errors")
            log.warning("hicache-store linker: lookup failed: %r", exc)
            return []

    def load(self, rid: str, transfers: list[Any]) -> bool:
        """Queue ``rid``'s pages for the next ``start_layer_wise_loading``."""
        job = self._job(transfers, "load")
        if job is None:
            return False
        if rid in self._pending:
            raise RuntimeError(f"hicache-store linker: a load for {rid} is already queued")
        self._pending[rid] = job
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        jobs, self._pending = list(self._pending.values()), {}
        index: int = self.layer_done_counter.update_producer()
        self._loads.put((index, jobs))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return bool(self.layer_done_counter.finish(counter_index))

    def cancel_queued_load(self, rid: str) -> bool:
        return self._pending.pop(rid, None) is not None

    def offload(self, transfers: list[Any], session_id: str | None = None) -> bool:
        """Queue a node's pages for storing; its completion is popped in order."""
        job = self._job(transfers, "offload")
        if job is None:
            return False
        if not self.writer:  # a replica: the writer stores the same bytes
            self._results.put(True)
            return True
        # SGLang's scheduler thread offloads a node once its KV is computed, and records a
        # weight update on the same thread: the link now is the one of the KV's weights.
        job.link = self._current_link()
        self._offloads.put(job)
        return True

    def num_completed_offloads(self) -> int:
        return self._results.qsize()

    def pop_completed_offload(self) -> bool:
        return self._results.get_nowait()

    def reset(self) -> None:
        self._pending.clear()
        self._loads.join()
        self._offloads.join()
        # SGLang flushes its tree (and resets this linker) after a weight update.
        self._current_link()
        while not self._results.empty():
            self._results.get_nowait()
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        self._loads.put(None)
        self._offloads.put(None)
        for thread in self._threads:
            thread.join(timeout=30)
        try:
            _sync.run_sync(self.backend.close(), timeout=30.0)
        except Exception as exc:
            log.warning("hicache-store linker: closing the backend failed: %s", exc)

    # -- threads --------------------------------------------------------------------------------

    def _load_loop(self) -> None:
        _serve_queue(self._loads, self._load_or_fail)

    def _load_or_fail(self, task: tuple[int, list[_Job]]) -> None:
        index, jobs = task
        try:
            self._load(index, jobs)
        except BaseException as exc:  # the forward waits on the counter: fail it
            self.layer_done_counter.fail(index, exc)
            self._count("load_failed")
            log.warning("hicache-store linker: load failed: %r", exc)

    def _load(self, index: int, jobs: list[_Job]) -> None:
        keys = [k for job in jobs for k in job.keys]
        slots = torch.cat([job.slots for job in jobs])
        rows = self._rows(len(keys))
        stats = IOStats()
        link = self._current_link()

        async def read_all() -> list[bool]:
            import asyncio

            return list(await asyncio.gather(
                *(link.read_page(k, rows[i], stats) for i, k in enumerate(keys))
            ))

        done = _sync.run_sync(read_all(), timeout=self._timeout())
        if not all(done):
            raise RuntimeError(f"{len(done) - sum(done)} of {len(done)} pages did not load")
        views = self._views(rows)
        for layer in range(self.num_layers):
            self._copy_layer(layer, views, slots, into_device=True)
            self.layer_done_counter.complete(index, layer)
        self._count("load_pages", len(keys))

    def _offload_loop(self) -> None:
        _serve_queue(self._offloads, self._offload)

    def _offload(self, job: _Job) -> None:
        ok = False
        try:
            ok = self._store(job)
        except Exception as exc:
            log.warning("hicache-store linker: offload failed: %r", exc)
        self._count("offload_pages" if ok else "offload_failed", len(job.keys))
        self._results.put(ok)

    def _store(self, job: _Job) -> bool:
        if self.forward_stream is not None:  # the forward may still write these pages
            for event in self.record_offload_ready():  # type: ignore[attr-defined]  # SGLang's
                event.synchronize()
        rows = self._rows(len(job.keys))
        views = self._views(rows)
        for layer in range(self.num_layers):
            self._copy_layer(layer, views, job.slots, into_device=False)
        stats = IOStats()
        link = job.link or self.link
        pages = [PageWrite(k, rows[i], job.keys[i - 1] if i else None)
                 for i, k in enumerate(job.keys)]
        return all(_sync.run_sync(link.write_in_order(pages, stats),
                                  timeout=self._timeout()))

    # -- pages between the device pool and unified rows -----------------------------------------

    def _rows(self, pages: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Page-aligned staging, one unified page row per page."""
        nbytes = self.layout.page_bytes
        return np.frombuffer(aligned_buffer(max(1, pages) * nbytes), dtype=np.uint8)[
            : pages * nbytes
        ].reshape(pages, nbytes)

    def _views(self, rows: np.ndarray[Any, np.dtype[np.uint8]]) -> list[tuple[int, int, torch.Tensor]]:
        """Per head block: (first head, stop head, a view [pages, layers, planes, P, heads, D]
        of ``rows``): writes through a view land in the rows."""
        ns = self.namespace
        dtype = self.device_pool.store_dtype if hasattr(self.device_pool, "store_dtype") else (
            self.device_pool.dtype)
        flat = torch.from_numpy(rows.reshape(-1)).view(dtype)
        item = flat.element_size()
        out = []
        for block in self.layout.blocks:
            heads, dim = block.num_heads, ns.head_dim
            shape = (rows.shape[0], self.num_layers, ns.kv_planes, ns.page_size, heads, dim)
            inner = (ns.kv_planes * ns.page_size * heads * dim, ns.page_size * heads * dim,
                     heads * dim, dim, 1)
            view = flat.as_strided(shape, (rows.shape[1] // item, *inner), block.offset // item)
            out.append((block.head_start - self.layout.head_start,
                        block.head_stop - self.layout.head_start, view))
        return out

    def _copy_layer(self, layer: int, views: list[tuple[int, int, torch.Tensor]],
                    slots: torch.Tensor, *, into_device: bool) -> None:
        pool = self.device_pool
        planes = [pool.kv_buffer[layer]] if self.mla else [pool.k_buffer[layer], pool.v_buffer[layer]]
        # [pages, page_size] slot indices against [pages, page_size, heads, dim] views: no
        # reshape across pages (the staging rows are strided, a reshape would copy)
        device_slots = slots.to(planes[0].device).view(-1, self.page_size)
        for h0, h1, view in views:
            for plane, buffer in enumerate(planes):
                data = view[:, layer, plane]
                target = buffer if buffer.dim() == 3 else buffer.view(buffer.shape[0], 1, -1)
                if into_device:
                    target[device_slots, h0:h1] = data.to(target.device)
                else:
                    data.copy_(target[device_slots, h0:h1].cpu())

    # -- internals -----------------------------------------------------------------------------

    def _job(self, transfers: Sequence[Any], what: str) -> _Job | None:
        """The KV pages of ``transfers`` and their device slots for a ``what`` (load or
        offload); None when there are none, or when ``transfers`` cannot be served (a pool
        other than KV, a bad key, a wrong slot count): counted as ``{what}_refused``, logged."""
        try:
            kv = next((t for t in transfers if _is_kv(t)), None)
            others = [t for t in transfers if t is not kv]
            if others:
                raise ValueError(f"pools other than KV: {[str(t.name) for t in others]}")
            if kv is None or not kv.keys:
                return None
            keys = [validate_page_hash(k) for k in kv.keys]
            slots = kv.device_indices
            if slots is None or slots.numel() != len(keys) * self.page_size:
                raise ValueError(
                    f"{len(keys)} pages need {len(keys) * self.page_size} device slots")
            return _Job(keys, slots.to(torch.int64).flatten())
        except Exception as exc:
            self._count(f"{what}_refused")
            log.warning("hicache-store linker: %s refused: %r", what, exc)
            return None

    def _timeout(self) -> float:
        return self.link.io_timeout_s * 2 + 5

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n


def _serve_queue(tasks: queue.Queue[T | None], handle: Callable[[T], None]) -> None:
    """A worker thread's loop: ``handle`` each task of ``tasks`` in order until ``None``,
    marking every one done (``join`` waits for the ones queued)."""
    while True:
        task = tasks.get()
        try:
            if task is None:
                return
            handle(task)
        finally:
            tasks.task_done()


def _is_kv(transfer: Any) -> bool:
    """Whether an SGLang transfer moves the KV pool (its ``name``: the enum or its value)."""
    return str(getattr(transfer.name, "value", transfer.name)) == KV


def _kv_keys(transfers: Sequence[Any]) -> list[str]:
    for t in transfers:
        if _is_kv(t):
            return [validate_page_hash(k) for k in (t.keys or [])]
    return []


def _check_components(components: Any) -> None:
    """Full attention only: SWA and recurrent state have no store here yet."""
    names = {str(getattr(c, "name", c)).upper() for c in (components or ())}
    extra = names - {"FULL"}
    if extra:
        raise ValueError(
            f"hicache-store linker: tree components {sorted(extra)} (sliding-window or recurrent "
            "state) are not stored by hicache-store yet; only full-attention KV is"
        )


def _tp(params: Any) -> tuple[int, int]:
    """This worker's attention-TP rank and size (the group SGLang shards KV heads over)."""
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    from sglang.srt.runtime_context import get_parallel  # type: ignore[import-untyped]

    parallel = get_parallel()
    return int(parallel.attn_tp_rank), int(parallel.attn_tp_size)


def _model_path() -> str:
    try:
        from sglang.srt.runtime_context import get_model

        path = str(get_model().model_path)
    except Exception as exc:
        raise ValueError(f'hicache-store linker: set "model" in linker_extra_config ({exc})') from None
    if not path:
        raise ValueError('hicache-store linker: set "model" in linker_extra_config')
    return path
