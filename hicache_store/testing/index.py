"""``IndexTests``: the index contract (``hicache_store.backends.index``) as tests.

One suite for every ``ObjectIndex`` implementation, as ``BackendTests`` is for backends: the
SQLite index of a file root, the Valkey index of a fleet, a third party's. The index under
test stands in front of a ``MemorySite`` (objects in a dict, which the tests also read and
write around the index: the oracle), and several instances opened on one store play the
processes (or hosts) that share it. Subclass it (a class named ``Test...``) and implement two
hooks::

    class TestMyIndex(IndexTests):
        def open_index(self, store, site, clock):
            return MyIndex(store, site, clock=clock)   # same ``store``: the same index

        def kill(self, index):
            ...   # make ``index``'s writer dead as the others see it (around the API)

``store`` is a directory per store (for an index that keeps files); ``clock`` gives unix
seconds for retention deadlines. Tests switch on ``index.features``: retention, the change
feed and leases are checked where declared. The suite closes every index it opened.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hicache_store.backends import CapacityError, PinBudgetError, Retention
from hicache_store.backends.errors import WriterFencedError
from hicache_store.backends.index import Measured, ObjectIndex, ObjectSite, Reservation

from .retention import Clock

#: the capacity most tests run under (bytes; objects are 100 bytes unless said otherwise).
CAPACITY = 1000


class MemorySite:
    """Objects in a dict, as an ``ObjectSite``: the store behind the index under test, and the
    tests' oracle. ``fail_removal`` holds keys whose removal fails (an undeletable file)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.mtimes: dict[str, float] = {}
        self.temps: dict[str, set[str]] = {}
        self.fail_removal: set[str] = set()
        self._lock = threading.Lock()

    def publish(self, key: str, data: bytes) -> None:
        with self._lock:
            self.objects[key] = data
            self.mtimes[key] = time.time()

    def measure(self, keys: Sequence[str]) -> list[Measured | None]:
        with self._lock:
            return [None if key not in self.objects else
                    Measured(len(self.objects[key]), len(self.objects[key]), self.mtimes[key])
                    for key in keys]

    def remove(self, keys: Sequence[str]) -> list[bool | OSError]:
        out: list[bool | OSError] = []
        with self._lock:
            for key in keys:
                if key in self.fail_removal:
                    out.append(PermissionError(13, "cannot remove", key))
                elif self.objects.pop(key, None) is None:
                    out.append(False)
                else:
                    self.mtimes.pop(key, None)
                    out.append(True)
        return out

    def walk(self) -> Iterator[tuple[str, Measured]]:
        with self._lock:
            items = list(self.objects.items())
        for key, data in items:
            yield key, Measured(len(data), len(data), self.mtimes[key])

    def remove_temps(self, writer: str) -> int:
        with self._lock:
            return len(self.temps.pop(writer, set()))

    def charge_of(self, size: int) -> int:
        return size


def page_key(page: int, group: int = 0, digest: str = "0123456789abcdef") -> str:
    """An object key of page ``page`` (a fake sha256 page hash), head group ``group``."""
    return f"{page:064x}_{digest}_L0-0_H{group}"


@dataclass
class IndexEnv:
    """One store under test: its site, and a way to open more processes' indexes on it."""

    site: MemorySite
    open: Callable[[], ObjectIndex]
    clock: Clock
    opened: list[ObjectIndex] = field(default_factory=list)


def put(index: ObjectIndex, site: MemorySite, keys: Sequence[str], sizes: Sequence[int] | None = None,
        *, capacity: int = CAPACITY, write: bool = True) -> Reservation:
    """A put through the protocol: reserve, make room, write (unless not ``write``), settle."""
    sizes = [100] * len(keys) if sizes is None else sizes
    reservation = index.reserve(keys, sizes, capacity)
    try:
        index.make_room(capacity, reservation)
        if write:
            for key, size in zip(keys, sizes, strict=True):
                site.publish(key, b"x" * size)
    finally:
        index.settle_put(reservation)
    return reservation


