"""The tier's hint API: pins keep pages in L1/L2 within a budget, deadlines, owners, demote /
drop / session_end, holds reaching L3 through ``Backend.retain``, the session policy fed from
the request path, and hints never changing what a hit returns (logits equal recompute)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from _mini_tier import CONFIG, make_tier, prompts
from _serve import serve_checked

from hicache_store.backends.base import Backend
from hicache_store.backends.errors import PinBudgetError
from hicache_store.backends.memory import MemoryBackend
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.tier.cache import HiCache
from hicache_store.tier.components import KV
from hicache_store.tier.hints import HintAction, RequestHints, ResponseEnd


@pytest.fixture(scope="module")
def model() -> MiniLlama:
    return MiniLlama(CONFIG)


def hints(now: float, session: str | None = "a", *actions: HintAction) -> RequestHints:
    return RequestHints(now_s=now, session=session, actions=actions)


PIN = HintAction("pin")


def serve(tier: HiCache, model: MiniLlama, tokens: list[int], h: RequestHints | None) -> int:
    return serve_checked(tier, model, tokens, hints=h).start


def churn(tier: HiCache, model: MiniLlama, seed: int, now: float = 10.0, n: int = 6) -> None:
    """Other sessions' prompts: enough to evict every unpinned page of a small tier."""
    for i, other in enumerate(prompts(seed, n, 33)):
        serve(tier, model, other, hints(now + i, f"other{i}"))


@pytest.mark.parametrize("l2_pages", [0, 16])
def test_a_pinned_prompt_stays_where_an_unpinned_one_is_evicted(
    model: MiniLlama, l2_pages: int
) -> None:
    (system,) = prompts(1, 1, 16)
    starts = {}
    for pin in (True, False):
        tier = make_tier(16, l2_pages, pin_fraction=0.5)
        serve(tier, model, [*system, 1], hints(0.0, "a", *([PIN] if pin else [])))
        assert tier.hinting.pins.pinned == (4 if pin else 0)
        assert tier.metrics.others["pinned_pages"] == (4 if pin else 0)
        churn(tier, model, seed=2)
        assert tier.metrics.evictions_l1 > 0
        starts[pin] = serve(tier, model, [*system, 2, 3], hints(20.0, "a"))
        if pin:
            assert tier.metrics.hit_tokens_l1 >= 16  # its L1 copy stayed
            if l2_pages:
                assert tier.metrics.evictions_l2 > 0
                req = tier.match([*system, 1])
                pinned = tier.tree.match(req.hashes)
                assert len(pinned) == 4
                assert all(n.copy(KV.tag).l2 is not None for n in pinned)  # and its L2 copy
                tier.abort(req)
        tier.close()
    assert starts == {True: 16, False: 0}


def test_a_pin_past_the_budget_is_refused_whole_and_nothing_is_taken(model: MiniLlama) -> None:
    tier = make_tier(16, 32, pin_fraction=0.25)  # budgets: L1 4 pages, L2 8
    first, second = prompts(3, 2, 12)
    serve(tier, model, [*first, 1], hints(0.0, "a", PIN))  # 3 pages pinned
    assert tier.hinting.pins.pinned == 3
    with pytest.raises(PinBudgetError, match=r"L1 pin budget of 4 pages \(3 pinned"):
        tier.match([*second, 1], hints=hints(1.0, "b", PIN))
    assert tier.hinting.pins.reserved == 0 and tier.hinting.pins.pinned == 3
    tier.check_invariants()
    # The tier goes on serving; the refused request's own pages were never pinned.
    assert serve(tier, model, [*second, 1], hints(2.0, "b")) == 0
    assert tier.hinting.pins.pinned == 3
    # Re-pinning pages already pinned costs nothing: they are counted once.
    serve(tier, model, [*first, 5], hints(3.0, "b", PIN))
    assert tier.hinting.pins.pinned == 3
    tier.close()


