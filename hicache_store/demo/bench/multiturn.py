"""The multi-turn benchmark: the same workload under L1 only, L1+L2 and L1+L2+L3.

Each configuration serves every request of ``workload.generate`` through a fresh ``HiCache``
driving the mini engine: match, prefetch, load, compute only the suffix, insert. TTFT is the
time from ``match`` to the last prompt position's logits. After each request the answer is
appended the way a real engine's decode would (its KV joins the cache; not part of TTFT).

Reported per configuration: token hit rate (overall, on turns after the first, and per tier),
mean and median TTFT, effective input throughput (all prompt tokens, cached or not, over the
time spent serving prompts), and the tier's bookkeeping share of TTFT.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from hicache_store.backends import Backend, open_backend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.cache import HiCache, Request
from hicache_store.tier.config import TierConfig

from .workload import TurnRequest, WorkloadSpec, generate


@dataclass(frozen=True)
class TierSetup:
    """One configuration: which tiers exist and how big they are (in pages)."""

    name: str
    l1_pages: int
    l2_pages: int = 0
    backend_url: str | None = None


@dataclass
class RequestRecord:
    conversation: int
    turn: int
    prompt_tokens: int
    hit_l1: int
    hit_l2: int
    hit_l3: int
    ttft_s: float
    bookkeeping_s: float

    @property
    def hit_tokens(self) -> int:
        return self.hit_l1 + self.hit_l2 + self.hit_l3


@dataclass
class SetupResult:
    setup: TierSetup
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    tier_metrics: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        recs = self.records
        later = [r for r in recs if r.turn > 0]
        prompt = sum(r.prompt_tokens for r in recs)
        ttfts = [r.ttft_s for r in recs]
        serve_time = sum(ttfts)

        def rate(rows: list[RequestRecord], attr: str = "hit_tokens") -> float:
            total = sum(r.prompt_tokens for r in rows)
            return sum(getattr(r, attr) for r in rows) / total if total else 0.0

        return {
            "setup": asdict(self.setup),
            "requests": len(recs),
            "prompt_tokens": prompt,
            "hit_rate": rate(recs),
            "hit_rate_after_first_turn": rate(later),
            "hit_rate_l1": rate(recs, "hit_l1"),
            "hit_rate_l2": rate(recs, "hit_l2"),
            "hit_rate_l3": rate(recs, "hit_l3"),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else 0.0,
            "ttft_median_s": statistics.median(ttfts) if ttfts else 0.0,
            "input_throughput_tok_s": prompt / serve_time if serve_time else 0.0,
            "bookkeeping_share": statistics.fmean(r.bookkeeping_s / r.ttft_s for r in recs)
            if recs
            else 0.0,
            "wall_s": self.wall_s,
            "tier": self.tier_metrics,
        }


def l2_effect(without: SetupResult, with_l2: SetupResult) -> dict[str, Any]:
    """What adding L2 changed, request by request: both configurations serve the same requests
    in the same order, so each request is compared with itself.

    ``used_l2``: requests that resumed from L2 pages (their TTFT median in each configuration,
    paired); ``same``: requests that resumed at the same prefix in both, so computed the same
    tokens (their TTFT median in each: what the machine did between the two runs, since the
    work is equal); ``computed_tokens`` in each."""
    pairs = list(zip(without.records, with_l2.records, strict=True))
    used = [(a, b) for a, b in pairs if b.hit_l2]
    same = [(a, b) for a, b in pairs if a.hit_tokens == b.hit_tokens and not b.hit_l2]

    def medians(rows: list[tuple[RequestRecord, RequestRecord]]) -> list[float]:
        if not rows:
            return [0.0, 0.0]
        return [statistics.median(r[k].ttft_s for r in rows) for k in (0, 1)]

    return {
        "requests": len(pairs),
        "used_l2": len(used),
        "used_l2_ttft_median_s": medians(used),
        "same": len(same),
        "same_ttft_median_s": medians(same),
        "computed_tokens": [
            sum(r.prompt_tokens - r.hit_tokens for r in result.records)
            for result in (without, with_l2)
        ],
    }


def describe_l2_effect(effect: dict[str, Any], names: tuple[str, str]) -> str:
    """``l2_effect`` in words, for the command's output."""
    a, b = names
    used_a, used_b = (1e3 * t for t in effect["used_l2_ttft_median_s"])
    same_a, same_b = (1e3 * t for t in effect["same_ttft_median_s"])
    comp_a, comp_b = effect["computed_tokens"]
    return (
        f"L2, request by request ({b} against {a}): {effect['used_l2']} of "
        f"{effect['requests']} requests resumed from L2 (median TTFT {used_b:.0f} ms against "
        f"{used_a:.0f} ms in {a}); computed tokens {comp_b} against {comp_a}. The other "
        f"{effect['same']} requests with the same prefix in both computed the same tokens, "
        f"median TTFT {same_b:.0f} against {same_a:.0f} ms: that difference is the machine "
        "between the two runs (the same work measured twice), not L2. The workload comes back "
        "to a conversation only after every other one has taken its turn, so what L2 held of it "
        "has mostly been pushed out by then: L2 serves few requests here, and the table's "
        "medians compare mostly the same work at two times."
    )


