"""What the hybrid test modules share (imported by file name, like tests/distributed's tasks):
one tier with the hybrid mini engine's window and recurrent components, and a checked request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from _serve import serve_checked

from hicache_store.backends.base import Backend
from hicache_store.demo.hybrid import HybridMiniLlama, RecurrentPool, WindowPool
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.cache import HiCache, Prepared, Request
from hicache_store.tier.config import TierConfig
from hicache_store.tier.group import RankGroup


@dataclass
class Hybrid:
    """A tier and the engine-side pools of its components."""

    tier: HiCache
    model: HybridMiniLlama
    window: WindowPool | None
    recurrent: RecurrentPool

    def serve(
        self,
        tokens: list[int],
        *,
        after_match: Callable[[Request], None] | None = None,
        after_prepare: Callable[[Prepared], None] | None = None,
    ) -> int:
        """Serve one request (the hooks as ``serve_checked``'s), check its logits against a
        full recompute and the tier's bookkeeping; return the reused tokens."""
        return serve_checked(
            self.tier, self.model, tokens, window=self.window, recurrent=self.recurrent,
            after_match=after_match, after_prepare=after_prepare,
        ).start

    def extra(self, name: str) -> float:
        return self.tier.metrics.extra.get(name, 0)

    def close(self) -> None:
        self.tier.close()


def namespace(model: HybridMiniLlama, name: str, page: int) -> Namespace:
    config = model.config
    layers = len(config.full_layers)
    shape = ModelShape.mha(layers, config.num_kv_heads, config.head_dim)
    return Namespace.create(name, shape, config.dtype, page, Grid(layers, config.num_kv_heads))


def make_hybrid(
    model: HybridMiniLlama,
    name: str,
    page: int,
    *,
    backend: Backend | None = None,
    l1: int = 64,
    l2: int = 64,
    snapshot_slots: int = 16,
    snapshot_l2: int = 16,
    window_slots: int = 32,
    window_l2: int = 64,
    every: int = 0,
    group: RankGroup | None = None,
    **config: object,
) -> Hybrid:
    ns = namespace(model, name, page)
    window = None
    if model.config.window_layers:
        window = WindowPool(model.config, ns, window_slots, l2_slots=window_l2 if l2 else 0)
    recurrent = RecurrentPool(
        model.state_dim, ns, snapshot_slots, l2_slots=snapshot_l2 if l2 else 0, every=every
    )
    options: dict[str, object] = {
        "prefetch_policy": "wait_complete",
        "prefetch_threshold_tokens": page,
        **config,
    }
    tier = HiCache(
        ns,
        TierConfig(l1_pages=l1, l2_pages=l2, **options),  # type: ignore[arg-type]
        model.make_pool(l1, page),
        backend=backend,
        group=group,
        components=[c.component for c in (window, recurrent) if c is not None],
    )
    return Hybrid(tier, model, window, recurrent)


def hashes(tokens: list[int], page: int) -> list[str]:
    return page_hashes(torch.tensor(tokens).numpy().astype("<u4"), page)