def test_a_refused_range_or_another_namespace_is_an_error_before_anything(model: MiniLlama) -> None:
    tier = make_tier(16)
    (doc,) = prompts(4, 1, 12)
    with pytest.raises(ValueError, match="not within the prompt of 12 tokens"):
        tier.match(doc, hints=hints(0.0, "a", HintAction("pin", 0, 13)))
    other = dataclasses.replace(hints(0.0, "a", PIN), namespace="0123456789abcdef")
    with pytest.raises(ValueError, match="namespace '0123456789abcdef'"):
        tier.match(doc, hints=other)
    mine = dataclasses.replace(hints(0.0, "a", PIN), namespace=tier.namespace.digest)
    assert serve(tier, model, doc, mine) == 0
    assert tier.hinting.pins.pinned == 3
    assert tier.requests_seen == 3 and tier.metrics.requests == 1
    tier.close()


def test_deadlines_expire_and_only_the_owner_shortens(model: MiniLlama) -> None:
    tier = make_tier(16, pin_fraction=0.5, eviction_policy="lru")
    (doc,) = prompts(5, 1, 16)
    (other,) = prompts(6, 1, 8)
    serve(tier, model, [*doc, 1], hints(0.0, "a", HintAction("pin", duration_s=100.0)))
    # Another session pins the same pages for less: it cannot shorten a's pin.
    serve(tier, model, [*doc, 2], hints(1.0, "b", HintAction("pin", duration_s=10.0)))
    serve(tier, model, [*other, 1], hints(50.0, "c"))
    assert tier.hinting.pins.pinned == 4
    # The owner shortens its own pin (until 52); b's expired at 11.
    serve(tier, model, [*doc, 3], hints(51.0, "a", HintAction("pin", duration_s=1.0)))
    assert tier.hinting.pins.pinned == 4
    serve(tier, model, [*other, 2], hints(53.0, "c"))
    assert tier.hinting.pins.pinned == 0
    # The pages are ordinary again: churn evicts them.
    churn(tier, model, seed=7, now=54.0)
    assert serve(tier, model, [*doc, 4], hints(60.0, "a")) == 0
    tier.close()


def test_a_pin_held_by_another_session_outlives_the_owners_drop(model: MiniLlama) -> None:
    tier = make_tier(16, pin_fraction=0.5)
    (doc,) = prompts(8, 1, 16)
    serve(tier, model, [*doc, 1], hints(0.0, "a", PIN))
    serve(tier, model, [*doc, 2], hints(1.0, "b", PIN))
    serve(tier, model, [*doc, 3], hints(2.0, "a", HintAction("drop")))
    assert tier.hinting.pins.pinned == 4  # b's pin holds
    serve(tier, model, [*doc, 4], hints(3.0, "b", HintAction("session_end")))
    assert tier.hinting.pins.pinned == 0
    tier.close()


def test_demote_moves_pages_to_l2_and_drop_gives_them_up(model: MiniLlama) -> None:
    tier = make_tier(16, 32)
    (doc,) = prompts(9, 1, 16)
    serve(tier, model, [*doc, 1], hints(0.0, "a", PIN))
    serve(tier, model, [*doc, 2], hints(1.0, "a", HintAction("demote")))
    tier.flush()
    assert tier.hinting.pins.pinned == 0
    assert tier.metrics.others["hint_demoted_copies"] == 4
    l2_before = tier.metrics.hit_tokens_l2
    assert serve(tier, model, [*doc, 3], hints(2.0, "a", HintAction("drop"))) == 16
    assert tier.metrics.hit_tokens_l2 - l2_before == 16  # served from L2 after the demote
    tier.flush()
    assert tier.metrics.others["hint_dropped_copies"] >= 4
    assert serve(tier, model, [*doc, 4], hints(3.0, "a")) == 0  # dropped everywhere
    tier.close()


class NoRetention(MemoryBackend):
    capabilities = dataclasses.replace(MemoryBackend.capabilities, retention=False)


