"""Replay a block-hash trace through the cache tier and a real backend.

Every request of the trace is served, in arrival order, the way an engine serves a prompt:
``tier.match`` (the tier hashes the synthesized tokens, finds the cached prefix in L1, L2 and
L3 and starts an L3 prefetch), ``tier.prepare`` (settles the prefetch as the prefetch policy
says, loads L2 pages into L1), then ``tier.complete`` (inserts the new pages, writes through
to L2 and, in the background, to L3). There is no model: the replay measures the cache, not
the model, so the KV bytes moved are whatever the small pool holds.

* Tokens come from ``trace_tokens`` (same block id, same tokens), so the tier's page-hash chain
  reproduces the trace's sharing at any page size that divides the trace's block.
* KV pages carry a small model shape (``KVShape``: one layer, one KV head, head_dim 2, bf16 by
  default: 8 bytes per token, so L2 at 64,000 blocks is 250 MiB), so a whole trace fits this
  machine's disk and memory while every byte still goes through the real tier, kernels, object
  framing and backend.
* Arrival times are honoured on a scaled clock: with ``time_scale`` s > 0, request i is not
  served before ``(timestamp_i - timestamp_0) * s`` seconds into the replay, so background
  L3 writes and prefetches get the time they would have (a slower replay just runs late, and
  says by how much); 0 serves requests back to back.
* Each request carries what an engine knows of it, through the same API an engine uses:
  ``trace_sim.HintFeed`` gives ``tier.match`` the request's ``RequestHints`` (session, kind,
  the previous response's stop reason and end, on the trace's clock) and ``tier.response_end``
  each response once it has ended. A policy that takes hints (``session``) orders by them;
  ``lru`` and ``arc`` ignore them. The trace asks for no pins; the pins the tier held at the end
  are reported (``pinned_pages``).

Sizes (``parse_capacity``) are given per tier in blocks of the trace (a bare number), pages,
tokens or bytes of KV; the tier works in pages.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hicache_store._sync import run_sync
from hicache_store.backends import Backend, open_backend
from hicache_store.backends.types import parse_size
from hicache_store.layout.namespace import Grid, ModelShape, Namespace

from .trace_format import Trace
from .trace_sim import HintFeed, HitCount, request_kind
from .trace_tokens import blocks_tokens, request_tokens

#: model name of the replay's namespace (its objects never mix with a real model's).
REPLAY_MODEL = "hicache-store/trace-replay"


@dataclass(frozen=True)
class KVShape:
    """The KV geometry of the replay's pages (MHA)."""

    layers: int = 1
    kv_heads: int = 1
    head_dim: int = 2
    dtype: str = "bfloat16"

    def namespace(self, page_size: int) -> Namespace:
        shape = ModelShape.mha(self.layers, self.kv_heads, self.head_dim)
        return Namespace.create(
            REPLAY_MODEL, shape, self.dtype, page_size, Grid(self.layers, self.kv_heads)
        )


