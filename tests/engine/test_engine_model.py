"""MiniLlama: prefill over a cached prefix is bit-identical to a full recompute.

The model's contract (see ``hicache_store.demo.engine.model``) is exactness by construction, so every
comparison here is ``torch.equal``, in float32 and in bfloat16.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hicache_store.demo.engine import DeviceKVPool, MiniLlama, MiniLlamaConfig

PAGE = 16
DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module", params=DTYPES)
def model(request: pytest.FixtureRequest) -> MiniLlama:
    return MiniLlama(MiniLlamaConfig(dtype=request.param))


@pytest.fixture(scope="module")
def model32() -> MiniLlama:
    return MiniLlama(MiniLlamaConfig())


def tokens_of(n: int, seed: int = 1, vocab: int = 512) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen)


def shuffled_slots(pool: DeviceKVPool, n: int, seed: int = 0) -> torch.Tensor:
    """Slots of ``n`` tokens on pages allocated from ``pool`` in a scrambled order."""
    pages = pool.alloc(-(-n // pool.page_size))
    order = torch.randperm(len(pages), generator=torch.Generator().manual_seed(seed))
    return pool.slots_of([pages[i] for i in order.tolist()])[:n]


def copy_prefix(
    src: DeviceKVPool, src_slots: torch.Tensor, dst: DeviceKVPool, dst_slots: torch.Tensor
) -> None:
    """What a restore from a lower tier does: the prefix's K/V bytes land in other slots."""
    for layer in range(src.num_layers):
        dst.k_buffers[layer][dst_slots] = src.k_buffers[layer][src_slots]
        dst.v_buffers[layer][dst_slots] = src.v_buffers[layer][src_slots]


def test_logits_are_well_conditioned(model: MiniLlama) -> None:
    logits = model.forward_full(tokens_of(200)).float()
    assert logits.shape == (200, 512)
    assert logits.dtype == torch.float32 or model.config.dtype == "bfloat16"
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3.0
    # Not degenerate: positions disagree on their argmax.
    assert logits.argmax(-1).unique().numel() > 20


def test_weights_depend_on_seed_only() -> None:
    toks = tokens_of(40)
    a = MiniLlama(MiniLlamaConfig(seed=7)).forward_full(toks)
    assert torch.equal(a, MiniLlama(MiniLlamaConfig(seed=7)).forward_full(toks))
    assert not torch.equal(a, MiniLlama(MiniLlamaConfig(seed=8)).forward_full(toks))


def test_forward_full_is_causal_and_prefix_consistent(model32: MiniLlama) -> None:
    toks = tokens_of(150)
    full = model32.forward_full(toks)
    assert torch.equal(model32.forward_full(toks[:97]), full[:97])
    changed = toks.clone()
    changed[100] = (changed[100] + 1) % 512
    other = model32.forward_full(changed)
    assert torch.equal(other[:100], full[:100])
    assert not torch.equal(other[100:], full[100:])


def test_chunked_prefills_into_one_pool_equal_forward_full(model: MiniLlama) -> None:
    toks = tokens_of(300)
    ref = model.forward_full(toks)
    pool = model.make_pool(num_pages=32, page_size=PAGE)
    slots = shuffled_slots(pool, 300)
    # Chunk boundaries on, before and after block (64) and page (16) boundaries.
    bounds = [0, 100, 128, 129, 250, 299, 300]
    for start, end in itertools.pairwise(bounds):
        out = model.prefill(toks[start:end], start, slots[:end], pool)
        assert out.shape == (end - start, 512)
        assert torch.equal(out, ref[start:end]), (start, end)


def test_prefix_restored_into_other_pages_of_another_pool(model: MiniLlama) -> None:
    toks = tokens_of(260, seed=3)
    ref = model.forward_full(toks)
    prefix = 192  # 12 pages
    source = model.make_pool(num_pages=20, page_size=PAGE)
    src_slots = source.slots_of(source.alloc(12))
    model.prefill(toks[:prefix], 0, src_slots, source)

    target = model.make_pool(num_pages=40, page_size=PAGE)
    target.alloc(5)  # so the restored pages are not the source's page numbers
    dst_slots = shuffled_slots(target, 260, seed=5)
    copy_prefix(source, src_slots, target, dst_slots[:prefix])
    out = model.prefill(toks[prefix:], prefix, dst_slots, target)
    assert torch.equal(out, ref[prefix:])
    last = model.prefill(toks[prefix:], prefix, dst_slots, target, last_only=True)
    assert torch.equal(last, ref[-1:])

    # The check is sensitive: one wrong element of restored KV changes the logits.
    target.v_buffers[1][dst_slots[10], 0, 3] += 0.5
    assert not torch.equal(model.prefill(toks[prefix:], prefix, dst_slots, target), ref[prefix:])


@pytest.mark.parametrize("start", [1, 15, 63, 64, 65, 130])
@pytest.mark.parametrize("n_new", [1, 2, 70])
def test_any_split_point_is_exact(model32: MiniLlama, start: int, n_new: int) -> None:
    toks = tokens_of(start + n_new, seed=start * 100 + n_new)
    ref = model32.forward_full(toks)
    pool = model32.make_pool(num_pages=16, page_size=PAGE)
    slots = shuffled_slots(pool, start + n_new)
    model32.prefill(toks[:start], 0, slots[:start], pool)
    out = model32.prefill(toks[start:], start, slots, pool)
    assert torch.equal(out, ref[start:])
    assert torch.equal(model32.prefill(toks[start:], start, slots, pool, last_only=True), ref[-1:])


