"""P/D with a hybrid model: the state beyond KV pages at the boundary travels too.

The decode side's cache holds the full-attention layers' KV only. A model with sliding-window
layers also needs, to decode after the prompt, the window layers' K/V of the last
``sliding_window - 1`` prompt tokens (a *fresh window tail*, which reaches back before the
decode side's boundary here), and ``HybridMiniLlama`` its recurrent state after the prompt. The
prefill worker sends both with the suffix (``bench.pd_worker.ResumeStateCodec``), having
resumed the model from its own cache's components after the previous turn; decode logits must
equal a single-process recompute bit for bit.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from _pd_support import MOONCAKE_MARKS, PAGE, setup_for, tokens
from _serve import assert_equals_recompute

from hicache_store.demo.bench.hybrid import hybrid_config
from hicache_store.demo.bench.pd_worker import (
    PrefillProcess,
    ResumeState,
    ResumeStateCodec,
    close_decode_side,
    decode_side,
    start_prefill,
)
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.model import MiniLlama, WindowKV
from hicache_store.demo.hybrid import HybridMiniLlama
from hicache_store.pd import DecodeWorker, Served, suffix_pages

WINDOW = 14  # the tail (13 tokens) is longer than a turn's new tokens: it crosses the boundary
CONFIG = hybrid_config(MiniLlamaConfig(), WINDOW)
FULL_LAYERS = CONFIG.num_layers - len(CONFIG.window_layers)
ROW = FULL_LAYERS * 2 * PAGE * CONFIG.num_kv_heads * CONFIG.head_dim * 4
MODELS = {"window": 0, "window+recurrent": 8}


PARAMS = [
    pytest.param(("tcp", kind), id=f"tcp-{kind}") for kind in MODELS
] + [
    pytest.param(("mooncake", kind), id=f"mooncake-{kind}", marks=MOONCAKE_MARKS)
    for kind in MODELS
]


@pytest.fixture(scope="module", params=PARAMS)
def hybrid_prefill(request: pytest.FixtureRequest) -> Iterator[PrefillProcess]:
    transport, kind = request.param
    if transport == "mooncake":
        pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is not installed")
    setup = setup_for(
        transport, l1_pages=128, model=CONFIG.to_dict(), recurrent_dim=MODELS[kind]
    )
    process = start_prefill(setup)
    try:
        yield process
    finally:
        process.stop()


def hybrid_decode_step(
    model: MiniLlama | HybridMiniLlama, worker: DecodeWorker, served: Served, answer: list[int]
) -> None:
    """Decode ``answer`` over the served KV plus the received state; logits must equal a
    full recompute."""
    state = served.state
    assert isinstance(state, ResumeState)
    n = len(served.prompt)
    slots = served.extend(answer)
    pool = worker.pool

    def decode(window: WindowKV | None, recurrent: torch.Tensor | None) -> torch.Tensor:
        if isinstance(model, HybridMiniLlama):
            assert recurrent is not None
            logits, _, _ = model.prefill(answer, n, slots, pool, recurrent, window=window)  # type: ignore[arg-type]
            return logits
        assert recurrent is None
        return model.prefill(torch.tensor(answer), n, slots, pool, window=window)  # type: ignore[arg-type]

    full = model.forward_full(torch.tensor(served.prompt + answer))
    # the state matters: without the received tail (or recurrent state) decoding goes wrong
    blank = WindowKV.zeros(model.config, n + len(answer))
    assert not torch.equal(decode(blank, state.recurrent), full[n:])
    if state.recurrent is not None:
        wrong = decode(state.window(n + len(answer)), torch.zeros_like(state.recurrent))
        assert not torch.equal(wrong, full[n:])
    logits = decode(state.window(n + len(answer)), state.recurrent)  # rewrites the answer's KV
    assert_equals_recompute(model, served.prompt + answer, logits, n,
                            "decode logits differ from a single-process recompute")
    served.finish()


def test_the_window_tail_and_recurrent_state_travel_with_the_suffix(
    hybrid_prefill: PrefillProcess,
) -> None:
    setup = setup_for(
        hybrid_prefill.setup.transport,
        l1_pages=64,
        l2_pages=64,
        model=CONFIG.to_dict(),
        recurrent_dim=hybrid_prefill.setup.recurrent_dim,
    )
    worker, model = decode_side(setup, hybrid_prefill.connect())
    codec = worker.state
    assert isinstance(codec, ResumeStateCodec) and codec.tail_tokens == WINDOW - 1
    rng = random.Random(5)
    history = tokens(rng, 30)
    previous: list[int] = []
    try:
        with torch.inference_mode():
            for turn in range(3):
                prompt = history + tokens(rng, 5)
                if turn == 2:
                    worker.tier.evict_device()  # type: ignore[union-attr]  # prefix from L2
                served = worker.serve(prompt)
                boundary = (len(history) // PAGE) * PAGE if turn else 0
                assert served.boundary == boundary and served.attempts == 1
                # prefill's own cache resumes the model (KV, window pages, a checkpoint) after
                # the previous prompt's full pages
                assert served.prefill_cached == (len(previous) // PAGE) * PAGE
                if turn:
                    # the fresh tail reaches before the boundary: the decode cache has no
                    # window K/V there, only what prefill sent makes the logits right
                    assert len(prompt) - codec.tail_tokens < boundary
                pages = suffix_pages(len(prompt), boundary, PAGE)
                assert served.received_bytes == pages * ROW + codec.nbytes
                answer = tokens(rng, 4)
                hybrid_decode_step(model, worker, served, answer)
                history = prompt + answer
                previous = prompt
                worker.tier.check_invariants()  # type: ignore[union-attr]
    finally:
        close_decode_side(worker)


def test_a_plain_model_cannot_talk_to_a_hybrid_prefill(hybrid_prefill: PrefillProcess) -> None:
    setup = setup_for(hybrid_prefill.setup.transport, l1_pages=32)
    with pytest.raises(Exception, match="state|namespace|model"):
        decode_side(setup, hybrid_prefill.connect(), MiniLlama(MiniLlamaConfig()))


def test_state_bytes_round_trip_and_refuse_a_wrong_size() -> None:
    codec = ResumeStateCodec(CONFIG, recurrent_dim=3)
    handle = codec.begin(20)
    assert handle.window is not None
    handle.window.k.normal_()
    handle.window.v.normal_()
    handle.recurrent = torch.randn(3)
    data = codec.encode(handle)
    assert data.dtype == torch.uint8 and data.numel() == codec.nbytes
    state = codec.decode(data, 20)
    window = state.window(24)
    assert window is not None and state.recurrent is not None
    tail = slice(20 - codec.tail_tokens, 20)
    assert torch.equal(window.k[:, tail], handle.window.k[:, tail])
    assert torch.equal(window.v[:, tail], handle.window.v[:, tail])
    assert not window.k[:, : tail.start].any() and not window.k[:, 20:].any()
    assert torch.equal(state.recurrent, handle.recurrent)
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(data[:-1], 20)
    with pytest.raises(ValueError, match="no state"):
        ResumeStateCodec(MiniLlamaConfig())


def test_a_prompt_shorter_than_the_tail_pads_before_position_zero() -> None:
    codec = ResumeStateCodec(CONFIG)
    handle = codec.begin(5)
    assert handle.window is not None
    handle.window.k.normal_()
    state = codec.decode(codec.encode(handle), 5)
    window = state.window(5)
    assert window is not None and torch.equal(window.k, handle.window.k)
