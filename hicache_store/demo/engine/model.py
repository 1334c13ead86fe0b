"""``MiniLlama``: a small Llama-style decoder that computes prefill over a paged KV pool.

Architecture (per layer): RMSNorm -> fused Q/K/V projection -> RoPE (rotate-half, as Llama) ->
grouped-query causal attention -> O projection -> residual; RMSNorm -> SwiGLU MLP -> residual.
Then a final RMSNorm and an untied LM head. Weights are random, drawn on the CPU from a
``torch.Generator`` seeded with ``config.seed`` (the same config gives the same weights on any
device) and scaled so activations stay O(1) and logits are roughly standard normal.

Two entry points share one implementation:

* ``forward_full(tokens)``: the reference. No pool; every position is recomputed.
* ``prefill(tokens, start_pos, slots, pool, wait_layer)``: the engine path. The KV of positions
  ``[0, start_pos)`` is already in ``pool`` at ``slots[:start_pos]`` (put there by an earlier
  prefill or restored by the cache tier, possibly into different pages); only the suffix is
  computed, its KV written to ``slots[start_pos:]``, and attention runs over cached + new KV.

Exactness: **bit-exact**, in float32, bfloat16 and float16. ``prefill`` over a cached prefix
returns logits ``torch.equal`` to the corresponding rows of ``forward_full`` of the whole
sequence (same config, device, torch build and intra-op thread count), whatever chunking
produced the prefix KV and whichever slots or pool hold it: rows are computed in blocks of
``config.compute_block`` tokens aligned to absolute positions, so every op sees the same shapes
in both paths (why that suffices: docs/design/mini-engine.md). Across devices, torch builds or
thread counts only rounding-level agreement is promised.

Sliding-window layers (``config.window_layers``) mask keys at or before ``t - sliding_window``
for query ``t``; their K/V live not in the device pool but in a ``WindowKV`` the caller passes to
``prefill``, where only the prefix's last ``sliding_window`` rows must be valid.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool

#: signature of the per-layer hook: called with the layer index before that layer reads the pool.
WaitLayer = Callable[[int], None]


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(heads + 2*kv_heads) * head_dim, hidden]
    wo: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]


class _LayerKV(abc.ABC):
    """Where a layer's K/V come from and go to: local tensors (reference) or the pool."""

    @abc.abstractmethod
    def exchange(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new rows' K/V ``[T_new, kv_heads, head_dim]``; return K and V of positions
        ``[0, end)`` as ``[end, kv_heads, head_dim]`` in the model dtype."""


class _LocalKV(_LayerKV):
    def exchange(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return k_new, v_new


class _PoolKV(_LayerKV):
    def __init__(
        self,
        pool: DeviceKVPool,
        slots: torch.Tensor,
        start_pos: int,
        wait_layer: WaitLayer | None,
    ) -> None:
        self.pool = pool
        self.all_slots = slots
        self.new_slots = slots[start_pos:]
        self.wait_layer = wait_layer

    def exchange(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.wait_layer is not None:
            self.wait_layer(layer)
        k_buf = self.pool.k_buffers[layer]
        v_buf = self.pool.v_buffers[layer]
        k_buf.index_copy_(0, self.new_slots, k_new)
        v_buf.index_copy_(0, self.new_slots, v_new)
        return k_buf.index_select(0, self.all_slots), v_buf.index_select(0, self.all_slots)


class WindowKV:
    """The sliding-window layers' K and V of one sequence, outside the device pool.

    ``k`` and ``v``: ``[num_window_layers, length, kv_heads, head_dim]`` in the model dtype, row
    ``p`` holding position ``p`` (window layers in ``config.window_layers`` order). Before a
    ``prefill(tokens, start_pos, ...)`` the rows ``[start_pos - sliding_window, start_pos)`` must
    hold the prefix's K/V (a cache restores them); ``prefill`` writes rows ``[start_pos, end)``.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device or k.dim() != 4:
            raise ValueError(
                f"k and v must be 4-D tensors of one shape, dtype and device, got "
                f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
        self.k = k
        self.v = v

    @classmethod
    def zeros(
        cls, config: MiniLlamaConfig, length: int, device: torch.device | str = "cpu"
    ) -> WindowKV:
        shape = (len(config.window_layers), length, config.num_kv_heads, config.head_dim)
        k = torch.zeros(shape, dtype=config.torch_dtype, device=device)
        return cls(k, torch.zeros_like(k))

    @property
    def length(self) -> int:
        return int(self.k.shape[1])


class _SplitKV(_LayerKV):
    """Full-attention layers through ``_PoolKV`` (pool layer = rank among full layers), window
    layers through a ``WindowKV``."""

    def __init__(
        self, config: MiniLlamaConfig, pool_kv: _PoolKV, window: WindowKV, start_pos: int
    ) -> None:
        self.pool_kv = pool_kv
        self.window = window
        self.start_pos = start_pos
        self.pool_index = {layer: i for i, layer in enumerate(config.full_layers)}
        self.window_index = {layer: i for i, layer in enumerate(config.window_layers)}

    def exchange(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.pool_index:
            return self.pool_kv.exchange(self.pool_index[layer], k_new, v_new)
        i = self.window_index[layer]
        end = self.start_pos + k_new.shape[0]
        self.window.k[i, self.start_pos : end] = k_new
        self.window.v[i, self.start_pos : end] = v_new
        return self.window.k[i, :end], self.window.v[i, :end]


class MiniLlama:
    """A seeded random-weight Llama-style decoder (see the module docstring for the contract).

    ``config``: the hyper-parameters; ``device``: where weights live and compute runs. The model
    is stateless between calls (all KV state is in the caller's pool), so one model may serve
    prefills for any number of pools; calls from several threads are safe as long as they write
    disjoint slots.
    """

    def __init__(self, config: MiniLlamaConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        cfg = config
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        dtype = cfg.torch_dtype

        def normal(*shape: int, std: float) -> torch.Tensor:
            w = torch.randn(shape, generator=gen, dtype=torch.float32) * std
            return w.to(device=self.device, dtype=dtype)

        def norm_weight() -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(cfg.hidden_size, generator=gen, dtype=torch.float32)
            return w.to(device=self.device, dtype=dtype)

        hidden, head_dim = cfg.hidden_size, cfg.head_dim
        q_dim = cfg.num_heads * head_dim
        kv_dim = cfg.num_kv_heads * head_dim
        residual_scale = 1.0 / math.sqrt(2.0 * cfg.num_layers)
        self.embed = normal(cfg.vocab_size, hidden, std=1.0)
        self.layers: list[_Layer] = [
            _Layer(
                attn_norm=norm_weight(),
                wqkv=normal(q_dim + 2 * kv_dim, hidden, std=hidden**-0.5),
                wo=normal(hidden, q_dim, std=q_dim**-0.5 * residual_scale),
                mlp_norm=norm_weight(),
                w_gate_up=normal(2 * cfg.intermediate_size, hidden, std=hidden**-0.5),
                w_down=normal(
                    hidden, cfg.intermediate_size, std=cfg.intermediate_size**-0.5 * residual_scale
                ),
            )
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = norm_weight()
        self.lm_head = normal(cfg.vocab_size, hidden, std=hidden**-0.5)

        self._inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / float(head_dim))
        )
        self._rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        block = cfg.compute_block
        # Which of its own block's keys a query row may see (True: key column c <= row r).
        self._tail_mask = torch.ones(block, block, dtype=torch.bool).tril().to(self.device)

    # -- public API ----------------------------------------------------------------------------

    def make_pool(self, num_pages: int, page_size: int) -> DeviceKVPool:
        """A ``DeviceKVPool`` with this model's KV geometry and dtype, on its device."""
        return DeviceKVPool.for_model(
            self.config, num_pages=num_pages, page_size=page_size, device=self.device
        )

    def forward_full(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Reference logits ``[T, vocab]`` (model dtype) for every position of ``tokens``.

        Plain causal attention over the sequence's own K/V; no pool involved.
        """
        toks = self._check_tokens(tokens)
        with torch.no_grad():
            return self._forward(toks, 0, _LocalKV(), last_only=False)

    def prefill(
        self,
        tokens: torch.Tensor | Sequence[int],
        start_pos: int,
        slots: torch.Tensor | Sequence[int],
        pool: DeviceKVPool,
        wait_layer: WaitLayer | None = None,
        *,
        last_only: bool = False,
        window: WindowKV | None = None,
    ) -> torch.Tensor:
        """Compute the suffix ``tokens`` (positions ``start_pos .. start_pos+T_new-1``) over the
        cached prefix in ``pool``; return logits ``[T_new, vocab]`` (``[1, vocab]`` for the last
        position only when ``last_only``), bit-identical to those rows of ``forward_full``.

        Preconditions (``ValueError`` naming the argument otherwise): ``tokens`` is a non-empty
        1-D integer sequence of ids in ``[0, vocab)``; ``start_pos >= 0``; ``slots`` is a 1-D
        integer sequence of exactly ``start_pos + T_new`` distinct slot indices in
        ``[0, pool.num_slots)``; ``pool`` has this model's layers, KV heads, head dim, dtype and
        device. The KV of position ``p < start_pos`` must already be at ``slots[p]`` (not checked:
        that is the cache tier's contract).

        Effects: for every pool layer, the suffix's K/V are written to ``slots[start_pos:]``;
        nothing else in the pool is written.

        Sliding-window layers (a config with ``window_layers``; ``window`` is then required and
        must cover ``start_pos + T_new`` rows): their prefix K/V are read from ``window`` (only
        the last ``sliding_window`` rows before ``start_pos`` matter) and the suffix's written
        into it; the pool holds the full-attention layers only.

        ``wait_layer(i)`` is called exactly once per pool layer, in order ``0 .. pool layers-1``
        (also when ``start_pos == 0``), after that layer's Q/K/V projections of the suffix and
        before it first touches the pool (reads or writes). A cache tier loading the prefix layer
        by layer passes its handle's ``wait`` here so compute on layer ``i`` overlaps the transfer
        of later layers. An exception from ``wait_layer`` propagates; the suffix slots of layers
        before ``i`` then hold new KV and the rest are untouched.
        """
        toks = self._check_tokens(tokens)
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos must be a non-negative int, got {start_pos!r}")
        self._check_pool(pool)
        slot_t = self._check_slots(slots, start_pos + toks.numel(), pool)
        pool_kv = _PoolKV(pool, slot_t, start_pos, wait_layer)
        kv: _LayerKV = pool_kv
        if self.config.window_layers:
            self._check_window(window, start_pos + toks.numel())
            assert window is not None
            kv = _SplitKV(self.config, pool_kv, window, start_pos)
        elif window is not None:
            raise ValueError("window: this model has no sliding-window layers")
        with torch.no_grad():
            return self._forward(toks, start_pos, kv, last_only=last_only)

    # -- validation ----------------------------------------------------------------------------

    def _check_tokens(self, tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):
            if (
                tokens.dtype.is_floating_point
                or tokens.dtype.is_complex
                or tokens.dtype == torch.bool
            ):
                raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
            toks = tokens
        else:
            toks = torch.as_tensor(tokens, dtype=torch.int64)
        if toks.dim() != 1 or toks.numel() == 0:
            raise ValueError(
                f"tokens must be a non-empty 1-D sequence, got shape {tuple(toks.shape)}"
            )
        lo, hi = int(toks.min()), int(toks.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"tokens: id {bad} out of range [0, {self.config.vocab_size})")
        return toks.to(device=self.device, dtype=torch.int64)

    def _check_window(self, window: WindowKV | None, length: int) -> None:
        cfg = self.config
        if window is None:
            raise ValueError("window: a model with sliding-window layers needs a WindowKV")
        expected = (len(cfg.window_layers), cfg.num_kv_heads, cfg.head_dim, cfg.torch_dtype)
        actual = (window.k.shape[0], window.k.shape[2], window.k.shape[3], window.k.dtype)
        if expected != actual or window.k.device != self.device:
            raise ValueError(
                "window does not match the model: (window layers, kv_heads, head_dim, dtype) is "
                f"{actual} on {window.k.device}, expected {expected} on {self.device}"
            )
        if window.length < length:
            raise ValueError(f"window: {window.length} rows, the sequence needs {length}")

    def _check_pool(self, pool: DeviceKVPool) -> None:
        cfg = self.config
        expected = (
            len(cfg.full_layers),
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.torch_dtype,
            self.device,
        )
        actual = (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype, pool.device)
        if expected != actual:
            raise ValueError(
                "pool does not match the model: (layers, kv_heads, head_dim, dtype, device) is "
                f"{actual}, expected {expected}"
            )

    @staticmethod
    def _check_slots(
        slots: torch.Tensor | Sequence[int], expected_len: int, pool: DeviceKVPool
    ) -> torch.Tensor:
        if isinstance(slots, torch.Tensor):
            if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
                raise ValueError(f"slots must be an integer tensor, got dtype {slots.dtype}")
            slot_t = slots
        else:
            slot_t = torch.as_tensor(slots, dtype=torch.int64)
        if slot_t.dim() != 1 or slot_t.numel() != expected_len:
            raise ValueError(
                f"slots must be 1-D of length start_pos + len(tokens) = {expected_len}, "
                f"got shape {tuple(slot_t.shape)}"
            )
        lo, hi = int(slot_t.min()), int(slot_t.max())
        if lo < 0 or hi >= pool.num_slots:
            bad = lo if lo < 0 else hi
            raise ValueError(f"slots: slot {bad} out of range [0, {pool.num_slots})")
        if torch.unique(slot_t).numel() != expected_len:
            raise ValueError("slots: slot indices must be distinct")
        return slot_t.to(device=pool.device, dtype=torch.int64)

    # -- computation ---------------------------------------------------------------------------

    def _rope_block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE factors for the positions of ``block``: ``cos`` and signed ``sin``, each
        ``[B, 1, head_dim]`` in the model dtype, such that
        ``rope(x) = x * cos + roll(x, head_dim/2) * sin`` (Llama's rotate-half form: the first half
        of ``sin`` is negated). Computed on the CPU from absolute positions, then moved."""
        cached = self._rope_cache.get(block)
        if cached is None:
            size = self.config.compute_block
            pos = torch.arange(block * size, (block + 1) * size, dtype=torch.float32)
            angles = pos[:, None] * self._inv_freq[None, :]
            cos, sin = angles.cos(), angles.sin()
            dtype = self.config.torch_dtype
            cos_full = torch.cat((cos, cos), dim=-1)[:, None, :]
            sin_signed = torch.cat((-sin, sin), dim=-1)[:, None, :]
            cached = self._rope_cache.setdefault(
                block,
                (
                    cos_full.to(device=self.device, dtype=dtype),
                    sin_signed.to(device=self.device, dtype=dtype),
                ),
            )
        return cached

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of ``x [B, heads, head_dim]`` with factors from ``_rope_block``."""
        return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_eps)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, window: int = 0
    ) -> torch.Tensor:
        """Causal GQA of one block's queries ``q [B, heads, head_dim]`` over keys
        ``[0, (block+1)*B)`` of ``k``/``v`` (``[kv_heads, >= (block+1)*B, head_dim]``, model
        dtype, zero past the sequence end). Returns ``[B, heads*head_dim]`` in the model dtype.
        ``window > 0``: query ``t`` sees only keys ``(t - window, t]`` (same call, same shapes:
        a narrower mask, so the masked keys' values never matter).

        One ``scaled_dot_product_attention`` call whose shapes depend only on ``block`` (the fused
        CPU kernel accumulates in float32 and splits queries and keys by size, so fixed shapes mean
        fixed arithmetic). Query head ``h`` reads KV head ``h // group_size``.
        """
        size = self.config.compute_block
        keys = (block + 1) * size
        mask = torch.ones(size, keys, dtype=torch.bool, device=self.device)
        mask[:, keys - size :] = self._tail_mask
        if window:
            query_pos = torch.arange(block * size, keys, device=self.device)[:, None]
            key_pos = torch.arange(keys, device=self.device)[None, :]
            mask &= key_pos > query_pos - window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k[None, :, :keys],
            v[None, :, :keys],
            attn_mask=mask,
            enable_gqa=True,
        )  # [1, heads, B, head_dim]
        return out[0].transpose(0, 1).reshape(size, -1)

    def _forward(
        self, tokens: torch.Tensor, start_pos: int, kv: _LayerKV, *, last_only: bool
    ) -> torch.Tensor:
        cfg = self.config
        size = cfg.compute_block
        n_new = tokens.numel()
        end = start_pos + n_new
        first_block, last_block = start_pos // size, -(-end // size)
        n_blocks = last_block - first_block
        lead = start_pos - first_block * size  # padding rows before the first new token
        valid = slice(lead, lead + n_new)
        last_row = lead + n_new - 1  # row of the last new token in the padded rows
        q_dim = cfg.num_heads * cfg.head_dim
        kv_dim = cfg.num_kv_heads * cfg.head_dim

        hidden = torch.zeros(
            n_blocks * size, cfg.hidden_size, dtype=cfg.torch_dtype, device=self.device
        )
        hidden[valid] = self.embed.index_select(0, tokens)
        blocks = hidden.view(n_blocks, size, cfg.hidden_size)
        ropes = [self._rope_block(first_block + j) for j in range(n_blocks)]
        # Padded K/V of positions [0, last_block*size): [kv_heads, positions, head_dim].
        k_all = torch.zeros(
            cfg.num_kv_heads,
            last_block * size,
            cfg.head_dim,
            dtype=cfg.torch_dtype,
            device=self.device,
        )
        v_all = torch.zeros_like(k_all)

        heads = cfg.num_heads + cfg.num_kv_heads  # query and key heads, rotated together
        windows = [cfg.sliding_window if kind == "window" else 0 for kind in cfg.layer_kinds]
        for index, layer in enumerate(self.layers):
            queries: list[torch.Tensor] = []
            k_rows = torch.empty(
                n_blocks * size,
                cfg.num_kv_heads,
                cfg.head_dim,
                dtype=cfg.torch_dtype,
                device=self.device,
            )
            v_rows = torch.empty_like(k_rows)
            for j in range(n_blocks):
                cos, sin = ropes[j]
                qkv = F.linear(self._rms_norm(blocks[j], layer.attn_norm), layer.wqkv)
                qk = self._rotate(
                    qkv[:, : q_dim + kv_dim].view(size, heads, cfg.head_dim), cos, sin
                )
                queries.append(qk[:, : cfg.num_heads])
                rows = slice(j * size, (j + 1) * size)
                k_rows[rows] = qk[:, cfg.num_heads :]
                v_rows[rows] = qkv[:, q_dim + kv_dim :].view(size, cfg.num_kv_heads, cfg.head_dim)
            k_seq, v_seq = kv.exchange(index, k_rows[valid], v_rows[valid])
            k_all[:, :end] = k_seq.transpose(0, 1)
            v_all[:, :end] = v_seq.transpose(0, 1)
            # With last_only, the last layer's output matters only for the last token's block.
            finishing = range(n_blocks)
            if last_only and index == cfg.num_layers - 1:
                finishing = range(last_row // size, last_row // size + 1)
            for j in finishing:
                x = blocks[j]
                attn = self._attend(queries[j], k_all, v_all, first_block + j, windows[index])
                x.add_(F.linear(attn, layer.wo))
                gate, up = F.linear(self._rms_norm(x, layer.mlp_norm), layer.w_gate_up).chunk(2, -1)
                x.add_(F.linear(F.silu(gate).mul_(up), layer.w_down))

        if last_only:
            block = blocks[last_row // size]
            logits = F.linear(self._rms_norm(block, self.final_norm), self.lm_head)
            return logits[last_row % size : last_row % size + 1]
        logits = torch.cat(
            [
                F.linear(self._rms_norm(blocks[j], self.final_norm), self.lm_head)
                for j in range(n_blocks)
            ]
        )
        return logits[valid]
