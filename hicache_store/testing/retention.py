"""``RetentionTests``: the retention contract (``hicache_store.backends.retention``) as tests.

A pytest mixin for backends that bound their size and declare ``capabilities.retention``:
pins are never evicted, retained objects go after unretained ones and by ascending priority,
the pin budget refuses a whole call (a ``retain``, or a ``put`` that rewrites a pinned object
larger), only an owner shortens or releases its own entry,
deadlines expire into ordinary data, a delete drops a key's entries, and ``delete_until_held``
stops at the first group that holds a key. Subclass it (a class
named ``Test...``) and implement one hook::

    class TestMyRetention(RetentionTests):
        async def open_retention_backend(self, where, capacity_bytes, pin_fraction, clock):
            return MyBackend(where, capacity_bytes=capacity_bytes,
                             pin_fraction=pin_fraction, clock=clock)

``where`` is a fresh empty directory per store (for backends that keep files); ``clock``
gives unix seconds and must be what the backend reads deadlines against. Sizes in the tests
are exact: a store of ``capacity_bytes`` holds objects whose lengths sum to at most that.
The mixin closes every store it opened. A backend that does not declare the capability gets
one test (its retention calls raise ``NotSupportedError``); the others skip, saying why.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from hicache_store.backends import (
    Backend,
    CapacityError,
    NotSupportedError,
    PinBudgetError,
    Retention,
)


class Clock:
    """A settable clock (unix seconds) for deadlines: tests move time instead of waiting."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


OpenStore = Callable[..., Awaitable[Backend]]