def test_pins_and_retention_reach_l3_and_session_end_releases_them(model: MiniLlama) -> None:
    backend = MemoryBackend()
    tier = make_tier(16, 32, backend)
    (doc,) = prompts(10, 1, 16)
    serve(tier, model, [*doc, 1], hints(0.0, "s1", HintAction("pin", 0, 8)))
    serve(tier, model, [*doc, 2], hints(1.0, "s2", HintAction("retain", priority=7,
                                                              duration_s=600.0)))
    tier.flush()
    keys = tier.hinting._keys([n.page_hash for n in tier.tree.match(tier.match(doc).hashes)])
    tier.abort(tier.match(doc))
    assert len(keys) == 4
    entries = backend_retention(backend, keys)
    assert [sorted(e.owner for e in es) for es in entries] == (
        [["s1", "s2#retain"]] * 2 + [["s2#retain"]] * 2)
    s1 = next(e for e in entries[0] if e.owner == "s1")
    s2 = next(e for e in entries[3] if e.owner == "s2#retain")
    assert s1.pinned and s1.until_s is None
    assert not s2.pinned and s2.priority == 7 and s2.until_s is not None
    assert tier.metrics.others["hint_l3_pinned_pages"] == 2
    assert tier.metrics.others["hint_l3_retained_pages"] == 4
    serve(tier, model, [*doc, 3], hints(2.0, "s1", HintAction("session_end")))
    tier.flush()
    assert [sorted(e.owner for e in es) for es in backend_retention(backend, keys)] == [
        ["s2#retain"]
    ] * 4
    assert tier.metrics.others["hint_l3_released_pages"] == 2
    tier.close()


def test_a_later_retain_by_the_session_never_unpins_its_pages_in_l3(model: MiniLlama) -> None:
    backend = MemoryBackend()
    tier = make_tier(16, 32, backend)
    (doc,) = prompts(13, 1, 16)
    serve(tier, model, [*doc, 1], hints(0.0, "s", HintAction("pin", 0, 8)))
    serve(tier, model, [*doc, 2], hints(1.0, "s", HintAction("retain", priority=2)))
    tier.flush()
    keys = tier.hinting._keys([n.page_hash for n in tier.tree.match(tier.match(doc).hashes)])
    tier.abort(tier.match(doc))
    entries = backend_retention(backend, keys)
    pinned = [any(e.pinned for e in es) for es in entries]  # type: ignore[attr-defined]
    assert pinned == [True, True, False, False]
    serve(tier, model, [*doc, 3], hints(2.0, "s", HintAction("session_end")))
    tier.flush()
    assert backend_retention(backend, keys) == [()] * 4
    tier.close()


def backend_retention(backend: Backend, keys: list[str]) -> list[tuple[object, ...]]:
    from hicache_store._sync import run_sync

    return run_sync(backend.retention_of(keys))  # type: ignore[return-value]


def test_an_l3_pin_the_backend_refuses_is_counted_never_raised(model: MiniLlama) -> None:
    # L3 takes the pages but its pin budget (0.5% of 1 MiB) is below one page's objects.
    backend = MemoryBackend(capacity_bytes=1 << 20, pin_fraction=0.005)
    tier = make_tier(16, 32, backend)
    (doc,) = prompts(11, 1, 16)
    serve(tier, model, [*doc, 1], hints(0.0, "a", PIN))
    tier.flush()
    assert tier.metrics.others["hint_l3_refused_pages"] == 4
    assert tier.hinting.pins.pinned == 4  # L1/L2 pins hold
    assert serve(tier, model, [*doc, 2], hints(1.0, "a")) == 16
    tier.close()


def test_a_backend_without_retention_is_counted_never_an_error(model: MiniLlama) -> None:
    tier = make_tier(16, 32, NoRetention())
    (doc,) = prompts(12, 1, 16)
    serve(tier, model, [*doc, 1], hints(0.0, "a", PIN, HintAction("retain", priority=1)))
    tier.flush()
    assert tier.metrics.others["hint_l3_unsupported"] == 2
    assert tier.hinting.pins.pinned == 4
    tier.close()


def test_abort_gives_the_pin_reservation_back(model: MiniLlama) -> None:
    tier = make_tier(16, pin_fraction=0.25)
    (doc,) = prompts(13, 1, 16)
    req = tier.match([*doc, 1], hints=hints(0.0, "a", PIN))
    assert tier.hinting.pins.reserved == 4
    tier.prepare(req)
    tier.abort(req)
    assert tier.hinting.pins.reserved == 0 and tier.hinting.pins.pinned == 0
    tier.check_invariants()
    tier.close()


