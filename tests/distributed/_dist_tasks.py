"""Task functions the rank processes run (importable by name: ``RankPool`` pickles them)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from _serve import serve

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.demo.launch import RankContext
from hicache_store.demo.sharded import ShardedEngine
from hicache_store.distributed.cp import CPShardStore
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.plans import plan_reads
from hicache_store.layout.sealing import TenantKey
from hicache_store.layout.topology import Topology
from hicache_store.objects import DEFAULT_IO_TIMEOUT_S, IOStats, L3Link
from hicache_store.tenant import KeyRing
from hicache_store.tier.cache import HiCache
from hicache_store.tier.config import TierConfig


@dataclass(frozen=True)
class Setup:
    """Model, namespace and tier sizes of a scenario (the tiny engine with 4 KV heads)."""

    l3_dir: str
    kv_heads: int = 4
    grid: tuple[int, int] = (2, 2)
    page: int = 4
    l1_pages: int = 20
    l2_pages: int = 30
    prefetch_policy: str = "wait_complete"
    flush_each: bool = True
    sealed: bool = False  # objects sealed with ``key_ring`` (a tenant's AEAD key)

    @property
    def model_config(self) -> MiniLlamaConfig:
        return MiniLlamaConfig(num_heads=4, num_kv_heads=self.kv_heads, dtype="float32")

    @property
    def namespace(self) -> Namespace:
        cfg = self.model_config
        shape = ModelShape.mha(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        return Namespace.create(
            "mini-llama", shape, "float32", self.page, Grid(*self.grid), sealed=self.sealed
        )

    @property
    def key_ring(self) -> KeyRing | None:
        """The tenant's key ring when ``sealed`` (the same secret in every rank process)."""
        return KeyRing((TenantKey(bytes(range(32))),)) if self.sealed else None

    @property
    def tier_config(self) -> TierConfig:
        return TierConfig(
            l1_pages=self.l1_pages,
            l2_pages=self.l2_pages,
            prefetch_threshold_tokens=self.page,
            prefetch_policy=self.prefetch_policy,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class Rogue:
    """How one rank misbehaves (consensus-check tests). ``kind``: ``skip_prefetch_agreement``
    (the plain ``HiCache.prepare``, with a backend whose existence checks fail),
    ``other_prompt`` (prompt ``at`` differs in one token), ``evict_l1`` (drops its L1 before
    request ``at``)."""

    rank: int
    kind: str
    at: int = 0


@dataclass
class Outcome:
    starts: list[int] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    plan_amplification: float = 1.0
    injected: int = 0
    agreements: int = 0


def _model(ctx: RankContext | None, cfg: MiniLlamaConfig) -> MiniLlama:
    if ctx is None:
        return MiniLlama(cfg)
    key = f"model-{cfg}"
    if key not in ctx.scratch:
        ctx.scratch[key] = MiniLlama(cfg)
    model: MiniLlama = ctx.scratch[key]
    return model


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _backend(setup: Setup, faults: FaultConfig | None) -> Backend:
    backend = open_backend(f"file://{setup.l3_dir}")
    return FaultyBackend(backend, faults) if faults is not None else backend


class SkipsPrefetchAgreement:
    """A rank's group that skips the ``prefetch_pages`` agreement (what the tier once did when
    it had no prefetch, a real bug): what the consensus check must catch."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def agree_min(self, value: int, what: str) -> int:
        return value if what == "prefetch_pages" else int(self.inner.agree_min(value, what))


def serve_group(
    ctx: RankContext,
    setup: Setup,
    topology: Topology,
    prompts: list[list[int]],
    faults: dict[int, FaultConfig] | None = None,
    rogue: Rogue | None = None,
) -> Outcome:
    """This rank of a ``topology`` group serves ``prompts`` (fresh L1/L2, shared L3)."""
    model = _model(ctx, setup.model_config)
    fault = (faults or {}).get(ctx.rank)
    group: Any = ctx.group
    if rogue is not None and rogue.rank == ctx.rank and rogue.kind == "skip_prefetch_agreement":
        group = SkipsPrefetchAgreement(ctx.group)
        fault = FaultConfig(read_error_rate=1.0)
    backend = _backend(setup, fault)
    engine = ShardedEngine(
        model,
        setup.namespace,
        topology,
        group,
        setup.tier_config,
        backend=backend,
    )
    out = Outcome()
    try:
        for i, prompt in enumerate(prompts):
            tokens = list(prompt)
            if rogue is not None and rogue.rank == ctx.rank and rogue.at == i:
                if rogue.kind == "other_prompt":
                    tokens[-1] = (tokens[-1] + 1) % setup.model_config.vocab_size
                elif rogue.kind == "evict_l1":
                    engine.tier.evict_device()
            served = engine.serve(tokens)
            expected = model.forward_full(torch.tensor(tokens))[served.start :]
            out.starts.append(served.start)
            out.exact.append(bool(torch.equal(served.logits, expected)))
            out.digests.append(_digest(served.logits))
            engine.tier.check_invariants()
            if setup.flush_each:
                engine.tier.flush()
        engine.tier.flush()
        assert engine.tier.host.used == engine.tier.host_pages_referenced()
    finally:
        engine.close()
        run_sync(backend.close())
    out.metrics = engine.tier.metrics.to_dict()
    out.plan_amplification = plan_reads(setup.namespace, topology, ctx.rank).read_amplification
    if isinstance(backend, FaultyBackend):
        out.injected = sum(backend.injected.values())
    out.agreements = ctx.group.agreements
    return out


def serve_single(ctx: RankContext, setup: Setup, prompts: list[list[int]]) -> Outcome:
    """The single-process reference: one plain ``HiCache`` over the full KV (no group)."""
    model = _model(ctx, setup.model_config)
    backend = _backend(setup, None)
    pool = DeviceKVPool.for_model(model.config, num_pages=setup.l1_pages, page_size=setup.page)
    tier = HiCache(setup.namespace, setup.tier_config, pool, backend=backend, keys=setup.key_ring)
    out = Outcome()
    try:
        for prompt in prompts:
            served = serve(tier, model, prompt)
            expected = model.forward_full(torch.tensor(prompt))[served.start :]
            out.starts.append(served.start)
            out.exact.append(bool(torch.equal(served.logits, expected)))
            out.digests.append(_digest(served.logits))
            if setup.flush_each:
                tier.flush()
        tier.flush()
    finally:
        tier.close()
        run_sync(backend.close())
    out.metrics = tier.metrics.to_dict()
    return out


# -- MLA: one writer, every rank reads ---------------------------------------------------------


def mla_one_writer(ctx: RankContext, l3_dir: str, pages: int) -> dict[str, Any]:
    """A TP group over an MLA namespace: rank 0 alone writes each page's objects through its
    ``L3Link``; after a barrier every rank reads every page back and checks the bytes."""
    shape = ModelShape.mla(4, 32)
    ns = Namespace.create("mini-mla", shape, "float32", 4, Grid(2))
    topology = Topology(tp_size=ctx.size)
    backend = open_backend(f"file://{l3_dir}")
    link = L3Link(backend, ns, topology, ctx.rank, max_inflight_bytes=1 << 24,
                  io_timeout_s=DEFAULT_IO_TIMEOUT_S)
    rng = np.random.default_rng(7)
    size = link.read_plan.bytes_needed
    rows = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(pages)]
    hashes = [f"{i:064x}" for i in range(1, pages + 1)]
    written = 0
    for h, row in zip(hashes, rows, strict=True):
        written += int(run_sync(link.write_page(h, row, IOStats())))
    ctx.group.barrier()
    found = run_sync(link.exists_prefix(hashes))
    agreed = ctx.group.agree_min(found, "mla_pages")
    same = []
    for h, row in zip(hashes[:agreed], rows, strict=True):
        got = np.zeros(size, dtype=np.uint8)
        ok = run_sync(link.read_page(h, got, IOStats()))
        same.append(bool(ok) and bool(np.array_equal(got, row)))
    objects = sorted(run_sync(_list(backend)))
    run_sync(backend.close())
    return {
        "can_write": link.can_write,
        "written": written,
        "agreed": agreed,
        "same": same,
        "objects": len(objects),
    }


async def _list(backend: Backend) -> list[str]:
    return [key async for key in backend.list_prefix("")]


# -- CP: pages restored to their owner ranks ---------------------------------------------------


def cp_restore(ctx: RankContext, setup: Setup, prompt: list[int]) -> dict[str, Any]:
    """A CP group restores ``prompt``'s full pages from L3, each rank only the pages it owns
    (``layout.cp``), checks their placement, gathers the prefix and computes the rest."""
    model = _model(ctx, setup.model_config)
    ns = setup.namespace
    backend = _backend(setup, None)
    full_pages = (len(prompt) - 1) // setup.page
    local_pages = max(1, math.ceil(full_pages / ctx.size))
    pool = DeviceKVPool.for_model(model.config, num_pages=local_pages, page_size=setup.page)
    store = CPShardStore(ns, pool, ctx.group, backend, keys=setup.key_ring)
    try:
        owned = store.restore(prompt, full_pages)
        start = full_pages * setup.page
        # Placement: the owner of logical slot x holds it at local row l (seed 000, 1.1).
        reference = DeviceKVPool.for_model(
            model.config, num_pages=math.ceil(len(prompt) / setup.page), page_size=setup.page
        )
        model.prefill(torch.tensor(prompt), 0, torch.arange(len(prompt)), reference)
        placed = store.check_placement(reference, start)
        scratch = DeviceKVPool.for_model(
            model.config, num_pages=math.ceil(len(prompt) / setup.page), page_size=setup.page
        )
        store.gather_prefix(start, scratch)
        logits = model.prefill(
            torch.tensor(prompt[start:]), start, torch.arange(len(prompt)), scratch
        )
        expected = model.forward_full(torch.tensor(prompt))[start:]
    finally:
        run_sync(backend.close())
    return {
        "owned": owned,
        "placed": placed,
        "start": start,
        "exact": bool(torch.equal(logits, expected)),
    }


def fail_on_rank(ctx: RankContext, failing: int) -> int:
    """``failing`` raises before the agreement its peers wait in (they are stuck there)."""
    if ctx.rank == failing:
        raise RuntimeError(f"rank {failing} failed on purpose")
    return ctx.group.agree_min(ctx.rank, "never_reached_by_all")


# -- hybrid models -----------------------------------------------------------------------------


@dataclass(frozen=True)
class HybridSetup:
    """The hybrid mini engine (layers 1 and 3 sliding-window, a recurrent layer), 4 KV heads;
    KV and window objects of one layer and one head each, so every topology here can write."""

    l3_dir: str | None
    page: int = 4
    l1_pages: int = 24
    l2_pages: int = 32

    @property
    def model_config(self) -> MiniLlamaConfig:
        return MiniLlamaConfig(
            num_heads=4, num_kv_heads=4, dtype="float32", window_layers=(1, 3), sliding_window=6
        )

    @property
    def namespace(self) -> Namespace:
        cfg = self.model_config
        shape = ModelShape.mha(len(cfg.full_layers), cfg.num_kv_heads, cfg.head_dim)
        return Namespace.create("hybrid-ranks", shape, "float32", self.page, Grid(1, 1))

    @property
    def tier_config(self) -> TierConfig:
        return TierConfig(
            l1_pages=self.l1_pages,
            l2_pages=self.l2_pages,
            prefetch_threshold_tokens=self.page,
            prefetch_policy="wait_complete",
        )


@dataclass
class HybridOutcome:
    starts: list[int] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)
    calls: int = 0


def serve_hybrid(
    ctx: RankContext,
    setup: HybridSetup,
    topology: Topology,
    prompts: list[list[int]],
    drops: dict[int, dict[int, list[str]]] | None = None,
) -> HybridOutcome:
    """This rank of a ``topology`` group serves ``prompts`` with the hybrid model (fresh L1/L2;
    the shared L3 when ``setup.l3_dir``). ``drops[i][rank]``: page hashes whose recurrent
    snapshot this rank loses before request ``i`` (its L1 and L2 copies)."""
    from hicache_store.demo.hybrid import HybridMiniLlama

    key = "hybrid-model"
    if key not in ctx.scratch:
        ctx.scratch[key] = HybridMiniLlama(setup.model_config, state_dim=8)
    model: HybridMiniLlama = ctx.scratch[key]
    backend = open_backend(f"file://{setup.l3_dir}") if setup.l3_dir else None
    engine = ShardedEngine(
        model, setup.namespace, topology, ctx.group, setup.tier_config, backend=backend
    )
    out = HybridOutcome()
    try:
        for i, prompt in enumerate(prompts):
            for page_hash in (drops or {}).get(i, {}).get(ctx.rank, []):
                assert engine.tier.drop(page_hash, "recurrent"), "nothing to drop"
            served = engine.serve(prompt)
            expected = model.forward_full(torch.tensor(prompt))[served.start :]
            out.starts.append(served.start)
            out.exact.append(bool(torch.equal(served.logits, expected)))
            out.rounds.append(engine.tier.agreement_rounds)
            engine.tier.flush()
            engine.tier.check_invariants()
        out.extra = dict(engine.tier.metrics.extra)
        out.calls = ctx.group.agreements
    finally:
        engine.close()
        if backend is not None:
            run_sync(backend.close())
    return out