def _later() -> None:
    """Let the clock move on: calls made at least a millisecond apart rank apart."""
    time.sleep(0.003)


def _a0_then_b0(index: ObjectIndex, site: MemorySite) -> None:
    """Fill a 200-byte store with ``a0``, then ``b0`` (100 bytes each, ``a0`` the older)."""
    put(index, site, ["a0"], capacity=200)
    _later()
    put(index, site, ["b0"], capacity=200)


class IndexTests(abc.ABC):
    """Mixin: the index contract. See the module docstring."""

    @abc.abstractmethod
    def open_index(self, store: Path, site: ObjectSite, clock: Callable[[], float]) -> ObjectIndex:
        """An index on ``store`` (a new one, or another process's view of an existing one)."""

    @abc.abstractmethod
    def kill(self, index: ObjectIndex) -> None:
        """Make ``index``'s writer dead, as the other processes of the store see it."""

    @pytest.fixture
    def env(self, tmp_path: Path) -> Iterator[IndexEnv]:
        site = MemorySite()
        clock = Clock(time.time())
        store = tmp_path / "store"
        store.mkdir()
        env = IndexEnv(site, lambda: self._open(env, store), clock)
        yield env
        for index in env.opened:
            index.close()

    def _open(self, env: IndexEnv, store: Path) -> ObjectIndex:
        index = self.open_index(store, env.site, env.clock)
        env.opened.append(index)
        return index

    # -- presence and sizes ---------------------------------------------------------------------

    def test_a_settled_put_is_present_counted_and_listed(self, env: IndexEnv) -> None:
        index = env.open()
        put(index, env.site, ["a0", "a1"], [100, 50])
        assert index.exists(["a0", "a1", "b0"]) == [True, True, False]
        assert index.totals() == (150, 2)
        assert index.reserved_bytes() == 0
        listed = sorted(key for page in index.key_pages("") for key in page)
        assert listed == ["a0", "a1"]
        entries = {key: size for page in index.entry_pages("a") for key, size, _ in page}
        assert entries == {"a0": 100, "a1": 50}
        assert [key for page in index.key_pages("a1") for key in page] == ["a1"]

    def test_a_put_that_wrote_nothing_settles_absent_and_frees_its_room(
            self, env: IndexEnv) -> None:
        index = env.open()
        reservation = index.reserve(["a0"], [300], CAPACITY)
        assert index.reserved_bytes() >= 300
        index.settle_put(reservation)
        assert index.exists(["a0"]) == [False]
        assert index.totals() == (0, 0)
        assert index.reserved_bytes() == 0

    def test_a_rewrite_takes_the_new_size(self, env: IndexEnv) -> None:
        index = env.open()
        put(index, env.site, ["a0"], [100])
        put(index, env.site, ["a0"], [250])
        assert index.totals() == (250, 1)

    def test_another_process_sees_each_change_at_once(self, env: IndexEnv) -> None:
        first, second = env.open(), env.open()
        put(first, env.site, ["a0"])
        assert second.exists(["a0"]) == [True]
        assert second.totals() == (100, 1)
        assert second.delete(["a0"]) == [True]
        assert first.exists(["a0"]) == [False]
        assert "a0" not in env.site.objects

    def test_adopt_and_repair_follow_the_store(self, env: IndexEnv) -> None:
        index = env.open()
        env.site.publish("a0", b"x" * 70)  # placed by other means
        assert index.exists(["a0"]) == [False]
        assert index.adopt(["a0", "b0"]) == 1
        assert index.exists(["a0"]) == [True]
        assert index.totals() == (70, 1)
        del env.site.objects["a0"]  # removed behind the index's back
        _later()  # a repair whose look shares the adoption's millisecond may be taken as stale
        index.repair_missing("a0")
        assert index.exists(["a0"]) == [False]
        assert index.totals() == (0, 0)

    def test_a_late_repair_keeps_an_object_stored_again(self, env: IndexEnv) -> None:
        # A read's miss reaches the index late (queued, or its process stopped) after another
        # process stored the key again and pinned it: the repair looks at the store again.
        index, other = env.open(), env.open()
        put(other, env.site, ["a0", "a1"])
        if index.features.retention:
            other.retain(["a0"], Retention("pinner", None, pinned=True), pin_budget=200)
        index.repair_missing("a0")
        assert index.exists(["a0", "a1"]) == [True, True]
        assert index.totals() == (200, 2)
        if index.features.retention:
            assert [r.owner for r in index.retention_of(["a0"])[0]] == ["pinner"]

    # -- the bound and the eviction order ---------------------------------------------------------

    def test_a_put_larger_than_the_capacity_is_refused(self, env: IndexEnv) -> None:
        index = env.open()
        with pytest.raises(CapacityError):
            index.reserve(["a0"], [CAPACITY + 1], CAPACITY)
        assert index.reserved_bytes() == 0

    def test_the_least_recent_call_goes_first_and_a_chain_loses_its_tail_first(
            self, env: IndexEnv) -> None:
        index = env.open()
        put(index, env.site, ["c0", "c1", "c2"], capacity=300)  # one chain, in order
        _later()
        put(index, env.site, ["d0"], capacity=300)
        assert index.exists(["c0", "c1", "c2", "d0"]) == [True, True, False, True]
        _later()
        put(index, env.site, ["e0"], capacity=300)
        assert index.exists(["c0", "c1", "d0", "e0"]) == [True, False, True, True]
        assert index.totals() == (300, 3)
        assert sorted(env.site.objects) == ["c0", "d0", "e0"]

    def test_a_read_makes_a_key_recent(self, env: IndexEnv) -> None:
        index = env.open()
        _a0_then_b0(index, env.site)
        _later()
        index.touch(["a0"])
        index.flush_touches()
        put(index, env.site, ["c0"], capacity=200)
        assert index.exists(["a0", "b0", "c0"]) == [True, False, True]

    def test_the_objects_of_one_page_are_evicted_together(self, env: IndexEnv) -> None:
        """Two objects of page 1 written by two calls (two ranks of one deployment), then
        page 2: room for one more object takes both of page 1, never half of it."""
        index = env.open()
        put(index, env.site, [page_key(1, 0)], capacity=300)
        _later()
        put(index, env.site, [page_key(2, 0)], capacity=300)
        _later()
        put(index, env.site, [page_key(1, 1)], capacity=300)  # page 1 recent again
        _later()
        put(index, env.site, [page_key(3, 0)], capacity=300)  # room: page 2 goes, alone
        assert index.exists([page_key(1, 0), page_key(1, 1), page_key(2, 0)]) == [
            True, True, False]
        _later()
        put(index, env.site, [page_key(4, 0)], capacity=300)  # room for one: page 1, whole
        assert index.exists([page_key(1, 0), page_key(1, 1)]) == [False, False]
        assert index.exists([page_key(3, 0), page_key(4, 0)]) == [True, True]
        assert sorted(env.site.objects) == sorted([page_key(3, 0), page_key(4, 0)])

    def test_a_read_of_one_object_keeps_its_whole_page(self, env: IndexEnv) -> None:
        index = env.open()
        put(index, env.site, [page_key(1, 0), page_key(1, 1)], capacity=300)
        _later()
        put(index, env.site, [page_key(2, 0)], capacity=300)
        _later()
        index.touch([page_key(1, 1)])  # a reader of head group 1 only
        index.flush_touches()
        put(index, env.site, [page_key(3, 0)], capacity=300)
        assert index.exists([page_key(1, 0), page_key(1, 1), page_key(2, 0)]) == [
            True, True, False]

    def test_a_key_in_flight_is_never_evicted(self, env: IndexEnv) -> None:
        first, second = env.open(), env.open()
        _a0_then_b0(first, env.site)
        rewriting = first.reserve(["a0"], [100], 200)  # a0 busy in the first process
        first.make_room(200, rewriting)
        put(second, env.site, ["c0"], capacity=200)
        assert second.exists(["a0", "b0", "c0"]) == [True, False, True]
        env.site.publish("a0", b"y" * 100)
        first.settle_put(rewriting)
        assert second.totals() == (200, 2)

    def test_an_object_that_cannot_be_removed_stays_indexed_and_eviction_goes_on(
            self, env: IndexEnv) -> None:
        index = env.open()
        _a0_then_b0(index, env.site)
        env.site.fail_removal.add("a0")
        reservation = index.reserve(["c0"], [100], 200)
        counts = index.make_room(200, reservation)
        env.site.publish("c0", b"c" * 100)
        index.settle_put(reservation)
        assert (counts.evicted, counts.failed) == (1, 1), counts
        assert index.exists(["a0", "b0", "c0"]) == [True, False, True]
        assert index.totals() == (200, 2)

    def test_objects_that_cannot_be_removed_end_in_no_room_not_in_a_loop(
            self, env: IndexEnv) -> None:
        """Every object eviction could take fails to go: each is tried once for the put (a
        failure is not picked again for it), and the put is refused for want of room. The
        objects stay indexed, and the reservation is released."""
        index = env.open()
        _a0_then_b0(index, env.site)
        env.site.fail_removal.update({"a0", "b0"})
        outcome: list[object] = []

        def room() -> None:
            reservation = index.reserve(["c0"], [100], 200)
            try:
                outcome.append(index.make_room(200, reservation))
            except CapacityError as exc:
                outcome.append(exc)
            finally:
                index.settle_put(reservation)

        worker = threading.Thread(target=room, daemon=True)
        worker.start()
        worker.join(60.0)  # a hang detector: the step is a few round trips
        assert not worker.is_alive(), "make_room kept picking objects that cannot be removed"
        assert len(outcome) == 1
        assert isinstance(outcome[0], CapacityError), outcome
        assert index.exists(["a0", "b0", "c0"]) == [True, True, False]
        assert index.totals() == (200, 2)
        assert index.reserved_bytes() == 0

    def test_concurrent_writers_never_pass_the_bound(self, env: IndexEnv) -> None:
        """Four processes, 25 puts each of 2-4 objects, racing: at every settle the indexed
        bytes fit the capacity, and what is indexed is exactly what the store holds."""
        capacity = 2000
        indexes = [env.open() for _ in range(4)]
        worst: list[int] = []
        errors: list[BaseException] = []

        def writer(n: int, index: ObjectIndex) -> None:
            try:
                for i in range(25):
                    keys = [f"w{n}k{i}p{j}" for j in range(2 + i % 3)]
                    put(index, env.site, keys, capacity=capacity)
                    worst.append(index.totals()[0])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(n, ix)) for n, ix in enumerate(indexes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert max(worst) <= capacity
        listed = {key for page in indexes[0].key_pages("") for key in page}
        assert listed == set(env.site.objects)
        assert indexes[0].totals() == (100 * len(listed), len(listed))
        assert indexes[0].reserved_bytes() == 0

    # -- deletes ------------------------------------------------------------------------------------

    def test_delete_reports_what_it_removed_and_keeps_what_it_could_not(
            self, env: IndexEnv) -> None:
        index = env.open()
        put(index, env.site, ["a0", "a1"])
        assert index.delete(["a0", "b0"]) == [True, False]
        env.site.fail_removal.add("a1")
        with pytest.raises(PermissionError):
            index.delete(["a1"])
        assert index.exists(["a0", "a1"]) == [False, True]
        assert index.totals() == (100, 1)

    def test_delete_unindexed_removes_only_what_nothing_accounts_for(
            self, env: IndexEnv) -> None:
        index = env.open()
        put(index, env.site, ["a0"])
        env.site.publish("s0", b"stray")  # published by a writer that lost its lease
        in_flight = index.reserve(["b0"], [100], CAPACITY)
        env.site.publish("b0", b"b" * 100)  # written, not settled yet
        assert index.delete_unindexed(["a0", "s0", "b0", "z0"]) == 1
        assert sorted(env.site.objects) == ["a0", "b0"]
        index.settle_put(in_flight)
        assert index.exists(["a0", "b0", "s0"]) == [True, True, False]

    # -- writers that die --------------------------------------------------------------------------

    def test_a_dead_writers_reservations_are_reclaimed(self, env: IndexEnv) -> None:
        dead, live = env.open(), env.open()
        written = dead.reserve(["a0"], [100], CAPACITY)
        env.site.publish("a0", b"a" * 100)  # renamed, not settled: then killed
        dead.reserve(["b0"], [600], CAPACITY)  # killed before writing
        self.kill(dead)
        assert live.recover() >= 2
        assert live.exists(["a0", "b0"]) == [True, False]
        assert live.totals() == (100, 1)
        assert live.reserved_bytes() == 0
        put(live, env.site, ["c0"], [800])  # the dead writer's 600 bytes are free again
        assert live.exists(["c0"]) == [True]
        if dead.features.leases:
            with pytest.raises(WriterFencedError):  # it woke up: it cannot settle
                dead.settle_put(written)

    def test_a_dead_writers_eviction_is_finished(self, env: IndexEnv) -> None:
        dead, live = env.open(), env.open()
        _a0_then_b0(live, env.site)
        reservation = dead.reserve(["c0"], [100], 200)
        if not reservation.victims:
            pytest.skip(f"{type(dead).__name__} evicts inside make_room, in one call")
        # chosen inside reserve: out of the index, the object not removed yet; then killed
        assert live.exists(reservation.victims) == [False] * len(reservation.victims)
        self.kill(dead)
        live.recover()
        assert "a0" not in env.site.objects
        assert live.exists(["a0", "b0"]) == [False, True]
        assert live.totals() == (100, 1)
        assert live.reserved_bytes() == 0

    # -- retention ----------------------------------------------------------------------------------

    def _retention(self, index: ObjectIndex) -> None:
        if not index.features.retention:
            pytest.skip(f"{type(index).__name__} keeps no retention")

    def test_a_pinned_page_is_never_evicted(self, env: IndexEnv) -> None:
        index = env.open()
        self._retention(index)
        _a0_then_b0(index, env.site)
        index.retain(["a0"], Retention("pinner", None, pinned=True), pin_budget=200)
        put(index, env.site, ["c0"], capacity=200)
        assert index.exists(["a0", "b0", "c0"]) == [True, False, True]
        index.retain(["c0"], Retention("pinner", None, pinned=True), pin_budget=200)
        with pytest.raises(CapacityError):
            put(index, env.site, ["d0"], capacity=200)
        assert index.exists(["a0", "c0", "d0"]) == [True, True, False]
        assert index.pinned_bytes() == 200

    def test_another_process_honours_pins_and_the_budget_refuses_whole(
            self, env: IndexEnv) -> None:
        first, second = env.open(), env.open()
        self._retention(first)
        put(first, env.site, ["a0", "a1", "a2"])
        first.retain(["a0"], Retention("p", None, pinned=True), pin_budget=200)
        with pytest.raises(PinBudgetError):
            second.retain(["a1", "a2"], Retention("q", None, pinned=True), pin_budget=200)
        assert second.retention_of(["a0", "a1", "a2"]) == [
            (Retention("p", None, True),), (), ()]
        assert second.pinned_bytes() == 100

    def test_delete_until_held_stops_at_the_first_held_group(self, env: IndexEnv) -> None:
        index = env.open()
        self._retention(index)
        put(index, env.site, ["a0", "a1", "b0", "c0"])
        index.retain(["b0"], Retention("r", None, pinned=False), pin_budget=0)
        done, removed = index.delete_until_held([["a0", "a1"], ["b0"], ["c0"]])
        assert (done, removed) == (1, [True, True])
        assert index.exists(["a0", "a1", "b0", "c0"]) == [False, False, True, True]
        index.release(["b0"], "r")
        assert index.delete_until_held([["b0"], ["c0"]]) == (2, [True, True])

    def test_a_rewrite_that_grows_a_pinned_object_is_charged_as_a_pin(
            self, env: IndexEnv) -> None:
        index = env.open()
        self._retention(index)
        put(index, env.site, ["a0"], [100])
        index.retain(["a0"], Retention("p", None, pinned=True), pin_budget=250)
        with pytest.raises(PinBudgetError):
            index.reserve(["a0"], [400], CAPACITY, pin_budget=250)
        assert index.reserved_bytes() == 0
        reservation = index.reserve(["a0"], [200], CAPACITY, pin_budget=250)
        env.site.publish("a0", b"x" * 200)
        index.settle_put(reservation)
        assert index.pinned_bytes() == 200

    def test_retained_objects_go_after_the_rest_and_holds_end_with_their_object(
            self, env: IndexEnv) -> None:
        index = env.open()
        self._retention(index)
        put(index, env.site, ["a0"], capacity=300)
        _later()
        put(index, env.site, ["b0"], capacity=300)
        _later()
        put(index, env.site, ["c0"], capacity=300)
        index.retain(["a0"], Retention("r", None, pinned=False, priority=5), pin_budget=0)
        put(index, env.site, ["d0"], capacity=300)  # b0 goes, not the older retained a0
        assert index.exists(["a0", "b0"]) == [True, False]
        index.delete(["a0"])
        put(index, env.site, ["a0"], capacity=300)
        assert index.retention_of(["a0"]) == [()]

    def test_a_hold_past_its_deadline_is_ordinary_data(self, env: IndexEnv) -> None:
        index = env.open()
        self._retention(index)
        _a0_then_b0(index, env.site)
        index.retain(["a0"], Retention("p", env.clock.now + 10, pinned=True), pin_budget=200)
        env.clock.now += 11
        assert index.retention_of(["a0"]) == [()]
        assert index.pinned_bytes() == 0
        put(index, env.site, ["c0"], capacity=200)
        assert index.exists(["a0", "b0"]) == [False, True]

    def test_a_new_process_with_no_holds_evicts_only_what_it_must(self, env: IndexEnv) -> None:
        """An empty hold table means nothing is held, never that everything may go."""
        first = env.open()
        put(first, env.site, [f"a{i}" for i in range(5)], capacity=600)
        first.close()
        env.opened.remove(first)
        second = env.open()
        put(second, env.site, ["b0"], capacity=600)
        assert second.totals() == (600, 6)
        put(second, env.site, ["b1"], capacity=600)
        assert second.totals() == (600, 6)

    # -- the change feed ----------------------------------------------------------------------------

    def _feed(self, index: ObjectIndex) -> None:
        if not index.features.change_feed:
            pytest.skip(f"{type(index).__name__} has no change feed")

    def test_every_change_appears_once_in_order(self, env: IndexEnv) -> None:
        first, second = env.open(), env.open()
        self._feed(first)
        start = first.changes_after(2**62, limit=1).last
        put(first, env.site, ["a0", "a1"], capacity=300)
        put(second, env.site, ["a0"], capacity=300)  # a rewrite: no change of presence
        second.delete(["a1"])
        _later()
        put(second, env.site, ["b0", "b1", "b2"], capacity=300)  # evicts a0
        changes: list[tuple[str, bool]] = []
        seq = start
        while True:
            found = first.changes_after(seq, limit=2)
            assert found.complete
            changes.extend(found.changes)
            seq = found.upto
            if seq >= found.last:
                break
        assert changes == [("a0", True), ("a1", True), ("a1", False), ("a0", False),
                           ("b0", True), ("b1", True), ("b2", True)]
        last, keys = second.listing()
        assert last == seq
        assert sorted(keys) == ["b0", "b1", "b2"]

    def test_a_listing_is_the_store_as_of_its_change_number(self, env: IndexEnv) -> None:
        index = env.open()
        self._feed(index)
        for i in range(20):
            put(index, env.site, [f"k{i}"], capacity=100_000)
        index.delete([f"k{i}" for i in range(0, 20, 3)])
        last, keys = index.listing()
        assert sorted(keys) == sorted(env.site.objects)
        assert index.changes_after(last).changes == []
        put(index, env.site, ["z0"], capacity=100_000)
        assert index.changes_after(last).changes == [("z0", True)]


__all__ = ["CAPACITY", "IndexEnv", "IndexTests", "MemorySite", "page_key", "put"]