@pytest.mark.asyncio
class RetentionTests(abc.ABC):
    """Mixin: the retention contract on a bounded backend. See the module docstring."""

    @abc.abstractmethod
    async def open_retention_backend(
        self, where: Path, capacity_bytes: int, pin_fraction: float, clock: Callable[[], float]
    ) -> Backend:
        """An open, empty backend of ``capacity_bytes`` with this pin fraction and clock."""

    @pytest.fixture
    async def open_store(self, tmp_path: Path) -> AsyncIterator[OpenStore]:
        opened: list[Backend] = []
        numbers = itertools.count()

        async def open_(
            capacity_bytes: int, pin_fraction: float = 0.25, clock: Callable[[], float] | None = None
        ) -> Backend:
            where = tmp_path / f"retention-{next(numbers)}"
            where.mkdir()
            store = await self.open_retention_backend(
                where, capacity_bytes, pin_fraction, clock or Clock()
            )
            opened.append(store)
            if not store.capabilities.retention:
                with pytest.raises(NotSupportedError):
                    await store.retain(["a0"], Retention("o", None, pinned=True))
                pytest.skip(f"{store.name} does not declare capabilities.retention")
            return store

        yield open_
        for store in opened:
            await store.close()

    async def test_pin_blocks_eviction_and_retained_goes_after_unretained(
        self, open_store: OpenStore
    ) -> None:
        store = await open_store(300, pin_fraction=0.5)
        await store.put(["a0", "a1", "a2"], [b"x" * 100] * 3)
        await store.retain(["a0"], Retention("s", None, pinned=True))
        await store.retain(["a1"], Retention("s", None, pinned=False, priority=1))
        await store.put(["a3"], [b"y" * 100])  # evicts a2 (unretained), not the older a0/a1
        assert await store.exists(["a0", "a1", "a2", "a3"]) == [True, True, False, True]
        await store.put(["a4"], [b"z" * 100])  # then a3 (unretained) before the retained a1
        assert await store.exists(["a0", "a1", "a3", "a4"]) == [True, True, False, True]
        await store.put(["a5"], [b"w" * 200])  # only a1 and a4 can go; a0 stays pinned
        assert await store.exists(["a0", "a1", "a4", "a5"]) == [True, False, False, True]
        with pytest.raises(CapacityError):
            await store.put(["a6"], [b"v" * 300])  # would need the pinned a0
        assert await store.exists(["a0", "a5", "a6"]) == [True, True, False]

    async def test_retained_objects_go_by_ascending_priority(self, open_store: OpenStore) -> None:
        store = await open_store(300)
        await store.put(["b0", "b1", "b2"], [b"x" * 100] * 3)
        await store.retain(["b0"], Retention("s", None, pinned=False, priority=5))
        await store.retain(["b1"], Retention("s", None, pinned=False, priority=1))
        await store.retain(["b2"], Retention("s", None, pinned=False, priority=3))
        # another owner's lower priority does not lower b0's: the highest entry counts
        await store.retain(["b0"], Retention("t", None, pinned=False, priority=0))
        await store.put(["b3"], [b"y" * 100])
        assert await store.exists(["b0", "b1", "b2", "b3"]) == [True, False, True, True]
        await store.put(["b4"], [b"z" * 200])  # b3 (unretained), then b2 (priority 3)
        assert await store.exists(["b0", "b2", "b3", "b4"]) == [True, False, False, True]

    async def test_pin_budget_refuses_the_whole_call(self, open_store: OpenStore) -> None:
        store = await open_store(1000, pin_fraction=0.25)
        await store.put(["a0", "a1", "a2", "a3"], [b"x" * 100] * 4)
        await store.retain(["a0", "a1"], Retention("s", None, pinned=True))
        with pytest.raises(PinBudgetError, match="budget 250 bytes, used 200, asked 100"):
            await store.retain(["a2"], Retention("t", None, pinned=True))
        with pytest.raises(PinBudgetError, match="used 200, asked 200"):
            await store.retain(["a0", "a2", "a3"], Retention("t", None, pinned=True))
        assert await store.retention_of(["a2", "a3"]) == [(), ()]
        assert [r.owner for r in (await store.retention_of(["a0"]))[0]] == ["s"]
        # re-pinning what is pinned already asks nothing; an unpinned hold is not budgeted
        await store.retain(["a0", "a1"], Retention("t", None, pinned=True))
        await store.retain(["a2", "a3"], Retention("t", None, pinned=False))
        await store.release(["a0", "a1"], "s")
        await store.release(["a1"], "t")
        await store.retain(["a2"], Retention("t", None, pinned=True))  # 200 pinned now
        assert [len(h) for h in await store.retention_of(["a0", "a1", "a2"])] == [1, 0, 1]

    async def test_a_rewrite_of_a_pinned_object_is_charged_as_a_pin(
        self, open_store: OpenStore
    ) -> None:
        store = await open_store(1000, pin_fraction=0.25)  # 250 bytes of pins
        await store.put(["a0", "a1"], [b"p" * 40, b"u" * 100])
        await store.retain(["a0"], Retention("s", None, pinned=True))
        # the rewrite keeps the pin: 900 pinned bytes would pass the budget, so the whole call
        # is refused and the old objects (and the pin) stay
        with pytest.raises(PinBudgetError, match="rewriting pinned objects"):
            await store.put(["a1", "a0"], [b"v" * 100, b"q" * 900])
        assert await store.get_bytes("a0") == b"p" * 40
        assert await store.get_bytes("a1") == b"u" * 100
        assert [r.owner for r in (await store.retention_of(["a0"]))[0]] == ["s"]
        with pytest.raises(PinBudgetError, match="used 40, asked 211"):
            await store.put(["a0"], [b"q" * 251])
        await store.put(["a0"], [b"q" * 250])  # up to the budget, and at its size or less
        await store.put(["a0"], [b"r" * 250])
        await store.put(["a0"], [b"s" * 10])
        await store.put(["a1"], [b"w" * 600])  # an object without a pin is not charged
        assert [len(await store.get_bytes(k) or b"") for k in ("a0", "a1")] == [10, 600]
        await store.release(["a0"], "s")
        await store.put(["a0"], [b"t" * 300])  # released: an ordinary rewrite
        assert await store.get_bytes("a0") == b"t" * 300

    async def test_an_expired_pin_does_not_count_against_the_budget(
        self, open_store: OpenStore
    ) -> None:
        clock = Clock()
        store = await open_store(1000, pin_fraction=0.2, clock=clock)
        await store.put(["c0", "c1", "c2"], [b"x" * 100] * 3)
        await store.retain(["c0", "c1"], Retention("s", 1100.0, pinned=True))
        with pytest.raises(PinBudgetError):
            await store.retain(["c2"], Retention("t", None, pinned=True))
        clock.now = 1100.0  # a deadline is exclusive: at until_s the pin no longer holds
        await store.retain(["c2"], Retention("t", None, pinned=True))
        assert [len(h) for h in await store.retention_of(["c0", "c1", "c2"])] == [0, 0, 1]

    async def test_only_the_owner_shortens_and_deadlines_expire(
        self, open_store: OpenStore
    ) -> None:
        clock = Clock()
        store = await open_store(200, clock=clock)
        await store.put(["a0", "a1"], [b"x" * 100] * 2)
        await store.retain(["a0"], Retention("o", 2000.0, pinned=False))
        await store.retain(["a0"], Retention("p", 1500.0, pinned=False))  # another owner: beside
        assert [r.owner for r in (await store.retention_of(["a0"]))[0]] == ["o", "p"]
        await store.retain(["a0"], Retention("o", 1100.0, pinned=False))  # the owner shortens
        assert [r.until_s for r in (await store.retention_of(["a0"]))[0]] == [1100.0, 1500.0]
        await store.release(["a0"], "nobody")  # another owner's release changes nothing
        assert len((await store.retention_of(["a0"]))[0]) == 2
        clock.now = 1600.0
        assert await store.retention_of(["a0"]) == [()]  # both expired: ordinary data again
        await store.retain(["a1"], Retention("o", None, pinned=False))
        await store.put(["a2"], [b"y" * 100])  # a0 (expired, oldest) goes, a1 is retained
        assert await store.exists(["a0", "a1", "a2"]) == [False, True, True]
        await store.release(["a1"], "o")
        assert await store.retention_of(["a1", "d9"]) == [(), ()]

    async def test_an_expired_pin_is_evicted_like_ordinary_data(
        self, open_store: OpenStore
    ) -> None:
        clock = Clock()
        store = await open_store(200, pin_fraction=1.0, clock=clock)
        await store.put(["e0", "e1"], [b"x" * 100] * 2)
        await store.retain(["e0", "e1"], Retention("s", 1050.0, pinned=True))
        with pytest.raises(CapacityError):
            await store.put(["e2"], [b"y" * 100])
        clock.now = 1050.0
        await store.put(["e2"], [b"y" * 100])
        assert sum(await store.exists(["e0", "e1", "e2"])) == 2
        assert (await store.exists(["e2"])) == [True]

    async def test_missing_keys_are_ignored_and_delete_drops_holds(
        self, open_store: OpenStore
    ) -> None:
        store = await open_store(1000)
        await store.retain(["a0"], Retention("o", None, pinned=True))
        await store.put(["a0"], [b"x"])
        assert await store.retention_of(["a0"]) == [()]  # a hold is on an object, not a name
        await store.retain(["a0"], Retention("o", None, pinned=True))
        await store.put(["a0"], [b"xy"])  # an overwrite keeps the key's entries
        assert [r.owner for r in (await store.retention_of(["a0"]))[0]] == ["o"]
        await store.delete(["a0"])
        await store.put(["a0"], [b"x"])
        assert await store.retention_of(["a0"]) == [()]

    async def test_an_evicted_retained_object_loses_its_entries(
        self, open_store: OpenStore
    ) -> None:
        store = await open_store(200)
        await store.put(["f0", "f1"], [b"x" * 100] * 2)
        await store.retain(["f0", "f1"], Retention("o", None, pinned=False))
        await store.put(["f2"], [b"y" * 200])  # only retained objects can go: both do
        assert await store.exists(["f0", "f1", "f2"]) == [False, False, True]
        await store.put(["f0"], [b"z" * 100])
        assert await store.retention_of(["f0", "f1"]) == [(), ()]

    async def test_delete_until_held_stops_at_the_first_held_group(
        self, open_store: OpenStore
    ) -> None:
        clock = Clock()
        store = await open_store(1000, pin_fraction=1.0, clock=clock)
        await store.put([f"a{i}" for i in range(7)], [b"x" * 10] * 7)
        await store.retain(["a3"], Retention("s", None, pinned=True))
        await store.retain(["a5"], Retention("r", None, pinned=False))
        await store.retain(["a6"], Retention("e", 1100.0, pinned=True))
        done = await store.delete_until_held([["a0", "a1"], ["b9", "a2"], ["a4", "a3"], ["a6"]])
        assert (done.groups, done.removed) == (2, (True, True, False, True))
        assert await store.exists([f"a{i}" for i in range(7)]) == [
            False, False, False, True, True, True, True]  # the held group and the rest stay
        done = await store.delete_until_held([["a4"], ["a5"], ["a6"]])  # a retention holds too
        assert (done.groups, done.removed) == (1, (True,))
        clock.now = 1100.0  # a6's pin has expired: ordinary data
        await store.release(["a5"], "r")
        done = await store.delete_until_held([["a6"], ["a5"], ["a3"]])
        assert (done.groups, done.removed) == (2, (True, True))
        assert await store.exists(["a3", "a5", "a6"]) == [True, False, False]
        assert (await store.delete_until_held([])).groups == 0
        with pytest.raises(ValueError, match="at least one key"):
            await store.delete_until_held([["a3"], []])
        assert await store.exists(["a3"]) == [True]

    async def test_bad_arguments_are_refused(self, open_store: OpenStore) -> None:
        store = await open_store(1000)
        with pytest.raises(TypeError):
            await store.retain(["a0"], ("o", None, True))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="owner"):
            Retention("", None, pinned=True)
        with pytest.raises(ValueError, match="key"):
            await store.retain(["../a0"], Retention("o", None, pinned=True))
