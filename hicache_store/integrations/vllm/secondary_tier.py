"""hicache-store as a secondary tier of vLLM's tiered KV offloading (``SecondaryTierManager``).

vLLM 0.32's ``OffloadingConnector`` with ``TieringOffloadingSpec`` keeps offloaded KV in a CPU
primary tier: a shared region of *chunk rows*, one row per offloaded chunk (every rank's slot
of that chunk, each holding the chunk's blocks of every layer, in vLLM's own byte order). A
secondary tier receives rows from the primary tier (``submit_store``: write-through of every
chunk the primary stores) and writes rows back into primary slots (``submit_load``: promotion
of a chunk a lookup found). vLLM calls every method from the scheduler thread and requires
them to return at once; transfers report through ``get_finished_jobs``.

``HiCacheStoreTier`` stores each row as one framed, checksummed object (``layout.framing``
through ``objects.ObjectIO``) on any hicache-store backend:

* **Key.** vLLM names a chunk by its 36-byte ``OffloadKey`` (the chain hash of the chunk's
  last block, then the KV group). The object's page hash is the sha256 of those 36 bytes (64
  hex: any hash length vLLM is configured with, and each group, name a distinct object);
  coordinates ``L0-0`` (a row is one block; the per-block checksum covers the whole row).
* **Namespace** (``row_namespace``): a row is opaque bytes, so the namespace says so (one
  layer, one token, ``row_bytes`` uint8 values, replicated) and names what decides those
  bytes: the model (``{model}#vllm-row-{descriptor digest}``, the descriptor being vLLM's
  release line, the KV dtype, TP / PP / PCP / DCP sizes, tokens per block, blocks per chunk,
  canonical or direct layout, replicated layout, the KV cache layout, the KV groups' token
  spans and the row size), plus the weights' revision (``_weights``: ``model_revision``, else
  the identity of vLLM's model files; a connector reset, which reaches this tier as
  ``drain_jobs``, moves it) and ``tenant_salt``. A deployment that differs in any of them
  misses; it never reads another's bytes as its own. The one
  exception is by design: vLLM's canonical rows that vLLM certified parallelism-agnostic
  leave the topology out (they are the same bytes under every TP size), so deployments of
  different TP sizes share them. float8 KV (any ``fp8`` ``--kv-cache-dtype``) is refused at
  start-up (``check_unscaled_kv``): its per-layer k/v scales live in the attention layers,
  which a tier never sees, so rows could not carry them.
* **Bounded.** The backend's own capacity and eviction: ``file:///path?capacity_bytes=64GiB``
  (least recently used first; the file backend's default is 90% of the filesystem).
* **Written once.** A store job's rows the store already holds (vLLM offers a chunk again
  where it recomputed it: a hybrid's full-attention chunks past the hit its sliding-window
  group allowed) are not written again where the backend's index says so exactly
  (``InlineExists.now``, else for chunks offered before ``InlineExists.blocking``; a backend
  without either writes every row): the job reports them stored and its
  ``transfer_bytes`` counts only the rows written (``stats.stores_held``). The key names the
  namespace and the chunk, so a row held is this deployment's; one found corrupt on a read is
  deleted, and written again when next offered.
* **Write admission** (``write_admission``, ``integrations._admission``). Under capacity
  pressure the backend evicts its least recently used rows; where conversations come back in
  turn and outgrow the store, those are the rows about to be read, so every row would be
  evicted before its next read and every recompute written again. While the lookups show
  that (rows this tier wrote, evicted before they were asked for again, outnumber those
  found, or two requests in a row lost such rows), store jobs are refused
  (``stats.stores_refused``; vLLM sees a job that moved no bytes, not a failure): what the
  store holds stays and is served. The hold ends when what it holds is no longer read, or
  after a while, to try new rows again. Where the backend declares its room
  (``capacity_usage``) a job is judged by its bytes before anything is evicted: into free
  room it goes, otherwise only over rows no lookup or job touched lately (``_admission``).
  Rows the store already holds are no write to admit (``ReuseAdmission.held``).
  ``all`` writes every job (the backend's LRU alone);
  backends without capacity eviction write every job. A job
  whose rows the request's ``kv_hints`` pin or retain is always written.
* **Non-blocking.** ``lookup`` answers at once where the backend can without waiting
  (``InlineExists.now``: the file backend's in-memory index, as last brought up to date if
  that was at most ``lookup_max_age_s`` ago, without a database call: a change of the last
  moments missed costs a recompute or a failed load, then recompute; each store job brings
  it up to date after its write), else ``RETRY`` while the
  existence check of its key runs (vLLM's ``AsyncLookupManager``: one batched check per
  scheduler step on vLLM's lookup thread, answered on that thread where the backend can
  (``InlineExists.blocking``: the file backend's index), else through the library's loop
  bounded by ``lookup_timeout_s``; a failed or late check is a miss). Either way the verdict
  lives in vLLM's lookup state, so a key whose load failed answers MISS for the rest of the
  request (vLLM's livelock guard). A load job's reads run in the backend's native code
  where it has such a path (``ObjectIO.start_read_frames``: the file backend's C reads and
  checksums on a thread that never takes the GIL), found done by ``get_finished_jobs`` on
  the scheduler thread, which verifies the rows and copies them into their slots; elsewhere
  a load job runs on the library's loop. ``get_finished_jobs`` collects the jobs that ended;
  ``drain_jobs`` waits for all of them (none is cut short). A store job's rows are copied
  into staging, sealed and written by one backend call: they are stored, or reported failed,
  together. Where the backend can start a put from the caller's thread
  (``ObjectIO.start_write_frames``: the file backend reserves on the scheduler thread, writes
  on a thread that never takes the GIL, and settles when the poll takes the outcome) the
  rows are sealed on the scheduler thread and the put handed straight to the backend, found
  done by ``get_finished_jobs``, with ``put_together``'s deadline and
  ``max_inflight_mib`` (past it a job takes the loop's path, which waits for the budget);
  elsewhere the job runs on the library's sync-bridge loop (``ObjectIO.put_together``).
  Why the native paths skip the library's loop: vLLM's engine loop runs Python between
  steps without pause, so every hand-off to another Python thread waits for the GIL (up to
  the interpreter's 5 ms switch interval); a load through the library's loop and its pool
  waited for it five times; a native read or put waits for it never.
* **Verified loads.** A load job reads all its objects whole into staging in one batched
  backend call (``ObjectIO.start_read_frames``, else ``read_frames``; the file backend does
  a run of reads and their checksums in one C call without the GIL), checks each header
  against its key, the stored size and the row's checksum, and
  only then copies a row into its primary slot: vLLM's memory never holds unverified bytes,
  and nothing writes into it after the job has ended. A missing, truncated or corrupt object
  fails its key's load (``JobResult.successful_keys`` holds the others): vLLM frees the slot
  and recomputes. A corrupt object is counted and deleted, so the next store of that chunk
  writes it again.
* **Hints.** vLLM's per-request ``kv_hints`` (``ReqContext.kv_hints``, else the request's
  ``kv_transfer_params["kv_hints"]``) pin, retain, demote, drop or release the row objects of
  the request's chunks this tier stores or finds (not those vLLM serves from its primary
  tier: this tier never sees them for that request), through the backend's retention
  (``_hints``: the schema, the actions, the counters in ``hints.counts``). A pin past the
  backend's pin budget is refused and logged, a malformed envelope logged and ignored:
  neither fails the request.
* **Events.** With ``enable_kv_events`` (and vLLM's KV events on), every stored chunk is a
  ``BlockStored`` event (medium ``STORAGE``) and every corrupt object deleted a removal.
  On a backend with a named change feed (the file backend's shared index), a row this tier
  stored that leaves the store otherwise (a capacity eviction by this or another process, a
  ``gc``, a delete) is a removal too: after each store job the tier reads the feed from
  where it last stopped, and where the feed cannot name what changed (pruned, rebuilt) it
  compares its rows with a listing. Rows other processes stored are not this tier's events.

Configuration (a ``secondary_tiers`` entry; every key but ``type`` and ``module_path`` optional;
any other key is refused with one ``ConfigError`` line, as the connector refuses its own)::

    {"type": "HiCacheStoreTier",
     "module_path": "hicache_store.integrations.vllm.secondary_tier",
     "url": "file:///var/cache/kv?capacity_bytes=64GiB",   # any backend URL
     "backend_options": {},          # more backend options (JSON object)
     "model": None,                  # default: vLLM's model name
     "model_revision": None,         # default: the identity of the model's files
     "keep_revision_on_reset": False,  # true: a reset (drain_jobs) keeps the revision
     "tenant_salt": "",
     "io_timeout_s": 20.0,           # floor of one store / load batch's deadline
     "lookup_timeout_s": 5.0,        # deadline of one step's existence check
     "lookup_max_age_s": 0.5,        # age of an in-memory answer taken at once (0: exact only)
     "max_inflight_mib": 256,        # bytes of writes (and of reads through the loop) in flight
     "enable_kv_events": False, "locality": None,
     "write_admission": "reuse",     # "all": every store job is written (see above)
     "test_alter_loaded_kv": False}  # TEST ONLY: zero every loaded row after its check
                                     # (and store nothing while it is on)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import vllm
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager, LookupPhase, LookupState
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hicache_store._sync import run_sync, submit
from hicache_store.backends import Backend, InlineExists, open_backend
from hicache_store.backends.errors import InvalidRangeError
from hicache_store.backends.feed import ChangeFeed, FeedFollower
from hicache_store.integrations._admission import (
    ReuseAdmission,
    admission_for,
    check_write_admission,
    refuses,
    room_of,
)
from hicache_store.integrations._lookups import LookupCounters
from hicache_store.layout.errors import ConfigError, CorruptObjectError, InvalidNamespaceError
from hicache_store.layout.framing import ObjectHeader
from hicache_store.layout.keys import ObjectCoords, ObjectKey
from hicache_store.layout.namespace import Grid, ModelShape, Namespace, check_kv_scales
from hicache_store.objects import Arena, Frame, ObjectIO, PendingFrames, PendingFrameWrites
from hicache_store.objects.io import DEFAULT_IO_TIMEOUT_S
from hicache_store.weights import WeightsIdentity

from ._config import check_backend_url, check_tier_options
from ._hints import TierHints
from ._logging import attach as attach_logging
from ._weights import Revision, model_identity

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector


log = logging.getLogger(__name__)
attach_logging()  # this library's lines in vLLM's log, in its format

#: the object coordinates of every row (one block).
ROW_COORDS = ObjectCoords(0, 1, None)
#: chunks offered for a store remembered (a store job offering one again asks the index)
OFFERED_MEMORY = 1 << 16
#: chunks whose object and storage keys are remembered
NAMES_MEMORY = 1 << 16



def default_url() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return "file://" + os.path.join(cache, "hicache-store", "vllm-tier")


def row_descriptor(spec: OffloadingSpec, row_bytes: int) -> str:
    """What decides a row's bytes, as one canonical line (its digest names the namespace).

    The topology (TP / PP / PCP / DCP and world sizes, and the bytes each worker holds per
    block) is part of it, except for vLLM's canonical layout where vLLM certified every layer
    parallelism-agnostic (``is_parallelism_agnostic``): a canonical row is then the model's
    KV of the chunk as if there were no parallelism, the same bytes under every topology, so
    deployments of different TP sizes share rows."""
    config = spec.config
    par = config.parallel
    groups = ",".join(str(g.tokens_per_block) for g in config.groups)
    if config.canonical_layout and par.is_parallelism_agnostic:
        topology: dict[str, object] = {"topology": "agnostic"}
    else:
        topology = {
            "tp": par.tp_size, "pp": par.pp_size, "pcp": par.pcp_size, "dcp": par.dcp_size,
            "world": par.world_size,
        }
    parts = {
        "vllm": ".".join(vllm.__version__.split(".")[:2]),
        "dtype": config.model.dtype,
        **topology,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": groups,
        "canonical": int(config.canonical_layout),
        "replicated": int(spec.replicated_layout),
        "kv_layout": config.kv_cache_layout or "",
        "row_bytes": row_bytes,
    }
    if "topology" not in topology:
        parts["worker_bytes_per_block"] = config.worker_kv_bytes_per_block
    if len(config.groups) > 1:
        # A hybrid's rows: which layers each group holds (a model's sliding, state and full
        # layers; their windows and state shapes are its config's, in the weights identity).
        parts["group_layers"] = "|".join(
            f"{g.group_id}:{','.join(g.layer_names)}" for g in config.groups)
    return ";".join(f"{k}={v}" for k, v in parts.items())


def row_namespace(
    spec: OffloadingSpec, row_bytes: int, *, model: str | None = None,
    model_revision: str = "", tenant_salt: str = "",
) -> Namespace:
    """The namespace of a deployment's rows (see the module docstring).

    Raises ``ConfigError`` for float8 KV: its per-layer k/v scales live in the model's
    attention layers, which a secondary tier never sees, so rows would be stored without them
    and served under other scales."""
    check_unscaled_kv(spec.config.model.dtype)
    name = model or spec.config.model.name
    digest = hashlib.sha256(row_descriptor(spec, row_bytes).encode()).hexdigest()[:16]
    return Namespace.create(
        f"{name}#vllm-row-{digest}",
        ModelShape.mla(1, row_bytes),
        "uint8",
        1,
        Grid(1, 1),
        model_revision=model_revision,
        tenant_salt=tenant_salt,
    )


def check_unscaled_kv(kv_dtype: str, cache_dtype: str | None = None) -> None:
    """Refuse quantized KV (``ConfigError``, one line naming ``--kv-cache-dtype``): a float8
    ``kv_dtype`` (the offloading config's) or an ``fp8*`` ``cache_dtype`` (vLLM's setting).
    Their per-layer k/v scales live in the attention layers, which a tier never sees."""
    setting = "--kv-cache-dtype auto (a secondary tier cannot see the attention layers' scales)"
    if cache_dtype is not None and cache_dtype.startswith("fp8"):
        # fp8 variants whose cache is not a float8 tensor (fp8_ds_mla: uint8) are refused too
        raise ConfigError(
            f"HiCacheStoreTier: kv_cache_dtype {cache_dtype!r} KV needs its per-layer k/v "
            f"scales in the namespace and none were found: set {setting}; quantized KV is not "
            "stored without them"
        )
    try:
        check_kv_scales(kv_dtype, "", setting=setting)
    except InvalidNamespaceError as exc:
        raise ConfigError(f"HiCacheStoreTier: {exc}") from None


def _model_identity(spec: OffloadingSpec) -> WeightsIdentity | None:
    """The identity of the weights of ``spec``'s model, at the revision and download folder
    of vLLM's config where it is current (tiers are built inside vLLM's config context)."""
    from vllm.config import get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    return model_identity(spec.config.model.name,
                          None if current is None else current.model_config,
                          None if current is None else current.load_config)


def page_hash_of(key: OffloadKey) -> str:
    """The page hash of vLLM's chunk ``key``: sha256 of its bytes, hex."""
    return hashlib.sha256(key).hexdigest()


