"""Hyper-parameters of the mini engine's Llama-style decoder (``MiniLlamaConfig``).

Every field that can change a single bit of the model's output lives here, including the
execution block size ``compute_block`` (see ``hicache_store.demo.engine.model`` for why the block size
is part of the arithmetic). Two configs that compare equal produce bit-identical logits on the
same device and torch build.

Presets: ``MiniLlamaConfig()`` is a tiny model for CPU unit tests (milliseconds per prefill);
``MiniLlamaConfig.preset("bench")`` is the model the multi-turn benchmark drives: large enough that
prefill compute dominates TTFT on a 2-core CPU, small enough that a few hundred requests finish in
minutes.

Layer kinds: every layer is a full-attention layer unless listed in ``window_layers``; those are
sliding-window layers (a query at position ``t`` sees keys ``(t - sliding_window, t]``, as
Mistral/Gemma). ``layer_kinds`` is the one place the code asks. The device KV pool holds the
full-attention layers only (``full_layers``); a sliding-window layer's KV is a separate cache
component of the tier with its own pools (``hicache_store.demo.hybrid.WindowPool``), because
resuming needs only its last ``sliding_window`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

#: dtype names the model computes in (weights, activations and KV all use this dtype).
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class MiniLlamaConfig:
    """Shape, numerics and seed of a ``MiniLlama``.

    Invariants (checked on construction, ``ValueError`` naming the field otherwise): every size is
    positive, ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention),
    ``head_dim`` is even (RoPE rotates pairs), ``dtype`` is a key of ``SUPPORTED_DTYPES``.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: str = "float32"
    seed: int = 0
    #: tokens per execution block; rows are processed in blocks aligned to absolute positions.
    compute_block: int = 64
    #: indices of sliding-window layers (sorted, distinct; empty: all layers are full attention).
    window_layers: tuple[int, ...] = ()
    #: tokens a sliding-window layer attends to (itself included); 0 iff ``window_layers`` is empty.
    sliding_window: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "compute_block",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_eps > 0:
            raise ValueError(f"rms_eps must be positive, got {self.rms_eps}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}"
            )
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        # JSON round trips give lists: accept any sequence of ints, store a tuple (hashable).
        layers = tuple(self.window_layers)
        object.__setattr__(self, "window_layers", layers)
        if any(not isinstance(i, int) or isinstance(i, bool) for i in layers):
            raise ValueError(f"window_layers must be layer indices, got {layers!r}")
        if list(layers) != sorted(set(layers)) or (
            layers and not 0 <= layers[0] <= layers[-1] < self.num_layers
        ):
            raise ValueError(
                f"window_layers must be sorted distinct indices in [0, {self.num_layers}), "
                f"got {layers!r}"
            )
        if len(layers) == self.num_layers:
            raise ValueError("window_layers: at least one layer must be a full-attention layer")
        window = self.sliding_window
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise ValueError(f"sliding_window must be a non-negative int, got {window!r}")
        if bool(window) != bool(layers):
            raise ValueError(
                "sliding_window must be positive exactly when window_layers is non-empty, got "
                f"sliding_window={window} with window_layers={layers!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype`` (the dtype of weights, activations and KV)."""
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The attention kind of each layer: ``"full"`` or ``"window"`` (sliding window)."""
        windowed = set(self.window_layers)
        return tuple("window" if i in windowed else "full" for i in range(self.num_layers))

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers: the device pool's layers, in order."""
        windowed = set(self.window_layers)
        return tuple(i for i in range(self.num_layers) if i not in windowed)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of the full-attention layers for one token (what the device pool and
        the cache tier's pages hold per token; all layers when there are no window layers)."""
        itemsize = torch.finfo(self.torch_dtype).bits // 8
        return len(self.full_layers) * 2 * self.num_kv_heads * self.head_dim * itemsize

    def with_(self, **changes: Any) -> MiniLlamaConfig:
        """A copy with some fields changed (validated like a new config)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (for JSON reports)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def preset(cls, name: str) -> MiniLlamaConfig:
        """A named preset: ``"tiny"`` (the defaults) or ``"bench"``."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            ) from None


#: Named configs. ``bench``: 8 layers, hidden 256, 8 query / 4 KV heads of 32, float32;
#: 2 KiB of KV per token.
PRESETS: dict[str, MiniLlamaConfig] = {
    "tiny": MiniLlamaConfig(),
    "bench": MiniLlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        compute_block=64,
    ),
}
