"""vLLM's ``kv_hints`` envelope read and applied (``integrations/vllm/_hints.py``), no engine.

The envelope is vLLM's own ``KvHintsEnvelope`` (and its JSON form); holds go to the real file
backend (bounded, with its pin budget) and are read back with ``retention_of``. The secondary
tier is driven as vLLM's tiering manager drives it (``test_secondary_tier_unit.Harness``), with a
``ReqContext`` carrying the envelope and vLLM's key positions.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_secondary_tier_unit import CHUNKS, END, ROW, Harness, key
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import ReqContext

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.retention import Retention
from hicache_store.integrations.vllm._hints import (
    HintError,
    HintSink,
    KeyOp,
    Unit,
    ops_for,
    parse_envelope,
)

NS = "0123456789abcdef"


def envelope(*actions: tuple[str, dict[str, Any]], version: str = "1") -> KvHintsEnvelope:
    return KvHintsEnvelope("1", "msg-1", [
        KvHintAction(f"a{i}", kind, version, payload) for i, (kind, payload) in enumerate(actions)
    ])


# -- the envelope ----------------------------------------------------------------------------------


def test_vllms_envelope_and_its_json_form_read_the_same() -> None:
    env = envelope(("Pin", {"session": "conv", "end_token": 40, "duration_s": 60}),
                   ("retain", {"session": "conv", "priority": 3}),
                   ("share", {"peer": "x"}), ("prefetch", {}))
    parsed = parse_envelope(env, now_s=10.0, namespace=NS)
    assert parsed is not None
    assert parsed.owner == "conv" and parsed.skipped == ("share",)
    assert [(a.action, a.end_token, a.priority, a.duration_s) for a in parsed.hints.actions] == [
        ("pin", 40, 0, 60.0), ("retain", None, 3, None), ("prefetch", None, 0, None)]
    assert parse_envelope(msgspec.to_builtins(env), now_s=10.0, namespace=NS) == parsed


def test_no_envelope_or_no_action_is_no_hints() -> None:
    assert parse_envelope(None, now_s=1.0, namespace=NS) is None
    assert parse_envelope(envelope(), now_s=1.0, namespace=NS) is None
    no_session = parse_envelope(envelope(("pin", {})), now_s=1.0, namespace=NS)
    assert no_session is not None and no_session.owner == "anonymous"


@pytest.mark.parametrize(("env", "named"), [
    ({"protocol_version": "1", "message_id": "m"}, "'actions' is missing"),
    ({"protocol_version": 1, "message_id": "m", "actions": []}, "protocol_version"),
    ({"protocol_version": "1", "message_id": "m", "actions": {}}, "actions must be a list"),
    (envelope(("pin", {})), None),  # the valid one, as a control
    (envelope(("pin", {}), version="2"), "action_version '2'"),
    (envelope(("pin", {"duration": 5})), "unknown payload keys ['duration']"),
    (envelope(("pin", {"start_token": -1})), "start_token"),
    (envelope(("pin", {"start_token": 30, "end_token": 10})), "[30, 10)"),
    (envelope(("retain", {"priority": True})), "priority"),
    (envelope(("retain", {"duration_s": math.nan})), "duration_s"),
    (envelope(("pin", {"session": ""})), "session"),
    (envelope(("pin", {"session": "a"}), ("drop", {"session": "b"})), "one session"),
    (envelope(("pin", {"namespace": "ffffffffffffffff"})), "another deployment"),
    ({"protocol_version": "1", "message_id": "m",
      "actions": [{"action_id": "a", "action_type": "pin", "action_version": "1",
                   "payload": [1]}]}, "payload must be a JSON object"),
])
def test_a_malformed_envelope_is_refused_naming_the_field(env: Any, named: str | None) -> None:
    if named is None:
        assert parse_envelope(env, now_s=1.0, namespace=NS) is not None
        return
    with pytest.raises(HintError) as caught:
        parse_envelope(env, now_s=1.0, namespace=NS)
    assert named in str(caught.value)


# -- actions over units ----------------------------------------------------------------------------


def units(n: int = 4, size: int = 16) -> list[Unit]:
    return [Unit(i * size, (i + 1) * size, (f"k{i}",)) for i in range(n)]


def ops(*actions: tuple[str, dict[str, Any]]) -> list[KeyOp]:
    parsed = parse_envelope(envelope(*actions), now_s=5.0, namespace=NS)
    assert parsed is not None
    return ops_for(parsed, units(), wall_s=1000.0)


def test_a_pin_holds_the_prefix_up_to_its_range_end() -> None:
    (op,) = ops(("pin", {"session": "s", "start_token": 30, "end_token": 33, "duration_s": 9}))
    assert op.kind == "hold" and op.names == ("k0", "k1", "k2")  # unit 2 holds token 32
    assert op.retention == Retention("s", 1009.0, True, 0)


def test_retain_carries_its_priority_and_never_replaces_the_sessions_pin() -> None:
    got = ops(("retain", {"session": "s", "priority": 7}), ("pin", {"session": "s",
                                                                      "end_token": 16}))
    assert {(op.names, op.retention) for op in got} == {
        (("k0",), Retention("s", None, True, 0)),
        (("k0", "k1", "k2", "k3"), Retention("s#retain", None, False, 7)),
    }


def test_demote_and_drop_take_the_units_their_range_touches() -> None:
    got = ops(("demote", {"start_token": 20, "end_token": 40}), ("drop", {"start_token": 48}))
    assert [(op.kind, op.names, op.owner) for op in got] == [
        ("release", ("k1", "k2"), "anonymous"), ("drop", ("k3",), "anonymous")]


def test_prefetch_and_session_end_take_no_range_step() -> None:
    assert ops(("prefetch", {}), ("session_end", {"session": "s"})) == []


# -- the backend side ------------------------------------------------------------------------------


class Store:
    """A bounded file store with objects ``k0..k{n-1}`` of ``size`` bytes and a sink on it."""

    def __init__(self, root: Path, query: str = "capacity_bytes=100000&pin_fraction=0.25",
                 n: int = 6, size: int = 10000) -> None:
        self.backend = open_backend({"url": f"file://{root}?{query}"})
        self.counts: dict[str, int] = {}
        self.sink = HintSink(self.backend, self.count, "test")
        self.names = [f"{i:064x}_{'ab' * 8}_L0-0" for i in range(n)]
        payload = bytes(size)
        for name in self.names:
            run_sync(self.backend.put([name], [payload]))

    def count(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def apply(self, *steps: KeyOp) -> None:
        run_sync(self.sink.apply(list(steps)))

    def held(self, i: int) -> tuple[Retention, ...]:
        return run_sync(self.backend.retention_of([self.names[i]]))[0]

    def exists(self, i: int) -> bool:
        return bool(run_sync(self.backend.exists([self.names[i]]))[0])


def test_pins_hold_and_session_end_releases_them(tmp_path: Path) -> None:
    s = Store(tmp_path)
    pin = Retention("s", time.time() + 60, True)
    s.apply(KeyOp("s", "hold", tuple(s.names[:2]), pin))
    assert s.held(0) == (pin,) and s.held(1) == (pin,) and s.held(2) == ()
    assert s.counts == {"hint_pinned_objects": 2}
    s.apply(KeyOp("s", "end"))
    assert s.held(0) == () and s.held(1) == ()
    assert s.counts["hint_released_objects"] == 2


def test_a_later_retain_by_the_session_keeps_its_pin_and_session_end_frees_both(
    tmp_path: Path,
) -> None:
    s = Store(tmp_path)
    (pin,) = ops_for_store(s, ("pin", {"session": "s", "end_token": 16}))
    (retain,) = ops_for_store(s, ("retain", {"session": "s", "priority": 3}))
    s.apply(pin)
    s.apply(retain)
    assert sorted((r.owner, r.pinned) for r in s.held(0)) == [("s", True), ("s#retain", False)]
    assert [r.owner for r in s.held(1)] == ["s#retain"]
    s.apply(KeyOp("s", "end"))
    assert s.held(0) == () and s.held(1) == ()


def ops_for_store(s: Store, *actions: tuple[str, dict[str, Any]]) -> list[KeyOp]:
    """``ops_for`` on the store's objects, one per 16-token unit."""
    parsed = parse_envelope(envelope(*actions), now_s=5.0, namespace=NS)
    assert parsed is not None
    return ops_for(parsed, [Unit(16 * i, 16 * (i + 1), (n,)) for i, n in enumerate(s.names)],
                   wall_s=time.time())