def namespace_for(config: MiniLlamaConfig, page_size: int) -> Namespace:
    """The namespace of the mini engine's pool pages: its full-attention layers; a model with
    sliding-window layers is another model (its window and layer list are in the name)."""
    layers = len(config.full_layers)
    shape = ModelShape.mha(layers, config.num_kv_heads, config.head_dim)
    grid = Grid(layers, config.num_kv_heads)
    model = "hicache-store/mini-llama"
    if config.window_layers:
        listed = ",".join(map(str, config.window_layers))
        model += f"+swa{config.sliding_window}@{listed}"
    return Namespace.create(model, shape, config.dtype, page_size, grid)


def default_setups(
    spec: WorkloadSpec,
    page_size: int,
    *,
    l1_fraction: float,
    l2_fraction: float,
    backend_url: str,
) -> list[TierSetup]:
    """L1 only, L1+L2, L1+L2+L3 with L1 and L2 sized below the working set."""
    working = -(-spec.working_set_tokens // page_size)
    longest = -(-(spec.max_prompt_tokens + spec.answer_tokens) // page_size)
    l1 = max(int(working * l1_fraction), 2 * longest)
    l2 = max(int(working * l2_fraction), longest)
    return [
        TierSetup("L1", l1),
        TierSetup("L1+L2", l1, l2),
        TierSetup("L1+L2+L3", l1, l2, backend_url),
    ]


def run_setup(
    model: MiniLlama,
    spec: WorkloadSpec,
    setup: TierSetup,
    page_size: int,
    tier_options: dict[str, Any],
    progress: Callable[[int], None] | None = None,
) -> SetupResult:
    """Serve the whole workload under one configuration."""
    config = model.config
    pool = DeviceKVPool.for_model(config, num_pages=setup.l1_pages, page_size=page_size)
    backend = open_backend(setup.backend_url) if setup.backend_url else None
    tier = HiCache(
        namespace_for(config, page_size),
        TierConfig(l1_pages=setup.l1_pages, l2_pages=setup.l2_pages, **tier_options),
        pool,
        backend=backend,
    )
    result = SetupResult(setup)

    def step(request: TurnRequest) -> None:
        result.records.append(_serve(model, tier, pool, request))
        _append_answer(model, tier, pool, request)

    result.wall_s = serve_workload(spec, step, tier, backend, progress)
    result.tier_metrics = tier.metrics.to_dict()
    return result


class _Cache(Protocol):
    def flush(self) -> None: ...
    def close(self) -> None: ...


def serve_workload(
    spec: WorkloadSpec,
    step: Callable[[TurnRequest], None],
    cache: _Cache,
    backend: Backend | None,
    progress: Callable[[int], None] | None,
) -> float:
    """Run ``step`` on every request of ``spec`` (inference mode, progress after each), flush
    ``cache``, then close it and ``backend`` (also on error); return the wall seconds."""
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            for i, request in enumerate(generate(spec)):
                step(request)
                if progress is not None:
                    progress(i + 1)
        cache.flush()
    finally:
        cache.close()
        if backend is not None:
            from hicache_store._sync import run_sync

            run_sync(backend.close())
    return time.perf_counter() - started


def _serve(
    model: MiniLlama, tier: HiCache, pool: DeviceKVPool, request: TurnRequest
) -> RequestRecord:
    started = time.perf_counter()
    req = tier.match(request.prompt)
    prep = tier.prepare(req)
    model.prefill(
        torch.tensor(request.prompt[prep.start :]),
        prep.start,
        prep.slots,
        pool,
        wait_layer=prep.wait_layer,
        last_only=True,
    )
    ttft = time.perf_counter() - started
    tier.complete(req)
    return record_of(request, req, tier.namespace.page_size, ttft)


def record_of(request: TurnRequest, req: Request, page_size: int, ttft: float) -> RequestRecord:
    """The record of a served prompt: its prefix split by the tier each page came from."""
    l1 = min(req.l1_pages, req.prefix_pages)
    l2 = min(req.l2_pages, req.prefix_pages - l1)
    l3 = req.prefix_pages - l1 - l2
    return RequestRecord(
        request.conversation,
        request.turn,
        len(request.prompt),
        l1 * page_size,
        l2 * page_size,
        l3 * page_size,
        ttft,
        req.bookkeeping_s,
    )


def _append_answer(
    model: MiniLlama, tier: HiCache, pool: DeviceKVPool, request: TurnRequest
) -> None:
    if not request.answer:
        return
    tokens = request.prompt + request.answer
    req = tier.match(tokens)
    prep = tier.prepare(req)
    model.prefill(
        torch.tensor(tokens[prep.start :]),
        prep.start,
        prep.slots,
        pool,
        wait_layer=prep.wait_layer,
        last_only=True,
    )
    tier.complete(req)


def fresh_directory(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def write_chart(results: list[dict[str, Any]], path: Path) -> None:
    """Two panels: median TTFT per configuration, and token hit rate split by tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["setup"]["name"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [1e3 * r["ttft_median_s"] for r in results], color="#4c72b0")
    left.set_ylabel("median TTFT (ms)")
    left.set_title("Time to first token")
    bottom = [0.0] * len(results)
    for tier_name, color in (("l1", "#55a868"), ("l2", "#c44e52"), ("l3", "#8172b2")):
        values = [100 * r[f"hit_rate_{tier_name}"] for r in results]
        right.bar(names, values, bottom=bottom, color=color, label=tier_name.upper())
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylim(0, 100)
    right.set_ylabel("token hit rate (%)")
    right.set_title("Where prefix tokens came from")
    right.legend()
    fig.suptitle("hicache-store multi-turn benchmark")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
