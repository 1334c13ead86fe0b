"""One request through a cache tier, the way an engine serves it, checked against recompute.

``serve`` (the demo engine's, ``demo.hybrid.serve``) is the documented call order on
``HiCache``'s public API only: ``match`` -> ``prepare`` -> prefill of the suffix (a
``MiniLlama`` over the tier's pool, a ``HybridMiniLlama`` with its window and recurrent
components restored and captured, a sidecar draft model beside it) -> ``complete``.
``serve_checked`` adds what every tier, hybrid, distributed and P/D test asserts of a served
request: the suffix's logits equal a full recompute bit for bit (``assert_equals_recompute``,
which the P/D tests' decode steps use too), and (unless told not to) the tier's invariants
hold afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache_store.demo.engine.model import MiniLlama
from hicache_store.demo.hybrid import HybridMiniLlama, Served, serve
from hicache_store.tier.cache import HiCache

__all__ = ["Served", "assert_equals_recompute", "assert_recomputed", "serve", "serve_checked"]


def assert_equals_recompute(
    model: MiniLlama | HybridMiniLlama,
    tokens: Sequence[int],
    logits: torch.Tensor,
    start: int,
    message: str = "logits differ from a full recompute",
) -> None:
    """``logits`` of ``tokens[start:]`` equal a full recompute of ``tokens``, bit for bit."""
    expected = model.forward_full(torch.tensor(list(tokens)))[start:]
    assert torch.equal(logits, expected), message


def assert_recomputed(
    model: MiniLlama | HybridMiniLlama,
    tokens: Sequence[int],
    served: Served,
    message: str = "logits differ from a full recompute",
) -> None:
    """The served suffix's logits equal a full recompute of ``tokens``, bit for bit."""
    assert_equals_recompute(model, tokens, served.logits, served.start, message)


def serve_checked(
    tier: HiCache,
    model: MiniLlama | HybridMiniLlama,
    tokens: Sequence[int],
    *,
    message: str = "logits differ from a full recompute",
    invariants: bool = True,
    **options: object,
) -> Served:
    """``serve`` (``options`` passed on), then ``assert_recomputed`` (a sidecar draft's
    logits against the draft model's own recompute too) and, with ``invariants``,
    ``tier.check_invariants()``."""
    served = serve(tier, model, tokens, **options)  # type: ignore[arg-type]
    assert_recomputed(model, tokens, served, message)
    draft = options.get("draft")
    if draft is not None:
        draft_model, _ = draft  # type: ignore[misc]
        assert served.draft_logits is not None
        assert_equals_recompute(draft_model, tokens, served.draft_logits, served.start,
                                "draft logits differ from a full recompute")
    if invariants:
        tier.check_invariants()
    return served
