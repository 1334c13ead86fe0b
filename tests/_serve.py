"""One request through a cache tier, the way an engine serves it, checked against recompute.

``serve`` is the documented call order on ``HiCache``'s public API only: ``match`` ->
``prepare`` -> prefill of the suffix (the demo engine's ``prefill_prepared``: a ``MiniLlama``
over the tier's pool, a ``HybridMiniLlama`` with its window and recurrent components restored
and captured) -> ``complete``. ``serve_checked`` adds what every tier, hybrid, distributed and
P/D test asserts of a served request: the suffix's logits equal a full recompute bit for bit,
and (unless told not to) the tier's invariants hold afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.demo.hybrid import (
    HybridMiniLlama,
    RecurrentPool,
    Served,
    WindowPool,
    prefill_prepared,
)
from hicache_store.tier.cache import HiCache, Prepared, Request
from hicache_store.tier.hints import RequestHints

__all__ = ["Served", "assert_recomputed", "serve", "serve_checked"]


def serve(
    tier: HiCache,
    model: MiniLlama | HybridMiniLlama,
    tokens: Sequence[int],
    *,
    window: WindowPool | None = None,
    recurrent: RecurrentPool | None = None,
    need: Collection[str] | None = None,
    hints: RequestHints | None = None,
    after_match: Callable[[Request], None] | None = None,
    after_prepare: Callable[[Prepared], None] | None = None,
) -> Served:
    """Serve ``tokens``: match (``need``: the components to resume with, default all;
    ``hints``: the request's hints),
    ``after_match(request)``, prepare, ``after_prepare(prepared)``, prefill the suffix over
    ``tier.pool``, complete. The two hooks are a test's way in between the phases (to time
    them, let a prefetch run, look at the tier's accounting)."""
    toks = list(tokens)
    req = tier.match(toks, need=need, hints=hints)
    if after_match is not None:
        after_match(req)
    prep = tier.prepare(req)
    if after_prepare is not None:
        after_prepare(prep)
    pool: DeviceKVPool = tier.pool  # type: ignore[assignment]
    logits, _ = prefill_prepared(
        model, pool, toks, prep, tier.namespace.page_size, window=window, recurrent=recurrent
    )
    tier.complete(req)
    return Served(logits, prep.start, req, prep)


def assert_recomputed(
    model: MiniLlama | HybridMiniLlama,
    tokens: Sequence[int],
    served: Served,
    message: str = "logits differ from a full recompute",
) -> None:
    """The served suffix's logits equal a full recompute of ``tokens``, bit for bit."""
    expected = model.forward_full(torch.tensor(list(tokens)))[served.start :]
    assert torch.equal(served.logits, expected), message


def serve_checked(
    tier: HiCache,
    model: MiniLlama | HybridMiniLlama,
    tokens: Sequence[int],
    *,
    message: str = "logits differ from a full recompute",
    invariants: bool = True,
    **options: object,
) -> Served:
    """``serve`` (``options`` passed on), then ``assert_recomputed`` and, with
    ``invariants``, ``tier.check_invariants()``."""
    served = serve(tier, model, tokens, **options)  # type: ignore[arg-type]
    assert_recomputed(model, tokens, served, message)
    if invariants:
        tier.check_invariants()
    return served
