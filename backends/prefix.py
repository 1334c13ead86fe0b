"""How many leading pages of a prompt are stored, in few round trips: the search, without I/O.

An engine asks "how much of this prompt is cached?" before every long request. The answer is
the number of leading pages whose objects are *all* stored. Probing every page costs one
existence check per object of the prompt (on S3 a HEAD each: a 1M-token prompt of 15,625
pages with 32 objects per page is half a million requests). This module finds the boundary
by probing a few pages per round trip instead.

**The assumption it exploits.** Writers in this library store a chain's pages parent first
(a page is only useful after its parents), and every eviction (the backends' ``ChainLRU``,
``hicache-store gc``) removes a chain from its tail. So the stored pages of a prompt are
normally a prefix: page ``i`` stored implies every page before it stored, and the boundary
can be searched for like a sorted array's.

**The search** (``ordered=True``), each step one round trip of at most ``fanout`` pages:

1. a *galloping* round: page 0, page ``count - 1`` and geometrically spaced pages between
   (a cold prompt ends here after one round; a short hit is bracketed at once);
2. *k-ary* rounds: ``fanout`` evenly spaced pages inside the bracket ``[lo, hi)`` (``lo``
   pages assumed stored, page ``hi`` seen missing), until ``lo == hi``;
3. a *verification* round: the ``verify`` pages just below the boundary (where a writer that
   died mid-prompt leaves holes: its in-flight pages) and pages at distances 1, 2, 4, 8, ...
   below it. If any of them is missing, the store is not a prefix here, and the pages below
   the first hole found are probed linearly (exact, the cost of ``ordered=False``).

About ``fanout * log(count) / log(fanout + 1) + log2(count)`` pages in ``2 + log(count) /
log(fanout + 1)`` round trips: for 15,625 pages and ``fanout=8``, about 60 pages in 7 round
trips. The result never counts a page that was seen missing, and is exact whenever the
prompt's stored pages form a prefix or the holes lie where the search looked. A hole on a
page nobody probed can make it too long; the read path is built for that (it verifies every
object and a missing one ends the hit, so the cost is a wasted read, never wrong data).

``ordered=False`` probes pages in order, in rounds that double in size (``fanout``, then
``2 * fanout``, ... up to ``max_round``), and stops at the first missing page: exact on any
store, one round trip for a cold prompt.

The probe is the caller's: ``probe(pages)`` says, in one round trip, whether every object of
each page is stored. ``Backend.exists_prefix_pages`` wires it to a backend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

#: ``probe(page_indices) -> [page fully stored?]``, one round trip.
Probe = Callable[[Sequence[int]], Awaitable[Sequence[bool]]]

#: pages probed per round trip by default (the rounds' requests run in parallel).
DEFAULT_FANOUT = 8
#: pages just below the boundary that the verification round always checks.
DEFAULT_VERIFY = 8
#: the largest round of the linear probe, in pages.
MAX_LINEAR_ROUND = 256


async def search_prefix(
    count: int,
    probe: Probe,
    *,
    ordered: bool = True,
    fanout: int = DEFAULT_FANOUT,
    verify: int = DEFAULT_VERIFY,
    max_round: int = MAX_LINEAR_ROUND,
) -> int:
    """How many leading pages of ``count`` are stored, per ``probe``; see the module docstring.

    Raises ``ValueError`` for a negative ``count`` or a ``fanout`` below 2. ``probe`` is never
    called with an empty list, never with a page outside ``[0, count)``, and never twice for
    the same page.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if fanout < 2:
        raise ValueError(f"fanout must be >= 2, got {fanout}")
    seen: dict[int, bool] = {}

    async def ask(pages: Sequence[int]) -> None:
        fresh = sorted({p for p in pages if p not in seen})
        if not fresh:
            return
        answers = await probe(fresh)
        if len(answers) != len(fresh):
            raise ValueError(f"probe answered {len(answers)} pages for {len(fresh)} asked")
        seen.update(zip(fresh, (bool(a) for a in answers), strict=True))

    if count == 0:
        return 0
    if not ordered or count <= fanout:
        return await _linear(0, count, ask, seen, fanout, max_round)
    await ask(_gallop_points(count, fanout))
    lo, hi = _bracket(seen, 0, count)
    while lo < hi:
        await ask(_spread(lo, hi, fanout))
        lo, hi = _bracket(seen, lo, hi)
    boundary = lo
    await ask(_verify_points(boundary, verify))
    hole = next((p for p in sorted(seen) if p < boundary and not seen[p]), None)
    if hole is None:
        return boundary
    # Not a prefix here: the pages below the first hole are checked one by one.
    return await _linear(0, hole, ask, seen, fanout, max_round)


async def _linear(
    start: int,
    stop: int,
    ask: Callable[[Sequence[int]], Awaitable[None]],
    seen: dict[int, bool],
    first_round: int,
    max_round: int,
) -> int:
    """Pages ``[start, stop)`` in order, in doubling rounds; the index of the first missing."""
    size = max(1, first_round)
    page = start
    while page < stop:
        batch = range(page, min(stop, page + size))
        await ask(batch)
        for p in batch:
            if not seen[p]:
                return p
        page = batch.stop
        size = min(size * 2, max(1, max_round))
    return stop


def _gallop_points(count: int, fanout: int) -> list[int]:
    """``fanout`` pages from 0 to ``count - 1``, geometrically spaced (dense near the start)."""
    last = count - 1
    points = {0, last}
    for j in range(1, fanout - 1):
        points.add(min(last, round((count) ** (j / (fanout - 1))) - 1))
    return sorted(points)


def _spread(lo: int, hi: int, fanout: int) -> list[int]:
    """Up to ``fanout`` pages evenly spaced in ``[lo, hi)`` (all of them when few)."""
    width = hi - lo
    if width <= fanout:
        return list(range(lo, hi))
    return sorted({lo + (width * (j + 1)) // (fanout + 1) for j in range(fanout)})


def _bracket(seen: dict[int, bool], lo: int, hi: int) -> tuple[int, int]:
    """Narrow ``[lo, hi)`` with what has been seen: ``hi`` becomes the first page seen missing
    in it, ``lo`` one past the last page seen stored below that."""
    for page in sorted(p for p in seen if lo <= p < hi):
        if not seen[page]:
            return lo, page
        lo = page + 1
    return lo, hi


def _verify_points(boundary: int, window: int) -> list[int]:
    """The ``window`` pages below ``boundary`` and those at distances 1, 2, 4, ... below it."""
    points = set(range(max(0, boundary - window), boundary))
    step = 1
    while step <= boundary:
        points.add(boundary - step)
        step *= 2
    return sorted(points)
