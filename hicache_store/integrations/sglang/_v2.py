"""SGLang's v2 multi-pool interface: hybrid models' sidecar pools as cache components.

A 0.5.23 ``HybridCacheController`` registers every entry of its ``HostPoolGroup`` through
``register_mem_host_pool_v2(host_pool, name)``: the KV pool (the same pool
``register_mem_pool_host`` received) and, for hybrid models, sidecar pools whose pages the tree
moves with ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``, one ``PoolTransfer`` per
pool. The KV itself still goes through the v1 calls.

**What is stored.** Each supported sidecar pool is a cache component (``tier.components``) with
its own namespace (``component_namespace``: ``{model}#{part}``, the model's revision, tenant
salt and hash algorithm, sealed when the model's is) and its own objects (``_C{tag}`` keys),
keyed by the KV page hash SGLang gives the transfer:

* ``swa`` (sliding-window KV, an ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` of the
  KV's page size): one page of the SWA layers per KV page, in the unified layout of its own
  namespace (``#swa``: the SWA layers, heads and dtype), sharded across TP ranks by its grid
  exactly like KV (MLA: replicated, TP rank 0 writes), so any TP size reads it. Tag 1.
* ``mamba`` (recurrent state, a ``MambaPoolHost``, one state per slot, page size 1): one
  object per state snapshot, keyed by the hash of the KV page it ends. The bytes are SGLang's
  own page of the pool (``get_data_page`` / ``set_from_flat_data_page``: conv and temporal
  states, side states); the state is TP-sharded in a way only the model knows, so the
  namespace (``#mamba.{structure}.tp{rank}-{size}``) names the rank's shard and the state's
  structure: another TP size, state dtype or shape never hits. Tag 2.

Every object is framed (header, per-layer checksums) and verified on read; a missing,
corrupt or tampered object is a miss for its page, and nothing of it reaches the host pool.

**Hit rule.** ``batch_exists_v2`` answers as SGLang's reference backend (``HiCacheFile``): the
KV prefix, then per transfer its policy (``ALL_PAGES``: every page; ``TRAILING_PAGES`` with
``n`` keys: the last ``n`` pages before the prefix end, ``n == 1`` a checkpoint at the end),
through the tier's ``ComponentSpec.pages_needed``; ``restorable_prefix_pages`` lists every
prefix length at which the KV and every pool can resume (sparse: a state exists only at node
ends), and the hit is the longest. A pool missing at a length removes that length, so a KV
hit never comes without its window or state.

**Not supported** (``check_pool`` refuses at registration, start-up or a runtime attach, with
one message naming the pool): every other pool (indexer, draft, DeepSeek-V4 compressed pools),
sidecars with PP > 1 (a stage's pool does not say which of the model's sidecar layers it
holds), and SWA pools of a replicated MLA deployment's MHA layers. The v2 data calls never
raise: a pool that is not registered is a miss / failure for every page (``v2_refused``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache_store.backends import Backend, aligned_buffer
from hicache_store.layout.keys import validate_page_hash
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.plans import suggest_grid
from hicache_store.layout.topology import Topology
from hicache_store.objects import IOStats, L3Link, PageWrite
from hicache_store.sglang_config import AdapterConfig
from hicache_store.tenant import KeyRing
from hicache_store.tier.components import (
    RECURRENT_TAG,
    WINDOW_TAG,
    ComponentSpec,
    HitRule,
    component_namespace,
)

from ._pool import Registered, describe_host_pool, host_slots

#: SGLang's pool names (``PoolName``) this module knows.
KV_POOL = "kv"
SWA_POOL = "swa"
MAMBA_POOL = "mamba"
#: component tags in object keys (``_C{tag}``), the tier's window and recurrent tags.
SWA_TAG = WINDOW_TAG
MAMBA_TAG = RECURRENT_TAG
#: one row of a state object at most (the namespace's ``head_dim`` limit).
_STATE_ROW_LIMIT = 1 << 20
_STATE_ROWS_LIMIT = 1024  # one object: at most MAX_LAYERS_PER_OBJECT rows
Rows = np.ndarray[Any, np.dtype[np.uint8]]


def pool_name(name: Any) -> str:
    """``PoolName.SWA`` or ``"swa"`` -> ``"swa"``."""
    return str(getattr(name, "value", name))


def refuse(label: str, host_pool: Any, why: str) -> ValueError:
    """The one start-up error for a pool the adapter does not store."""
    return ValueError(
        f"hicache-store: SGLang registered a {label!r} host pool ({type(host_pool).__name__}) "
        f"beside the KV pool, and {why}. The adapter stores the KV, 'swa' and 'mamba' pools "
        "(PP 1); it refuses at start-up rather than store KV whose prefixes could never be "
        "restored. Serve this model without --hicache-storage-backend, or with a storage "
        "backend that stores these pools."
    )


# -- the sidecars ------------------------------------------------------------------------------


@dataclass
class PagedSidecar:
    """A sidecar pool of KV-shaped pages (SWA): moved like KV, through its own namespace."""

    name: str
    reg: Registered

    @property
    def namespace(self) -> Namespace:
        return self.reg.namespace

    @property
    def link(self) -> L3Link:
        return self.reg.link


class StateSidecar:
    """A recurrent-state pool (Mamba): one framed object per state slot, SGLang's page bytes.

    Writes: ``stage`` copies the slots' states into rows (the calling thread), ``write`` stores
    them. Reads: ``read`` fetches each state into its own row of a fresh buffer (a read that
    outlives the call lands in memory nobody uses), ``install`` copies the verified ones into
    the pool (the calling thread); a state that failed never reaches the pool.
    """

    def __init__(self, name: str, host_pool: Any, namespace: Namespace, link: L3Link) -> None:
        self.name = name
        self.pool = host_pool
        self.namespace = namespace
        self.link = link
        self.state_bytes = namespace.num_layers * namespace.head_dim

    def slots(self, host_indices: Any, n: int, *, writes_pool: bool) -> list[int]:
        """The ``n`` state slots of a transfer, checked before any I/O (``host_slots``:
        SGLang's state pool indexes a negative slot from its end)."""
        table = host_slots(host_indices, n, 1, int(self.pool.size), writes_pool=writes_pool)
        return [int(slot) for slot in table.view(-1).tolist()]

    def stage(self, slots: Sequence[int]) -> Rows:
        rows = self.rows(len(slots))
        for i, slot in enumerate(slots):
            page = self.pool.get_data_page(int(slot), flat=True)
            rows[i] = page.contiguous().view(torch.uint8).reshape(-1).numpy()
        return rows

    async def write(self, keys: Sequence[str], rows: Rows) -> list[bool]:
        if self.link.write_plan is None:
            return [False] * len(keys)
        pages = [PageWrite(key, rows[i], keys[i - 1] if i else None) for i, key in enumerate(keys)]
        return await self.link.write_in_order(pages, IOStats())

    async def read(self, keys: Sequence[str], rows: Rows, io: IOStats) -> list[bool]:
        found = await asyncio.gather(
            *(self.link.read_page(key, rows[i], io) for i, key in enumerate(keys))
        )
        return list(found)

    def install(self, found: Sequence[bool], rows: Rows, slots: Sequence[int]) -> None:
        for ok, row, slot in zip(found, rows, slots, strict=True):
            if ok:
                self.pool.set_from_flat_data_page(int(slot), torch.from_numpy(row))

    def rows(self, n: int) -> Rows:
        """``n`` rows of one state each, in a fresh page-aligned buffer."""
        view = aligned_buffer(max(1, n * self.state_bytes))
        return np.frombuffer(view, dtype=np.uint8)[: n * self.state_bytes].reshape(
            n, self.state_bytes
        )


Sidecar = PagedSidecar | StateSidecar


@dataclass(frozen=True)
class Deployment:
    """What a sidecar's namespace and shard derive from (the KV registration's facts)."""

    kv: Registered
    config: AdapterConfig
    backend: Backend
    keys: KeyRing | None
    tp_rank: int
    tp_size: int
    pp_size: int
    replicated: bool  # the KV is replicated across TP (MLA)


def make_sidecar(label: str, host_pool: Any, d: Deployment) -> Sidecar:
    """The sidecar for SGLang's pool ``label``; ``ValueError`` (``refuse``) when unsupported."""
    if label not in (SWA_POOL, MAMBA_POOL):
        raise refuse(label, host_pool, f"the adapter does not store {label!r} pools yet")
    if d.pp_size > 1:
        raise refuse(label, host_pool, "pipeline parallelism (PP > 1) is not supported with it")
    if label == SWA_POOL:
        return PagedSidecar(label, _swa_registered(host_pool, d))
    return _mamba_sidecar(host_pool, d)


def _link(d: Deployment, namespace: Namespace, topology: Topology, rank: int, tag: int,
          *, read_only: bool) -> L3Link:
    return L3Link.for_component(
        d.backend, namespace, topology, rank, d.config, keys=d.keys, component=tag,
        min_bandwidth_mib_s=d.config.min_bandwidth_mib_s,
        read_only=read_only,
    )


def _swa_registered(host_pool: Any, d: Deployment) -> Registered:
    """The SWA pool as KV-shaped pages of the ``#swa`` component namespace."""
    try:
        geometry, host = describe_host_pool(host_pool)
    except ValueError as exc:
        raise refuse(SWA_POOL, host_pool, f"its pool cannot be moved ({exc})") from None
    kv = d.kv
    if geometry.page_size != kv.geometry.page_size:
        raise refuse(
            SWA_POOL, host_pool,
            f"its page size {geometry.page_size} is not the KV's {kv.geometry.page_size}",
        )
    mla = geometry.kv_kind == "mla"
    if d.replicated and not mla:
        raise refuse(SWA_POOL, host_pool, "MHA sliding-window layers beside replicated KV "
                     "are not supported")
    if mla:
        shape = ModelShape.mla(geometry.num_layers, geometry.head_dim)
        topology, rank, read_only = Topology(), 0, d.tp_rank != 0
    else:
        heads = geometry.num_heads * d.tp_size
        shape = ModelShape.mha(geometry.num_layers, heads, geometry.head_dim)
        topology, rank, read_only = kv.topology, kv.rank, False
    cfg = d.config
    grid = (
        cfg.grid
        if cfg.grid is not None and cfg.key_scheme == "hicache"
        else suggest_grid(shape, [topology, *cfg.share_with])
    )
    namespace = component_namespace(
        kv.namespace, SWA_POOL, shape, geometry.kv_dtype(cfg.kv_dtype), grid
    )
    link = _link(d, namespace, topology, rank, SWA_TAG, read_only=read_only)
    return Registered.build(geometry, host, topology, rank, link)


def _mamba_sidecar(host_pool: Any, d: Deployment) -> StateSidecar:
    """The Mamba pool as state objects of this rank's ``#mamba...`` component namespace."""
    needed = ("get_data_page", "set_from_flat_data_page", "size_per_token", "page_size", "size")
    missing = [a for a in needed if not hasattr(host_pool, a)]
    if missing or int(host_pool.page_size) != 1:
        raise refuse(MAMBA_POOL, host_pool, "it is not a state pool of page size 1 with "
                     f"{', '.join(needed)}")
    nbytes = int(host_pool.size_per_token)
    rows = _state_rows(nbytes)
    if rows is None:
        raise refuse(MAMBA_POOL, host_pool, f"its {nbytes}-byte state does not split into "
                     f"at most {_STATE_ROWS_LIMIT} equal rows of at most {_STATE_ROW_LIMIT} B")
    part = f"{MAMBA_POOL}.{state_structure(host_pool)}.tp{d.tp_rank}-{d.tp_size}"
    namespace = component_namespace(
        d.kv.namespace, part, ModelShape.mla(rows, nbytes // rows), "uint8", Grid(rows, 1),
        page_size=1,
    )
    link = _link(d, namespace, Topology(), 0, MAMBA_TAG, read_only=False)
    return StateSidecar(MAMBA_POOL, host_pool, namespace, link)


def _state_rows(nbytes: int) -> int | None:
    """The fewest equal rows (the namespace's "layers") a state of ``nbytes`` splits into."""
    first = max(1, -(-nbytes // _STATE_ROW_LIMIT))
    return next(
        (r for r in range(first, _STATE_ROWS_LIMIT + 1) if nbytes % r == 0), None
    )


def state_structure(host_pool: Any) -> str:
    """12 hex digits naming a state pool's structure: what its bytes mean (shapes, dtypes and
    order of the temporal, conv and side states, layer count), so no other structure hits."""
    parts = [f"layers={getattr(host_pool, 'num_mamba_layers', '?')}"]
    for tensor in host_pool._iter_page_tensors(0) if hasattr(host_pool, "_iter_page_tensors") \
            else ():
        parts.append(f"{tuple(tensor.shape)}:{tensor.dtype}")
    parts.append(f"bytes={int(host_pool.size_per_token)}")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:12]


# -- the hit rule ------------------------------------------------------------------------------


def transfer_spec(transfer: Any, page_size: int) -> ComponentSpec | None:
    """The tier's hit rule for one ``PoolTransfer`` (its ``hit_policy`` and key count), or
    None for a policy this module does not know (``BLOCK_GROUPS``)."""
    name = pool_name(transfer.name)
    tag = MAMBA_TAG if name == MAMBA_POOL else SWA_TAG
    policy = pool_name(getattr(transfer, "hit_policy", "all_pages"))
    if policy == "all_pages":
        return ComponentSpec(name, tag, HitRule.FULL)
    if policy == "trailing_pages":
        n = max(1, len(transfer.keys or ()))
        if n == 1:
            return ComponentSpec(name, tag, HitRule.CHECKPOINT)
        return ComponentSpec(name, tag, HitRule.WINDOW, window_tokens=n * page_size)
    return None


def restorable_prefixes(
    specs: Sequence[ComponentSpec],
    present: Mapping[str, Sequence[bool]],
    page_size: int,
    num_pages: int,
) -> list[int]:
    """Every prefix length in [1, ``num_pages``] at which each of ``specs`` can resume, given
    ``present[name][i]`` (whether that component's object of page ``i`` is stored)."""
    return [
        p
        for p in range(1, num_pages + 1)
        if all(all(present[s.name][i] for i in s.pages_needed(p, page_size)) for s in specs)
    ]


def check_keys(keys: Sequence[str]) -> list[str]:
    out = list(keys)
    for key in out:
        validate_page_hash(key)
    return out


# -- results -----------------------------------------------------------------------------------


@dataclass
class FallbackPoolTransferResult:
    """SGLang's ``PoolTransferResult`` fields, where its class does not import."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict[str, int]
    restorable_prefix_pages: list[int] | None = None


def transfer_result(
    kv_hit_pages: int, pool_hits: dict[str, int], restorable: list[int] | None
) -> Any:
    """SGLang's ``PoolTransferResult`` (what ``batch_exists_v2`` must return)."""
    try:
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped]
            PoolTransferResult,
        )
    except Exception:
        return FallbackPoolTransferResult(kv_hit_pages, pool_hits, restorable)
    return PoolTransferResult(kv_hit_pages, pool_hits, restorable)
