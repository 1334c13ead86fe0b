"""MiniLlamaConfig: validation, presets, derived sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hicache_store.demo.engine import PRESETS, MiniLlamaConfig


def test_defaults_are_small_and_valid() -> None:
    cfg = MiniLlamaConfig()
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 4, 2, 16)
    assert (cfg.hidden_size, cfg.vocab_size) == (64, 512)
    assert cfg.torch_dtype == torch.float32
    assert cfg.group_size == 2
    assert cfg.layer_kinds == ("full",) * 4
    assert cfg.kv_bytes_per_token == 4 * 2 * 2 * 16 * 4
    assert cfg.with_(dtype="bfloat16").kv_bytes_per_token == 4 * 2 * 2 * 16 * 2


def test_presets() -> None:
    assert MiniLlamaConfig.preset("tiny") == MiniLlamaConfig()
    bench = MiniLlamaConfig.preset("bench")
    assert bench is PRESETS["bench"]
    assert (bench.num_layers, bench.hidden_size, bench.num_heads, bench.head_dim) == (8, 256, 8, 32)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        MiniLlamaConfig.preset("huge")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_size": -4}, "hidden_size"),
        ({"num_layers": 1.5}, "num_layers"),
        ({"num_heads": 6, "num_kv_heads": 4}, "num_kv_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"dtype": "int8"}, "dtype"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rms_eps": 0.0}, "rms_eps"),
        ({"compute_block": 0}, "compute_block"),
    ],
)
def test_invalid_fields_are_named(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MiniLlamaConfig().with_(**changes)


def test_frozen_hashable_and_serialisable() -> None:
    cfg = MiniLlamaConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]
    assert hash(cfg) == hash(MiniLlamaConfig())
    assert MiniLlamaConfig(**cfg.to_dict()) == cfg
