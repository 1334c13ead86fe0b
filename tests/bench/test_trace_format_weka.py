"""The WEKA session format: the tester's replay rule on a hand-written set, strictness."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from hicache_store.demo.bench.trace_format import (
    TraceFormatError,
    check_chains,
    read_trace,
    read_weka,
)
from hicache_store.demo.bench.trace_sim import lru_reference
from hicache_store.tier.eviction import EVICTION_POLICIES


def request(t: float, ids: list[int], extra: int = 0, **fields: Any) -> dict[str, Any]:
    record = {"t": t, "type": "n", "in": 64 * len(ids) + extra, "out": 1, "hash_ids": ids,
              "stop": "tool_use", "api_time": 2.0}
    record.update(fields)
    return record


#: session a (k = 0): a subagent started at 5 s, whose second request ties with a main one at
#: 10 s (file order: main first), and a main request at 30 s that ties with session b's first
#: (k = 1, starting at 30 s: session order, a first).
SESSION_A = {
    "id": "a", "block_size": 64, "hash_id_scope": "local",
    "requests": [
        request(0.0, [1, 2], extra=2),
        request(10.0, [1, 2, 3], extra=8, stop="end_turn"),
        {"t": 5.0, "type": "subagent", "agent_id": "agent_1", "requests": [
            request(0.0, [7]), request(5.0, [7, 8], stop="end_turn")]},
        request(30.0, [1, 2, 3, 4]),
    ],
}
SESSION_B = {
    "id": "b", "block_size": 64, "hash_id_scope": "local",
    "requests": [request(0.0, [1, 5], stop="")],
}


def write_folder(folder: Path, sessions: dict[str, object]) -> Path:
    folder.mkdir()
    for name, document in sessions.items():
        (folder / name).write_text(json.dumps(document))
    return folder


def write_tar(path: Path, sessions: dict[str, object]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, document in sessions.items():
            data = json.dumps(document).encode()
            info = tarfile.TarInfo(f"traces/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(params=["folder", "tar"])
def hand_set(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    # named so that sorting by name puts a first
    sessions = {"trace_b.json": SESSION_B, "trace_a.json": SESSION_A}
    if request.param == "folder":
        return write_folder(tmp_path / "sessions", sessions)
    return write_tar(tmp_path / "sessions.tar.gz", sessions)


def test_flattens_by_the_testers_rule(hand_set: Path) -> None:
    trace = read_trace(hand_set, "weka")
    check_chains(trace)
    assert trace.block_tokens == 64
    # arrival ms, chain (global id = local x 2 sessions + k), stream
    got = [(r.timestamp_ms, r.hash_ids, r.session.stream) for r in trace.requests if r.session]
    assert got == [
        (0, (2, 4), "a"),
        (5000, (14,), "a/agent_1"),
        (10000, (2, 4, 6), "a"),
        (10000, (14, 16), "a/agent_1"),
        (30000, (2, 4, 6, 8), "a"),
        (30000, (3, 11), "b"),
    ]
    a1, sub0, sub1, b0 = (trace.requests[i].session for i in (2, 1, 3, 5))
    assert a1 is not None and sub0 is not None and sub1 is not None and b0 is not None
    assert (a1.kind, a1.previous_stop, a1.previous_end_ms, a1.stop, a1.end_ms) == (
        "main", "tool_use", 2000, "end_turn", 12000)
    assert (sub0.kind, sub0.subagent_start, sub0.previous_stop) == ("subagent", True, None)
    assert (sub1.subagent_start, sub1.previous_end_ms) == (False, 7000)
    assert b0.stop == ""
    assert [r.input_length for r in trace.requests] == [130, 64, 200, 128, 256, 128]


def test_hit_rates_by_hand(hand_set: Path) -> None:
    trace = read_trace(hand_set, "weka")
    unbounded = lru_reference(trace, None)
    # a1 hits 2 blocks, sub1 1, a2 3: 128 + 64 + 192 tokens of 906
    assert (unbounded.hit_tokens, unbounded.input_tokens) == (384, 906)
    assert unbounded.by_kind == {"main": [320, 714], "subagent": [64, 192]}
    # 3 blocks: a1 hits [2, 4]; sub1's 14 and a2's 2 were evicted
    assert lru_reference(trace, 3).hit_tokens == 128


def broken(**changes: Any) -> dict[str, Any]:
    return {**SESSION_B, **changes}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("not json", "not JSON"),
        ([], "expected a JSON object"),
        (broken(id=""), "'id'"),
        (broken(block_size=16), "'block_size' 16"),
        (broken(hash_id_scope="global"), "'hash_id_scope'"),
        (broken(requests={}), "'requests' must be a list"),
        (broken(requests=[request(0.0, [1, 2], extra=64)]), "2 hash ids for 'in' 192"),
        (broken(requests=[request(-1.0, [1])]), "'t'"),
        (broken(requests=[request(0.0, [1], stop=3)]), "'stop'"),
        (broken(requests=[request(0.0, [1], api_time="x")]), "'api_time'"),
        (broken(requests=[request(0.0, [True])]), "'hash_ids'"),
        (broken(requests=[{"t": 0, "type": "subagent", "requests": []}]), "'agent_id'"),
        (broken(requests=[{"t": 0, "type": "subagent", "agent_id": "x", "requests": [
            {"t": 0, "type": "subagent", "agent_id": "y", "requests": []}]}]), "do not nest"),
    ],
)
def test_rejects_malformed_sessions(tmp_path: Path, document: object, message: str) -> None:
    folder = tmp_path / "sessions"
    folder.mkdir()
    (folder / "trace_a.json").write_text(json.dumps(SESSION_A))
    text = document if isinstance(document, str) else json.dumps(document)
    (folder / "trace_b.json").write_text(text)
    with pytest.raises(TraceFormatError, match="trace_b.json") as raised:
        read_trace(folder, "weka")
    assert message in str(raised.value)


def test_rejects_what_is_no_set_of_sessions(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceFormatError, match="no session files"):
        read_trace(empty, "weka")
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    with pytest.raises(TraceFormatError, match="not a folder or a tar archive"):
        read_trace(plain, "weka")


def test_bench_trace_weka_command(
    hand_set: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hicache_store.cli import main

    out = tmp_path / "r.json"
    code = main([
        "bench", "trace", "--format", "weka", str(hand_set), "--capacities", "3,unbounded",
        "--belady", "3", "--policy", "lru,session", "--json", str(out), "--no-progress",
    ])
    assert code == 0
    document = json.loads(out.read_text())
    assert (document["format"], document["replay"], document["sessions"]) == ("weka", "sim", 2)
    rows = {(r["capacity_blocks"], r["policy"]): r for r in document["results"]}
    small, everything = rows[(3, "session")], rows[(8, "session")]  # 8 distinct blocks
    assert small["lru_reference"] == pytest.approx(128 / 906)
    assert small["belady"] is not None and everything["belady"] is None
    assert everything["unbounded"]
    for policy in ("lru", "session"):
        row = rows[(8, policy)]
        assert row["hit_rate"] == pytest.approx(384 / 906)
        assert row["hit_rate_by_kind"] == pytest.approx({"main": 320 / 714, "subagent": 64 / 192})
    table = capsys.readouterr().out
    assert "subagent" in table and "unbounded" in table


def test_the_tier_replay_hands_each_request_its_hints(tmp_path: Path) -> None:
    """Through the real tier, ``session`` keeps the session that went off to run a tool and
    lets go of those that handed the turn to a human; LRU loses it. Same outcome as the
    block-level simulator of the same policy: the hints reach the tier as they reach the sim.

    L2 of 4 blocks. a (k=0) sends [1, 2] at 0 s, its response ends in a tool call at 1 s; b (at
    30 s) and c (at 60 s) each send two blocks and hand the turn to the human. At 60 s LRU
    evicts a (least recently used); ``session`` expects b back at 31 + 300 s and a, overdue
    since 11 s, at 60 + 59 s: b goes. a returns at 70 s with [1, 2, 3]: 2 blocks hit.
    """
    from hicache_store.demo.bench.trace_replay import ReplaySetup, replay
    from hicache_store.demo.bench.trace_sim import block_policy, simulate

    sessions = {
        "trace_a.json": {"id": "a", "block_size": 64, "hash_id_scope": "local", "requests": [
            request(0.0, [1, 2], api_time=1.0), request(70.0, [1, 2, 3], api_time=1.0)]},
        "trace_b.json": {"id": "b", "block_size": 64, "hash_id_scope": "local", "requests": [
            request(0.0, [1, 2], stop="end_turn", api_time=1.0)]},
        "trace_c.json": {"id": "c", "block_size": 64, "hash_id_scope": "local", "requests": [
            request(0.0, [1, 2], stop="end_turn", api_time=1.0)]},
    }
    trace = read_trace(write_folder(tmp_path / "s", sessions), "weka")
    hits = {}
    for policy in ("lru", "arc", "session"):
        setup = ReplaySetup(page_size=64, l1_pages=3, l2_pages=4, backend_url=None,
                            eviction_policy=policy, settle=True)
        result = replay(trace, setup)
        hits[policy] = result.counts.l2.hit_tokens
        assert hits[policy] == simulate(trace, 4, block_policy(policy, trace, 4)).hit_tokens
        summary = result.summary()
        assert set(summary["hit_rate_by_kind"]) == {"main"}
        assert summary["pinned_pages"] == 0  # the trace asks for no pins
    assert hits == {"lru": 0, "arc": 0, "session": 128}


def test_the_tier_keeps_what_the_policy_ranks_above_a_new_request(tmp_path: Path) -> None:
    """L2 admission follows the policy: a new request's pages do not push out pages the policy
    expects back sooner, where L2 may do without them (no L3 write needs them). Same outcome
    as the block-level simulator, which admits every page and then evicts.

    L2 of 4 blocks. a sends [1, 2] at 0 s; its response ends in a tool call at 1 s (back at
    about 1 + 10 s). c sends 4 new blocks at 2 s (in flight: back at about 3 + 10 s). a's pages
    rank above c's, so c keeps only the 2 that fit beside them and a returns at 8 s to a hit of
    2 blocks. With an L3 that takes c's pages they are kept in L2 for their write (a's pages
    give way) and a's hit comes from L3: nothing that an L3 should hold is given up.
    """
    from hicache_store.demo.bench.trace_replay import ReplaySetup, replay
    from hicache_store.demo.bench.trace_sim import block_policy, simulate

    sessions = {
        "trace_a.json": {"id": "a", "block_size": 64, "hash_id_scope": "local", "requests": [
            request(0.0, [1, 2], api_time=1.0), request(8.0, [1, 2, 3], api_time=1.0)]},
        "trace_c.json": {"id": "c", "block_size": 64, "hash_id_scope": "local", "requests": [
            request(0.0, [1, 2, 3, 4], api_time=1.0)]},
    }
    folder = write_folder(tmp_path / "s", sessions)
    trace = read_weka(folder, spacing_s=2.0)
    assert [r.session.session for r in trace.requests if r.session] == ["a", "c", "a"]
    simulated = simulate(trace, 4, block_policy("session", trace, 4))
    hits = {}
    for backend in (None, f"file://{tmp_path}/l3"):
        setup = ReplaySetup(page_size=64, l1_pages=4, l2_pages=4, backend_url=backend,
                            eviction_policy="session", settle=True)
        counts = replay(trace, setup).counts
        hits[backend is not None] = (counts.l2.hit_tokens, counts.l3.hit_tokens)
    assert simulated.hit_tokens == 128
    assert hits == {False: (128, 0), True: (0, 128)}


def random_sessions(seed: int, count: int = 6) -> dict[str, object]:
    """Session documents of growing conversations (each request extends the last, now and
    then one drops its tail: an edited history), random stops, gaps and response times, a
    subagent in some."""
    import random

    rng = random.Random(seed)
    out: dict[str, object] = {}
    for k in range(count):
        ids: list[int] = []
        fresh = 1
        requests: list[dict[str, Any]] = []
        t = rng.uniform(0, 20)
        for _ in range(rng.randint(2, 6)):
            if ids and rng.random() < 0.2:
                ids = ids[: rng.randint(1, len(ids))]
            grow = rng.randint(1, 4)
            ids = [*ids, *range(fresh, fresh + grow)]
            fresh += grow
            stop = rng.choice(["tool_use", "tool_use", "end_turn"])
            requests.append(request(t, ids, api_time=rng.uniform(0.5, 4), stop=stop))
            t += rng.choice([rng.uniform(1, 15), rng.uniform(60, 400)])
        if rng.random() < 0.5:
            requests.append({"t": rng.uniform(0, t), "type": "subagent", "agent_id": "agent_1",
                             "requests": [request(0.0, [500, 501], api_time=1.0),
                                          request(4.0, [500, 501, 502], stop="end_turn")]})
        out[f"trace_{k}.json"] = {"id": str(k), "block_size": 64, "hash_id_scope": "local",
                                  "requests": requests}
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_tier_replay_equals_the_simulator_on_random_sessions(
    tmp_path: Path, seed: int
) -> None:
    """Through the tier (L2 alone) every policy hits exactly what the block-level simulator
    of the same policy hits: the figures the simulator publishes are the tier's. (``arc``
    shows the order: the simulator admits a request's pages before it evicts, so a ghost hit
    moves ARC's target before the eviction; the tier must do the same.)"""
    from hicache_store.demo.bench.trace_replay import ReplaySetup, longest_request_pages, replay
    from hicache_store.demo.bench.trace_sim import block_policy, simulate

    trace = read_weka(write_folder(tmp_path / "s", random_sessions(seed)), spacing_s=10.0)
    l1 = longest_request_pages(trace, 64)
    differ = []
    for capacity in (6, 12):
        for policy in EVICTION_POLICIES:
            simulated = simulate(trace, capacity, block_policy(policy, trace, capacity))
            setup = ReplaySetup(page_size=64, l1_pages=l1, l2_pages=capacity, backend_url=None,
                                eviction_policy=policy)
            counts = replay(trace, setup).counts
            got = counts.l2.hit_tokens + counts.l1.hit_tokens
            if got != simulated.hit_tokens:
                differ.append((policy, capacity, got, simulated.hit_tokens))
    assert not differ


def test_a_request_limit_reads_only_the_sessions_it_needs(tmp_path: Path) -> None:
    # Session b (second by name) is not JSON: the first request of a starts before b does,
    # so a limit of one never opens b; without the limit b is read and refused.
    sessions = {"trace_a.json": SESSION_A}
    folder = write_folder(tmp_path / "s", sessions)
    (folder / "trace_b.json").write_text("{not json")
    one = read_trace(folder, "weka", limit=1)
    assert len(one) == 1
    with pytest.raises(TraceFormatError, match="trace_b.json"):
        read_trace(folder, "weka")
    # the ids are those of the whole trace (they depend on the number of files)
    full = read_weka(write_folder(tmp_path / "full", {**sessions, "trace_b.json": SESSION_B}))
    limited = read_weka(tmp_path / "full", limit=1)
    assert limited.requests == full.requests[:1]
