"""``ReuseAdmission`` against a model of a store that evicts least recently used first.

The model is the file backend's rule at row granularity (a write or a hit makes a row the most
recent; room is made by evicting the least recent); the workload is the one where that rule
fails: conversations served in turn, each turn's prompt the conversation so far, looked up in
chain order up to the first miss (as vLLM looks up a prompt's chunks), what was not found
written after it was computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from hicache_store.backends import BackendUnavailableError
from hicache_store.integrations._admission import (
    ReuseAdmission,
    admission_for,
    check_write_admission,
    refuses,
)
from hicache_store.layout.errors import ConfigError


@dataclass
class LRUStore:
    capacity: int
    rows: OrderedDict[object, None] = field(default_factory=OrderedDict)
    evictions: int = 0
    writes: int = 0

    def has(self, key: object) -> bool:
        if key in self.rows:
            self.rows.move_to_end(key)
            return True
        return False

    def put(self, keys: list[object]) -> None:
        for key in keys:
            self.rows[key] = None
            self.rows.move_to_end(key)
            self.writes += 1
            while len(self.rows) > self.capacity:
                self.rows.popitem(last=False)
                self.evictions += 1


@dataclass
class Outcome:
    hits_per_turn: list[int]
    writes: int
    kept: int


def serve(store: LRUStore, admission: ReuseAdmission | None, *, conversations: int,
          rows_per_turn: int, turns: int, fresh: bool = False,
          first_rows: int | None = None) -> Outcome:
    """Conversations in turn; ``fresh``: every turn is a new conversation (no reuse);
    ``first_rows``: rows of a conversation's first turn (its system prompt; default
    ``rows_per_turn``)."""
    history: dict[int, list[object]] = {c: [] for c in range(conversations)}
    hits_per_turn = []
    for turn in range(turns):
        hits = 0
        for c in range(conversations):
            # (a new conversation's prompt is looked up too: its first chunk misses)
            chain = [("new", c, turn)] if fresh else history[c]
            found = 0
            for key in chain:
                there = store.has(key)
                if admission is not None:
                    admission.answered(key, there, (c, turn))
                if not there:
                    break
                found += 1
            hits += found
            rows = first_rows if first_rows is not None and turn == 0 else rows_per_turn
            new = chain[found:] + [(c, turn, i) for i in range(rows)]
            history[c] = chain[:found] + new
            # (rows of one byte: the store's room is counted in rows)
            if admission is None or admission.admit(
                    len(new) if admission.knows_room else 0, keys=new):
                if admission is not None:
                    admission.written(new, len(new))
                store.put(new)
        hits_per_turn.append(hits)
    return Outcome(hits_per_turn, store.writes, len(store.rows))


def admission_of(store: LRUStore, **limits: int) -> ReuseAdmission:
    return ReuseAdmission(lambda: store.evictions, **limits)


def room_admission_of(store: LRUStore, **limits: int) -> ReuseAdmission:
    """The admission with the store's room known (``capabilities.capacity_usage``)."""
    return ReuseAdmission(lambda: store.evictions, room=lambda: (store.capacity, len(store.rows)),
                          **limits)


def test_lru_alone_thrashes_on_conversations_that_outgrow_the_store() -> None:
    # The failure the admission exists for: after the store fills, nothing is ever served and
    # every turn is written again.
    store = LRUStore(capacity=24)
    out = serve(store, None, conversations=6, rows_per_turn=2, turns=8)
    assert out.hits_per_turn[4:] == [0, 0, 0, 0]
    assert out.writes > 3 * store.capacity


def test_a_thrashing_store_holds_what_it_has_and_serves_it() -> None:
    store = LRUStore(capacity=24)
    admission = admission_of(store)
    out = serve(store, admission, conversations=6, rows_per_turn=2, turns=8)
    assert admission.counts.holds >= 1 and admission.counts.refused > 0
    # what the store holds is served on every later turn (LRU alone: nothing)
    assert all(h > 0 for h in out.hits_per_turn[4:])
    assert sum(out.hits_per_turn) > 2 * store.capacity
    # the writes that filled the store and those that showed the thrash, then none: LRU
    # alone writes every turn again (416 rows here)
    assert out.writes <= 3 * store.capacity
    assert out.hits_per_turn[-1] >= store.capacity // 2