def test_the_session_policy_gets_the_hints_of_the_request_path(model: MiniLlama) -> None:
    """Under ``session`` a session that said it ended loses its pages first; under LRU the
    least recently used session does. Same requests, same L1."""
    b_doc, a_doc, c_doc = prompts(14, 3, 16)
    starts = {}
    for policy in ("session", "lru"):
        tier = make_tier(12, eviction_policy=policy)
        serve(tier, model, [*b_doc, 1], hints(0.0, "b"))
        tier.response_end(ResponseEnd("b", "tool_use", 1.0))
        serve(tier, model, [*a_doc, 1], hints(2.0, "a", HintAction("session_end")))
        tier.response_end(ResponseEnd("a", "end_turn", 3.0))
        serve(tier, model, [*c_doc, 1, 2, 3, 4], hints(4.0, "c"))  # 5 pages, 4 free: evicts
        starts[policy] = (
            serve(tier, model, [*b_doc, 5], hints(5.0, "b")),
            serve(tier, model, [*a_doc, 5], hints(6.0, "a")),
        )
        tier.close()
    assert starts["session"][0] == 16 and starts["session"][1] < 16
    assert starts["lru"][0] < 16  # b was the least recently used


def test_hints_never_change_what_a_hit_returns(model: MiniLlama) -> None:
    """A random mix of requests with every action, through L1, L2 and L3: every served
    request's logits equal a full recompute, and the tier's bookkeeping holds after each."""
    rng = random.Random(15)
    docs = list(prompts(16, 5, 24))
    backend = MemoryBackend()
    tier = make_tier(24, 24, backend, pin_fraction=0.5, eviction_policy="session")
    plain = make_tier(24, 24, MemoryBackend(), pin_fraction=0.5, eviction_policy="session")
    now, most_pinned = 0.0, 0
    for i in range(16):
        doc = docs[rng.randrange(len(docs))][: rng.randrange(8, 25)]
        tokens = [*doc, *(rng.randrange(CONFIG.vocab_size) for _ in range(rng.randrange(1, 9)))]
        action = rng.choice(["pin", "retain", "prefetch", "demote", "drop", "session_end", None])
        acts = () if action is None else (
            HintAction(action, 0, rng.randrange(0, len(tokens) + 1),
                       duration_s=rng.choice([None, 3.0])),
        )
        now += 1.0
        session = f"s{rng.randrange(3)}"
        try:
            serve(tier, model, tokens, hints(now, session, *acts))
        except PinBudgetError:
            tier.check_invariants()
        most_pinned = max(most_pinned, tier.hinting.pins.pinned)
        serve(plain, model, tokens, None)
        if i % 7 == 0:
            tier.response_end(ResponseEnd(session, rng.choice(["tool_use", "end_turn"]), now))
            tier.evict_device()
    tier.flush()
    tier.check_invariants()
    assert most_pinned > 0 and tier.metrics.others["hint_l3_pinned_pages"] > 0
    assert tier.metrics.others["hint_demoted_copies"] + tier.metrics.others[
        "hint_dropped_copies"] > 0
    tier.close()
    plain.close()


def test_interleaved_requests_give_their_pages_to_their_own_sessions() -> None:
    """a and b are in flight together (b said its session ends); a completes first, while b
    was the last request announced. a's new pages are still a's: under pressure b's go first.
    Without hints, a third request's pages belong to no session."""
    tier = make_tier(12, eviction_policy="session")
    a_doc, b_doc, d_doc = prompts(17, 3, 16)
    a = tier.match([*a_doc, 1], hints=hints(0.0, "a"))
    b = tier.match([*b_doc, 1], hints=hints(0.5, "b", HintAction("session_end")))
    tier.prepare(a)
    tier.prepare(b)
    tier.complete(a)
    tier.complete(b)
    tier.response_end(ResponseEnd("a", "tool_use", 1.0))
    d = tier.match([*d_doc, 1, 2, 3])  # no hints: 5 pages, 4 free, so 1 page goes: b's
    tier.prepare(d)
    tier.complete(d)
    again = tier.match([*a_doc, 2], hints=hints(2.0, "a"))
    assert tier.prepare(again).start == 16
    tier.complete(again)
    again = tier.match([*b_doc, 2], hints=hints(3.0, "b"))
    assert tier.prepare(again).start < 16
    tier.complete(again)
    tier.check_invariants()
    tier.close()
