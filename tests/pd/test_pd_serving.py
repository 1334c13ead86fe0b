"""P/D with decode-side reuse between two real processes: decode logits equal a full recompute.

Each conversation turn is served by the decode worker (this process) from its own cache plus the
suffix the prefill worker (a child process) sends over a real transport; the decode step then
runs over those slots and must give logits bit-identical to a single-process recompute of the
whole sequence.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _pd_support import PAGE, ROW, decode_step, setup_for, tokens

from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.demo.bench.pd_worker import PrefillProcess, close_decode_side, decode_side
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.pd import suffix_pages
from hicache_store.pd.protocol import Failed, PrefillDone, PrefillRequest


def test_turns_reuse_l1_and_l2_and_receive_only_the_suffix(
    prefill: PrefillProcess, model: MiniLlama
) -> None:
    setup = setup_for(prefill.setup.transport, l1_pages=64, l2_pages=128)
    worker, _ = decode_side(setup, prefill.connect(), model)
    assert worker.layout.page_bytes == ROW
    rng = random.Random(1)
    history = tokens(rng, 41)
    try:
        with torch.inference_mode():
            expected_boundaries = []
            for turn in range(4):
                prompt = history + tokens(rng, 7)
                if turn == 3:
                    worker.tier.evict_device()  # type: ignore[union-attr]  # restore from L2
                l2_before = worker.tier.metrics.hit_tokens_l2  # type: ignore[union-attr]
                served = worker.serve(prompt)
                # decode holds every full page of the previous prompt + answer (turn > 0)
                expected = (len(history) // PAGE) * PAGE if turn else 0
                expected_boundaries.append(expected)
                assert served.boundary == expected
                assert served.attempts == 1
                pages = suffix_pages(len(prompt), expected, PAGE)
                assert served.received_bytes == pages * ROW
                if turn == 3:
                    assert worker.tier.metrics.hit_tokens_l2 - l2_before == expected  # type: ignore[union-attr]
                answer = tokens(rng, 5)
                decode_step(model, worker, served, answer)
                history = prompt + answer
                worker.tier.check_invariants()  # type: ignore[union-attr]
        assert worker.landing.pool.used == 0
        assert worker.metrics.reused_tokens == sum(expected_boundaries)
    finally:
        close_decode_side(worker)


def test_baseline_without_decode_reuse_receives_every_token(
    prefill: PrefillProcess, model: MiniLlama
) -> None:
    setup = setup_for(prefill.setup.transport, l1_pages=64, reuse=False)
    worker, _ = decode_side(setup, prefill.connect(), model)
    rng = random.Random(2)
    history = tokens(rng, 30)
    try:
        with torch.inference_mode():
            for _turn in range(2):
                prompt = history + tokens(rng, 6)
                served = worker.serve(prompt)
                assert served.boundary == 0
                assert served.received_bytes == suffix_pages(len(prompt), 0, PAGE) * ROW
                answer = tokens(rng, 3)
                decode_step(model, worker, served, answer)
                history = prompt + answer
        assert worker.pool.num_free_pages == setup.l1_pages
    finally:
        close_decode_side(worker)


def test_both_workers_must_mean_the_same_boundary(prefill: PrefillProcess, model: MiniLlama) -> None:
    """Requests whose boundary prefill cannot honour are refused before a byte is written."""
    setup = setup_for(prefill.setup.transport, l1_pages=64, l2_pages=64)
    worker, _ = decode_side(setup, prefill.connect(), model)
    rng = random.Random(3)
    prompt = tokens(rng, 22)
    good = worker.tier.match(prompt).hashes  # type: ignore[union-attr]
    try:
        landing = worker.landing.pool.data
        landing.fill_(7)
        before = landing.clone()
        bad_requests = {
            "page hash": PrefillRequest(900, prompt, 8, "00" * 32, [0, 1, 2, 3]),
            "page-aligned": PrefillRequest(901, prompt, 6, good[0], [0, 1, 2, 3]),
            "landing rows": PrefillRequest(902, prompt, 8, good[1], [0, 1, 2]),
            "distinct": PrefillRequest(903, prompt, 8, good[1], [0, 1, 2, 2]),
            "below": PrefillRequest(904, prompt, 8, good[1], [0, 1, 2, 10_000]),
        }
        for why, request in bad_requests.items():
            worker.channel.send(request)
            answer = worker.channel.recv(30)
            assert isinstance(answer, Failed) and answer.rid == request.rid
            assert why in answer.error
        assert torch.equal(landing, before), "a refused request wrote into landing memory"
        # The same request with the boundary both sides agree on is served.
        worker.channel.send(PrefillRequest(905, prompt, 8, good[1], [3, 2, 1, 0]))
        done = worker.channel.recv(30)
        assert isinstance(done, PrefillDone)
        assert (done.rid, done.boundary, done.pages, done.bytes) == (905, 8, 4, 4 * ROW)
        assert not torch.equal(landing[:4], before[:4])
        assert torch.equal(landing[4:], before[4:]), "prefill wrote outside the rows named"
    finally:
        close_decode_side(worker)


def test_an_l3_span_extends_the_boundary_only_once_its_prefetch_is_accepted(
    prefill: PrefillProcess, model: MiniLlama, tmp_path: Path
) -> None:
    transport = prefill.setup.transport
    url = f"file://{tmp_path}/l3"
    rng = random.Random(4)
    prompt = tokens(rng, 33)
    # A first decode worker serves the prompt; its cache writes the pages through to L3.
    setup = setup_for(transport, l1_pages=64, l2_pages=64)
    first, _ = decode_side(setup, prefill.connect(), model, backend=open_backend(url))
    try:
        with torch.inference_mode():
            decode_step(model, first, first.serve(prompt), tokens(rng, 3))
        first.tier.flush()  # type: ignore[union-attr]
    finally:
        close_decode_side(first)
    follow = prompt + tokens(rng, 6)
    # A fresh decode worker whose L3 reads all come back corrupt: the prefetch is not accepted,
    # so nothing of L3 is promised (and the request is served correctly without it).
    broken = FaultyBackend(open_backend(url), FaultConfig(bit_flip_rate=1.0))
    second, _ = decode_side(
        setup_for(transport, l1_pages=64, l2_pages=64, tier_options={"write_policy": "write_back"}),
        prefill.connect(),
        model,
        backend=broken,
    )
    try:
        with torch.inference_mode():
            served = second.serve(follow)
            assert served.boundary == 0 and served.attempts == 1
            assert second.tier.metrics.corruptions > 0  # type: ignore[union-attr]
            decode_step(model, second, served, tokens(rng, 2))
    finally:
        close_decode_side(second)
    # A fresh decode worker with a working L3: the accepted prefetch extends the boundary.
    third, _ = decode_side(setup, prefill.connect(), model, backend=open_backend(url))
    try:
        with torch.inference_mode():
            served = third.serve(follow)
            assert served.boundary == (len(prompt) // PAGE) * PAGE
            assert third.tier.metrics.hit_tokens_l3 == served.boundary  # type: ignore[union-attr]
            decode_step(model, third, served, tokens(rng, 2))
    finally:
        close_decode_side(third)


def test_a_mismatched_model_is_refused_at_the_handshake(prefill: PrefillProcess) -> None:
    other = setup_for(prefill.setup.transport, l1_pages=16).config.with_(seed=1, dtype="bfloat16")
    setup = setup_for(prefill.setup.transport, l1_pages=16)
    setup = type(setup)(**{**setup.__dict__, "model": other.to_dict()})
    with pytest.raises(Exception, match="namespace"):
        decode_side(setup, prefill.connect())
