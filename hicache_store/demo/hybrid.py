"""A hybrid mini engine and its cache components: ``MiniLlama``'s attention stack plus one
simple recurrent layer, with its sliding-window KV and recurrent checkpoints plugged into the
tier as components (``tier.components``). Demo and test harness: the library's core never
imports it.

The recurrent layer is a diagonal linear recurrence (the shape of linear attention / Mamba's
state update, without the gating)::

    h_t = decay * h_{t-1} + u[token_t]          (h_{-1} = 0, elementwise)
    logits_t = llama_logits_t + W_out @ h_t

Its state ``h`` after a prefix is all it needs to resume there: the checkpoint component
(``RecurrentPool``: one state vector per snapshot, replicated on every rank, written by rank 0).
Every step is elementwise or one fixed-shape matrix-vector product per token, so resuming from
a restored snapshot computes bit-identical logits to a full recompute.

Sliding-window layers come from the config (``window_layers``, ``sliding_window``): their KV is
the window component (``WindowPool``: one page of K and V of every window layer per object, on
the KV grid of its own namespace). Resuming after ``s`` tokens needs the window layers' KV of
tokens ``(s - sliding_window, s)`` only. The model computes over a per-sequence ``WindowKV``;
the pool copies restored pages into it before ``prefill`` and the new pages out of it after.

``serve`` runs one request through a tier with these components in the documented call order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama, WaitLayer, WindowKV
from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Shard, Topology, shard_of
from hicache_store.tier.cache import HiCache, Prepared, Request
from hicache_store.tier.components import (
    RECURRENT_TAG,
    WINDOW_TAG,
    Component,
    ComponentSpec,
    HitRule,
    Placement,
    component_namespace,
)
from hicache_store.tier.hints import RequestHints

#: component tags of the hybrid model's objects (``_C1``, ``_C2`` in keys): WINDOW_TAG and
#: RECURRENT_TAG, from the one table of tags (``tier.components.TAGS``).


class WindowPool:
    """The sliding-window layers' KV as a tier component: ``slots`` pages of K and V of this
    rank's shard of the window layers (all of them on one rank), on the KV grid ``grid`` of the
    component's own namespace. Copies pages between its slots and a sequence's ``WindowKV``."""

    def __init__(
        self,
        config: MiniLlamaConfig,
        model_namespace: Namespace,
        slots: int,
        *,
        l2_slots: int = 0,
        grid: Grid | None = None,
        topology: Topology | None = None,
        rank: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        layers = len(config.window_layers)
        if not layers:
            raise ValueError("the model has no sliding-window layers")
        page = model_namespace.page_size
        shape = ModelShape.mha(layers, config.num_kv_heads, config.head_dim)
        self.namespace = component_namespace(
            model_namespace, "window", shape, config.dtype, grid or Grid(layers, config.num_kv_heads)
        )
        self.shard: Shard = shard_of(self.namespace, topology or Topology(), rank)
        rows = slots * page
        dtype = config.torch_dtype
        self.k = [
            torch.zeros(rows, self.shard.num_heads, config.head_dim, dtype=dtype, device=device)
            for _ in range(self.shard.num_layers)
        ]
        self.v = [torch.zeros_like(b) for b in self.k]
        spec = ComponentSpec(
            "window", WINDOW_TAG, HitRule.WINDOW, window_tokens=max(1, config.sliding_window - 1)
        )
        self.page_size = page
        self.component = Component(
            spec, self.namespace, DevicePool.mha(self.k, self.v), slots, l2_slots, Placement.GRID
        )

    def _rows(self, index: int) -> slice:
        return slice(index * self.page_size, (index + 1) * self.page_size)

    def restore(self, window: WindowKV, restored: Sequence[tuple[int, int]]) -> None:
        """Copy restored pages (page index, slot) into ``window`` (this rank's shard)."""
        heads = slice(self.shard.head_start, self.shard.head_stop)
        layers = range(self.shard.layer_start, self.shard.layer_stop)
        for index, slot in restored:
            for i, layer in enumerate(layers):
                window.k[layer, self._rows(index), heads] = self.k[i][self._rows(slot)]
                window.v[layer, self._rows(index), heads] = self.v[i][self._rows(slot)]

    def capture(self, window: WindowKV, produce: Sequence[tuple[int, int]]) -> None:
        """Copy the request's new pages (page index, slot) out of ``window`` into the slots."""
        heads = slice(self.shard.head_start, self.shard.head_stop)
        layers = range(self.shard.layer_start, self.shard.layer_stop)
        for index, slot in produce:
            for i, layer in enumerate(layers):
                self.k[i][self._rows(slot)] = window.k[layer, self._rows(index), heads]
                self.v[i][self._rows(slot)] = window.v[layer, self._rows(index), heads]


class RecurrentPool:
    """Recurrent-state checkpoints as a tier component: ``slots`` snapshots of ``state_dim``
    float32 channels, one per object (namespace page size 1), held whole by every rank and
    written by rank 0 (``Placement.REPLICATED``). ``every``: also checkpoint every that many
    pages of a computed range."""

    def __init__(
        self,
        state_dim: int,
        model_namespace: Namespace,
        slots: int,
        *,
        l2_slots: int = 0,
        every: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.namespace = component_namespace(
            model_namespace,
            "recurrent",
            ModelShape.mla(1, state_dim),
            "float32",
            Grid(1, 1),
            page_size=1,
        )
        self.states = torch.zeros(slots, 1, state_dim, dtype=torch.float32, device=device)
        self.component = Component(
            ComponentSpec("recurrent", RECURRENT_TAG, HitRule.CHECKPOINT),
            self.namespace,
            DevicePool.mla([self.states]),
            slots,
            l2_slots,
            Placement.REPLICATED,
            checkpoint_every=every,
        )

    def state(self, slot: int) -> torch.Tensor:
        return self.states[slot, 0].clone()

    def store(self, slot: int, state: torch.Tensor) -> None:
        self.states[slot, 0] = state.to(self.states.device, torch.float32)


@dataclass(frozen=True)
class Served:
    """One request's outcome: the suffix's logits, where computation started, the request and
    what ``prepare`` decided."""

    logits: torch.Tensor
    start: int
    request: Request
    prepared: Prepared
    draft_logits: torch.Tensor | None = None


def serve(
    tier: HiCache,
    model: MiniLlama | HybridMiniLlama,
    tokens: Sequence[int],
    *,
    window: WindowPool | None = None,
    recurrent: RecurrentPool | None = None,
    draft: tuple[MiniLlama, DeviceKVPool] | None = None,
    need: Collection[str] | None = None,
    hints: RequestHints | None = None,
    after_match: Callable[[Request], None] | None = None,
    after_prepare: Callable[[Prepared], None] | None = None,
) -> Served:
    """One request through ``tier`` and ``model`` in the documented call order: match
    (``need``: the components to resume with, default all; ``hints``: the request's hints),
    prepare, restore the components
    into the model's inputs, prefill the suffix over ``tier.pool`` (and a sidecar draft
    model's, on the draft pool at the same slots), capture the new snapshots and window pages
    into their slots, complete. ``after_match(request)`` and ``after_prepare(prepared)`` run
    between the phases (a caller's way in: to time them, let a prefetch run, look at the
    tier's accounting)."""
    toks = list(tokens)
    req = tier.match(toks, need=need, hints=hints)
    if after_match is not None:
        after_match(req)
    prep = tier.prepare(req)
    if after_prepare is not None:
        after_prepare(prep)
    logits, _ = prefill_prepared(
        model,
        tier.pool,  # type: ignore[arg-type]
        toks,
        prep,
        tier.namespace.page_size,
        window=window,
        recurrent=recurrent,
    )
    draft_logits = None
    if draft is not None:
        draft_model, draft_pool = draft
        draft_logits = draft_model.prefill(
            torch.tensor(toks[prep.start :]), prep.start, prep.slots, draft_pool
        )
    tier.complete(req)
    return Served(logits, prep.start, req, prep, draft_logits)


def prefill_prepared(
    model: MiniLlama | HybridMiniLlama,
    pool: DeviceKVPool,
    tokens: Sequence[int],
    prep: Prepared,
    page_size: int,
    *,
    window: WindowPool | None = None,
    recurrent: RecurrentPool | None = None,
    buffer: WindowKV | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Compute ``tokens[prep.start:]`` as ``prep`` decided: restore the window pages into
    ``buffer`` (the sequence's ``WindowKV``; a fresh one when None) and the recurrent snapshot
    at ``prep.start``, prefill, then store the snapshots and capture the window pages the tier
    asked for into their slots. Returns the suffix's logits and the recurrent state after the
    last token (None for a ``MiniLlama``)."""
    page = page_size
    if buffer is None and model.config.window_layers:
        buffer = WindowKV.zeros(model.config, len(tokens), model.device)
    win = prep.components.get("window")
    if window is not None and win is not None and buffer is not None:
        window.restore(buffer, win.restored)
    suffix = torch.tensor(list(tokens[prep.start :]), dtype=torch.int64)
    final = None
    if isinstance(model, HybridMiniLlama):
        state = None
        snapshot_at: tuple[int, ...] = ()
        rec = prep.components.get("recurrent")
        if recurrent is not None and rec is not None:
            if prep.start:
                (last,) = [slot for index, slot in rec.restored if (index + 1) * page == prep.start]
                state = recurrent.state(last)
            snapshot_at = tuple((index + 1) * page for index, _ in rec.produce)
        logits, final, snaps = model.prefill(
            suffix,
            prep.start,
            prep.slots,
            pool,
            state,
            wait_layer=prep.wait_layer,
            snapshot_at=snapshot_at,
            window=buffer,
        )
        if recurrent is not None and rec is not None:
            for index, slot in rec.produce:
                recurrent.store(slot, snaps[(index + 1) * page])
    else:
        logits = model.prefill(suffix, prep.start, prep.slots, pool, prep.wait_layer, window=buffer)
    if window is not None and win is not None and buffer is not None:
        window.capture(buffer, win.produce)
    return logits, final


class HybridMiniLlama:
    """``MiniLlama`` plus a recurrent layer of ``state_dim`` channels (float32 state)."""

    def __init__(
        self, config: MiniLlamaConfig, *, state_dim: int = 16, device: torch.device | str = "cpu"
    ) -> None:
        if state_dim <= 0:
            raise ValueError("state_dim must be positive")
        self.base = MiniLlama(config, device)
        self.config = config
        self.device = self.base.device
        self.state_dim = state_dim
        gen = torch.Generator(device="cpu").manual_seed(config.seed + 7919)
        self.decay = (0.5 + 0.45 * torch.rand(state_dim, generator=gen)).to(self.device)
        self.u = torch.randn(config.vocab_size, state_dim, generator=gen).to(self.device)
        self.w_out = (0.3 * torch.randn(config.vocab_size, state_dim, generator=gen)).to(
            self.device
        )

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.state_dim,)

    @property
    def state_dtype(self) -> torch.dtype:
        return torch.float32

    def initial_state(self) -> torch.Tensor:
        return torch.zeros(self.state_dim, dtype=torch.float32, device=self.device)

    def make_pool(self, num_pages: int, page_size: int) -> DeviceKVPool:
        """The device pool of the full-attention layers."""
        return self.base.make_pool(num_pages, page_size)

    def new_window(self, length: int) -> WindowKV | None:
        """A zeroed window KV buffer for a sequence of ``length`` tokens (None without window
        layers)."""
        if not self.config.window_layers:
            return None
        return WindowKV.zeros(self.config, length, self.device)

    def forward_full(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Reference logits ``[T, vocab]`` from the start of ``tokens``."""
        toks = torch.as_tensor(tokens, dtype=torch.int64)
        logits = self.base.forward_full(toks)
        out, _, _ = self._recur(toks, 0, self.initial_state(), logits, ())
        return out

    def prefill(
        self,
        tokens: torch.Tensor | Sequence[int],
        start_pos: int,
        slots: torch.Tensor | Sequence[int],
        pool: DeviceKVPool,
        state: torch.Tensor | None,
        *,
        wait_layer: WaitLayer | None = None,
        snapshot_at: Sequence[int] = (),
        window: WindowKV | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Compute the suffix over a cached prefix: KV in ``pool``, the window layers' KV in
        ``window`` (required with window layers, see ``MiniLlama.prefill``) and the recurrent
        ``state`` after ``start_pos`` tokens (None only when ``start_pos == 0``).

        Returns the suffix's logits (bit-identical to those rows of ``forward_full``), the state
        after the last token, and the state after each position ``p`` of ``snapshot_at`` with
        ``start_pos < p <= start_pos + len(tokens)`` (a prefix of ``p`` tokens).
        """
        toks = torch.as_tensor(tokens, dtype=torch.int64)
        if state is None:
            if start_pos:
                raise ValueError("resuming after a prefix needs the recurrent state there")
            state = self.initial_state()
        if tuple(state.shape) != self.state_shape:
            raise ValueError(f"state of shape {tuple(state.shape)}, expected {self.state_shape}")
        logits = self.base.prefill(toks, start_pos, slots, pool, wait_layer, window=window)
        return self._recur(toks, start_pos, state, logits, snapshot_at)

    def _recur(
        self,
        toks: torch.Tensor,
        start_pos: int,
        state: torch.Tensor,
        logits: torch.Tensor,
        snapshot_at: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        wanted = set(snapshot_at)
        snaps: dict[int, torch.Tensor] = {}
        h = state.to(device=self.device, dtype=torch.float32).clone()
        rows = []
        with torch.no_grad():
            for i, token in enumerate(toks.tolist()):
                h = self.decay * h + self.u[token]
                rows.append(torch.mv(self.w_out, h))
                if start_pos + i + 1 in wanted:
                    snaps[start_pos + i + 1] = h.clone()
            extra = torch.stack(rows).to(logits.dtype)
        return logits + extra, h, snaps