def test_a_pin_past_the_budget_is_refused_whole_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Store(tmp_path)  # budget 25,000 bytes: two objects of 10,000, not three
    with caplog.at_level(logging.WARNING, "hicache_store.integrations.vllm"):
        s.apply(KeyOp("s", "hold", tuple(s.names[:3]), Retention("s", None, True)))
    assert s.counts == {"hint_pins_refused": 1}
    assert all(s.held(i) == () for i in range(3)), "a refused pin applies nothing"
    assert "refused" in caplog.text and "pin budget" in caplog.text
    s.apply(KeyOp("s", "hold", tuple(s.names[:2]), Retention("s", None, True)))
    assert s.counts["hint_pinned_objects"] == 2


def test_drop_deletes_only_what_no_other_owner_holds(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.apply(KeyOp("a", "hold", tuple(s.names[:2]), Retention("a", None, False, 1)),
            KeyOp("b", "hold", (s.names[1],), Retention("b", None, False, 1)))
    s.apply(KeyOp("a", "drop", tuple(s.names[:3])))
    assert not s.exists(0) and not s.exists(2)
    assert s.exists(1) and [r.owner for r in s.held(1)] == ["b"]
    assert s.counts["hint_dropped_objects"] == 2


def test_demote_releases_the_owners_entry_only(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.apply(KeyOp("a", "hold", (s.names[0],), Retention("a", None, True)),
            KeyOp("b", "hold", (s.names[0],), Retention("b", None, False, 2)))
    s.apply(KeyOp("a", "release", (s.names[0],)))
    assert [r.owner for r in s.held(0)] == ["b"] and s.exists(0)


def test_a_backend_without_retention_counts_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Store(tmp_path, "index=none")
    assert not s.backend.capabilities.retention
    with caplog.at_level(logging.WARNING, "hicache_store.integrations.vllm"):
        s.apply(KeyOp("s", "hold", (s.names[0],), Retention("s", None, True)),
                KeyOp("s", "release", (s.names[0],)), KeyOp("s", "drop", (s.names[1],)))
    assert s.counts == {"hint_unsupported": 2, "hint_dropped_objects": 1}
    assert caplog.text.count("keeps no retention") == 1
    assert s.exists(0) and not s.exists(1)  # drop still deletes there


def test_a_failing_backend_is_counted_never_raised(tmp_path: Path) -> None:
    s = Store(tmp_path)
    run_sync(s.backend.close())
    s.apply(KeyOp("s", "hold", (s.names[0],), Retention("s", None, True)))
    assert s.counts == {"hint_failures": 1}


# -- the secondary tier ----------------------------------------------------------------------------


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def factory(store: Path | None = None, **options: Any) -> Harness:
        made.append(Harness(store or tmp_path / "store", **options))
        return made[-1]

    yield factory
    for harness in made:
        harness.tier.shutdown()


def hinted(env: Any, positions: dict[Any, int], req_id: str = "r1") -> ReqContext:
    ctx = ReqContext(req_id=req_id, kv_hints=env)
    for k, end in positions.items():
        ctx.set_offload_key_position(k, end)
    return ctx


def store_for(h: Harness, ctx: ReqContext, chunks: list[int]) -> None:
    h.req = ctx
    h.tier.on_new_request(ctx)
    for c in chunks:
        h.fill(c, seed=c)
    assert h.store([key(c) for c in chunks], chunks).success
    h.tier.hints.drain(30)


def held(h: Harness, chunks: list[int]) -> list[tuple[Retention, ...]]:
    names = [h.tier.storage_key(key(c)) for c in chunks]
    return run_sync(h.tier.backend.retention_of(names))


def test_the_tier_pins_the_chunks_it_stores_within_the_range(make: Any) -> None:
    h = make()  # 16-token chunks (one block each)
    env = envelope(("pin", {"session": "s", "end_token": 20, "duration_s": 600}),
                   ("retain", {"session": "s", "priority": 4}))
    ctx = hinted(env, {key(c): 16 * (c + 1) for c in range(4)})
    store_for(h, ctx, [0, 1, 2, 3])
    got = held(h, [0, 1, 2, 3])
    # the session's pin and its retention are two entries: the retain never replaces the pin
    assert [[r.pinned for r in g] for g in got] == [[True, False]] * 2 + [[False]] * 2
    assert got[2][0].priority == 4 and got[0][0].until_s is not None
    assert h.tier.hints.counts["hint_pinned_objects"] == 2


def test_a_stored_jobs_holds_follow_its_put_without_waiting_for_a_poll(make: Any) -> None:
    # A native store job ends when its put does; the holds that follow it must not wait for
    # the scheduler's next poll (shutdown waits for the jobs, then the holds, polling none).
    h = make()
    env = envelope(("pin", {"session": "s", "end_token": 32, "duration_s": 600}))
    ctx = hinted(env, {key(c): 16 * (c + 1) for c in range(2)})
    h.req = ctx
    h.tier.on_new_request(ctx)
    for c in (0, 1):
        h.fill(c, seed=c)
    job = h.job([key(0), key(1)], [0, 1], promotion=False)
    h.tier.submit_store(job)
    h.tier.wait_jobs()  # no get_finished_jobs
    h.tier.hints.drain(5)
    assert [[r.pinned for r in g] for g in held(h, [0, 1])] == [[True]] * 2


def test_rows_a_hint_holds_are_written_while_write_admission_refuses_others(
        make: Any, tmp_path: Path) -> None:
    """Write admission refuses store jobs while the store evicts rows before their next read;
    a job whose rows the request's kv_hints pin or retain is written all the same."""
    from test_secondary_tier_unit import serve_in_turn

    h = make(store=tmp_path / "bounded", backend_options={
        "capacity_bytes": 16 * (ROW + 4096), "durability": "none"})
    serve_in_turn(h, conversations=4, turns=6)
    assert h.tier.admission is not None
    assert h.tier.stats.stores_refused > 0, "the workload should have the store refuse writes"
    refused = h.tier.stats.stores_refused
    store_for(h, ReqContext(req_id="plain"), [0])
    assert h.tier.stats.stores_refused > refused  # an ordinary job: refused
    assert held(h, [0]) == [()]
    refused = h.tier.stats.stores_refused
    ctx = hinted(envelope(("pin", {"session": "s", "duration_s": 600})), {key(1): 16}, "r9")
    store_for(h, ctx, [1])
    assert h.tier.stats.stores_refused == refused  # the pinned one: written, and held
    assert [[r.pinned for r in g] for g in held(h, [1])] == [[True]]


def test_the_tier_holds_chunks_a_lookup_finds_and_releases_at_session_end(make: Any) -> None:
    h = make()
    store_for(h, ReqContext(req_id="plain"), [0, 1])
    assert held(h, [0, 1]) == [(), ()]
    ctx = hinted(envelope(("pin", {"session": "s"})), {key(0): 16, key(1): 32}, "r2")
    h.tier.on_new_request(ctx)
    for c in (0, 1):
        assert h.lookup(key(c), ctx)[0].name == "HIT"
    h.tier.on_schedule_end(END)
    h.tier.hints.drain(30)
    assert [[r.pinned for r in g] for g in held(h, [0, 1])] == [[True], [True]]
    h.tier.on_new_request(hinted(envelope(("session_end", {"session": "s"})), {}, "r3"))
    h.tier.hints.drain(30)
    assert held(h, [0, 1]) == [(), ()]


def test_a_malformed_envelope_is_logged_and_the_chunks_stored_as_usual(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h = make()
    bad = envelope(("pin", {"until": 5}))
    with caplog.at_level(logging.ERROR, "hicache_store.integrations.vllm"):
        store_for(h, hinted(bad, {key(0): 16}), [0])
    assert "kv_hints refused" in caplog.text and "until" in caplog.text
    assert h.tier.hints.counts["hints_malformed"] == 1
    assert h.tier.stats.stored == 1 and held(h, [0]) == [()]


def test_a_pin_past_the_tiers_store_budget_is_refused_and_the_store_succeeds(
    make: Any, tmp_path: Path
) -> None:
    root = tmp_path / "small"
    capacity = CHUNKS * (ROW + 4096) * 2
    h = make(root, backend_options={"capacity_bytes": capacity, "pin_fraction": 0.1})
    ctx = hinted(envelope(("pin", {"session": "s"})), {key(c): 16 * (c + 1) for c in range(4)})
    store_for(h, ctx, [0, 1, 2, 3])  # 4 rows pinned > 10% of 16 rows
    assert h.tier.stats.stored == 4
    assert h.tier.hints.counts["hint_pins_refused"] == 1
    assert held(h, [0, 1, 2, 3]) == [(), (), (), ()]


def test_the_tier_reads_kv_transfer_params_when_vllms_field_is_unset(make: Any) -> None:
    h = make()
    env = msgspec.to_builtins(envelope(("pin", {"session": "http", "end_token": 16})))
    ctx = ReqContext(req_id="r4", kv_transfer_params={"kv_hints": env})
    for c in range(2):
        ctx.set_offload_key_position(key(c), 16 * (c + 1))
    store_for(h, ctx, [0, 1])
    assert [[r.owner for r in g] for g in held(h, [0, 1])] == [["http"], []]


# -- the connector's scheduler side ----------------------------------------------------------------


def test_the_connector_hands_each_page_over_once_as_it_is_stored_or_saved(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from hicache_store.integrations.vllm._hints import ConnectorHints

    counts: dict[str, int] = {}
    hints = ConnectorHints(Store(tmp_path, n=0).backend, NS, 16,
                           lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n))
    env = msgspec.to_builtins(envelope(("pin", {"session": "s", "end_token": 40})))
    hints.track(SimpleNamespace(request_id="r", kv_hints=None,
                                kv_transfer_params={"kv_hints": env}))
    hints.track(SimpleNamespace(request_id="bad", kv_hints=envelope(("pin", {"x": 1})),
                                kv_transfer_params=None))
    assert counts == {"hints_malformed": 1}
    tracked = SimpleNamespace(hashes=[f"h{i}" for i in range(5)], planned=0, stored_pages=2)
    (first,) = hints.plan({"r": tracked})
    assert first.names == ("h0", "h1") and first.retention is not None
    assert first.retention.pinned
    assert hints.plan({"r": tracked}) == []  # nothing new: nothing handed over twice
    tracked.planned = 5
    (second,) = hints.plan({"r": tracked})
    assert second.names == ("h2",)  # pages 3 and 4 start past token 40
    hints.track(SimpleNamespace(request_id="end", kv_hints=envelope(("session_end",
                                                                     {"session": "s"})),
                                kv_transfer_params=None))
    assert hints.plan({}) == [KeyOp("s", "end")]
    hints.finished("r")
    tracked.planned = 9
    assert hints.plan({"r": tracked}) == []


def test_the_connector_knows_which_saves_a_hint_holds(tmp_path: Path) -> None:
    """The write admission refuses a save only where no hint pins or retains its pages."""
    from types import SimpleNamespace

    from hicache_store.integrations.vllm._hints import ConnectorHints

    hints = ConnectorHints(Store(tmp_path, n=0).backend, NS, 16, lambda k, n: None)
    for req_id, env in (
        ("pin", envelope(("pin", {"session": "s", "end_token": 40}))),
        ("retain", envelope(("retain", {"session": "s", "priority": 2}))),
        ("drop", envelope(("drop", {"session": "s"}))),
    ):
        hints.track(SimpleNamespace(request_id=req_id, kv_hints=env, kv_transfer_params=None))
    assert hints.holds("pin", [0, 1]) and hints.holds("pin", [2, 3])  # page 2 starts at 32
    assert not hints.holds("pin", [3, 4])  # past token 40
    assert hints.holds("retain", [7])
    assert not hints.holds("drop", [0])  # no hold: the admission decides
    assert not hints.holds("unhinted", [0])
    hints.finished("pin")
    assert not hints.holds("pin", [0])
