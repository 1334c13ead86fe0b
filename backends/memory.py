"""``memory://``: the reference backend, an in-process dict with a byte bound and LRU eviction.

It is the executable specification of the ``Backend`` contract (the conformance suite's first
customer) and the L3 stand-in of unit tests. Not shared between processes and not persistent.

Atomicity: every core method runs without an ``await`` between reading and updating the dict,
so on one event loop each call is atomic; a stored object is an immutable ``bytes`` copy made
before it is published, so no reader can observe it half-written and the caller's buffer is
never aliased.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ._lru import ChainLRU
from .base import Backend, ReadCounts, ReadRanges
from .errors import CapacityError, InvalidRangeError
from .retention import (
    DEFAULT_PIN_FRACTION,
    Retention,
    check_pin_budget,
    eviction_class,
    holding,
    is_pinned,
    pin_budget_bytes,
)
from .types import Capabilities, DeletedUntilHeld, ObjectStat, parse_size

#: default bound: 1 GiB.
DEFAULT_CAPACITY_BYTES = 1 << 30


class MemoryBackend(Backend):
    """Objects in a dict, at most ``capacity_bytes`` in total, chain-aware LRU eviction.

    Options: ``capacity_bytes`` (int or a size string such as ``256MiB``; default 1 GiB),
    ``pin_fraction`` (share of the capacity pins may hold, default 0.25), ``clock`` (unix
    seconds, for retention deadlines; default ``time.time``).
    An object larger than the capacity raises ``CapacityError``, as does a put that could
    only make room by evicting a pin. Retention (``backends.retention``): an overwrite keeps
    the key's entries (one that grows a pinned object past the pin budget raises
    ``PinBudgetError``); a delete removes them with the object.
    """

    name = "memory"
    capabilities = Capabilities(
        ranged_reads=True, listing=True, atomic_put=True, eviction=True, mtime=True,
        retention=True, capacity_usage=True,
    )

    def __init__(
        self,
        capacity_bytes: int | str = DEFAULT_CAPACITY_BYTES,
        pin_fraction: float | str = DEFAULT_PIN_FRACTION,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.capacity_bytes = parse_size(capacity_bytes, option="capacity_bytes")
        self.pin_budget_bytes = pin_budget_bytes(self.capacity_bytes, float(pin_fraction))
        self._clock = clock
        self._holds: dict[str, dict[str, Retention]] = {}
        self._data: dict[str, bytes] = {}
        self._mtimes: dict[str, float] = {}
        self._lru = ChainLRU()

    @property
    def used_bytes(self) -> int:
        return self._lru.total_bytes

    def _usage(self) -> tuple[int, int]:
        # docstring inherited (a put holds the lock from its evictions to its insert: nothing
        # is reserved between calls)
        return self.capacity_bytes, self._lru.total_bytes

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        hits = [key in self._data for key in keys]
        self._lru.touch_batch([k for k, hit in zip(keys, hits, strict=True) if hit])
        return hits

    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: ReadRanges
    ) -> ReadCounts:
        # docstring inherited
        results: ReadCounts = []
        for key, buf, rng in zip(keys, buffers, ranges, strict=True):
            data = self._data.get(key)
            if data is None:
                results.append(None)
                continue
            if rng is None:
                if len(data) > len(buf):
                    raise InvalidRangeError(
                        f"object of {len(data)} bytes does not fit a {len(buf)}-byte buffer",
                        backend=self.name, operation="get_into", key=key,
                    )
                buf[: len(data)] = data
                results.append(len(data))
            else:
                rng.check_within(len(data), backend=self.name, key=key)
                buf[: rng.length] = data[rng.start : rng.end]
                results.append(rng.length)
        self._lru.touch_batch([k for k, n in zip(keys, results, strict=True) if n is not None])
        return results

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        # docstring inherited
        copies = [(key, bytes(buf)) for key, buf in zip(keys, buffers, strict=True)]
        for key, data in copies:
            if len(data) > self.capacity_bytes:
                raise CapacityError(
                    f"object of {len(data)} bytes exceeds the capacity of {self.capacity_bytes}",
                    backend=self.name, operation="put", key=key,
                )
        latest = dict(copies)  # a key repeated in one batch: the last copy wins
        if self._holds:
            self._charge_rewrites(latest)
        self._make_room(sum(len(v) for v in latest.values()), keep=latest.keys())
        now = time.time()
        for key, data in latest.items():
            self._data[key] = data
            self._mtimes[key] = now
        self._lru.add_batch([(key, len(data)) for key, data in copies if latest[key] is data])

    def _charge_rewrites(self, latest: dict[str, bytes]) -> None:
        """A rewrite keeps the key's entries, so one that grows a pinned object is charged as
        a pin (``backends.retention``): ``PinBudgetError`` before anything is stored."""
        now = self._clock()
        pinned = {k for k, h in self._holds.items() if is_pinned(h.values(), now)}
        growth = sum(max(0, len(data) - len(self._data[key])) for key, data in latest.items()
                     if key in pinned and key in self._data)
        if growth:
            used = sum(len(self._data[k]) for k in pinned if k in self._data)
            check_pin_budget(budget=self.pin_budget_bytes, used=used, asked=growth,
                             backend=self.name, operation="put")

    def _make_room(self, incoming: int, keep: Any) -> None:
        victims = self._victims()
        if self._holds:
            # Pins may make room impossible: find out before evicting anything for nothing.
            victims = list(victims)
            evictable = sum(len(self._data[v]) for v in victims if v not in keep)
            if self._lru.total_bytes - evictable + incoming > self.capacity_bytes:
                raise CapacityError(
                    f"cannot make room for {incoming} bytes: what remains is pinned",
                    backend=self.name, operation="put",
                )
        for victim in victims:
            if self._lru.total_bytes + incoming <= self.capacity_bytes:
                return
            if victim in keep:
                continue  # being rewritten by this very batch: its old size goes away anyway
            del self._data[victim]
            self._mtimes.pop(victim, None)
            self._holds.pop(victim, None)
            self._lru.discard(victim)
            self.stats.evictions += 1
        if self._lru.total_bytes + incoming > self.capacity_bytes:
            raise CapacityError(
                f"cannot make room for {incoming} bytes: what remains is pinned",
                backend=self.name, operation="put",
            )

    def _victims(self) -> Any:
        """Eviction candidates in order: lazily in LRU order while nothing is retained (the
        usual case: no ranking of the whole store per put); else unretained in LRU order, then
        retained by priority (LRU within), never a pinned object."""
        if not self._holds:
            return (victim for victim, _size in self._lru.victims())
        now = self._clock()
        ranked: list[tuple[tuple[int, int], int, str]] = []
        for order, (victim, _size) in enumerate(self._lru.victims()):
            cls = eviction_class(self._holds.get(victim, {}).values(), now)
            if cls is not None:
                ranked.append((cls, order, victim))
        ranked.sort()
        return (victim for _cls, _order, victim in ranked)

    async def _retain(self, keys: Sequence[str], retention: Retention) -> None:
        now = self._clock()
        present = list(dict.fromkeys(k for k in keys if k in self._data))
        if retention.pinned and retention.holds(now):
            pinned = {k for k, h in self._holds.items() if is_pinned(h.values(), now)}
            used = sum(len(self._data[k]) for k in pinned if k in self._data)
            asked = sum(len(self._data[k]) for k in present if k not in pinned)
            check_pin_budget(
                budget=self.pin_budget_bytes, used=used, asked=asked, backend=self.name
            )
        for key in present:
            self._holds.setdefault(key, {})[retention.owner] = retention

    async def _release(self, keys: Sequence[str], owner: str) -> None:
        for key in keys:
            held = self._holds.get(key)
            if held is not None:
                held.pop(owner, None)
                if not held:
                    del self._holds[key]

    async def _retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        now = self._clock()
        return [holding(self._holds.get(k, {}).values(), now) for k in keys]

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        removed = []
        for key in keys:
            removed.append(self._data.pop(key, None) is not None)
            self._mtimes.pop(key, None)
            self._holds.pop(key, None)
            self._lru.discard(key)
        return removed

    async def _delete_until_held(self, groups: list[list[str]]) -> DeletedUntilHeld:
        # docstring inherited. Atomic: no await between the hold check and the delete.
        now = self._clock()
        done = 0
        for group in groups:
            if any(holding(self._holds.get(key, {}).values(), now) for key in group):
                break
            done += 1
        removed = await self._delete([key for group in groups[:done] for key in group])
        return DeletedUntilHeld(done, tuple(removed))

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        # docstring inherited
        return [
            None
            if (data := self._data.get(key)) is None
            else ObjectStat(key, len(data), self._mtimes.get(key))
            for key in keys
        ]

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        # docstring inherited; a snapshot, so writes during the listing cannot break it.
        for key in [k for k in self._data if k.startswith(prefix)]:
            yield key

    async def _put_if_absent(self, key: str, buffer: memoryview) -> bool:
        # Atomic: no await between the check and the insert.
        if key in self._data:
            return False
        await self._put([key], [buffer])
        return True

    async def _close(self) -> None:
        self._data.clear()
        self._mtimes.clear()
        self._holds.clear()
        self._lru = ChainLRU()

    # -- oracle access for tests (bypasses the API: no validation, no stats, no LRU) ---------

    def raw_get(self, key: str) -> bytes | None:
        return self._data.get(key)

    def raw_set(self, key: str, data: bytes) -> None:
        old = self._data.get(key)
        self._data[key] = bytes(data)
        self._mtimes[key] = time.time()
        if old is not None:
            self._lru.discard(key)
        self._lru.add(key, len(data))