def test_a_first_round_that_overflows_the_store_is_not_written_again() -> None:
    # The conversations' first turns alone outgrow the store: the first answer of evidence is
    # a row evicted before its first read. Waiting for more evidence would write each of the
    # next histories again (and evict the one after it); the store writes what it keeps.
    store = LRUStore(capacity=16)
    lru = serve(LRUStore(capacity=16), None, conversations=6, rows_per_turn=1, turns=3,
                first_rows=3)
    admission = admission_of(store)
    out = serve(store, admission, conversations=6, rows_per_turn=1, turns=3, first_rows=3)
    assert admission.counts.holds == 1 and admission.counts.refused > 0
    assert out.writes == 6 * 3  # the first round only (LRU alone: 72)
    assert out.writes <= out.kept + 3  # beyond what it keeps: one conversation's first turn
    assert sum(out.hits_per_turn) > sum(lru.hits_per_turn) == 0


def test_histories_lost_one_after_another_start_a_hold_at_the_second() -> None:
    # The first turns fit; from the second turn on each conversation's rewrite evicts the
    # next one's history. Two requests in a row that lost theirs are enough: waiting for
    # premature evictions to outnumber the window's hits wrote two more histories (28 rows
    # for the 16 it keeps) and served fewer rows.
    store = LRUStore(capacity=16)
    lru = serve(LRUStore(capacity=16), None, conversations=6, rows_per_turn=1, turns=3,
                first_rows=2)
    admission = admission_of(store)
    out = serve(store, admission, conversations=6, rows_per_turn=1, turns=3, first_rows=2)
    assert admission.counts.holds == 1 and admission.counts.refused > 0
    assert out.writes <= out.kept + 4  # one history (3 rows) and one new turn beyond it
    assert sum(out.hits_per_turn) >= 25 > sum(lru.hits_per_turn)


def test_premature_evictions_between_hits_do_not_hold() -> None:
    evictions = 0
    admission = ReuseAdmission(lambda: evictions)
    for i, found in enumerate([True, False, True, True, False, True, False]):
        admission.written([i])
        evictions += 1
        admission.answered(i, found, f"r{i}")  # never two in a row, never more than hits
    assert admission.counts.premature_evictions == 3 and not admission.holding
    admission.written(["y"])
    evictions += 1
    admission.answered("y", False, "ry")  # the second in a row (3 against 3 in the window)
    assert admission.holding


def test_once_the_store_has_served_a_row_one_premature_eviction_does_not_hold() -> None:
    evictions = 0
    admission = ReuseAdmission(lambda: evictions)
    admission.written([("a", 0), ("b", 0)])
    admission.answered(("a", 0), True, "r1")  # the store served a row written here
    evictions = 1
    admission.answered(("b", 0), False, "r2")  # then one evicted before its read
    assert admission.counts.premature_evictions == 1 and not admission.holding
    # where nothing written here was ever served, one is enough
    fresh = ReuseAdmission(lambda: evictions)
    fresh.written([("b", 0)])
    evictions = 2
    fresh.answered(("b", 0), False, "r2")
    assert fresh.holding


def test_a_store_above_the_workload_admits_everything() -> None:
    store = LRUStore(capacity=1000)
    admission = admission_of(store)
    serve(store, admission, conversations=6, rows_per_turn=2, turns=8)
    assert admission.counts.holds == 0 and admission.counts.refused == 0
    assert store.evictions == 0