@pytest.mark.slow
def test_bench_preset_is_exact_and_bf16_tracks_float32() -> None:
    cfg = MiniLlamaConfig.preset("bench")
    toks = tokens_of(150, vocab=cfg.vocab_size)
    for dtype in DTYPES:
        model = MiniLlama(cfg.with_(dtype=dtype))
        ref = model.forward_full(toks)
        pool = model.make_pool(num_pages=4, page_size=64)
        slots = pool.slots_of(pool.alloc(3))[:150]
        model.prefill(toks[:70], 0, slots[:70], pool)
        assert torch.equal(model.prefill(toks[70:], 70, slots, pool), ref[70:])
        if dtype == "float32":
            ref32 = ref
    # bfloat16 computes the same function, to bf16 precision.
    torch.testing.assert_close(ref.float(), ref32, atol=0.15, rtol=0.05)


def test_prefill_writes_only_the_suffix_slots(model32: MiniLlama) -> None:
    toks = tokens_of(90)
    pool = model32.make_pool(num_pages=10, page_size=PAGE)
    slots = shuffled_slots(pool, 90)
    model32.prefill(toks[:40], 0, slots[:40], pool)
    before_k = [b.clone() for b in pool.k_buffers]
    before_v = [b.clone() for b in pool.v_buffers]
    model32.prefill(toks[40:], 40, slots, pool)
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[slots[40:]] = False
    for layer in range(pool.num_layers):
        for now, before in ((pool.k_buffers, before_k), (pool.v_buffers, before_v)):
            assert torch.equal(now[layer][untouched], before[layer][untouched])
            assert now[layer][slots[40:]].abs().sum() > 0


@pytest.mark.parametrize("start", [0, 40])
def test_wait_layer_once_per_layer_before_the_pool_is_touched(
    model32: MiniLlama, start: int
) -> None:
    toks = tokens_of(100)
    pool = model32.make_pool(num_pages=10, page_size=PAGE)
    slots = shuffled_slots(pool, 100)
    if start:
        model32.prefill(toks[:start], 0, slots[:start], pool)
    new = slots[start:]
    calls: list[int] = []

    def wait_layer(layer: int) -> None:
        # Layer `layer` has not written its suffix yet; the layer before it has.
        assert not pool.k_buffers[layer][new].any()
        if layer:
            assert pool.k_buffers[layer - 1][new].any()
        calls.append(layer)

    out = model32.prefill(toks[start:], start, slots, pool, wait_layer=wait_layer)
    assert calls == list(range(model32.config.num_layers))
    assert torch.equal(out, model32.forward_full(toks)[start:])


def test_wait_layer_error_propagates(model32: MiniLlama) -> None:
    toks = tokens_of(50)
    pool = model32.make_pool(num_pages=4, page_size=PAGE)
    slots = pool.slots_of(pool.alloc(4))[:50]

    def wait_layer(layer: int) -> None:
        if layer == 2:
            raise TimeoutError("layer 2 never arrived")

    with pytest.raises(TimeoutError, match="layer 2"):
        model32.prefill(toks, 0, slots, pool, wait_layer=wait_layer)
    assert pool.k_buffers[1][slots].any()
    assert not pool.k_buffers[2][slots].any()


def test_bad_arguments_are_named(model32: MiniLlama) -> None:
    pool = model32.make_pool(num_pages=4, page_size=PAGE)  # 64 slots
    toks = tokens_of(10)
    slots = torch.arange(20)
    with pytest.raises(ValueError, match=r"slots must be 1-D of length .* = 20, got shape \(19,\)"):
        model32.prefill(toks, 10, slots[:19], pool)
    with pytest.raises(ValueError, match=r"slots must be 1-D"):
        model32.prefill(toks, 10, slots.view(2, 10), pool)
    with pytest.raises(ValueError, match=r"slots: slot 64 out of range \[0, 64\)"):
        model32.prefill(toks, 10, torch.arange(45, 65), pool)
    with pytest.raises(ValueError, match=r"slots: slot -1 out of range"):
        model32.prefill(toks, 10, torch.arange(-1, 19), pool)
    with pytest.raises(ValueError, match="slots: slot indices must be distinct"):
        model32.prefill(toks, 10, torch.cat([torch.arange(10), torch.arange(10)]), pool)
    with pytest.raises(ValueError, match="slots must be an integer tensor"):
        model32.prefill(toks, 10, slots.float(), pool)
    with pytest.raises(ValueError, match=r"tokens: id 512 out of range \[0, 512\)"):
        model32.prefill(torch.tensor([1, 512]), 0, torch.arange(2), pool)
    with pytest.raises(ValueError, match="tokens must be a non-empty 1-D"):
        model32.prefill(torch.tensor([], dtype=torch.int64), 0, torch.arange(0), pool)
    with pytest.raises(ValueError, match="tokens must be an integer tensor"):
        model32.forward_full(torch.ones(3))
    with pytest.raises(ValueError, match="start_pos"):
        model32.prefill(toks, -1, slots, pool)
    bf16_pool = DeviceKVPool.for_model(
        model32.config.with_(dtype="bfloat16"), num_pages=4, page_size=PAGE
    )
    with pytest.raises(ValueError, match="pool does not match the model"):
        model32.prefill(toks, 10, slots, bf16_pool)
    # Nothing was written by the refused calls.
    assert not any(b.any() for b in pool.k_buffers)


def test_sequences_also_accepted(model32: MiniLlama) -> None:
    pool = model32.make_pool(num_pages=2, page_size=PAGE)
    toks = tokens_of(20)
    out = model32.prefill(toks.tolist(), 0, list(range(20)), pool)
    assert torch.equal(out, model32.forward_full(toks.int()))
