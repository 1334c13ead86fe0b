"""Sliding-window layers: the mask, the split of KV between the pool and a ``WindowKV``, and
exact resumes that keep only the window's rows of the prefix."""

from __future__ import annotations

import pytest
import torch

from hicache_store.demo.engine import MiniLlama, MiniLlamaConfig, WindowKV

WINDOW = 8
CONFIG = MiniLlamaConfig(window_layers=(1, 3), sliding_window=WINDOW, compute_block=16)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request: pytest.FixtureRequest) -> MiniLlama:
    return MiniLlama(CONFIG.with_(dtype=request.param))


def tokens_of(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_config_kinds_and_validation() -> None:
    assert CONFIG.layer_kinds == ("full", "window", "full", "window")
    assert CONFIG.full_layers == (0, 2)
    assert CONFIG.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # the pool's two full layers
    assert MiniLlamaConfig(**CONFIG.to_dict()) == CONFIG
    assert MiniLlamaConfig(**{**CONFIG.to_dict(), "window_layers": [1, 3]}) == CONFIG  # JSON
    for bad in (
        {"window_layers": (3, 1)},
        {"window_layers": (1, 1)},
        {"window_layers": (4,)},
        {"window_layers": (0, 1, 2, 3)},
        {"window_layers": (), "sliding_window": WINDOW},
        {"sliding_window": 0},
        {"sliding_window": -2},
    ):
        with pytest.raises(ValueError, match="window"):
            CONFIG.with_(**bad)


def test_window_layers_change_the_model() -> None:
    toks = tokens_of(40)
    windowed = MiniLlama(CONFIG).forward_full(toks)
    full = MiniLlama(CONFIG.with_(window_layers=(), sliding_window=0)).forward_full(toks)
    assert torch.equal(windowed[:WINDOW], full[:WINDOW])  # the window is not yet binding
    assert not torch.equal(windowed[WINDOW:], full[WINDOW:])


def test_pool_holds_only_the_full_layers(model: MiniLlama) -> None:
    pool = model.make_pool(16, 4)
    assert pool.num_layers == 2
    toks = tokens_of(30)
    window = WindowKV.zeros(model.config, 30)
    out = model.prefill(toks, 0, torch.arange(30), pool, window=window)
    assert torch.equal(out, model.forward_full(toks))
    # the window layers' K/V went to the WindowKV, every row written and non-zero
    assert window.k.shape == (2, 30, 2, 16)
    assert bool((window.k.abs().sum(dim=(0, 2, 3)) > 0).all())


@pytest.mark.parametrize("start", [1, WINDOW - 1, WINDOW, 17, 24, 33])
def test_resume_needs_only_the_last_window_minus_one_rows(model: MiniLlama, start: int) -> None:
    """Resuming at ``start`` with only rows ``[start - W + 1, start)`` of the window layers (the
    rest zeros) is exact; dropping one more row is not (for starts past the window)."""
    toks = tokens_of(45, seed=start)
    reference = model.forward_full(toks)
    pool = model.make_pool(16, 4)
    slots = torch.arange(45)
    full = WindowKV.zeros(model.config, 45)
    model.prefill(toks, 0, slots, pool, window=full)

    def resumed(keep_from: int) -> torch.Tensor:
        window = WindowKV.zeros(model.config, 45)
        window.k[:, keep_from:start] = full.k[:, keep_from:start]
        window.v[:, keep_from:start] = full.v[:, keep_from:start]
        return model.prefill(toks[start:], start, slots, pool, window=window)

    assert torch.equal(resumed(max(0, start - WINDOW + 1)), reference[start:])
    if start >= WINDOW:
        assert not torch.equal(resumed(start - WINDOW + 2), reference[start:])


def test_window_argument_is_checked(model: MiniLlama) -> None:
    pool = model.make_pool(8, 4)
    toks = tokens_of(10)
    with pytest.raises(ValueError, match="needs a WindowKV"):
        model.prefill(toks, 0, torch.arange(10), pool)
    with pytest.raises(ValueError, match="rows"):
        model.prefill(toks, 0, torch.arange(10), pool, window=WindowKV.zeros(model.config, 9))
    other = WindowKV.zeros(model.config.with_(num_kv_heads=1, num_heads=2), 10)
    with pytest.raises(ValueError, match="window does not match"):
        model.prefill(toks, 0, torch.arange(10), pool, window=other)
    plain = MiniLlama(MiniLlamaConfig())
    with pytest.raises(ValueError, match="no sliding-window layers"):
        plain.prefill(
            toks, 0, torch.arange(10), plain.make_pool(8, 4), window=WindowKV.zeros(CONFIG, 10)
        )
    with pytest.raises(ValueError, match="one shape"):
        WindowKV(torch.zeros(2, 4, 2, 16), torch.zeros(2, 5, 2, 16))
