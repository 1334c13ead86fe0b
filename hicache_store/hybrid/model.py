"""A hybrid mini engine: ``MiniLlama``'s full-attention stack plus one simple recurrent layer.

The recurrent layer is a diagonal linear recurrence (the shape of linear attention / Mamba's
state update, without the gating)::

    h_t = decay * h_{t-1} + u[token_t]          (h_{-1} = 0, elementwise)
    logits_t = llama_logits_t + W_out @ h_t

Its state ``h`` after a prefix is all it needs to resume there: that is the checkpoint component.
Every step is elementwise or one fixed-shape matrix-vector product per token, so resuming from a
restored snapshot computes bit-identical logits to a full recompute (as ``MiniLlama.prefill`` does
for the attention part over a cached KV prefix).

Sliding-window layers come from the config (``window_layers``, ``sliding_window``): their KV is the
``window`` component (``window_component``), one object per page holding that page's K and V of
every window layer, ``[window layers, 2 (K, V), page_size, kv_heads, head_dim]`` in the model
dtype (layer-major, so each layer is one checksummed block in L3). Resuming after ``s`` tokens
needs the window layers' KV of tokens ``(s - sliding_window, s)`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache_store.engine.config import MiniLlamaConfig
from hicache_store.engine.kv_pool import DeviceKVPool
from hicache_store.engine.model import MiniLlama, WaitLayer, WindowKV

from .components import ComponentSpec, HitRule

#: the component tag of sliding-window KV objects (``_C1`` in keys).
WINDOW_COMPONENT = 1


@dataclass(frozen=True)
class WindowComponent:
    """The sliding-window KV component of a model: its spec and the shape of one page object."""

    spec: ComponentSpec
    page_shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, config: MiniLlamaConfig, page_size: int) -> WindowComponent | None:
        """The component of ``config``'s window layers (None without any)."""
        if not config.window_layers:
            return None
        # Query t sees keys (t - W, t]: resuming at s needs the W - 1 tokens before s.
        spec = ComponentSpec(
            "window",
            WINDOW_COMPONENT,
            HitRule.WINDOW,
            num_layers=len(config.window_layers),
            window_tokens=max(1, config.sliding_window - 1),
        )
        shape = (len(config.window_layers), 2, page_size, config.num_kv_heads, config.head_dim)
        return cls(spec, shape, config.torch_dtype)

    def buffer(self, length: int, device: torch.device | str = "cpu") -> WindowKV:
        """A zeroed ``WindowKV`` for a sequence of ``length`` tokens."""
        layers, _, _, heads, dim = self.page_shape
        k = torch.zeros(layers, length, heads, dim, dtype=self.dtype, device=device)
        return WindowKV(k, torch.zeros_like(k))

    def page(self, window: WindowKV, index: int) -> torch.Tensor:
        """Page ``index`` of a sequence's window KV as one object tensor (a copy)."""
        size = self.page_shape[2]
        rows = slice(index * size, (index + 1) * size)
        return torch.stack((window.k[:, rows], window.v[:, rows]), dim=1)

    def put_page(self, window: WindowKV, index: int, obj: torch.Tensor) -> None:
        """Write an object tensor back into rows of page ``index`` of ``window``."""
        size = self.page_shape[2]
        rows = slice(index * size, (index + 1) * size)
        window.k[:, rows] = obj[:, 0]
        window.v[:, rows] = obj[:, 1]


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

    def window_component(self, page_size: int) -> WindowComponent | None:
        return WindowComponent.of(self.config, page_size)

    def new_window(self, length: int) -> WindowKV | None:
        """A zeroed window KV buffer for a sequence of ``length`` tokens (None without window
        layers)."""
        component = self.window_component(1)
        return None if component is None else component.buffer(length, self.device)

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
