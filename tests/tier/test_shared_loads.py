"""Two requests in flight over the same pages: the second uses L1 copies the first request's
L2 -> L1 load is still filling. It must wait for that load (never compute on a half-filled
page) and fail with it; aborting either leaves no untrusted copy behind."""

from __future__ import annotations

import threading

import pytest
import torch
from test_tier_extend_abort import CONFIG, make_tier, serve, tokens

import hicache_store.tier.pools as tier_pools
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.tier.cache import HiCache
from hicache_store.tier.components import KV_TAG


@pytest.fixture(scope="module")
def model() -> MiniLlama:
    return MiniLlama(CONFIG)


def cold_l1(tier: HiCache) -> None:
    """Evict L1 and poison the freed pages: a copy read before its load would be NaN."""
    tier.evict_device()
    for buf in [*tier.pool.k_buffers, *tier.pool.v_buffers]:
        buf.fill_(float("nan"))


def test_a_request_using_pages_another_is_loading_waits_for_that_load(
    model: MiniLlama, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(l1_pages=32, l2_pages=32)
    doc = tokens(21, 16)
    serve(tier, model, doc)
    cold_l1(tier)
    gate = threading.Event()
    real = tier_pools.unpack_pages

    def gated(*args: object, **kwargs: object) -> None:
        assert gate.wait(30), "the test never opened the gate"
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tier_pools, "unpack_pages", gated)
    first, second = [*doc, 1, 2], [*doc, 3]
    a = tier.match(first)
    prep_a = tier.prepare(a)  # starts loading the doc's 4 pages; the copy waits for the gate
    b = tier.match(second)
    prep_b = tier.prepare(b)  # the doc's pages are "in L1": their copies are A's load's
    assert prep_b.start == 16
    assert prep_b.wait_layer is not None, "B would compute on pages A is still loading"
    out: dict[str, torch.Tensor] = {}
    worker = threading.Thread(
        target=lambda: out.setdefault(
            "b",
            model.prefill(
                torch.tensor(second[16:]), 16, prep_b.slots, tier.pool,  # type: ignore[arg-type]
                wait_layer=prep_b.wait_layer,
            ),
        )
    )
    worker.start()
    gate.set()
    worker.join(30)
    assert torch.equal(out["b"], model.forward_full(torch.tensor(second))[16:])
    logits_a = model.prefill(
        torch.tensor(first[16:]), 16, prep_a.slots, tier.pool,  # type: ignore[arg-type]
        wait_layer=prep_a.wait_layer,
    )
    assert torch.equal(logits_a, model.forward_full(torch.tensor(first))[16:])
    tier.complete(b)  # B first: A's load is still A's
    tier.complete(a)
    tier.check_invariants()
    assert serve(tier, model, [*doc, 4]) == 16


@pytest.mark.parametrize("first_to_abort", ["loader", "borrower"])
def test_a_failed_load_fails_every_request_using_it_and_leaves_no_copy(
    model: MiniLlama, monkeypatch: pytest.MonkeyPatch, first_to_abort: str
) -> None:
    tier = make_tier(l1_pages=32, l2_pages=32)
    doc = tokens(22, 16)
    serve(tier, model, doc)
    cold_l1(tier)

    real = tier_pools.unpack_pages

    def failing(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected: host-to-device copy failed")

    monkeypatch.setattr(tier_pools, "unpack_pages", failing)
    a = tier.match([*doc, 1])
    prep_a = tier.prepare(a)
    b = tier.match([*doc, 2])
    prep_b = tier.prepare(b)
    for prep in (prep_a, prep_b):
        assert prep.wait_layer is not None
        with pytest.raises(RuntimeError, match="loading cached KV"):
            prep.wait_layer(0)
    first, second = (a, b) if first_to_abort == "loader" else (b, a)
    tier.abort(first)
    # The copies stay while the other request holds them; a newcomer using them fails too.
    c = tier.match([*doc, 3])
    prep_c = tier.prepare(c)
    assert prep_c.start == 16 and prep_c.wait_layer is not None
    with pytest.raises(RuntimeError, match="loading cached KV"):
        prep_c.wait_layer(0)
    tier.abort(c)
    tier.abort(second)
    monkeypatch.setattr(tier_pools, "unpack_pages", real)
    nodes = [tier.tree.get(h) for h in a.hashes[:4]]
    assert all(n is not None and n.copy(KV_TAG).l1 is None and n.copy(KV_TAG).lock == 0 for n in nodes), (
        "an untrusted L1 copy survived"
    )
    tier.check_invariants()
    assert serve(tier, model, [*doc, 5]) == 16  # from the L2 copies, exact
