"""The ``session`` eviction policy: retention by predicted return time, from hints only.

Crafted sequences check the order (the session predicted back last loses its pages first,
least recent then deepest within it; a finished subagent before any live session; an overdue
session by how long it has waited); a recording policy checks that a replay hands it nothing
from the future; without a session signal it is its fallback, call for call.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _trace_helpers import random_tree_trace

from hicache_store.demo.bench.trace_format import SessionFields, Trace, TraceRequest
from hicache_store.demo.bench.trace_sim import block_policy, simulate
from hicache_store.tier.eviction import (
    DEFAULT_HUMAN_GAP_S,
    DEFAULT_TOOL_GAP_S,
    ARCEviction,
    SessionEviction,
    make_eviction_policy,
    takes_hints,
)
from hicache_store.tier.hints import HintAction, RequestHints, ResponseEnd


def depth_of(node: str) -> int:
    return len(node) - 1  # nodes named by their path: "a", "ab", "abc"


def policy() -> SessionEviction[str]:
    return SessionEviction(100, depth_of, lambda n: n)


def serve(p: SessionEviction[str], hints: RequestHints, chain: str) -> None:
    """One request of ``hints.session`` using the chain ``chain`` ("abc": a, ab, abc)."""
    p.begin_request()
    p.hint_request(hints)
    nodes = [chain[: i + 1] for i in range(len(chain))]
    for depth, node in enumerate(nodes):
        if node not in p._owned and node not in p.fallback._leaves.states:
            p.admit(node)
            p.set_evictable(node, True)
            if depth:
                p.set_evictable(nodes[depth - 1], False)
        p.touch(node)


def drain(p: SessionEviction[str]) -> list[str]:
    """Victims until empty, each evicted (its parent becoming a leaf when it was the last)."""
    out: list[str] = []
    resident = set(p._owned) | set(p.fallback._leaves.states)
    while (node := p.victim()) is not None:
        p.evict(node)
        resident.discard(node)
        out.append(node)
        up = node[:-1]
        if up and up in resident and not any(r[:-1] == up for r in resident):
            p.set_evictable(up, True)
    return out


def test_the_session_predicted_back_last_goes_first_tail_first() -> None:
    p = policy()
    serve(p, RequestHints(0.0, "tool"), "ab")
    serve(p, RequestHints(1.0, "human"), "xyz")
    p.hint_response(ResponseEnd("tool", "tool_use", 5.0))
    p.hint_response(ResponseEnd("human", "end_turn", 5.0))
    # in flight: back after a response time (the median of 5 s and 4 s seen so far: 5 s), then
    # its tool gap
    serve(p, RequestHints(8.0, "live"), "m")
    assert p.predicted_return("tool") == 5.0 + DEFAULT_TOOL_GAP_S
    assert p.predicted_return("human") == 5.0 + DEFAULT_HUMAN_GAP_S
    assert p.predicted_return("live") == 8.0 + 5.0 + DEFAULT_TOOL_GAP_S
    assert drain(p) == ["xyz", "xy", "x", "m", "ab", "a"]


def test_an_overdue_session_is_expected_to_wait_as_long_again() -> None:
    p = policy()
    serve(p, RequestHints(0.0, "stale"), "a")
    p.hint_response(ResponseEnd("stale", "tool_use", 1.0))
    serve(p, RequestHints(990.0, "human"), "x")
    p.hint_response(ResponseEnd("human", "end_turn", 995.0))
    serve(p, RequestHints(1000.0, "live"), "m")
    # stale: due at 11 s, 999 s overdue -> 1999; human: due at 1295
    assert p.predicted_return("stale") == 1000.0 + 999.0
    assert drain(p) == ["a", "x", "m"]


def test_a_finished_subagent_goes_before_live_sessions() -> None:
    p = policy()
    serve(p, RequestHints(0.0, "s/agent", "s", "subagent", session_start=True), "q")
    serve(p, RequestHints(1.0, "s"), "a")
    p.hint_response(ResponseEnd("s", "end_turn", 2.0))
    p.hint_response(ResponseEnd("s/agent", "end_turn", 3.0))
    serve(p, RequestHints(4.0, "t"), "x")
    assert drain(p) == ["q", "a", "x"]


def test_a_session_that_said_it_ends_goes_first() -> None:
    p = policy()
    serve(p, RequestHints(0.0, "done", actions=(HintAction("session_end"),)), "a")
    serve(p, RequestHints(1.0, "human"), "x")
    p.hint_response(ResponseEnd("human", "end_turn", 2.0))
    p.hint_response(ResponseEnd("done", "tool_use", 2.0))
    serve(p, RequestHints(3.0, "t"), "m")
    assert p.predicted_return("done") == float("inf")
    assert drain(p) == ["a", "x", "m"]


def test_gaps_are_learned_from_the_sessions_own_history() -> None:
    p = policy()
    for n in range(3):  # tool_use responses ending at 10n + 1, next request at 10n + 10
        serve(p, RequestHints(10.0 * n, "s", previous_stop="tool_use" if n else None,
                              previous_end_s=10.0 * n - 9 if n else None), "a")
    p.hint_response(ResponseEnd("s", "tool_use", 21.0))
    serve(p, RequestHints(22.0, "t"), "x")
    assert p.predicted_return("s") == 21.0 + 9.0  # the median of its own gaps, 9 s


def test_a_response_in_flight_is_expected_to_take_its_usual_time() -> None:
    p = policy()
    for n, duration in enumerate((2.0, 30.0, 4.0)):  # responses of s: 2, 30 and 4 s
        start = 100.0 * n
        serve(p, RequestHints(start, "s"), "a")
        p.hint_response(ResponseEnd("s", "tool_use", start + duration))
    # its tool gaps so far: 98, 70, 96 s (median 96)
    serve(p, RequestHints(300.0, "s", previous_stop="tool_use", previous_end_s=204.0), "a")
    serve(p, RequestHints(303.0, "t"), "x")  # the clock: 3 s into s's response
    # the median of the responses longer than 3 s (4, 30): 30 s, then the tool gap
    assert p.predicted_return("s") == 300.0 + 30.0 + 96.0
    serve(p, RequestHints(301.0, "t"), "x")  # 1 s in: 2, 4, 30 are longer, median 4
    assert p.predicted_return("s") == 303.0 - 3.0 + 30.0 + 96.0  # the clock never goes back
    serve(p, RequestHints(340.0, "t"), "x")  # 40 s in, longer than any: it may end now
    assert p.predicted_return("s") == 340.0 + 96.0


def test_a_branch_the_latest_request_left_goes_first() -> None:
    p = policy()
    serve(p, RequestHints(0.0, "h"), "xyz")
    p.hint_response(ResponseEnd("h", "end_turn", 1.0))  # h: back in minutes
    first = RequestHints(2.0, "s")
    serve(p, first, "abc")
    # Another request arrives (its clock ticks), then s's request is announced again (the
    # tier does so when it completes): the same request, so its pages are still on its path.
    serve(p, RequestHints(2.5, "t"), "m")
    p.hint_request(first)
    assert p.victim() == "xyz"
    p.hint_response(ResponseEnd("s", "tool_use", 3.0))
    # s comes back (due soonest) with its history edited: "abc" is off its path and goes
    # before every page of a session that may still come back.
    serve(p, RequestHints(4.0, "s", previous_stop="tool_use", previous_end_s=3.0), "abq")
    # Then h (due at 301 s); s (in flight, its one response took 1 s: due at 4 + 1 + 10) and t
    # (in flight for 1.5 s, longer than any response seen: due at 4 + 10).
    assert drain(p) == ["abc", "xyz", "xy", "x", "abq", "ab", "a", "m"]


def test_a_page_changes_hands_with_its_last_user() -> None:
    p = policy()
    serve(p, RequestHints(0.0, "a"), "ab")
    p.hint_response(ResponseEnd("a", "end_turn", 1.0))
    serve(p, RequestHints(2.0, "b"), "a")  # b shares a's first page
    p.hint_response(ResponseEnd("b", "tool_use", 3.0))
    serve(p, RequestHints(4.0, "c"), "z")
    # a (human, far) loses its tail; the shared page is b's now (due at 13 s) and outlasts
    # c's (in flight, due at 14 s)
    assert drain(p) == ["ab", "z", "a"]


def test_pages_used_without_a_session_compete_by_age() -> None:
    p = policy()
    serve(p, RequestHints(0.0), "f")  # no session: the fallback's
    serve(p, RequestHints(1.0, "s"), "a")
    p.hint_response(ResponseEnd("s", "tool_use", 2.0))
    serve(p, RequestHints(100.0, "t"), "x")
    # f: used at 0 -> next use expected at 200; s: due at 12, overdue -> 198; t in flight
    assert p.fallback_pages == 1
    assert drain(p) == ["f", "a", "x"]


def test_hints_refuse_the_future_and_nonsense() -> None:
    with pytest.raises(ValueError, match="future"):
        RequestHints(1.0, "s", previous_stop="tool_use", previous_end_s=2.0)
    with pytest.raises(ValueError, match="session id"):
        RequestHints(1.0, None, previous_stop="tool_use")
    with pytest.raises(ValueError, match="kind"):
        RequestHints(1.0, "s", kind="robot")
    with pytest.raises(ValueError, match="not one of"):
        HintAction("keep")
    with pytest.raises(ValueError, match="range"):
        HintAction("pin", 10, 5)
    assert RequestHints(5.0, "s", previous_stop="end_turn", previous_end_s=2.0).idle_s == 3.0


def session_trace(rng: random.Random, requests: int) -> Trace:
    """Random prefix-consistent requests of four sessions with stops, ends and subagents."""
    base = random_tree_trace(rng, requests, 4)
    out: list[TraceRequest] = []
    previous: dict[str, tuple[str, int]] = {}
    now = 0
    for request in base.requests:
        now += rng.choice([0, 1000, 3000, 60000])
        session = f"s{rng.randrange(4)}"
        agent = rng.choice([None, None, "agent_1"])
        stream = session if agent is None else f"{session}/{agent}"
        stop = rng.choice(["tool_use", "end_turn", ""])
        end = now + rng.randrange(0, 5000)
        before = previous.get(stream)
        previous[stream] = (stop, end)
        info = SessionFields(session, agent, stop, end, None if before is None else before[0],
                             None if before is None else before[1], before is None and bool(agent))
        out.append(TraceRequest(now, request.input_length, 0, request.hash_ids, info))
    return Trace("sessions", 4, tuple(out))


class Recorder(SessionEviction[int]):
    """A ``session`` policy that records the clock of everything it is handed."""

    def __init__(self, trace: Trace, capacity: int) -> None:
        depth = {b: d for r in trace.requests for d, b in enumerate(r.hash_ids)}
        super().__init__(capacity, depth.__getitem__, lambda b: b)
        self.requests = 0
        self.seen: list[tuple[int, float]] = []  # (request index, time handed over)

    def begin_request(self) -> None:
        super().begin_request()
        self.requests += 1

    def hint_request(self, hints: RequestHints) -> None:
        self.seen.append((self.requests - 1, hints.now_s))
        if hints.previous_end_s is not None:
            self.seen.append((self.requests - 1, hints.previous_end_s))
        super().hint_request(hints)

    def hint_response(self, end: ResponseEnd) -> None:
        self.seen.append((self.requests - 1, end.end_s))
        super().hint_response(end)


def test_a_replay_hands_the_policy_nothing_from_the_future() -> None:
    trace = session_trace(random.Random(3), 300)
    recorder = Recorder(trace, 12)
    simulate(trace, 12, recorder)
    assert recorder.requests == len(trace)
    ends = sum(1 for r in trace.requests[:-1] if r.session)
    assert len(recorder.seen) > ends  # responses and requests were handed over
    for index, when in recorder.seen:
        assert when <= trace.requests[index].timestamp_ms / 1000


@pytest.mark.parametrize("seed", range(4))
def test_without_a_session_signal_it_is_its_fallback(seed: int) -> None:
    trace = random_tree_trace(random.Random(seed), 400, 4)
    for capacity in (3, 8, 20):
        session = block_policy("session", trace, capacity)
        assert takes_hints(session)
        ours = simulate(trace, capacity, session)
        theirs = simulate(trace, capacity, block_policy("arc", trace, capacity))
        assert (ours.hit_tokens, ours.second_half_hit_tokens) == (
            theirs.hit_tokens, theirs.second_half_hit_tokens)
        assert isinstance(session, SessionEviction)
        assert isinstance(session.fallback, ARCEviction)
        assert session.fallback_pages == len(session)


def test_victims_match_the_fallback_call_for_call() -> None:
    rng = random.Random(9)
    trace = random_tree_trace(rng, 200, 4)
    depth = {b: d for r in trace.requests for d, b in enumerate(r.hash_ids)}

    class Twin(SessionEviction[int]):
        touch_path = None  # every touch goes through touch()

        def __init__(self) -> None:
            super().__init__(6, depth.__getitem__, lambda b: b, fallback="lru")
            self.twin = make_eviction_policy("lru", 6, depth.__getitem__, lambda b: b)

        def begin_request(self) -> None:
            super().begin_request()
            self.twin.begin_request()

        def admit(self, node: int) -> None:
            super().admit(node)
            self.twin.admit(node)

        def touch(self, node: int) -> None:
            super().touch(node)
            self.twin.touch(node)

        def set_evictable(self, node: int, evictable: bool) -> None:
            super().set_evictable(node, evictable)
            self.twin.set_evictable(node, evictable)

        def victim(self) -> int | None:
            ours = super().victim()
            assert ours == self.twin.victim()
            return ours

        def evict(self, node: int) -> None:
            super().evict(node)
            self.twin.evict(node)

    twin = Twin()
    simulate(trace, 6, twin)
