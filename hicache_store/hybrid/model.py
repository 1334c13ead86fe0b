"""A hybrid mini engine: ``MiniLlama``'s full-attention stack plus one simple recurrent layer.

The recurrent layer is a diagonal linear recurrence (the shape of linear attention / Mamba's
state update, without the gating)::

    h_t = decay * h_{t-1} + u[token_t]          (h_{-1} = 0, elementwise)
    logits_t = llama_logits_t + W_out @ h_t

Its state ``h`` after a prefix is all it needs to resume there: that is the checkpoint component.
Every step is elementwise or one fixed-shape matrix-vector product per token, so resuming from a
restored snapshot computes bit-identical logits to a full recompute (as ``MiniLlama.prefill`` does
for the attention part over a cached KV prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache_store.engine.config import MiniLlamaConfig
from hicache_store.engine.kv_pool import DeviceKVPool
from hicache_store.engine.model import MiniLlama, WaitLayer


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
        return self.base.make_pool(num_pages, page_size)

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
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Compute the suffix over a cached prefix: KV in ``pool`` and the recurrent ``state``
        after ``start_pos`` tokens (None only when ``start_pos == 0``).

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
        logits = self.base.prefill(toks, start_pos, slots, pool, wait_layer)
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