@dataclass
class TierStats:
    """Counters since start (read by tests and benchmarks; vLLM's own tier metrics count the
    bytes and times of ``JobResult``)."""

    stored: int = 0
    store_failures: int = 0
    loaded: int = 0
    load_misses: int = 0
    load_failures: int = 0
    corruptions: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    #: lookups answered (HIT or MISS, one chunk each) and those that found their chunk, named
    #: as every integration names them (also in Prometheus: ``_lookups``).
    lookup_pages_asked_l3: int = 0
    lookup_pages_found_l3: int = 0
    #: rows of store jobs refused by ``write_admission`` (not written, not failures)
    stores_refused: int = 0
    #: rows of store jobs the store already held (not written again; stored, for vLLM)
    stores_held: int = 0


class _Feed:
    """The rows this tier stored that are still in the store, followed through the backend's
    change feed (``capabilities.change_feed``; ``backends.feed.FeedFollower``), for removal
    events.

    ``stored`` records rows as their store events are emitted (so a row's removal event
    always comes after its store event); ``gone`` (on the loop, one reader at a time) reads
    the feed from the last change it saw and returns the recorded rows that left the store
    since, forgetting them. Where the feed cannot name its changes the follower gives a
    listing of the store instead, and the rows are compared with it. A row that leaves the
    store between its write and its store event (evicted at once: a store far smaller than a
    step's writes) is not reported. Memory: one entry per row of this tier in the store
    (bounded by the store's capacity)."""

    def __init__(self, feed: ChangeFeed) -> None:
        self._follower = FeedFollower(feed, from_start=False)
        self._rows: dict[str, OffloadKey] = {}
        self._lock = threading.Lock()
        self._reading: asyncio.Lock | None = None

    @classmethod
    def of(cls, backend: Backend) -> _Feed | None:
        """The feed of ``backend``, or None where it has none."""
        if not backend.capabilities.change_feed:
            return None
        return cls(backend.change_feed())

    def stored(self, rows: Iterable[tuple[str, OffloadKey]]) -> None:
        with self._lock:
            self._rows.update(rows)

    def forget(self, storage_key: str) -> None:
        with self._lock:
            self._rows.pop(storage_key, None)

    async def gone(self) -> list[OffloadKey]:
        if self._reading is None:
            self._reading = asyncio.Lock()
        async with self._reading:
            try:
                return await asyncio.to_thread(self._read)
            except Exception as exc:  # events are best effort: never fail a store job
                log.warning("HiCacheStoreTier: reading the store's change feed failed: %r", exc)
                return []

    def _read(self) -> list[OffloadKey]:
        latest: dict[str, bool] = {}  # each key's last change: stored again after an eviction
        while True:
            found = self._follower.read()
            if found.listing is not None:
                present = set(found.listing)
                with self._lock:
                    latest = {k: k in present for k in self._rows}
            latest.update(found.changes)
            if not found.more:
                break
        with self._lock:
            return [self._rows.pop(k) for k, there in latest.items()
                    if not there and k in self._rows]