def test_a_store_whose_reuse_fits_is_never_held_though_it_evicts() -> None:
    # Conversations that come back while their rows are held, and new ones that push old
    # ones out: evictions, and few of them evict what is read next.
    store = LRUStore(capacity=40)
    admission = admission_of(store)
    serve(store, admission, conversations=4, rows_per_turn=2, turns=4)
    serve(store, admission, conversations=30, rows_per_turn=2, turns=1, fresh=True)
    serve(store, admission, conversations=4, rows_per_turn=1, turns=4)
    assert store.evictions > 0
    assert admission.counts.holds == 0 and admission.counts.refused == 0


def test_the_hold_ends_when_what_the_store_holds_is_no_longer_read() -> None:
    store = LRUStore(capacity=24)
    admission = admission_of(store, idle=32)
    serve(store, admission, conversations=6, rows_per_turn=2, turns=8)
    assert admission.holding
    # the workload moves on: new conversations only, nothing held is read
    before = store.writes
    serve(store, admission, conversations=40, rows_per_turn=1, turns=1, fresh=True)
    assert not admission.holding
    assert store.writes > before  # new rows are written again


def test_a_hold_is_tried_again_after_a_while_even_while_its_rows_stay_hot() -> None:
    store = LRUStore(capacity=24)
    admission = admission_of(store, hold=40)
    serve(store, admission, conversations=6, rows_per_turn=2, turns=12)
    assert admission.counts.holds >= 2  # released by the bound, held again on new evidence


# -- with the room known (capacity_usage) --------------------------------------------------------


def test_with_the_room_known_a_thrashing_workload_writes_only_what_it_keeps() -> None:
    # The evidence alone holds only after the store has evicted rows before their read: it
    # writes more than it keeps. Knowing the room, nothing is written that evicts a row
    # written or found recently, so nothing written is lost, and the store serves more.
    runs = {}
    for name, make in (("evidence", admission_of), ("room", room_admission_of)):
        store = LRUStore(capacity=24)
        admission = make(store)
        runs[name] = (serve(store, admission, conversations=6, rows_per_turn=2, turns=8),
                      admission, store)
    evidence, (room, admission, store) = runs["evidence"][0], runs["room"]
    assert evidence.writes > evidence.kept  # (the figure the room improves on)
    assert room.writes == room.kept == store.capacity
    assert store.evictions == 0 and admission.counts.premature_evictions == 0
    assert admission.counts.refused_fresh > 0 and admission.counts.fitted > 0
    assert sum(room.hits_per_turn) >= sum(evidence.hits_per_turn)
    assert all(hits > 0 for hits in room.hits_per_turn[1:])


def test_with_the_room_known_a_workload_that_moves_on_turns_the_store_over() -> None:
    # The store full of conversations that are no longer read; new short sessions arrive
    # (three a turn, each asked twice): their rows are refused while the old ones are fresh,
    # then, once other rows of ``stale`` capacities were touched, written over the old ones
    # and served on their second ask. (Rows then held are fresh in their turn: the store
    # turns over in waves of ``stale`` capacities, never holding old rows for good.)
    store = LRUStore(capacity=24)
    admission = room_admission_of(store)
    serve(store, admission, conversations=6, rows_per_turn=2, turns=8)
    old = set(store.rows)
    served = []
    for turn in range(80):
        hits = 0
        for key in [("s", turn - 1, j) for j in range(3)] + [("s", turn, j) for j in range(3)]:
            there = store.has(key)
            admission.answered(key, there, key)
            if there:
                hits += 1
            elif key[1] == turn and admission.admit(1, keys=[key]):
                admission.written([key], 1)
                store.put([key])
        served.append(hits)
    assert served[:10] == [0] * 10  # the old rows were fresh: kept, the new refused
    assert admission.counts.refused_fresh > 0
    assert 3 in served and not old & set(store.rows)  # the store turned over
    assert admission.counts.premature_evictions == 0


