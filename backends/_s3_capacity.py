"""The S3 backend's own ``capacity_bytes`` bound (no fleet index): ``LocalBound``.

What this process knows of its prefix (the objects listed at open, written, or found by
``HEAD``) in chain-aware LRU order (``_lru.ChainLRU``); before a write, victims are deleted
until the batch fits. Several writers sharing a prefix each enforce their own view.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence

from ._lru import ChainLRU
from .errors import CapacityError
from .types import BackendStats, ObjectStat

#: how many eviction rounds a write may take before it is refused.
MAX_ROUNDS = 64


class LocalBound:
    """``capacity_bytes`` over a chain-aware LRU; evictions and refused deletes are counted in
    ``stats`` (the backend's). Every method but ``reserve`` is synchronous and short; call
    them from the event loop or under no lock of one's own."""

    def __init__(self, capacity_bytes: int, stats: BackendStats, *, name: str) -> None:
        self.capacity_bytes = capacity_bytes
        self._stats = stats
        self._name = name
        self._lru = ChainLRU()
        self._lock = threading.Lock()  # guards _lru

    def learn(self, found: Iterable[ObjectStat]) -> None:
        """At open: every object under the prefix, the oldest first in line."""
        # add_oldest puts each key first in line: add the newest first so the oldest leads.
        with self._lock:
            for st in sorted(found, key=lambda e: e.mtime or 0.0, reverse=True):
                self._lru.add_oldest(st.key, st.size)

    def found(self, stats: Sequence[ObjectStat | None]) -> None:
        """Objects a ``HEAD`` found: known now (first in line if new), then touched."""
        with self._lock:
            for st in stats:
                if st is not None:
                    self._lru.add_oldest(st.key, st.size)  # found, not written: first in line
            self._lru.touch_batch([st.key for st in stats if st is not None])

    def touched(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._lru.touch_batch(list(keys))

    def added(self, entries: Sequence[tuple[str, int]]) -> None:
        """Objects written (key, size): last in line."""
        with self._lock:
            self._lru.add_batch(list(entries))

    def removed(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._lru.discard(key)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._lru.total_bytes

    async def reserve(self, sizes: dict[str, int],
                      delete: Callable[[list[str]], Awaitable[list[str]]]) -> None:
        """Delete chain-aware-LRU victims until a batch of ``sizes`` fits.

        Victims are chosen under the lock and deleted with one ``delete`` per round (it returns
        the keys the store refused to delete); a refused object is counted, moved to the back
        of the line and skipped, so one stuck object never blocks writes. ``CapacityError``
        when the batch is larger than the bound, or no room can be made.
        """
        incoming = sum(sizes.values())
        if incoming > self.capacity_bytes:
            raise CapacityError(
                f"a batch of {incoming} bytes exceeds the capacity of {self.capacity_bytes}",
                backend=self._name, operation="put",
            )
        for _round in range(MAX_ROUNDS):
            with self._lock:
                rewritten = sum(self._lru.size_of(k) or 0 for k in sizes)
                excess = self._lru.total_bytes - rewritten + incoming - self.capacity_bytes
                victims: list[str] = []
                for key, size in self._lru.victims():
                    if excess <= 0:
                        break
                    if key in sizes:
                        continue
                    victims.append(key)
                    excess -= size
                if not victims:
                    if excess > 0:
                        raise CapacityError(
                            f"cannot make room for {incoming} bytes under {self.capacity_bytes}",
                            backend=self._name, operation="put",
                        )
                    return
                evicted = {key: self._lru.discard(key) or 0 for key in victims}
            failed = await delete(victims)
            with self._lock:
                self._stats.evictions += len(victims) - len(failed)
                self._stats.eviction_failures += len(failed)
                for key in failed:
                    # Still stored and still counted, but last in line: the next round picks
                    # other victims, so one undeletable object never blocks writes.
                    self._lru.add(key, evicted[key])
        raise CapacityError("eviction made no progress", backend=self._name, operation="put")


__all__ = ["LocalBound"]
