"""Chain-aware LRU order shared by the bounded backends (``memory``, ``file``).

The problem it solves: KV pages form chains (page ``i`` only helps if pages ``0..i-1`` are
also cached), and engines touch a chain head first. A plain per-object LRU therefore evicts the
*head* of a chain first, leaving a useless tail behind (a hole in the middle of the chain).

How the chain is known: from **batch order**. Engines and the cache tier write, probe and read
the pages of a prefix in chain order within one call (``batch_set``/``batch_get``/
``batch_exists`` all take a prefix's keys in order). So every call that touches a batch of keys
touches them *as one unit*, and within that unit the later keys are the deeper chain members.
The order kept here is "least recently touched batch first; inside a batch, the last key
first". A chain whose prefix is read again therefore keeps its head and loses its untouched
tail first, and an untouched chain is eaten from the tail backwards. No parent pointer, no
parsing of keys: keys that are not page chains simply get plain LRU.

The same order as numbers, for stores that keep it on disk instead of in memory (the file
backend's index): ``chain_ranks`` gives each key of one call a rank, smaller evicted first.

``ChainLRU`` is not thread-safe: the owner serialises access (the event loop, or a lock).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence

#: low bits of a rank that order the keys of one call (their depth in the chain).
RANK_DEPTH_BITS = 20
_DEPTH_TOP = (1 << RANK_DEPTH_BITS) - 1


def now_ms() -> int:
    """Wall-clock milliseconds: the time part of a rank (comparable across processes)."""
    return time.time_ns() // 1_000_000


def chain_ranks(count: int, at_ms: int | None = None) -> list[int]:
    """Eviction ranks for the ``count`` keys of one call, given in chain order.

    ``rank = at_ms << RANK_DEPTH_BITS | (2**RANK_DEPTH_BITS - 1 - depth)``: every key of a call
    ranks above (is evicted after) every key of a call made at least a millisecond earlier,
    and inside a call the last key ranks lowest, so a chain loses its tail first: the order
    ``ChainLRU.add_batch`` / ``touch_batch`` keep. Keys deeper than ``2**20 - 1`` share the
    lowest rank of their call. Fits a signed 64-bit integer until the year 2248.
    """
    base = (now_ms() if at_ms is None else at_ms) << RANK_DEPTH_BITS
    return [base | (_DEPTH_TOP - min(depth, _DEPTH_TOP)) for depth in range(count)]


def rank_at(seconds: float) -> int:
    """The rank of a key last used at ``seconds`` (a file's mtime), with no chain position."""
    return int(seconds * 1000) << RANK_DEPTH_BITS


def rank_seconds(rank: int) -> float:
    """The time (seconds since the epoch, ms resolution) a rank records: ``rank_at``'s
    inverse, and the last-use time of a key ranked by ``chain_ranks``."""
    return (rank >> RANK_DEPTH_BITS) / 1000.0


class ChainLRU:
    """Sizes of tracked keys in eviction order (front = evicted first)."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()
        self.total_bytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def size_of(self, key: str) -> int | None:
        return self._order.get(key)

    def keys(self) -> Iterable[str]:
        return self._order.keys()

    def add(self, key: str, size: int) -> None:
        """Track (or re-size) ``key`` as the most recently used. Use ``touch_batch`` when
        several keys of one call are added, so their chain order is kept."""
        old = self._order.pop(key, None)
        if old is not None:
            self.total_bytes -= old
        self._order[key] = size
        self.total_bytes += size

    def add_batch(self, items: Sequence[tuple[str, int]]) -> None:
        """Track keys written by one call: in reverse, so the batch's tail is evicted first."""
        for key, size in reversed(items):
            self.add(key, size)

    def add_oldest(self, key: str, size: int) -> None:
        """Track a key found on storage, not touched by this process: first in line."""
        if key in self._order:
            return
        self._order[key] = size
        self._order.move_to_end(key, last=False)
        self.total_bytes += size

    def touch_batch(self, keys: Sequence[str]) -> None:
        """Mark keys used by one call (a read or probe of a chain prefix), tail first."""
        for key in reversed(keys):
            if key in self._order:
                self._order.move_to_end(key)

    def discard(self, key: str) -> int | None:
        """Stop tracking ``key``; return its size if it was tracked."""
        size = self._order.pop(key, None)
        if size is not None:
            self.total_bytes -= size
        return size

    def oldest(self, excluding: Collection[str] = ()) -> tuple[str, int] | None:
        """The next key to evict that is not in ``excluding``, with its size (or None)."""
        for key, size in self._order.items():
            if key not in excluding:
                return key, size
        return None

    def victims(self) -> Iterator[tuple[str, int]]:
        """Keys in eviction order (a snapshot: the caller may discard while iterating)."""
        return iter(list(self._order.items()))
