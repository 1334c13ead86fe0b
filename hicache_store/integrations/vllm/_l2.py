"""The connector's L2: pages of this worker's shard kept in host memory, bounded.

Each entry is one page in the ``page_unified`` row format the connector packs and reads (the
row a stored object of the page is a slice of), in a ``tier.host_pool.HostPagePool`` row,
keyed by page hash. At most ``capacity_bytes // page_bytes`` pages are held; when a new page
needs a row, the page that goes is the choice of one of the cache tier's eviction policies
(``tier.eviction``, ``lru`` by default): each call (a ``put`` or a ``copy_into``) is one use
of its pages in chain order, so with ``lru`` the least recently used page goes first, a
chain's tail before its head (the order the bounded backends keep, ``backends._lru``). Every
held page may go except those of the call being served (the L2 is not prefix-closed: a call
hands over a stretch of a chain, not always from its first page).

**What it holds is what was put, byte for byte, by construction.** ``put`` copies the
caller's bytes into a row and ``copy_into`` copies a row out; no reference to a row ever
leaves this class, so nothing but a later ``put`` of another page into a freed row writes
it, and a row is freed only when its page leaves. The caller puts only bytes it may serve:
pages read through ``ObjectIO`` (header and checksums verified) before anything else could
touch them, and pages packed from vLLM's own KV. No checksum is kept or checked here.

Not thread-safe: the owner (the worker's engine thread) serialises every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache_store.tier.eviction import EvictionPolicy, make_eviction_policy
from hicache_store.tier.host_pool import HostPagePool


@dataclass
class L2Counts:
    """What the L2 did, pages and bytes, since the owner last took the counts."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0


class HostPageCache:
    """Up to ``capacity_bytes`` of ``page_bytes``-byte pages keyed by page hash, evicted in the
    order of the tier's eviction policy ``policy`` (``tier.eviction.EVICTION_POLICIES``)."""

    def __init__(self, capacity_bytes: int, page_bytes: int, *, policy: str = "lru") -> None:
        if capacity_bytes < 0 or page_bytes < 1:
            raise ValueError(f"L2: {capacity_bytes} bytes of {page_bytes}-byte pages")
        self.page_bytes = page_bytes
        self.capacity_pages = capacity_bytes // page_bytes
        # Untouched rows cost no memory: the pool's allocation is committed as rows fill.
        self._pool = HostPagePool(self.capacity_pages, page_bytes, pin=False)
        self._rows: dict[str, int] = {}
        # A page's place in the last call that used it (ties within a call: the tail first).
        self._depth: dict[str, int] = {}
        self._policy: EvictionPolicy[str] = make_eviction_policy(
            policy, max(self.capacity_pages, 1), self._depth.__getitem__, _same
        )
        self.counts = L2Counts()

    def __contains__(self, page_hash: object) -> bool:
        return page_hash in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def held_bytes(self) -> int:
        return len(self._rows) * self.page_bytes

    def copy_into(self, hashes: Sequence[str], out: torch.Tensor) -> list[bool]:
        """Copy each held page ``hashes[i]`` into ``out[i]``; which ones were held.

        ``out`` is ``[len(hashes), page_bytes]`` uint8; rows of pages not held are left as they
        are. The pages found become the most recently used, in chain order (one call = one
        chain, ``hashes`` head first).
        """
        self._check_rows(out, len(hashes))
        found: list[bool] = []
        for i, page_hash in enumerate(hashes):
            row = self._rows.get(page_hash)
            if row is not None:
                out[i].copy_(self._pool.data[row])
            found.append(row is not None)
        self._policy.begin_request()
        self._used(hashes)
        hits = sum(found)
        self.counts.hits += hits
        self.counts.misses += len(hashes) - hits
        return found

    def put(
        self, hashes: Sequence[str], rows: torch.Tensor | Sequence[torch.Tensor]
    ) -> tuple[list[str], list[str]]:
        """Keep a copy of ``rows[i]`` (``page_bytes`` uint8) as page ``hashes[i]`` (one chain,
        head first).

        A page already held is only marked used (its bytes are those of the same page). Rows
        are made free by evicting the policy's victims, never one of ``hashes``; when the
        batch outgrows the whole L2, its head is kept and the rest is not. Returns the pages
        added and the pages evicted.
        """
        if len(rows) != len(hashes):
            raise ValueError(f"L2: {len(hashes)} pages, {len(rows)} rows")
        added: list[str] = []
        evicted: list[str] = []
        policy = self._policy
        policy.begin_request()  # one use: pages admitted now are not "used again" below
        held = [h for h in dict.fromkeys(hashes) if h in self._rows]
        for page_hash in held:  # the call's own pages stay while it is served
            policy.set_evictable(page_hash, False)
        for i, page_hash in enumerate(hashes):
            if page_hash in self._rows:
                continue
            self._check_rows(rows[i], None)
            row = self._free_row(evicted)
            if row is None:
                break
            self._pool.data[row].copy_(rows[i])
            self._rows[page_hash] = row
            self._depth[page_hash] = i
            policy.admit(page_hash)
            added.append(page_hash)
            held.append(page_hash)
        for page_hash in held:
            policy.set_evictable(page_hash, True)
        self._used(hashes)
        self.counts.puts += len(added)
        self.counts.evictions += len(evicted)
        return added, evicted

    def take_counts(self) -> L2Counts:
        counts, self.counts = self.counts, L2Counts()
        return counts

    def _used(self, hashes: Sequence[str]) -> None:
        """The held pages of ``hashes`` used by the call (in chain order; after the policy's
        ``begin_request`` for the call)."""
        policy = self._policy
        for i, page_hash in enumerate(hashes):
            if page_hash in self._rows:
                self._depth[page_hash] = i
                policy.touch(page_hash)

    def _free_row(self, evicted: list[str]) -> int | None:
        """A free row, evicting the policy's victims (never a page of the call: not
        evictable meanwhile); None when every held page is the call's."""
        while True:
            rows = self._pool.alloc(1)
            if rows is not None:
                return rows[0]
            victim = self._policy.victim()
            if victim is None:
                return None
            self._policy.evict(victim)
            del self._depth[victim]
            self._pool.free([self._rows.pop(victim)])
            evicted.append(victim)

    def _check_rows(self, rows: torch.Tensor, count: int | None) -> None:
        """``rows`` must be ``[count, page_bytes]`` uint8 (one ``[page_bytes]`` row: None)."""
        shape = (self.page_bytes,) if count is None else (count, self.page_bytes)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != shape:
            raise ValueError(
                f"L2: expected uint8 {shape}, got {rows.dtype} {tuple(rows.shape)}"
            )


def _same(page_hash: str) -> str:
    """A page's key after it left (ARC's ghosts): its hash."""
    return page_hash
