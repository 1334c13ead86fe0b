"""Fixtures of the P/D tests: a real prefill worker process per transport, on the tiny model.

The prefill process (``bench.pd_worker``) keeps its cache across the decode connections of a
module; each test builds its own decode worker in this process (``decode_side``) and closes it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _pd_support import CONFIG, TRANSPORTS, start

from hicache_store.demo.bench.pd_worker import PrefillProcess
from hicache_store.demo.engine.model import MiniLlama


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    # Bit-exact logits across processes need equal intra-op thread counts (engine.model).
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> MiniLlama:
    return MiniLlama(CONFIG)


@pytest.fixture(scope="module", params=TRANSPORTS)
def prefill(request: pytest.FixtureRequest) -> Iterator[PrefillProcess]:
    """A prefill worker process for the module, one per transport."""
    process = start(request.param)
    try:
        yield process
    finally:
        process.stop()
