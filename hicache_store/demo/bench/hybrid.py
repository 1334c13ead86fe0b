"""The multi-turn benchmark on the hybrid mini engine (``bench multiturn --model hybrid``).

Same workload, tier configurations and records as ``bench.multiturn``; the model is
``HybridMiniLlama`` (the preset's layers, every other one a sliding-window layer, plus a recurrent
layer) served through one ``HiCache`` with its window and recurrent components
(``demo.hybrid``). Besides the token hit rates by tier, each configuration reports per-component
hit rates: for the full-attention KV, the sliding-window pages and the recurrent snapshots, the
share of prompt tokens that component alone could have resumed after, next to the share actually
reused (every component at once), and how often each component was the binding one.

Sizing (memory-fair): the window-page pools have as many pages as the KV pools (with every other
layer a window layer, the same bytes); only the window pages before checkpoints are kept, so the
snapshot pools get one slot per window's worth of pages (every snapshot a pool holds can have its
window), at least ``MIN_SNAPSHOT_SLOTS``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hicache_store.backends import open_backend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.hybrid import HybridMiniLlama, RecurrentPool, WindowPool, serve
from hicache_store.tier.cache import HiCache
from hicache_store.tier.config import TierConfig

from .multiturn import SetupResult, TierSetup, namespace_for, record_of, serve_workload
from .workload import TurnRequest, WorkloadSpec

MIN_SNAPSHOT_SLOTS = 4
COMPONENTS = ("kv", "window", "recurrent")


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
    """Serve the whole workload under one configuration through the tier and its components."""
    namespace = namespace_for(model.config, page_size)
    window = None
    per_window = 1
    if model.config.window_layers:
        window = WindowPool(model.config, namespace, setup.l1_pages, l2_slots=setup.l2_pages)
        per_window = len(window.component.spec.pages_needed(1 << 20, page_size))

    def snapshot_slots(pages: int) -> int:
        return max(MIN_SNAPSHOT_SLOTS, pages // per_window)

    recurrent = RecurrentPool(
        model.state_dim,
        namespace,
        snapshot_slots(setup.l1_pages),
        l2_slots=snapshot_slots(setup.l2_pages),
        every=checkpoint_interval_pages,
    )
    components = [p.component for p in (window, recurrent) if p is not None]
    backend = open_backend(setup.backend_url) if setup.backend_url else None
    tier = HiCache(
        namespace,
        TierConfig(l1_pages=setup.l1_pages, l2_pages=setup.l2_pages, **tier_options),
        model.make_pool(setup.l1_pages, page_size),
        backend=backend,
        components=components,
    )
    result = SetupResult(setup)
    counted: dict[str, float] = {}  # per-component counters over the prompts

    def step(request: TurnRequest) -> None:
        before = dict(tier.metrics.extra)
        started = time.perf_counter()
        served = serve(tier, model, request.prompt, window=window, recurrent=recurrent)
        # TTFT here includes ``complete``: keeping the snapshots and window pages in L1 and
        # queuing their backups (the plain model's TTFT ends before ``complete``).
        ttft = time.perf_counter() - started
        result.records.append(record_of(request, served.request, page_size, ttft))
        for name, value in tier.metrics.extra.items():
            counted[name] = counted.get(name, 0) + value - before.get(name, 0)
        if request.answer:  # decode's KV joins the cache; not a prompt, not counted
            serve(tier, model, request.prompt + request.answer, window=window, recurrent=recurrent)

    result.wall_s = serve_workload(spec, step, tier, backend, progress)
    prompt_tokens = max(1, sum(r.prompt_tokens for r in result.records))
    hit_rates = {
        name: counted.get(f"component_hit_tokens_{name}", 0) / prompt_tokens
        for name in COMPONENTS
    }
    hit_rates["all"] = sum(r.hit_tokens for r in result.records) / prompt_tokens
    result.tier_metrics = {
        **tier.metrics.to_dict(),
        "components": {
            # over the prompts (the records' requests), not the answers' decode prefills
            "hit_rates": hit_rates,
            "limited_by": {n: int(counted.get(f"limited_by_{n}", 0)) for n in COMPONENTS},
            # every request through the tier, answers included
            "counters": dict(tier.metrics.extra),
        },
    }
    return result

