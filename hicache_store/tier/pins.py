"""Pins: the pages hints hold in the tier's memory tiers, per owner, with deadlines and a budget.

A pin is held by an *owner* (the request's session; ``""`` for a request without one) on a
page until its deadline (seconds on the hints' clock, ``RequestHints.now_s``; None: until the
owner releases it). A page holds at most one entry per owner: the owner's next pin replaces its
own entry (so the owner can shorten or release it), another owner adds an entry beside it, so a
caller that does not own a pin can only extend how long the page stays pinned. A page is pinned
while any entry holds; an entry past its deadline is dropped when the table is expired
(``expire``, at each request the tier is given hints for) and the page is ordinary again.

The tree keeps a pinned page's KV copies (``PageTree.pin``: neither its L1 nor its L2 copy is
evictable); this table only decides which pages are pinned.

**Budget.** A pinned page may hold a place in every memory tier, so the number of pages pinned
at once is bounded by each tier's budget: ``pin_fraction`` of its capacity (L1 pages; L2 rows
where L2 caches pages). Pages a request will pin are reserved when it arrives (``reserve``:
``PinBudgetError`` naming the tier, and nothing reserved, when a budget would be passed) and
pinned when its pages exist (``hold``), so a pin is refused before the request runs, never
dropped afterwards. Pages already pinned when a request arrives cost nothing; one whose pins
all ended while the request ran is pinned again at its completion without a reservation, so
the pinned pages can pass a budget by such pages until pins end (new pins are refused
meanwhile).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping
from typing import Generic, TypeVar

from hicache_store.backends.errors import PinBudgetError

N = TypeVar("N")


class PinTable(Generic[N]):
    """The pins of one tier. ``budgets``: tier name -> pages that may be pinned at once."""

    def __init__(self, budgets: Mapping[str, int]) -> None:
        if any(b < 0 for b in budgets.values()):
            raise ValueError(f"pin budgets must not be negative, got {dict(budgets)}")
        self.budgets = dict(budgets)
        self.reserved = 0
        self._holds: dict[N, dict[str, float | None]] = {}
        # (deadline, seq, node, owner): an entry is stale once the owner's deadline changed.
        self._deadlines: list[tuple[float, int, N, str]] = []
        self._seq = itertools.count()

    @property
    def pinned(self) -> int:
        """Pages pinned now."""
        return len(self._holds)

    @property
    def budget(self) -> int:
        """Pages that may be pinned at once (the smallest tier budget)."""
        return min(self.budgets.values(), default=0)

    def owners(self, node: N) -> dict[str, float | None]:
        """The entries holding ``node``: owner -> deadline (a copy)."""
        return dict(self._holds.get(node, {}))

    def is_pinned(self, node: N) -> bool:
        return node in self._holds

    def reserve(self, pages: int) -> None:
        """Reserve ``pages`` more pinned pages, or raise ``PinBudgetError`` (nothing reserved)."""
        if pages <= 0:
            return
        for tier, budget in self.budgets.items():
            if self.pinned + self.reserved + pages > budget:
                raise PinBudgetError(
                    f"pin refused: {pages} more pages would pass the {tier} pin budget of "
                    f"{budget} pages ({self.pinned} pinned, {self.reserved} reserved by "
                    "requests in flight); unpin (drop / demote, session_end) or pin less",
                    backend=f"tier {tier}",
                    operation="pin",
                )
        self.reserved += pages

    def unreserve(self, pages: int) -> None:
        if pages > self.reserved:
            raise RuntimeError(f"unreserve of {pages} pages, only {self.reserved} reserved")
        self.reserved -= max(pages, 0)

    def hold(self, node: N, owner: str, until: float | None) -> bool:
        """Set ``owner``'s entry on ``node``; True when ``node`` was not pinned before (the
        caller pins it in the tree). Does not check the budget (``reserve`` did)."""
        entries = self._holds.get(node)
        fresh = entries is None
        if entries is None:
            entries = self._holds[node] = {}
        entries[owner] = until
        if until is not None:
            heapq.heappush(self._deadlines, (until, next(self._seq), node, owner))
        return fresh

    def release(self, node: N, owner: str) -> bool:
        """Drop ``owner``'s entry on ``node``; True when ``node`` is no longer pinned (the caller
        unpins it in the tree)."""
        entries = self._holds.get(node)
        if entries is None or owner not in entries:
            return False
        del entries[owner]
        if entries:
            return False
        del self._holds[node]
        return True

    def release_owner(self, owner: str) -> list[N]:
        """Drop every entry of ``owner``; the pages no longer pinned."""
        held = [node for node, entries in self._holds.items() if owner in entries]
        return [node for node in held if self.release(node, owner)]

    def expire(self, now: float) -> list[N]:
        """Drop the entries whose deadline is at or before ``now``; the pages no longer pinned."""
        freed = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            until, _, node, owner = heapq.heappop(heap)
            if self._holds.get(node, {}).get(owner, -1.0) != until:
                continue  # replaced or released since
            if self.release(node, owner):
                freed.append(node)
        if len(heap) > 4 * len(self._holds) + 64:  # stale entries: rebuild
            heap[:] = [
                e for e in heap if self._holds.get(e[2], {}).get(e[3], -1.0) == e[0]
            ]
            heapq.heapify(heap)
        return freed