class _Lookups(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's async lookup state machine over one batched ``exists`` per step, with the
    answers a backend gives at once (``InlineExists.now``: the file backend's index) taken
    without a RETRY: a new key the backend answers now enters vLLM's state already resolved,
    so the request does not wait a scheduler step, and vLLM's own bookkeeping (``mark_miss``
    after a failed load, ``cleanup`` when the request ends) applies to it unchanged."""

    def __init__(self, tier: HiCacheStoreTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def _worker(self) -> None:
        # First this thread's own connection to the backend's index and a read of it (~100 ms
        # on a busy 2-core machine), so that the first request's check does not wait for them.
        try:
            if self._tier.inline is not None:
                self._tier.inline.blocking([self._tier.storage_key(bytes(36))])
        except Exception as exc:  # the checks themselves report what is wrong
            log.debug("HiCacheStoreTier: warming the lookup thread failed: %r", exc)
        super()._worker()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        inline = self._tier.inline
        if key not in self._lookup_state and inline is not None:
            try:
                now = inline.now([self._tier.storage_key(key)],
                                 max_age_s=self._tier.lookup_max_age_s)
            except Exception as exc:  # never into the scheduler: the asynchronous check decides
                log.debug("HiCacheStoreTier: an inline exists failed: %r", exc)
                now = None
            if now is not None:
                self._lookup_state[key] = LookupState(
                    generation=self._next_generation, phase=LookupPhase.RESOLVED, result=now[0])
                self._next_generation += 1
        found: bool | None = super().lookup(key, req_context)
        return found

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        tier = self._tier
        names = [tier.storage_key(k) for k in keys]
        # This is vLLM's lookup thread: answer here where the backend can (its index read on
        # this thread, else from memory), without the hand-offs to the library's loop and
        # its pool and back, each of which waits for the GIL behind the engine's busy loop
        # (most of a step's lookup time, ~100 ms per request, before).
        if tier.inline is not None:
            return tier.inline.blocking(names)  # (exact: no need to try ``now`` first)
        return run_sync(tier.backend.exists(names), timeout=tier.lookup_timeout_s)


def _resolved(outcome: list[bool], seconds: float
              ) -> concurrent.futures.Future[tuple[list[bool], float]]:
    """A job's future that has already ended with ``(outcome, seconds)``."""
    future: concurrent.futures.Future[tuple[list[bool], float]] = concurrent.futures.Future()
    future.set_result((outcome, seconds))
    return future


@dataclass
class _NativeLoad:
    """A load job whose reads run in the backend's native code (``ObjectIO.start_read_frames``)."""

    chunks: list[int]
    okeys: list[ObjectKey]
    slots: list[memoryview]
    frames: list[memoryview]
    reads: PendingFrames
    start: float


@dataclass
class _NativeStore:
    """A store job whose put runs as one backend job (``ObjectIO.start_write_frames``)."""

    slots: list[memoryview]
    writes: PendingFrameWrites
    nbytes: int
    start: float
    #: ends when the put has (``TierHints.stored``: the rows' holds follow it)
    ended: concurrent.futures.Future[None] = dataclasses.field(
        default_factory=concurrent.futures.Future)

    def put_ended(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


@dataclass
class _Job:
    keys: list[OffloadKey]
    future: concurrent.futures.Future[tuple[list[bool], float]] | None
    is_load: bool
    native: _NativeLoad | None = None
    store: _NativeStore | None = None
    refused: bool = False  # a store job ``write_admission`` refused
    #: a store job's rows the store already held (not written; stored, for vLLM)
    held: list[OffloadKey] = dataclasses.field(default_factory=list)

    def done(self) -> bool:
        if self.native is not None:
            return self.native.reads.done()
        if self.store is not None:
            return self.store.writes.done()
        assert self.future is not None
        return self.future.done()


class HiCacheStoreTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier on a hicache-store backend. See the module docstring."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str | None = None,
        backend_options: Mapping[str, Any] | None = None,
        model: str | None = None,
        model_revision: str | None = None,
        keep_revision_on_reset: bool = False,
        tenant_salt: str = "",
        io_timeout_s: float = DEFAULT_IO_TIMEOUT_S,
        lookup_timeout_s: float = 5.0,
        lookup_max_age_s: float = 0.5,
        max_inflight_mib: float = 256,
        enable_kv_events: bool = False,
        locality: str | None = None,
        test_alter_loaded_kv: bool = False,
        write_admission: str = "reuse",
        backpressure_detector: BackpressureDetector | None = None,
        **unknown: Any,
    ) -> None:
        # (vLLM passes every other key of the secondary_tiers entry as a keyword)
        check_tier_options(unknown)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not vllm.__version__.startswith("0.32."):
            raise ConfigError(
                f"HiCacheStoreTier is written against vLLM 0.32 (SecondaryTierManager is "
                f"experimental and changes between releases); this is vLLM {vllm.__version__}"
            )
        if lookup_timeout_s <= 0 or io_timeout_s <= 0 or max_inflight_mib <= 0:
            raise ConfigError("io_timeout_s, lookup_timeout_s and max_inflight_mib must be positive")
        if not lookup_max_age_s >= 0:
            raise ConfigError(f"lookup_max_age_s must be 0 or more, not {lookup_max_age_s}")
        self.lookup_max_age_s = float(lookup_max_age_s)
        self._write_admission = check_write_admission(write_admission)
        self.locality = Locality(locality) if locality is not None else None
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
        check_unscaled_kv(offloading_spec.config.model.dtype,
                          None if current is None else str(current.cache_config.cache_dtype))
        self.row_bytes = self.block_size_bytes
        self._rows = primary_kv_view.cast("B")
        self._revision = Revision(model_revision, _model_identity(offloading_spec),
                                  keep_on_reset=bool(keep_revision_on_reset))
        self.namespace = row_namespace(
            offloading_spec, self.row_bytes, model=model, model_revision=self._revision.current,
            tenant_salt=tenant_salt,
        )
        self.url = url or default_url()
        check_backend_url(self.url)
        self.backend: Backend = open_backend({"url": self.url, **dict(backend_options or {})})
        self._io_limits = (io_timeout_s, int(max_inflight_mib * (1 << 20)))
        self.io = ObjectIO(
            self.backend, self.namespace, io_timeout_s=io_timeout_s,
            max_inflight_bytes=self._io_limits[1],
        )
        self._names: dict[OffloadKey, tuple[ObjectKey, str]] = {}
        self._header_bytes = self.io.header_bytes(1)
        self._staging = Arena(self._header_bytes + self.row_bytes, block_slots=8)
        self.lookup_timeout_s = lookup_timeout_s
        self.test_alter_loaded_kv = bool(test_alter_loaded_kv)
        self.stats = TierStats()
        self._stats_lock = threading.Lock()
        self._lookup_counts = LookupCounters("vllm_secondary_tier", labels={})
        self._jobs: dict[int, _Job] = {}
        self._native_writing = 0  # bytes of native store jobs in flight (scheduler thread)
        #: chunks offered for a store lately (scheduler thread; ``_held``)
        self._offered: OrderedDict[OffloadKey, None] = OrderedDict()
        #: refreshes of the backend's view after store jobs, under way on the loop
        self._refreshes: set[asyncio.Future[None] | concurrent.futures.Future[None]] = set()
        #: ``exists`` on the caller's thread, where the backend offers it (the file backend's
        #: index); else lookups go through the library's loop and no store refreshes a view
        self.inline: InlineExists | None = (
            self.backend.inline_exists() if self.backend.capabilities.inline_exists else None)
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                log.warning("HiCacheStoreTier: enable_kv_events is set but vLLM's KV cache "
                            "events are off; no events are emitted")
        # rows gone (corrupt ones deleted, evicted ones): the loop thread puts, take_events takes
        self._removed: queue.SimpleQueue[OffloadKey] = queue.SimpleQueue()
        self._feed = _Feed.of(self.backend) if self._events is not None else None
        self._lookups = _Lookups(self)
        #: refuses store jobs while the store only evicts rows before their next read
        #: (``integrations._admission``); None: every job is written (``write_admission="all"``)
        self.admission: ReuseAdmission | None = self._new_admission()
        # vLLM's kv_hints (``_hints``): holds on the request's row objects
        blocks = offloading_spec.config.cache.blocks_per_chunk
        self.hints = TierHints(self.backend, self.namespace.digest, self.storage_key, {
            g.group_id: g.tokens_per_block * blocks for g in offloading_spec.config.groups})
        log.info(
            "HiCacheStoreTier: rows of %d bytes as objects of namespace %s (%s; %s; weights "
            "%s) on %s",
            self.row_bytes, self.namespace.digest, self.namespace.model,
            row_descriptor(offloading_spec, self.row_bytes), self._revision.describe(), self.url,
        )

    # -- names --------------------------------------------------------------------------------

    def object_key(self, key: OffloadKey) -> ObjectKey:
        return self._names_of(key)[0]

    def storage_key(self, key: OffloadKey) -> str:
        return self._names_of(key)[1]

    def _names_of(self, key: OffloadKey) -> tuple[ObjectKey, str]:
        """``key``'s object key and storage key in the current namespace. Remembered (up to
        ``NAMES_MEMORY`` chunks): a chunk is named by its lookups, by the store job that
        asks whether the store holds it and by the frames it is written in, and each naming
        cost a hash, a checked ``ObjectKey`` and a formatted key (about 40 us in a busy
        engine). An entry of another namespace (a reset since) is made again."""
        digest = self.namespace.digest
        names = self._names.get(key)
        if names is None or names[0].namespace_digest != digest:
            okey = ObjectKey(page_hash_of(key), digest, ROW_COORDS)
            names = (okey, self.io.storage_key(okey))
            if len(self._names) >= NAMES_MEMORY:
                self._names.clear()  # (the working set is named again at once)
            self._names[key] = names
        return names

    def _row(self, chunk_id: int) -> memoryview:
        start = int(chunk_id) * self.row_bytes
        return self._rows[start : start + self.row_bytes]

    # -- the scheduler's calls ----------------------------------------------------------------

    def _new_admission(self) -> ReuseAdmission | None:
        """The write admission (``write_admission``), judging by the store's room where the
        backend declares it."""
        return admission_for(self._write_admission, self.backend.capabilities.eviction,
                             lambda: self.backend.stats.evictions, room_of(self.backend))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.hints.new_request(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        self._lookup_counts.count("l3", 1, int(found))
        if self.admission is not None:
            self.admission.answered(key, found, req_context.req_id)
        with self._stats_lock:
            self.stats.lookup_pages_asked_l3 += 1
            self.stats.lookup_pages_found_l3 += int(found)
        if found:
            self.hints.found(key, req_context)
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()
        self.hints.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        if self.test_alter_loaded_kv:
            # TEST ONLY: KV computed on top of altered rows is wrong too; never store it.
            future = _resolved([False] * len(keys), 0.0)
            self._jobs[job_metadata.job_id] = _Job(keys, future, is_load=False)
            self.hints.stored(job_metadata, future)
            return
        held = self._held(keys)
        if held:
            with self._stats_lock:
                self.stats.stores_held += len(held)
            if self.admission is not None:
                self.admission.held(held, len(held) * (self._header_bytes + self.row_bytes))
            kept = set(held)
            chunks = [c for k, c in zip(keys, chunks, strict=True) if k not in kept]
            keys = [k for k in keys if k not in kept]
        if not keys:  # every row already stored: a job done without I/O
            job = _Job([], _resolved([], 0.0), is_load=False, held=held)
        elif refuses(self.admission, lambda: self.hints.holds(job_metadata),
                     len(keys) * (self._header_bytes + self.row_bytes), keys):
            # Refused, not failed: the store keeps what it holds (vLLM counts no failure).
            with self._stats_lock:
                self.stats.stores_refused += len(keys)
            self._jobs[job_metadata.job_id] = _Job(keys, _resolved([False] * len(keys), 0.0),
                                                   is_load=False, refused=True)
            return
        else:
            if self.admission is not None:
                self.admission.written(keys, len(keys) * (self._header_bytes + self.row_bytes))
            job = (self._native_store_job(keys, chunks)
                   or _Job(keys, submit(self._store(keys, chunks)), is_load=False))
            job.held = held
        self._jobs[job_metadata.job_id] = job
        ended = job.store.ended if job.store is not None else job.future  # (or failed)
        assert ended is not None
        self.hints.stored(job_metadata, ended)

    def _held(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The rows of a store job the store holds already, as the backend's index says now,
        exactly (no answer of another moment), not written again: the key names the
        namespace and the chunk's bytes, and an object found corrupt on a read is deleted
        (then written again). Asked at once (``InlineExists.now``); where that cannot answer
        (the index changed since it was last read: a store job just committed), the rows
        this tier was offered before are asked on this thread (``InlineExists.blocking``:
        one index read, only for a job that offers rows again). None where the backend has
        no inline answer."""
        if self.inline is None or not keys:
            return []
        offered = self._offered
        again = [k for k in keys if k in offered]
        for k in keys:
            offered[k] = None
            offered.move_to_end(k)
        while len(offered) > OFFERED_MEMORY:
            offered.popitem(last=False)
        try:
            asked = keys
            found = self.inline.now([self.storage_key(k) for k in keys], max_age_s=0.0)
            if found is None and again:
                asked = again
                found = self.inline.blocking([self.storage_key(k) for k in again])
        except Exception as exc:  # never into the scheduler: then every row is written
            log.debug("HiCacheStoreTier: an exists before a store failed: %r", exc)
            return []
        if found is None:
            return []
        return [k for k, there in zip(asked, found, strict=True) if there]

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        self._jobs[job_metadata.job_id] = (
            self._native_load_job(keys, chunks)
            or _Job(keys, submit(self._load(keys, chunks)), is_load=True))

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id in [job_id for job_id, job in self._jobs.items() if job.done()]:
            result = self._result(job_id, self._jobs[job_id])
            if result is not None:  # (None: a native load handed on to the loop, still running)
                del self._jobs[job_id]
                results.append(result)
        return results

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        removed = []
        while not self._removed.empty():
            removed.append(self._removed.get_nowait())
        if removed:
            self._events.append(OffloadingEvent(
                keys=removed, medium=Medium.STORAGE, removed=True, locality=self.locality))
        events, self._events = self._events, []
        return events

    def drain_jobs(self) -> None:
        """vLLM's offloading reset (a connector reset: ``_weights``): wait for every submitted
        job, then move to a new weights revision, so rows stored before, of weights that may
        have been replaced, miss from now on (none is deleted)."""
        self.wait_jobs()
        old, revision = self.namespace.digest, self._revision.reset()
        if revision == self.namespace.model_revision:  # keep_revision_on_reset
            return
        self.namespace = dataclasses.replace(self.namespace, model_revision=revision)
        io_timeout_s, max_inflight = self._io_limits
        self.io = ObjectIO(self.backend, self.namespace, io_timeout_s=io_timeout_s,
                           max_inflight_bytes=max_inflight)
        self.hints.namespace = self.namespace.digest  # hints naming the old one are refused
        self.admission = self._new_admission()  # the old rows now miss: no evidence
        log.info("HiCacheStoreTier: reset (the weights may have changed): namespace %s -> %s",
                 old, self.namespace.digest)

    def wait_jobs(self) -> None:
        """Wait for every submitted job (each is bounded by ``io_timeout_s`` plus its bytes at
        the minimum bandwidth: ``objects.io.Deadline``); none is cut short. What
        ``drain_jobs`` does before a reset, without it (tests, benchmarks, shutdown)."""
        for job in list(self._jobs.values()):
            if job.native is not None:
                job.native.reads.wait()
            if job.store is not None:
                job.store.writes.wait()
                job.store.put_ended()  # (its holds need not wait for a poll)
        concurrent.futures.wait([job.future for job in self._jobs.values() if job.future is not None])

    def shutdown(self) -> None:
        self.wait_jobs()
        self.hints.drain(30.0)
        self._lookups.shutdown()
        try:
            run_sync(self.backend.close(), timeout=30.0)
        except Exception as exc:  # shutting down: log, never raise into vLLM's teardown
            log.warning("HiCacheStoreTier: closing %s failed: %r", self.url, exc)
        self._rows.release()  # the primary region can be unmapped now

    # -- results ------------------------------------------------------------------------------

    def _result(self, job_id: int, job: _Job) -> JobResult | None:
        if job.native is not None:
            finished = self._finish_native_load(job)
            if finished is None:
                return None
            job.future = finished
        if job.store is not None:
            finished = self._finish_native_store(job)
            if finished is None:
                return None
            job.future = finished
        assert job.future is not None
        if job.refused:
            return JobResult(job_id, success=True, transfer_time=0.0, transfer_bytes=0)
        try:
            outcome, seconds = job.future.result()
        except Exception as exc:  # a bug or a backend failure outside ObjectIO's own handling
            log.warning("HiCacheStoreTier: %s job %d failed: %r",
                        "load" if job.is_load else "store", job_id, exc)
            outcome, seconds = [False] * len(job.keys), 0.0
        ok = [k for k, good in zip(job.keys, outcome, strict=True) if good]
        nbytes = len(ok) * self.row_bytes
        if job.is_load:
            failed = [k for k, good in zip(job.keys, outcome, strict=True) if not good]
            if failed:
                self._lookups.mark_miss(failed)  # no re-promotion of what just failed
            return JobResult(job_id, success=not failed, successful_keys=ok if failed else None,
                             transfer_time=seconds, transfer_bytes=nbytes)
        stored = ok + job.held  # (the rows already held: stored, no bytes moved)
        if stored and self._events is not None:
            self._events.append(OffloadingEvent(
                keys=stored, medium=Medium.STORAGE, removed=False, locality=self.locality))
            if self._feed is not None:  # followed from now: its removal comes after this event
                self._feed.stored([(self.storage_key(k), k) for k in stored])
        return JobResult(job_id, success=len(ok) == len(job.keys), transfer_time=seconds,
                         transfer_bytes=nbytes)

    # -- transfers (on the sync bridge's loop) ------------------------------------------------

    async def _store(self, keys: list[OffloadKey], chunks: list[int]) -> tuple[list[bool], float]:
        start = time.perf_counter()
        slots = [self._staging.take() for _ in keys]
        try:
            stored = await self.io.put_together(self._store_frames(keys, chunks, slots))
        finally:
            for slot in slots:
                self._staging.give(slot)  # put has returned: nothing reads them any more
        self._count_store(keys, stored)
        if any(stored) and self.inline is not None:
            task = asyncio.ensure_future(self._refresh(keys[stored.index(True)]))
            self._refreshes.add(task)
            task.add_done_callback(self._refreshes.discard)
        await self._follow_feed()
        return stored, time.perf_counter() - start

    def _store_frames(self, keys: list[OffloadKey], chunks: list[int],
                      slots: list[memoryview]) -> list[Frame]:
        """A store job's rows copied into their staging slots, a frame each (the header's room
        first, sealed by the put)."""
        frames = []
        for key, chunk, slot in zip(keys, chunks, slots, strict=True):
            frame = slot[: self._header_bytes + self.row_bytes]
            frame[self._header_bytes :] = self._row(chunk)  # the primary slot stays pinned
            frames.append(Frame(self.object_key(key), frame))
        return frames

    def _count_store(self, keys: list[OffloadKey], stored: list[bool]) -> None:
        with self._stats_lock:
            n = sum(stored)
            self.stats.stored += n
            self.stats.store_failures += len(keys) - n
            self.stats.bytes_stored += n * self.row_bytes

    async def _follow_feed(self) -> None:
        """After a store job: the rows this tier stored that the feed says left the store."""
        if self._feed is not None:
            for key in await self._feed.gone():
                self._removed.put(key)

    async def _refresh(self, key: OffloadKey) -> None:
        """Ask the backend for ``key`` after a store job (on the loop, not waited for): the
        file backend's answer brings its in-memory index up to date, so the scheduler's next
        lookups answer from it at once (``lookup_max_age_s``) and see this job's rows."""
        try:
            await self.backend.exists([self.storage_key(key)])
        except Exception as exc:  # only a later lookup's speed depends on it
            log.debug("HiCacheStoreTier: refreshing the backend's view failed: %r", exc)

    def _native_store_job(self, keys: list[OffloadKey], chunks: list[int]) -> _Job | None:
        """A store job sealed on this thread and handed to the backend's own job
        (``ObjectIO.start_write_frames``; already failed when it could not start), or None
        (then the loop's path): a backend without native writes, or bytes in flight past
        ``max_inflight_mib`` (the loop's path waits for the write budget)."""
        nbytes = len(keys) * (self._header_bytes + self.row_bytes)
        if (not self.backend.capabilities.native_writes  # (asked first: no copy for nothing)
                or self._native_writing + nbytes > self._io_limits[1]):
            return None
        start = time.monotonic()  # (the put's own clock: ``PendingFrameWrites.ended``)
        slots = [self._staging.take() for _ in keys]
        frames = self._store_frames(keys, chunks, slots)
        try:
            writes = self.io.start_write_frames(frames)
        except Exception as exc:  # a closed backend: a failed job, never a row reported stored
            self._give(slots)
            log.warning("HiCacheStoreTier: store of %d rows failed: %r", len(keys), exc)
            self._count_store(keys, [False] * len(keys))
            return _Job(keys, _resolved([False] * len(keys), time.monotonic() - start),
                        is_load=False)
        if writes is None:
            self._give(slots)
            return None
        self._native_writing += nbytes
        return _Job(keys, None, is_load=False, store=_NativeStore(slots, writes, nbytes, start))

    def _finish_native_store(
        self, job: _Job
    ) -> concurrent.futures.Future[tuple[list[bool], float]] | None:
        """A native store's put has ended (scheduler thread): give its staging back, count.
        None when the job goes on on the loop to read the change feed (as ``_store`` does)."""
        store = job.store
        assert store is not None
        job.store = None
        stored = store.writes.result()
        self._give(store.slots)  # the put has ended: nothing reads them
        self._native_writing -= store.nbytes
        store.put_ended()
        self._count_store(job.keys, stored)
        # the put's own time, as fs reports its I/O's (not the wait for this poll)
        seconds = (store.writes.ended or time.monotonic()) - store.start
        if any(stored) and self.inline is not None:  # (on the loop, not waited for)
            refresh = submit(self._refresh(job.keys[stored.index(True)]))
            self._refreshes.add(refresh)
            refresh.add_done_callback(self._refreshes.discard)
        if self._feed is not None:
            async def followed() -> tuple[list[bool], float]:
                await self._follow_feed()
                return stored, seconds

            job.future = submit(followed())
            return None
        return _resolved(stored, seconds)

    def _native_load_job(self, keys: list[OffloadKey], chunks: list[int]) -> _Job | None:
        """A load job whose reads run in the backend's native code (already failed when they
        could not start), or None where the backend has no such path."""
        start = time.perf_counter()
        okeys = [self.object_key(k) for k in keys]
        slots = [self._staging.take() for _ in keys]
        frames = [slot[: self._header_bytes + self.row_bytes] for slot in slots]
        try:
            reads = self.io.start_read_frames(okeys, frames)
        except Exception as exc:  # a closed backend: failed loads, recomputed
            self._give(slots)
            return _Job(keys, self._failed_load(keys, exc, start), is_load=True)
        if reads is None:
            self._give(slots)
            return None
        return _Job(keys, None, is_load=True,
                    native=_NativeLoad(chunks, okeys, slots, frames, reads, start))

    def _finish_native_load(
        self, job: _Job
    ) -> concurrent.futures.Future[tuple[list[bool], float]] | None:
        """A native load's reads have ended (scheduler thread): verify, copy, count. None when
        the job goes on on the loop (``job.future``): to delete the corrupt objects it found,
        or, when the batch has an object stored larger than its frame, to read it through
        ``read_frames``, which finds that object."""
        native = job.native
        assert native is not None
        job.native = None
        try:
            found = native.reads.result()
        except InvalidRangeError:
            self._give(native.slots)
            job.future = submit(self._load(job.keys, native.chunks))
            return None
        except Exception as exc:  # backend failure: failed loads, recomputed
            self._give(native.slots)
            return self._failed_load(job.keys, exc, native.start)
        try:
            outcome = self._deliver(native.chunks, native.frames, found)
        finally:
            self._give(native.slots)  # the reads have ended: nothing writes them
        corrupt = self._count_load(job.keys, native.okeys, outcome, found)
        if corrupt:  # the job ends once they are deleted (on the loop), as ``_load`` does
            async def dropped() -> tuple[list[bool], float]:
                await self._drop_corrupt(corrupt)
                return outcome, time.perf_counter() - native.start

            job.future = submit(dropped())
            return None
        return _resolved(outcome, time.perf_counter() - native.start)

    async def _load(self, keys: list[OffloadKey], chunks: list[int]) -> tuple[list[bool], float]:
        """A load job on the library's loop (backends without native reads)."""
        start = time.perf_counter()
        okeys = [self.object_key(k) for k in keys]
        slots = [self._staging.take() for _ in keys]
        try:
            frames = [slot[: self._header_bytes + self.row_bytes] for slot in slots]
            try:
                found = await self.io.read_frames(okeys, frames)
            except Exception as exc:  # backend failure or deadline: failed loads, recomputed
                return self._failed_load(keys, exc, start).result()
            outcome = self._deliver(chunks, frames, found)
        finally:
            self._give(slots)  # read_frames has returned: nothing writes them
        corrupt = self._count_load(keys, okeys, outcome, found)
        if corrupt:
            await self._drop_corrupt(corrupt)
        return outcome, time.perf_counter() - start

    def _deliver(
        self, chunks: list[int], frames: list[memoryview],
        found: list[ObjectHeader | CorruptObjectError | None],
    ) -> list[bool]:
        """Copy each verified row into its primary slot; per key whether it was."""
        outcome = []
        for chunk, frame, got in zip(chunks, frames, found, strict=True):
            if got is None or isinstance(got, CorruptObjectError):
                outcome.append(False)
                continue
            row = self._row(chunk)
            # Verified: only now do the bytes reach vLLM's primary slot.
            row[:] = frame[self._header_bytes :]
            if self.test_alter_loaded_kv:
                row[:] = bytes(len(row))  # TEST ONLY: wrong KV on purpose, after the check
            outcome.append(True)
        return outcome

    def _count_load(
        self, keys: list[OffloadKey], okeys: list[ObjectKey], outcome: list[bool],
        found: list[ObjectHeader | CorruptObjectError | None],
    ) -> list[tuple[OffloadKey, ObjectKey, CorruptObjectError]]:
        """Count a load job's outcome; its corrupt objects, to be dropped."""
        with self._stats_lock:
            n = sum(outcome)
            self.stats.loaded += n
            self.stats.bytes_loaded += n * self.row_bytes
            self.stats.load_misses += sum(got is None for got in found)
        return [(k, o, got) for k, o, got in zip(keys, okeys, found, strict=True)
                if isinstance(got, CorruptObjectError)]

    def _failed_load(
        self, keys: list[OffloadKey], exc: BaseException, start: float
    ) -> concurrent.futures.Future[tuple[list[bool], float]]:
        log.warning("HiCacheStoreTier: load of %d rows failed: %r", len(keys), exc)
        with self._stats_lock:
            self.stats.load_failures += len(keys)
        return _resolved([False] * len(keys), time.perf_counter() - start)

    def _give(self, slots: list[memoryview]) -> None:
        for slot in slots:
            self._staging.give(slot)

    async def _drop_corrupt(
        self, corrupt: list[tuple[OffloadKey, ObjectKey, CorruptObjectError]]
    ) -> None:
        """Count and delete corrupt objects (a miss each), so the next store writes them again."""
        for _, okey, exc in corrupt:
            log.warning("HiCacheStoreTier: corrupt object %s (%s): a miss, deleted", okey, exc)
        with self._stats_lock:
            self.stats.corruptions += len(corrupt)
        try:
            await self.backend.delete([self.io.storage_key(okey) for _, okey, _ in corrupt])
        except Exception as exc:
            log.warning("HiCacheStoreTier: deleting %d corrupt objects failed: %r",
                        len(corrupt), exc)
            return
        for key, okey, _ in corrupt:
            if self._feed is not None:
                self._feed.forget(self.io.storage_key(okey))  # reported here, not again
            self._removed.put(key)
