"""What several hybrid test modules share (imported by file name, like tests/distributed's tasks)."""

from __future__ import annotations

import torch

from hicache_store.hybrid.cache import HybridCache, run_request
from hicache_store.hybrid.model import HybridMiniLlama


def serve(cache: HybridCache, model: HybridMiniLlama, tokens: list[int]) -> int:
    """Serve one request, check its logits against a full recompute, return the reused tokens."""
    logits, _, prep = run_request(cache, model, tokens)
    expected = model.forward_full(torch.tensor(tokens))[prep.start :]
    assert torch.equal(logits, expected), "logits differ from a full recompute"
    cache.check_invariants()
    return prep.start
