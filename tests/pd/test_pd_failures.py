"""P/D failure paths: a promised prefix that cannot be restored, a failing or stalled prefill.

Whatever fails, a request is either served with exactly the right KV (logits equal a full
recompute) or fails with ``DecodeFailed``; nothing leaks (device pages, landing rows, tier
locks), and landing rows prefill might still write into are never handed out again.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator

import pytest
import torch
from _pd_support import PAGE, ROW, decode_step, setup_for, tokens

import hicache_store.tier.pools as tier_pools
from hicache_store.demo.bench.pd_worker import PrefillProcess, close_decode_side, decode_side
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.pd import DecodeFailed
from hicache_store.tier.components import KV_TAG


@pytest.fixture(scope="module")
def small_prefill() -> Iterator[PrefillProcess]:
    """A prefill worker whose device pool holds 8 pages: a longer prompt fails there."""
    from _pd_support import start

    process = start("tcp", l1_pages=8)
    try:
        yield process
    finally:
        process.stop()


def test_a_promised_prefix_that_fails_to_restore_is_retried_without_reuse(
    prefill: PrefillProcess, model: MiniLlama, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = setup_for(prefill.setup.transport, l1_pages=64, l2_pages=64)
    worker, _ = decode_side(setup, prefill.connect(), model)
    tier = worker.tier
    assert tier is not None
    rng = random.Random(11)
    try:
        with torch.inference_mode():
            first = tokens(rng, 26)
            answer = tokens(rng, 4)
            decode_step(model, worker, worker.serve(first), answer)
            tier.evict_device()  # the conversation's pages are in L2 only now
            real_unpack = tier_pools.unpack_pages

            def failing_unpack(*args: object, **kwargs: object) -> None:
                monkeypatch.setattr(tier_pools, "unpack_pages", real_unpack)  # fail once
                raise RuntimeError("injected: the host copy could not be restored")

            monkeypatch.setattr(tier_pools, "unpack_pages", failing_unpack)
            prompt = first + answer + tokens(rng, 5)
            served = worker.serve(prompt)
            # The promise (28 tokens from L2) failed; the retry took everything from prefill.
            assert served.attempts == 2
            assert served.boundary == 0
            assert served.received_bytes == -(-len(prompt) // PAGE) * ROW
            assert worker.metrics.failed_attempts == 1
            decode_step(model, worker, served, tokens(rng, 3))
        tier.check_invariants()
        assert worker.landing.pool.used == 0
        assert all(n.copy(KV_TAG).lock == 0 and n.copy(KV_TAG).host_lock == 0 for n in tier.tree.nodes())
    finally:
        close_decode_side(worker)


def test_a_request_prefill_cannot_serve_fails_cleanly(
    small_prefill: PrefillProcess, model: MiniLlama
) -> None:
    setup = setup_for("tcp", l1_pages=64, l2_pages=32)
    worker, _ = decode_side(setup, small_prefill.connect(), model)
    tier = worker.tier
    assert tier is not None
    rng = random.Random(12)
    try:
        free = worker.pool.num_free_pages
        with torch.inference_mode(), pytest.raises(DecodeFailed, match="TierCapacityError"):
            worker.serve(tokens(rng, 60))  # 15 pages: more than prefill's device pool
        assert worker.metrics.failed_attempts == 2 and worker.metrics.failed_requests == 1
        assert worker.pool.num_free_pages == free
        assert worker.landing.pool.used == 0
        tier.check_invariants()
        with torch.inference_mode():  # the connection and both workers carry on
            decode_step(model, worker, worker.serve(tokens(rng, 13)), tokens(rng, 2))
    finally:
        close_decode_side(worker)


@pytest.mark.slow
def test_a_stalled_prefill_times_out_and_its_landing_rows_stay_quarantined(
    model: MiniLlama,
) -> None:
    from _pd_support import start

    process = start("tcp")
    setup = setup_for("tcp", l1_pages=64, l2_pages=32, timeout_s=2.0, landing_rows=32)
    worker, _ = decode_side(setup, process.connect(), model)
    rng = random.Random(13)
    try:
        os.kill(process.proc.pid, signal.SIGSTOP)
        try:
            prompt = tokens(rng, 30)  # 8 landing rows per attempt
            with torch.inference_mode(), pytest.raises(DecodeFailed, match="no answer"):
                worker.serve(prompt)
            assert worker.quarantined_rows == 16
            assert worker.landing.pool.used == 16
            worker.tier.check_invariants()  # type: ignore[union-attr]
        finally:
            os.kill(process.proc.pid, signal.SIGCONT)
        # Prefill wakes up and answers the stale requests; the next request collects those
        # answers on its way and gives the quarantined rows back.
        with torch.inference_mode():
            decode_step(model, worker, worker.serve(tokens(rng, 9)), tokens(rng, 2))
        assert worker.quarantined_rows == 0
        assert worker.landing.pool.used == 0
    finally:
        close_decode_side(worker)
        process.stop()


def test_a_dead_prefill_fails_requests_in_bounded_time(model: MiniLlama) -> None:
    from _pd_support import start

    process = start("tcp")
    setup = setup_for("tcp", l1_pages=64, l2_pages=32, timeout_s=5.0)
    worker, _ = decode_side(setup, process.connect(), model)
    rng = random.Random(14)
    try:
        process.proc.kill()
        process.proc.wait(10)
        free = worker.pool.num_free_pages
        with torch.inference_mode(), pytest.raises(DecodeFailed):
            worker.serve(tokens(rng, 21))
        assert worker.pool.num_free_pages == free
        worker.tier.check_invariants()  # type: ignore[union-attr]
    finally:
        close_decode_side(worker)
        process.stop()
