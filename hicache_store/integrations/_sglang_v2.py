"""SGLang's v2 multi-pool interface, as far as the adapter serves it today.

A 0.5.23 ``HybridCacheController`` registers every entry of its ``HostPoolGroup`` through
``register_mem_host_pool_v2(host_pool, name)``: for a plain MHA/MLA model that is only the KV
pool (the same pool ``register_mem_pool_host`` received), for hybrid models also sidecar pools
(``swa``, ``mamba``, ``indexer``, ``draft``, DeepSeek-V4's compressed pools, ...) whose pages
the tree then moves with ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``, one
``PoolTransfer`` per pool.

Until the adapter stores those components, ``check_pool`` refuses a sidecar pool at
registration (start-up, or a runtime attach), with one message naming the pool: storing a
model's KV without its sliding-window or recurrent state would only ever produce prefixes
SGLang cannot restore. The v2 data calls never raise: transfers of the KV pool are served
like v1 calls; any other pool is a miss / failure for every page (counted ``v2_refused``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: SGLang's name of the full-attention KV pool (``PoolName.KV``).
KV_POOL = "kv"


def pool_name(name: Any) -> str:
    """``PoolName.SWA`` or ``"swa"`` -> ``"swa"``."""
    return str(getattr(name, "value", name))


def check_pool(host_pool: Any, name: Any, kv_pool: Any) -> None:
    """Accept the KV pool ``register_mem_pool_host`` received; refuse every other pool."""
    label = pool_name(name)
    if label == KV_POOL and host_pool is kv_pool:
        return
    raise ValueError(
        f"hicache-store: SGLang registered a {label!r} host pool "
        f"({type(host_pool).__name__}) beside the KV pool. This model keeps state outside "
        "full-attention KV (sliding-window KV, Mamba/recurrent state, an indexer, a draft "
        "model or compressed KV), and the hicache-store SGLang adapter does not store "
        f"{label!r} pools yet: it refuses at start-up rather than store KV whose prefixes "
        "could never be restored. Serve this model without --hicache-storage-backend, or "
        "with a storage backend that stores these pools."
    )


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