def test_with_the_room_known_writes_into_free_room_go_whatever_the_hold() -> None:
    used, evictions = [0], [0]
    admission = ReuseAdmission(lambda: evictions[0], room=lambda: (100, used[0]))
    admission.written(["x"], 10)
    evictions[0] = 1
    admission.answered("x", False, "r")  # a premature eviction before any hit: a hold
    assert admission.holding
    assert admission.admit(50)  # fits: evicts nothing
    assert admission.admit(40)  # fits with the 50 the store does not count yet
    assert not admission.admit(20)  # 50 + 40 + 20 pass 100: it would evict, held
    used[0] = 90  # the store counts them: nothing ahead
    assert admission.admit(10) and not admission.admit(1)
    assert admission.counts.fitted == 3 and admission.counts.refused == 2


def test_with_the_room_known_rows_of_unknown_size_follow_the_evidence() -> None:
    evictions = [0]
    admission = ReuseAdmission(lambda: evictions[0], room=lambda: (100, 100))
    assert admission.admit()  # no hold, size unknown: goes
    admission.written(["x"])
    evictions[0] = 1
    admission.answered("x", False, "r")
    assert not admission.admit()


def test_with_the_room_known_a_write_that_evicts_only_stale_or_foreign_rows_goes() -> None:
    used = [0]
    admission = ReuseAdmission(lambda: 0, room=lambda: (100, used[0]), stale=1)
    assert admission.admit(60)
    admission.written([f"a{i}" for i in range(6)], 60)
    used[0] = 60
    assert not admission.admit(50)  # would evict a row written just now
    assert admission.counts.refused_fresh == 1
    for _ in range(3):  # 150 bytes of writes offered (refused) since: the rows are stale
        admission.admit(50)
    assert admission.admit(50)
    # rows of other writers (the store holds more than this process wrote): not seen here
    other = ReuseAdmission(lambda: 0, room=lambda: (100, 100))
    assert other.admit(10)


def test_with_the_room_known_rows_found_here_are_kept_whoever_wrote_them() -> None:
    # A store another process filled: the rows this one reads are kept as its own (no
    # evidence counted); rows it never reads are the store's LRU's to evict.
    runs = []
    for reads_old in (False, True):
        admission = ReuseAdmission(lambda: 0, room=lambda: (100, 100), stale=1)
        admission.written(["mine"], 10)  # (the row size: 10)
        for i in range(10):  # 100 bytes looked up since: "mine" is stale
            admission.answered(("gone", i), False, "r1")
        if reads_old:
            admission.answered("old0", True, "r2")  # written by another process, read here
        runs.append((admission.admit(30), admission.counts))
    assert runs[0][0]  # evicts "mine" (stale) and rows never seen here
    assert not runs[1][0] and runs[1][1].refused_fresh == 1  # would evict "old0", just read
    assert runs[1][1].hits == 0  # (hits count rows written here only)


def test_with_the_room_known_a_refused_row_offered_again_is_no_new_demand() -> None:
    # An engine offers a refused row again each time it computes it: that is not a workload
    # moving on, and must not age the rows the store holds into stale ones.
    outcomes = {}
    for named in (True, False):
        admission = ReuseAdmission(lambda: 0, room=lambda: (100, 100), stale=1)
        admission.written([f"a{i}" for i in range(10)], 100)
        outcomes[named] = [admission.admit(10, keys=["x"] if named else ()) for _ in range(30)]
    assert not any(outcomes[True])
    assert any(outcomes[False])  # (its rows unnamed, every offer counts as new)