def parse_capacity(text: str, *, block_tokens: int, page_size: int, page_bytes: int) -> int:
    """Pages from a size: ``4000`` or ``4000blocks`` (blocks of the trace), ``512pages``,
    ``2000000tokens`` (or ``tok``), or bytes of KV with a unit ending in B (``64MiB``,
    ``1GB``, ``4096B``). Partial pages round down; the result must be at least one page."""
    value = text.strip().replace("_", "")
    units = {
        "blocks": block_tokens // page_size,
        "block": block_tokens // page_size,
        "pages": 1,
        "page": 1,
    }
    pages: int | None = None
    for suffix, per in units.items():
        if value.endswith(suffix) and value[: -len(suffix)].isdigit():
            pages = int(value[: -len(suffix)]) * per
            break
    else:
        for suffix in ("tokens", "tok"):
            if value.endswith(suffix) and value[: -len(suffix)].isdigit():
                pages = int(value[: -len(suffix)]) // page_size
                break
        else:
            if value.isdigit():
                pages = int(value) * (block_tokens // page_size)
            elif value.endswith("B"):
                pages = parse_size(value) // page_bytes
    if pages is None:
        raise ValueError(
            f"size {text!r}: expected N (blocks), Nblocks, Npages, Ntokens or bytes like 64MiB"
        )
    if pages < 1:
        raise ValueError(f"size {text!r} is less than one page")
    return pages


@dataclass(frozen=True)
class ReplaySetup:
    """One replay: tier sizes in pages, the policies, the backend, the clock.

    ``l1_cache``: whether L1 keeps pages between requests. Off (the default), L1 holds only
    the request being served (it is emptied after each one), so every hit comes from L2 or L3
    and the cache measured is exactly L2's ``l2_pages``; on, L1 is a cache of its own above L2.
    ``settle``: wait for the tier's background L3 work after each request (an engine idle
    between requests): deterministic L3 contents, for tests and exact comparisons. Without it,
    a replay that serves requests faster than L3 takes their pages drops the backups past the
    tier's write queue (``max_queued_backup_pages``), and since those are the tails of chains,
    exactly what L2 evicts first, L3 then lacks the first page past L2 and starts no prefetch.
    ``whole_blocks``: serve each prompt padded to whole blocks (the last, partial block gets the
    rest of its id's tokens), so that every block of the trace takes the cache space of a whole
    block, as in the published reference; hit tokens are still counted up to the prompt's
    length only (``prefix_hit_tokens``). Off, a partial last block takes only its full pages,
    as in an engine, and the cache holds a few percent more than the reference's capacity.
    """

    page_size: int
    l1_pages: int
    l2_pages: int
    backend_url: str | None
    l1_cache: bool = False
    eviction_policy: str = "lru"
    time_scale: float = 0.0
    shape: KVShape = field(default_factory=KVShape)
    write_policy: str = "write_through"
    prefetch_policy: str = "wait_complete"
    settle: bool = False
    whole_blocks: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.time_scale < 0:
            raise ValueError("time_scale must not be negative")


@dataclass
class TierCounts:
    """Hit tokens per tier, over all requests and over the second half (``trace_sim.HitCount``
    accounting)."""

    l1: HitCount
    l2: HitCount
    l3: HitCount

    @classmethod
    def empty(cls, requests: int) -> TierCounts:
        return cls(HitCount(requests), HitCount(requests), HitCount(requests))


@dataclass
class ReplayResult:
    """What one replay measured. ``summary`` is its JSON form."""

    setup: ReplaySetup
    block_tokens: int
    page_bytes: int
    counts: TierCounts
    bookkeeping_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    behind_s: float = 0.0
    tier_metrics: dict[str, Any] = field(default_factory=dict)
    backend_stats: dict[str, int] = field(default_factory=dict)
    tree_nodes: int = 0
    peak_rss_bytes: int = 0

    def summary(self) -> dict[str, Any]:
        c, m, b = self.counts, self.tier_metrics, self.backend_stats
        memory = _sum_counts(c.l1, c.l2)
        everything = _sum_counts(memory, c.l3)
        book = sorted(self.bookkeeping_s) or [0.0]
        pages_per_block = self.block_tokens / self.setup.page_size
        return {
            "capacity_blocks": self.setup.l2_pages / pages_per_block,
            "policy": self.setup.eviction_policy,
            "hit_rate": memory.hit_rate,
            "hit_rate_second_half": memory.second_half_hit_rate,
            "hit_rate_l1": c.l1.hit_rate,
            "hit_rate_l2": c.l2.hit_rate,
            "hit_rate_l3": c.l3.hit_rate,
            "hit_rate_with_l3": everything.hit_rate,
            "hit_rate_with_l3_second_half": everything.second_half_hit_rate,
            "hit_rate_by_kind": memory.kind_hit_rates,
            "pinned_pages": m.get("pinned_pages", 0),
            "input_tokens": memory.input_tokens,
            "pages": {
                "page_size": self.setup.page_size,
                "page_bytes": self.page_bytes,
                "l1": self.setup.l1_pages,
                "l2": self.setup.l2_pages,
            },
            "links": {
                "l1_to_l2": {"pages": m.get("backups_l2", 0), "bytes": m.get("bytes_l1_to_l2", 0)},
                "l2_to_l1": {
                    "pages": m.get("bytes_l2_to_l1", 0) // self.page_bytes,
                    "bytes": m.get("bytes_l2_to_l1", 0),
                },
                "l2_to_l3": {"objects": b.get("writes", 0), "bytes": b.get("bytes_written", 0)},
                "l3_to_l2": {
                    "objects": b.get("reads", 0),
                    "hits": b.get("read_hits", 0),
                    "bytes": b.get("bytes_read", 0),
                },
            },
            "l3_objects_written": b.get("writes", 0),
            "l3_objects_read": b.get("read_hits", 0),
            "prefetch": {
                k: m.get(f"prefetch_{k}", 0)
                for k in ("started", "complete", "partial", "timed_out", "failed_pages")
            },
            "backups_dropped": m.get("backups_dropped", 0),
            "bookkeeping_ms": {
                "mean": 1e3 * statistics.fmean(book),
                "p50": 1e3 * book[len(book) // 2],
                "p99": 1e3 * book[min(len(book) - 1, math.ceil(0.99 * len(book)) - 1)],
                "max": 1e3 * book[-1],
            },
            "wall_s": self.wall_s,
            "behind_s": self.behind_s,
            "tree_nodes": self.tree_nodes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "setup": asdict(self.setup),
            "tier": self.tier_metrics,
        }


def _sum_counts(a: HitCount, b: HitCount) -> HitCount:
    """Hits of two tiers together (the same requests: input tokens are counted once)."""
    total = HitCount(
        a.requests,
        a.block_hits + b.block_hits,
        a.hit_tokens + b.hit_tokens,
        a.input_tokens,
        a.second_half_hit_tokens + b.second_half_hit_tokens,
        a.second_half_input_tokens,
    )
    for kind, (hits, inputs) in a.by_kind.items():
        total.by_kind[kind] = [hits + b.by_kind.get(kind, [0, 0])[0], inputs]
    return total


def longest_request_pages(trace: Trace, page_size: int, *, whole_blocks: bool = True) -> int:
    """Pages of the longest prompt (padded to whole blocks when ``whole_blocks``, as the
    replay serves it): the smallest L1 that can serve every request."""
    if whole_blocks:
        blocks = max((len(r.hash_ids) for r in trace.requests), default=1)
        return blocks * (trace.block_tokens // page_size)
    return max((-(-r.input_length // page_size) for r in trace.requests), default=1)


def replay(
    trace: Trace,
    setup: ReplaySetup,
    *,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Serve every request of ``trace`` through a fresh tier over ``setup.backend_url``."""
    import torch

    from hicache_store.demo.engine.kv_pool import DeviceKVPool
    from hicache_store.tier.cache import HiCache
    from hicache_store.tier.config import TierConfig

    if trace.block_tokens % setup.page_size:
        raise ValueError(
            f"page size {setup.page_size} does not divide the trace's {trace.block_tokens}-token "
            "blocks: pages would straddle blocks the trace shares and blocks it does not"
        )
    shape = setup.shape
    namespace = shape.namespace(setup.page_size)
    pool = DeviceKVPool(
        num_layers=shape.layers,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_pages=setup.l1_pages,
        page_size=setup.page_size,
        dtype=shape.dtype,
    )
    backend: Backend | None = open_backend(setup.backend_url) if setup.backend_url else None
    config_options: dict[str, Any] = {
        "l1_pages": setup.l1_pages,
        "l2_pages": setup.l2_pages,
        "write_policy": setup.write_policy,
        "prefetch_policy": setup.prefetch_policy,
        "eviction_policy": setup.eviction_policy,
    }
    tier = HiCache(namespace, TierConfig(**config_options), pool, backend=backend)
    result = ReplayResult(
        setup, trace.block_tokens, namespace.page_bytes, TierCounts.empty(len(trace))
    )
    metrics = tier.metrics
    feed = HintFeed(tier.response_end)
    started = time.monotonic()
    first_ms = trace.requests[0].timestamp_ms if trace.requests else 0
    try:
        with torch.inference_mode():
            for index, request in enumerate(trace.requests):
                if setup.time_scale:
                    due = started + (request.timestamp_ms - first_ms) / 1000 * setup.time_scale
                    now = time.monotonic()
                    if due > now:
                        time.sleep(due - now)
                    else:
                        result.behind_s = max(result.behind_s, now - due)
                if setup.whole_blocks:
                    tokens = blocks_tokens(request.hash_ids, trace.block_tokens, seed=setup.seed)
                else:
                    tokens = request_tokens(request, trace.block_tokens, seed=setup.seed)
                before = (metrics.hit_tokens_l1, metrics.hit_tokens_l2, metrics.hit_tokens_l3)
                hints = feed.arrive(request)
                req = tier.match(torch.from_numpy(tokens.astype(np.int64)), hints=hints)
                tier.prepare(req)
                tier.complete(req)
                if not setup.l1_cache:
                    tier.evict_device()
                if setup.settle:
                    tier.flush(timeout=600.0)
                counts = (result.counts.l1, result.counts.l2, result.counts.l3)
                after = (metrics.hit_tokens_l1, metrics.hit_tokens_l2, metrics.hit_tokens_l3)
                # Hits past the prompt (its padding) are not tokens of the trace: cap the
                # total at the prompt, as ``prefix_hit_tokens`` does, taking the excess from
                # the slowest tier that served it.
                hits = [new - old for old, new in zip(before, after, strict=True)]
                excess = max(0, sum(hits) - request.input_length)
                for tier_index in (2, 1, 0):
                    cut = min(excess, hits[tier_index])
                    hits[tier_index] -= cut
                    excess -= cut
                kind = request_kind(request)
                for count, hit in zip(counts, hits, strict=True):
                    count.add(index, hit, request.input_length, kind=kind)
                result.bookkeeping_s.append(req.bookkeeping_s)
                if progress is not None:
                    progress(index + 1)
        tier.flush(timeout=600.0)
        result.wall_s = time.monotonic() - started
    finally:
        tier.close()
        if backend is not None:
            run_sync(backend.close())
    result.tier_metrics = metrics.to_dict()
    result.backend_stats = backend.stats.as_dict() if backend is not None else {}
    result.tree_nodes = len(tier.tree)
    result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result
