"""The multi-turn benchmark on the hybrid mini engine (``bench multiturn --model hybrid``).

Same workload, tier configurations and records as ``bench.multiturn``; the model is
``HybridMiniLlama`` (the preset's layers, every other one a sliding-window layer, plus a recurrent
layer) served through ``HybridCache``. Besides the token hit rates by tier, each configuration
reports per-component hit rates: for the full-attention KV, the sliding-window pages and the
recurrent snapshots, the share of prompt tokens that component alone could have resumed after,
next to the share actually reused (every component at once), and how often each component was
the binding one (``HybridMetrics``).

Sizing (memory-fair): the window-page pools have as many pages as the KV pools (with every other
layer a window layer, the same bytes); only the window pages before checkpoints are kept, so the
snapshot pools get one slot per window's worth of pages (every snapshot a pool holds can have its
window), at least ``MIN_SNAPSHOT_SLOTS``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from hicache_store.backends import open_backend
from hicache_store.engine.config import MiniLlamaConfig
from hicache_store.hybrid.cache import HybridCache, HybridMetrics, run_request
from hicache_store.hybrid.model import HybridMiniLlama
from hicache_store.tier.config import TierConfig

from .multiturn import (
    RequestRecord,
    SetupResult,
    TierSetup,
    namespace_for,
    record_of,
    serve_workload,
)
from .workload import TurnRequest, WorkloadSpec

MIN_SNAPSHOT_SLOTS = 4


def hybrid_config(base: MiniLlamaConfig, sliding_window: int) -> MiniLlamaConfig:
    """``base`` with every odd layer a sliding-window layer of ``sliding_window`` tokens."""
    return base.with_(
        window_layers=tuple(range(1, base.num_layers, 2)), sliding_window=sliding_window
    )


def run_hybrid_setup(
    model: HybridMiniLlama,
    spec: WorkloadSpec,
    setup: TierSetup,
    page_size: int,
    tier_options: dict[str, Any],
    progress: Callable[[int], None] | None = None,
    *,
    checkpoint_interval_pages: int = 0,
) -> SetupResult:
    """Serve the whole workload under one configuration through a ``HybridCache``."""
    window = model.window_component(page_size)
    per_window = 1 if window is None else len(window.spec.pages_needed(1 << 20, page_size))

    def snapshot_slots(pages: int) -> int:
        return max(MIN_SNAPSHOT_SLOTS, pages // per_window)

    backend = open_backend(setup.backend_url) if setup.backend_url else None
    cache = HybridCache(
        namespace_for(model.config, page_size),
        TierConfig(l1_pages=setup.l1_pages, l2_pages=setup.l2_pages, **tier_options),
        model.make_pool(setup.l1_pages, page_size),
        model.state_shape,
        snapshot_l1_slots=snapshot_slots(setup.l1_pages),
        snapshot_l2_slots=snapshot_slots(setup.l2_pages),
        backend=backend,
        window=window,
        window_l1_slots=setup.l1_pages,
        window_l2_slots=setup.l2_pages,
        checkpoint_interval_pages=checkpoint_interval_pages,
    )
    result = SetupResult(setup)
    prompts = HybridMetrics(
        component_tokens=dict.fromkeys(cache.metrics.component_tokens, 0),
        limited_by=dict.fromkeys(cache.metrics.limited_by, 0),
    )

    def step(request: TurnRequest) -> None:
        before = copy.deepcopy(cache.metrics)
        result.records.append(_serve(model, cache, request))
        _add_delta(prompts, before, cache.metrics)
        if request.answer:  # decode's KV joins the cache; not a prompt, not counted
            run_request(cache, model, request.prompt + request.answer)

    result.wall_s = serve_workload(spec, step, cache, backend, progress)
    counters = asdict(cache.metrics)
    result.tier_metrics = {
        **cache.tier.metrics.to_dict(),
        "components": {
            # over the prompts (the records' requests), not the answers' decode prefills
            "hit_rates": prompts.hit_rates(),
            "limited_by": dict(prompts.limited_by),
            # every request through the cache, answers included
            "counters": {
                k: v for k, v in counters.items() if k not in ("component_tokens", "limited_by")
            },
        },
    }
    return result


def _add_delta(total: HybridMetrics, before: HybridMetrics, after: HybridMetrics) -> None:
    """Add what one request changed in the hit counters (``after - before``) to ``total``."""
    total.prompt_tokens += after.prompt_tokens - before.prompt_tokens
    total.hit_tokens += after.hit_tokens - before.hit_tokens
    for name, tokens in after.component_tokens.items():
        total.component_tokens[name] += tokens - before.component_tokens[name]
    for name, count in after.limited_by.items():
        total.limited_by[name] += count - before.limited_by[name]


def _serve(model: HybridMiniLlama, cache: HybridCache, request: TurnRequest) -> RequestRecord:
    started = time.perf_counter()
    _, hreq, _ = run_request(cache, model, request.prompt)
    # TTFT here includes ``complete``: saving the snapshots and window pages into L1/L2 and
    # queuing their L3 puts (the plain model's TTFT ends before ``complete``).
    ttft = time.perf_counter() - started
    return record_of(request, hreq.kv, cache.page_size, ttft)
