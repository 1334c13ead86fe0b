"""The helpers every backend has, written once on top of its core (``Backend`` mixes them in).

What ``ObjectStoreExt`` is to Rust ``object_store``'s ``ObjectStore``: conveniences a backend
never implements or overrides, each built from the validated core (``exists`` / ``_exists``,
``get_into``, ``stat``), so they keep its contracts (key validation, misses as results, the
buffer lifetime rule) without restating them::

    exists_prefix_length(keys)             -> int   leading keys stored (engines' batch_exists)
    exists_prefix_pages(count, keys_of)    -> int   leading pages stored, O(log n) round trips
    get_ranges(key, ranges)                -> list[memoryview] | None   coalesced range reads
    get_bytes(key, byte_range=None)        -> bytes | None   one object (or range) as bytes
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .errors import InvalidRangeError
from .prefix import DEFAULT_FANOUT, search_prefix
from .types import ByteRange, ReadCounts, ReadRanges

if TYPE_CHECKING:
    from .types import ObjectStat
    from .views import BufferLike


class Helpers:
    """The helper methods of ``Backend`` (see the module docstring)."""

    if TYPE_CHECKING:  # the part of the core they are written on (``Backend``'s own)

        def _check_open(self, operation: str) -> None: ...
        def _check_keys(self, keys: Sequence[str], operation: str) -> list[str]: ...
        async def _exists(self, keys: Sequence[str]) -> list[bool]: ...
        async def exists(self, keys: Sequence[str]) -> list[bool]: ...
        async def stat(self, keys: Sequence[str]) -> list[ObjectStat | None]: ...
        async def get_into(
            self,
            keys: Sequence[str],
            buffers: Sequence[BufferLike],
            ranges: ReadRanges | None = None,
        ) -> ReadCounts: ...

    async def exists_prefix_length(self, keys: Sequence[str], *, chunk: int = 1024) -> int:
        """How many keys from the start exist consecutively (what engines' ``batch_exists``
        returns). Probes ``chunk`` keys at a time and stops at the first miss; an invalid key
        anywhere refuses the whole call before anything is probed."""
        self._check_open("exists")
        checked = self._check_keys(keys, "exists")
        count = 0
        for start in range(0, len(checked), max(1, chunk)):
            hits = await self._exists(checked[start : start + chunk])
            for hit in hits:
                if not hit:
                    return count
                count += 1
        return count

    async def exists_prefix_pages(
        self,
        count: int,
        keys_of: Callable[[int], Sequence[str]],
        *,
        ordered: bool = True,
        fanout: int = DEFAULT_FANOUT,
    ) -> int:
        """How many leading pages of ``count`` have every one of their keys stored.

        ``keys_of(i)`` gives the keys page ``i`` needs; it is called only for the pages
        probed. With ``ordered`` (the store is written parent-first and evicted tails-first,
        as this library does), the boundary is searched for in O(log count) round trips of
        at most ``fanout`` pages each, then verified; otherwise pages are probed in order
        and the probe stops at the first missing one. The search, its cost and its exact
        guarantee are in ``hicache_store.backends.prefix``. One ``exists`` call per round trip.
        """
        self._check_open("exists")

        async def probe(pages: Sequence[int]) -> list[bool]:
            groups = [self._check_keys(keys_of(page), "exists") for page in pages]
            flat = [key for group in groups for key in group]
            hits = await self._exists(flat) if flat else []
            ends = list(itertools.accumulate(len(group) for group in groups))
            return [all(hits[end - len(group) : end]) for group, end in zip(groups, ends, strict=True)]

        return await search_prefix(count, probe, ordered=ordered, fanout=fanout)

    async def get_ranges(
        self,
        key: str,
        ranges: Sequence[ByteRange],
        *,
        coalesce_bytes: int = 1 << 20,
        max_concurrency: int = 8,
    ) -> list[memoryview] | None:
        """Fetch several ranges of one object; None on a miss.

        Ranges less than ``coalesce_bytes`` apart are merged into one read, and at most
        ``max_concurrency`` merged reads run at once. Returns one read-only view per range, in
        the order given (views may share memory with each other).
        """
        if not ranges:
            return [] if (await self.exists([key]))[0] else None
        order = sorted(range(len(ranges)), key=lambda i: ranges[i].start)
        groups: list[tuple[ByteRange, list[int]]] = []
        for i in order:
            rng = ranges[i]
            if groups and rng.start <= groups[-1][0].end + coalesce_bytes:
                merged, members = groups[-1]
                groups[-1] = (ByteRange(merged.start, max(merged.end, rng.end)), [*members, i])
            else:
                groups.append((rng, [i]))
        limit = asyncio.Semaphore(max(1, max_concurrency))

        async def fetch(rng: ByteRange) -> memoryview | None:
            async with limit:
                buf = bytearray(rng.length)
                got = await self.get_into([key], [buf], [rng])
                return memoryview(buf).toreadonly() if got[0] is not None else None

        datas = await asyncio.gather(*(fetch(rng) for rng, _ in groups))
        out: list[memoryview | None] = [None] * len(ranges)
        for (merged, members), data in zip(groups, datas, strict=True):
            if data is None:
                return None
            for i in members:
                rng = ranges[i]
                out[i] = data[rng.start - merged.start : rng.end - merged.start]
        return [view for view in out if view is not None]

    async def get_bytes(self, key: str, byte_range: ByteRange | None = None) -> bytes | None:
        """A whole object (or range) as new ``bytes``; None on a miss. For small objects and
        tools: it costs a ``stat`` and a copy. Hot paths use ``get_into``."""
        if byte_range is not None:
            buf = bytearray(byte_range.length)
            got = await self.get_into([key], [buf], [byte_range])
            return bytes(buf) if got[0] is not None else None
        for _attempt in range(3):
            (st,) = await self.stat([key])
            if st is None:
                return None
            buf = bytearray(st.size)
            try:
                (n,) = await self.get_into([key], [buf])
            except InvalidRangeError:
                continue  # replaced by a larger object between stat and read: try again
            return None if n is None else bytes(buf[:n])
        return None


__all__ = ["Helpers"]
