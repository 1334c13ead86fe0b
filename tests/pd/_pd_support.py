"""Shared helpers of the P/D tests (the fixtures are in ``conftest``)."""

from __future__ import annotations

import random

import pytest
import torch
from _serve import assert_equals_recompute

from hicache_store.demo.bench.pd_worker import PrefillProcess, WorkerSetup, start_prefill
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.pd import DecodeWorker, Served

PAGE = 4
CONFIG = MiniLlamaConfig()  # the tiny preset: 4 layers, 2 KV heads of 16, float32

#: the transports every P/D test runs over. Mooncake's runs the same checks over a second
#: transport at about twice the CPU of tcp's (a transfer engine per worker), so it is left to
#: the full run (``slow``) and the fast loop checks P/D over tcp.
MOONCAKE_MARKS = (pytest.mark.mooncake, pytest.mark.slow)
TRANSPORTS = ["tcp", pytest.param("mooncake", marks=MOONCAKE_MARKS)]


def setup_for(transport: str, **options: object) -> WorkerSetup:
    options.setdefault("model", CONFIG.to_dict())
    return WorkerSetup(page_size=PAGE, transport=transport, **options)  # type: ignore[arg-type]


def start(transport: str, **options: object) -> PrefillProcess:
    """A prefill worker process on ``transport`` (256 L1 pages unless ``options`` say)."""
    if transport == "mooncake":
        pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is not installed")
    return start_prefill(setup_for(transport, **{"l1_pages": 256, **options}))


ROW = 4 * 2 * PAGE * 2 * 16 * 4  # bytes of one page: layers x K/V x tokens x heads x dim x 4


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def decode_step(model: MiniLlama, worker: DecodeWorker, served: Served, answer: list[int]) -> None:
    """Decode ``answer`` after the served prompt; its logits must equal a full recompute."""
    slots = served.extend(answer)
    n = len(served.prompt)
    logits = model.prefill(torch.tensor(answer), n, slots, worker.pool)  # type: ignore[arg-type]
    assert_equals_recompute(model, served.prompt + answer, logits, n,
                            "decode logits differ from a single-process recompute")
    served.finish()


