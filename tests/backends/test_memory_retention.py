"""Retention and pins on the memory backend: eviction order, budget, owners, expiry."""

from __future__ import annotations

import pytest

from hicache_store.backends import CapacityError, NotSupportedError, PinBudgetError, Retention
from hicache_store.backends.memory import MemoryBackend


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_pin_blocks_eviction_and_retained_goes_after_unretained() -> None:
    store = MemoryBackend(capacity_bytes=300, pin_fraction=0.5)
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


async def test_pin_budget_refuses_the_whole_call() -> None:
    store = MemoryBackend(capacity_bytes=1000, pin_fraction=0.25)
    await store.put(["a0", "a1", "a2"], [b"x" * 100] * 3)
    await store.retain(["a0", "a1"], Retention("s", None, pinned=True))
    with pytest.raises(PinBudgetError, match="budget 250 bytes, used 200, asked 100"):
        await store.retain(["a2"], Retention("t", None, pinned=True))
    assert await store.retention_of(["a2"]) == [()]


async def test_only_the_owner_shortens_and_deadlines_expire() -> None:
    clock = Clock()
    store = MemoryBackend(capacity_bytes=200, clock=clock)
    await store.put(["a0", "a1"], [b"x" * 100] * 2)
    await store.retain(["a0"], Retention("o", 2000.0, pinned=False))
    await store.retain(["a0"], Retention("p", 1500.0, pinned=False))  # another owner: beside
    assert [r.owner for r in (await store.retention_of(["a0"]))[0]] == ["o", "p"]
    await store.retain(["a0"], Retention("o", 1100.0, pinned=False))  # the owner shortens
    clock.now = 1600.0
    assert await store.retention_of(["a0"]) == [()]  # both expired: ordinary data again
    await store.retain(["a1"], Retention("o", None, pinned=False))
    await store.put(["a2"], [b"y" * 100])  # a0 (expired, oldest) goes, a1 is retained
    assert await store.exists(["a0", "a1", "a2"]) == [False, True, True]
    await store.release(["a1"], "o")
    assert await store.retention_of(["a1", "d9"]) == [(), ()]


async def test_missing_keys_are_ignored_and_delete_drops_holds() -> None:
    store = MemoryBackend(capacity_bytes=1000)
    await store.retain(["a0"], Retention("o", None, pinned=True))
    await store.put(["a0"], [b"x"])
    assert await store.retention_of(["a0"]) == [()]
    await store.retain(["a0"], Retention("o", None, pinned=True))
    await store.delete(["a0"])
    await store.put(["a0"], [b"x"])
    assert await store.retention_of(["a0"]) == [()]


async def test_undeclared_backend_refuses() -> None:
    class NoRetention(MemoryBackend):
        capabilities = MemoryBackend.capabilities.replace(retention=False)

    with pytest.raises(NotSupportedError):
        await NoRetention().retain(["a0"], Retention("o", None, pinned=True))