def test_with_the_room_known_a_row_offered_while_held_is_fresh_and_no_write() -> None:
    # Rows offered that the store holds are not written: no write counted either way, and
    # in demand, so a write that would evict them is refused; rows never offered again age.
    runs = {}
    for reoffered in (False, True):
        admission = ReuseAdmission(lambda: 0, room=lambda: (100, 100), stale=1)
        admission.written([f"a{i}" for i in range(10)], 100)
        for i in range(10):  # 100 bytes of other rows looked up since: all ten are stale
            admission.answered(("other", i), False, "r")
        if reoffered:
            admission.held(["a0"], 10)  # the oldest, offered again while the store holds it
        runs[reoffered] = (admission.admit(10, keys=["new"]), admission.counts)
    assert runs[False][0]  # evicts a0, stale
    admitted, counts = runs[True]
    assert not admitted and counts.refused_fresh == 1  # a0 would be evicted: in demand
    assert counts.fitted == 0 and counts.refused == 1 and counts.hits == 0
    # held rows move the staleness clock as any offer, once each: a row held offered again
    # and again is no new demand
    clock = ReuseAdmission(lambda: 0, room=lambda: (100, 100), stale=1)
    clock.written(["b"], 10)
    for _ in range(20):
        clock.held(["c"], 10)
    assert not clock.admit(10, keys=["d"])  # "b" is not stale: 20 bytes offered, 10 new


def test_with_the_room_known_a_unreadable_room_falls_back_to_the_evidence() -> None:
    def room() -> tuple[int, int]:
        raise BackendUnavailableError("counters out of reach", backend="test")

    evictions = [0]
    admission = ReuseAdmission(lambda: evictions[0], room=room)
    assert admission.admit(10)
    admission.written(["x"], 10)
    evictions[0] = 1
    admission.answered("x", False, "r")
    assert not admission.admit(10)


def test_misses_of_rows_never_written_here_or_gone_without_eviction_are_no_evidence() -> None:
    evictions = 0
    admission = ReuseAdmission(lambda: evictions, min_evidence=1, window=4)
    for i in range(50):
        admission.answered(("other", i), False)  # never written here
    admission.written([("mine", 0)])
    admission.answered(("mine", 0), False)  # gone, but nothing was evicted: a delete
    assert not admission.holding and admission.counts.premature_evictions == 0
    admission.written([("mine", 1)])
    evictions = 1
    admission.answered(("mine", 1), False)
    assert admission.holding and admission.counts.premature_evictions == 1


@pytest.mark.parametrize("limits", [
    {"window": 0}, {"min_evidence": 0}, {"min_evidence": 7}, {"idle": 0}, {"hold": 0},
    {"memory": 0},
])
def test_limits_out_of_range_are_refused(limits: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="ReuseAdmission"):
        ReuseAdmission(lambda: 0, **limits)


# -- the routes' shared option and rule ----------------------------------------------------------


def holding_admission() -> ReuseAdmission:
    evictions = 0
    admission = ReuseAdmission(lambda: evictions, min_evidence=1)
    admission.written(["row"])
    evictions = 1
    admission.answered("row", False, "r")  # evicted before its first read: a hold
    assert admission.holding
    return admission


def test_a_write_is_refused_only_while_holding_and_no_hint_holds_its_rows() -> None:
    asked: list[str] = []

    def held(answer: bool) -> Callable[[], bool]:
        def ask() -> bool:
            asked.append("held")
            return answer
        return ask

    assert not refuses(None, held(False))  # no admission: every write goes
    idle = ReuseAdmission(lambda: 0)
    assert not refuses(idle, held(False)) and asked == []  # not holding: hints not asked
    admission = holding_admission()
    assert refuses(admission, held(False)) and admission.counts.refused == 1
    assert not refuses(admission, held(True))  # a pinned or retained row: written
    assert admission.counts.refused == 1 and asked == ["held", "held"]


def test_the_option_names_the_admission() -> None:
    assert isinstance(admission_for("reuse", True, lambda: 0), ReuseAdmission)
    assert admission_for("all", True, lambda: 0) is None  # the backend's LRU alone
    assert admission_for("reuse", False, lambda: 0) is None  # a store that never evicts
    assert check_write_admission("all") == "all"
    for bad in ("lru", None, ""):
        with pytest.raises(ConfigError, match="write_admission must be one of reuse, all"):
            check_write_admission(bad)
        with pytest.raises(ConfigError, match="write_admission"):
            admission_for(str(bad), True, lambda: 0)
