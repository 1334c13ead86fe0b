"""Eviction policies of a prefix-closed page pool: which evictable leaf goes next.

A pool (L1 or L2) holds a prefix-closed set of pages: if a page is resident, so is its parent.
Only *evictable leaves* may go (resident, unlocked, no resident child), so a cached chain always
loses its tail, never a page in its middle. The tree that owns the pool tells its policy what
happens; the policy decides the order. Calls, all from one thread:

    begin_request()            # a request starts using the pool: the policy's clock ticks
    admit(node)                # node became resident in the pool (before its touch)
    touch(node)                # the request used node (a hit or a page it added), path order
    set_evictable(node, flag)  # node became / stopped being an evictable leaf
    victim() -> node | None    # the next evictable leaf to evict (not removed by this call)
    evict(node)                # node left the pool (the tree calls it for every removal)

Every call is O(log n) or O(1) amortised (heaps with lazy deletion; a stale heap entry is
skipped when it surfaces, and the heaps are rebuilt when stale entries outnumber live ones, so
memory stays O(resident pages)). Nodes are any hashable handle with a depth (the position of
the page in its chain) and a ghost key (what identifies the page after it left: its hash); the
tier passes its ``PageNode``; the benchmark's simulator (``hicache_store.demo.bench.trace_sim``)
passes trace block ids, so the study measured exactly the code the tier runs.

Policies (``EVICTION_POLICIES``; measured in BENCHMARKS.md, "Production traces"):

``lru``
    Least recently used leaf first; the pages of one request share its time, and among equal
    times the deeper page goes first.

``arc`` (the default)
    ARC (Megiddo and Modha, FAST'03) made prefix-closed. Pages used by one request only are in
    list T1, pages a later request used again are in T2; each list evicts its least recently
    used leaf. Evicted pages leave their key in a ghost list (B1 from T1, B2 from T2, each
    bounded to ``ghost_factor`` x the pool's pages, 1 as in ARC): a page that comes back while
    its ghost is remembered is admitted straight to T2 and moves the target size ``p`` of T1
    (up for a B1 ghost, down for B2). T1 is evicted while it is above ``p``. Beyond ARC, the
    keys of the last ``recall_factor`` x pool pages evicted (4 by default) are remembered too:
    a page that comes back within that memory is admitted to T2 as well, without moving ``p``.
    On production conversation traffic most pages are used once (76% of the conversation
    trace's blocks): they churn through T1 while the chains that conversations came back to
    stay in T2; the longer memory catches the conversations that come back after their first
    turn was evicted, while ``p`` adapts on ARC's own, shorter evidence (adapting it on the
    longer memory pushes ``p`` up at small pools and loses hits: BENCHMARKS.md, "Production
    traces").
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

N = TypeVar("N", bound=Hashable)

#: eviction policy names (``TierConfig.eviction_policy``, ``bench trace --policy``).
EVICTION_POLICIES: tuple[str, ...] = ("lru", "arc")

#: the policy a pool uses unless told otherwise.
DEFAULT_EVICTION_POLICY = "arc"

#: ghost entries per page of pool capacity, per ghost list (B1, B2: what adapts ``p``), as in ARC.
DEFAULT_GHOST_FACTOR = 1.0

#: remembered evicted keys per page of pool capacity (admission to T2 only; the study's
#: choice: 4 catches conversations returning after up to ~4 pool turnovers).
DEFAULT_RECALL_FACTOR = 4.0


class EvictionPolicy(Protocol[N]):
    """The calls a pool makes to its policy (module docstring)."""

    def __len__(self) -> int:
        """Resident nodes the policy tracks (the tree's consistency checks compare)."""
        ...

    def begin_request(self) -> None: ...

    def admit(self, node: N) -> None: ...

    def touch(self, node: N) -> None: ...

    def set_evictable(self, node: N, evictable: bool) -> None: ...

    def victim(self) -> N | None: ...

    def evict(self, node: N) -> None: ...


@dataclass
class _State:
    """A resident node's policy state: its list, last touch, evictability, heap version."""

    segment: int  # 1: T1 (used by one request), 2: T2 (used again); LRU uses 1 only
    stamp: int = 0
    evictable: bool = False
    version: int = 0  # the sequence number of its newest heap entry: older ones are stale


class _LeafHeaps(Generic[N]):
    """Evictable leaves of each segment, least recently touched (then deepest) first."""

    def __init__(self, depth: Callable[[N], int]) -> None:
        self._depth = depth
        self._heaps: dict[int, list[tuple[int, int, int, N]]] = {1: [], 2: []}
        self._seq = itertools.count()
        self.states: dict[N, _State] = {}
        self.live = {1: 0, 2: 0}  # evictable leaves per segment
        self.resident = {1: 0, 2: 0}  # resident nodes per segment

    def push(self, node: N) -> None:
        """Record ``node``'s current state in its heap (if it is an evictable leaf)."""
        state = self.states[node]
        # One counter for all nodes: a node evicted and admitted again must not revive the
        # entries of its previous residency.
        state.version = next(self._seq)
        if state.evictable:
            heap = self._heaps[state.segment]
            heapq.heappush(heap, (state.stamp, -self._depth(node), state.version, node))
            if len(heap) > 2 * self.live[state.segment] + 64:
                self._compact(state.segment)

    def _compact(self, segment: int) -> None:
        heap = [e for e in self._heaps[segment] if self._current(e, segment)]
        heapq.heapify(heap)
        self._heaps[segment] = heap

    def _current(self, entry: tuple[int, int, int, N], segment: int) -> bool:
        state = self.states.get(entry[3])
        return (
            state is not None
            and state.evictable
            and state.segment == segment
            and state.version == entry[2]
        )

    def first(self, segment: int) -> N | None:
        """The segment's least recently touched evictable leaf, or None."""
        heap = self._heaps[segment]
        while heap and not self._current(heap[0], segment):
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def set_evictable(self, node: N, evictable: bool) -> None:
        state = self.states[node]
        if state.evictable != evictable:
            state.evictable = evictable
            self.live[state.segment] += 1 if evictable else -1
            self.push(node)

    def move(self, node: N, segment: int) -> None:
        state = self.states[node]
        if state.segment == segment:
            return
        self.resident[state.segment] -= 1
        self.resident[segment] += 1
        if state.evictable:
            self.live[state.segment] -= 1
            self.live[segment] += 1
        state.segment = segment

    def add(self, node: N, segment: int) -> None:
        if node in self.states:
            raise ValueError(f"{node!r} is already resident")
        self.states[node] = _State(segment)
        self.resident[segment] += 1

    def remove(self, node: N) -> int:
        """Forget ``node``; returns the segment it was in."""
        state = self.states.pop(node)
        self.resident[state.segment] -= 1
        if state.evictable:
            self.live[state.segment] -= 1
        return state.segment


class LRUEviction(Generic[N]):
    """``lru`` (module docstring)."""

    def __init__(self, depth: Callable[[N], int]) -> None:
        self._leaves: _LeafHeaps[N] = _LeafHeaps(depth)
        self._clock = 0

    def __len__(self) -> int:
        return len(self._leaves.states)

    def begin_request(self) -> None:
        self._clock += 1

    def admit(self, node: N) -> None:
        self._leaves.add(node, 1)

    def touch(self, node: N) -> None:
        self._leaves.states[node].stamp = self._clock
        self._leaves.push(node)

    def set_evictable(self, node: N, evictable: bool) -> None:
        self._leaves.set_evictable(node, evictable)

    def victim(self) -> N | None:
        return self._leaves.first(1)

    def evict(self, node: N) -> None:
        self._leaves.remove(node)


class ARCEviction(Generic[N]):
    """``arc`` (module docstring): ``capacity`` is the pool's size in pages."""

    def __init__(
        self,
        capacity: int,
        depth: Callable[[N], int],
        ghost_key: Callable[[N], Hashable],
        ghost_factor: float = DEFAULT_GHOST_FACTOR,
        recall_factor: float = DEFAULT_RECALL_FACTOR,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least one page, got {capacity}")
        if ghost_factor < 0 or recall_factor < 0:
            raise ValueError(
                f"ghost_factor and recall_factor must not be negative, got {ghost_factor}, "
                f"{recall_factor}"
            )
        self.capacity = capacity
        self.p = 0.0  # target size of T1, in pages
        self._leaves: _LeafHeaps[N] = _LeafHeaps(depth)
        self._ghost_key = ghost_key
        self._ghost_limit = int(ghost_factor * capacity)
        self._ghosts: dict[int, OrderedDict[Hashable, None]] = {1: OrderedDict(), 2: OrderedDict()}
        self._recall_limit = int(recall_factor * capacity)
        self._recall: OrderedDict[Hashable, None] = OrderedDict()  # evicted keys, oldest first
        self._clock = 0

    def __len__(self) -> int:
        return len(self._leaves.states)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """Resident pages in T1 and T2, ghost keys in B1 and B2."""
        r = self._leaves.resident
        return r[1], r[2], len(self._ghosts[1]), len(self._ghosts[2])

    @property
    def recalled(self) -> int:
        """Evicted keys remembered for admission to T2 (at most ``recall_factor`` x pool)."""
        return len(self._recall)

    def begin_request(self) -> None:
        self._clock += 1

    def admit(self, node: N) -> None:
        key = self._ghost_key(node)
        b1, b2 = self._ghosts[1], self._ghosts[2]
        segment = 1
        if key in b1:
            self.p = min(float(self.capacity), self.p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            segment = 2
        elif key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            segment = 2
        if key in self._recall:
            del self._recall[key]
            segment = 2
        self._leaves.add(node, segment)
        # A node admitted now and touched by this same request is not "used again".
        self._leaves.states[node].stamp = self._clock

    def touch(self, node: N) -> None:
        state = self._leaves.states[node]
        if state.segment == 1 and state.stamp < self._clock:
            self._leaves.move(node, 2)  # used again by a later request
        state.stamp = self._clock
        self._leaves.push(node)

    def set_evictable(self, node: N, evictable: bool) -> None:
        self._leaves.set_evictable(node, evictable)

    def victim(self) -> N | None:
        t1 = self._leaves.first(1)
        t2 = self._leaves.first(2)
        if t1 is not None and (self._leaves.resident[1] > self.p or t2 is None):
            return t1
        return t2 if t2 is not None else t1

    def evict(self, node: N) -> None:
        segment = self._leaves.remove(node)
        ghosts = self._ghosts[segment]
        key = self._ghost_key(node)
        ghosts[key] = None
        while len(ghosts) > self._ghost_limit:
            ghosts.popitem(last=False)
        if self._recall_limit:
            self._recall[key] = None
            while len(self._recall) > self._recall_limit:
                self._recall.popitem(last=False)


def make_eviction_policy(
    name: str,
    capacity: int,
    depth: Callable[[N], int],
    ghost_key: Callable[[N], Hashable],
) -> LRUEviction[N] | ARCEviction[N]:
    """The policy ``name`` (one of ``EVICTION_POLICIES``) for a pool of ``capacity`` pages."""
    if name == "lru":
        return LRUEviction(depth)
    if name == "arc":
        return ARCEviction(capacity, depth, ghost_key)
    raise ValueError(f"eviction policy {name!r} is not one of {', '.join(EVICTION_POLICIES)}")
