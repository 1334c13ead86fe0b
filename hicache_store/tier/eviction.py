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

Each policy here also has ``touch_path(nodes)``: ``touch`` of each node in order, in one call
(the simulator uses it for a request's cached prefix). Every call is O(log n) or O(1) amortised (heaps with lazy deletion; a stale heap entry is
skipped when it surfaces, and the heaps are rebuilt when stale entries outnumber live ones, so
memory stays O(resident pages)). Nodes are any hashable handle with a depth (the position of
the page in its chain) and a ghost key (what identifies the page after it left: its hash); the
tier passes its ``PageNode``; the benchmark's simulator (``hicache_store.demo.bench.trace_sim``)
passes trace block ids, so the study measured exactly the code the tier runs.

Policies (``EVICTION_POLICIES``; measured in BENCHMARKS.md, "Production traces"):

``lru``
    Least recently used leaf first; the pages of one request share its time, and among equal
    times the deeper page goes first.

``arc``
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

``session`` (the default)
    Retention by predicted return time, for agent sessions (``SessionEviction``). It takes two
    more calls, with what an engine knows at the time (``tier.hints``): ``hint_request(hints)``
    after ``begin_request`` (the request's session, the previous response's stop reason and end
    time) and ``hint_response(end)`` once a response has ended. Pages used by a request of a
    session belong to that session (its last user); each session has a predicted next
    arrival, and the evictable leaf to go is the least recently used (then deepest) leaf of the
    session predicted to come back last. Before any of that, a leaf of a session that its
    latest request did not use goes: the next request of a conversation extends its latest
    prompt, so a branch the latest request left (history the agent edited or compacted) is not
    expected back. The prediction, from what the engine has seen so far: a request in flight
    (its response has not ended), sent at ``a`` and running for ``r`` seconds now, ends at
    ``a + d``, where ``d`` is the median of the past response durations longer than ``r`` (the
    session's own, else over all sessions; ``now`` if none is known), and is followed after a
    tool gap: ``a + d + tool gap``; after a response ended at ``e`` with gap estimate ``g`` for
    its stop reason (the session's own median of past gaps after that stop, else the median
    over all sessions so far, else ``DEFAULT_TOOL_GAP_S`` after ``tool_use``,
    ``DEFAULT_HUMAN_GAP_S`` after ``end_turn``, ``DEFAULT_OTHER_GAP_S`` otherwise) the return
    is expected at ``e + g``; once overdue, at
    ``now + (now - e)`` (a wait that has lasted long is expected to last as long again: the
    gaps are heavy tailed, and a session that stopped is the limit). A subagent whose response
    ended its turn has finished: it goes before any live session. Pages used without a session
    are ordered by the fallback policy (``arc``); when both kinds compete, a fallback page's next
    use is estimated as ``now + its age``. Without any session signal it *is* its fallback. Of
    the hint actions it reads ``session_end`` (the session's pages go first, like a finished
    subagent's, unless the session sends another request); pins, retention and prefetch are
    the tier's to honour.

The tier admits a request's new pages into the policy before it makes room for them (unless
an L3 write needs their L2 copy), as the simulator does, so every policy may rank them below
what the pool holds and give them up at once (``tier.residency.Residency._admit_rows``).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from .hints import STOP_END_TURN, STOP_TOOL_USE, RequestHints, ResponseEnd

N = TypeVar("N", bound=Hashable)

#: eviction policy names (``TierConfig.eviction_policy``, ``bench trace --policy``).
EVICTION_POLICIES: tuple[str, ...] = ("lru", "arc", "session")

#: the policy a pool uses unless told otherwise: without session hints it is ``arc``, call
#: for call; with them it keeps the sessions predicted back soonest.
DEFAULT_EVICTION_POLICY = "session"

#: ghost entries per page of pool capacity, per ghost list (B1, B2: what adapts ``p``), as in ARC.
DEFAULT_GHOST_FACTOR = 1.0

#: remembered evicted keys per page of pool capacity (admission to T2 only; the study's
#: choice: 4 catches conversations returning after up to ~4 pool turnovers).
DEFAULT_RECALL_FACTOR = 4.0

#: ``session``: expected seconds from a ``tool_use`` response's end to the session's next
#: request, before any gap was observed (a tool runs for seconds).
DEFAULT_TOOL_GAP_S = 10.0

#: ``session``: the same after ``end_turn`` (a human reads and types: minutes).
DEFAULT_HUMAN_GAP_S = 300.0

#: ``session``: the same after any other stop reason (or none given).
DEFAULT_OTHER_GAP_S = 30.0

#: ``session``: past gaps remembered per session and stop reason (their median is its estimate),
#: and over all sessions; the same for response durations.
GAP_MEMORY = 16
GLOBAL_GAP_MEMORY = 256


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


def _touch_path(
    leaves: _LeafHeaps[N], nodes: Sequence[N], clock: int, promote: int | None
) -> None:
    """``touch`` of each node (moved from T1 to segment ``promote`` if used by an earlier
    request, ARC); a node that is not an evictable leaf gets no heap entry: its stale entries
    are already dead (``_current`` needs ``evictable``), and becoming evictable pushes anew."""
    states = leaves.states
    for node in nodes:
        state = states[node]
        if promote is not None and state.segment == 1 and state.stamp < clock:
            leaves.move(node, promote)
        state.stamp = clock
        if state.evictable:
            leaves.push(node)


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

    def touch_path(self, nodes: Sequence[N]) -> None:
        """``touch`` of each of ``nodes`` in order (a request's cached prefix), faster."""
        _touch_path(self._leaves, nodes, self._clock, None)

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

    def touch_path(self, nodes: Sequence[N]) -> None:
        """``touch`` of each of ``nodes`` in order (a request's cached prefix), faster."""
        _touch_path(self._leaves, nodes, self._clock, 2)

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


class HintedEvictionPolicy(EvictionPolicy[N], Protocol[N]):
    """A policy that also takes the engine's hints (``session``; module docstring)."""

    def hint_request(self, hints: RequestHints) -> None: ...

    def hint_response(self, end: ResponseEnd) -> None: ...


def takes_hints(policy: object) -> bool:
    """Whether ``policy`` takes hints (``HintedEvictionPolicy``)."""
    return callable(getattr(policy, "hint_request", None)) and callable(
        getattr(policy, "hint_response", None)
    )


class _Gaps:
    """The last ``limit`` durations observed of one kind (the gaps after one stop reason, or
    response times), in arrival order and sorted."""

    __slots__ = ("limit", "ordered", "values")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.values: deque[float] = deque()
        self.ordered: list[float] = []

    def add(self, gap: float) -> None:
        self.values.append(gap)
        bisect.insort(self.ordered, gap)
        if len(self.values) > self.limit:
            del self.ordered[bisect.bisect_left(self.ordered, self.values.popleft())]

    def median(self) -> float | None:
        ordered = self.ordered
        return ordered[len(ordered) // 2] if ordered else None

    def median_beyond(self, elapsed: float) -> float | None:
        """The median of the durations longer than ``elapsed`` (None: none is)."""
        ordered = self.ordered
        first = bisect.bisect_right(ordered, elapsed)
        longer = len(ordered) - first
        return ordered[first + longer // 2] if longer else None


class _Stream:
    """One session's state in ``SessionEviction``: its history and its evictable leaves."""

    __slots__ = (
        "arrival_s", "end_s", "ended", "gaps", "heap", "kind", "latest", "latest_hints", "live",
        "name", "ranked", "responses", "stop",
    )

    def __init__(self, name: str, kind: str) -> None:
        self.name = name
        self.kind = kind
        self.arrival_s: float | None = None  # the last request's arrival
        self.end_s: float | None = None  # the last ended response's end
        self.stop: str | None = None  # and its stop reason
        self.gaps: dict[str, _Gaps] = {}
        self.responses = _Gaps(GAP_MEMORY)  # its responses' durations
        self.latest = -1  # the request clock of its latest request: older pages are off its path
        self.latest_hints: RequestHints | None = None  # and that request's hints
        self.heap: list[tuple[int, int, int, object]] = []  # (stamp, -depth, version, node)
        self.live = 0  # evictable leaves
        self.ranked = -1  # the ranking epoch this stream was last pushed in
        self.ended = False  # its last request said the session ends (``session_end``)

    @property
    def in_flight(self) -> bool:
        return self.arrival_s is not None and (self.end_s is None or self.end_s < self.arrival_s)


@dataclass
class _Owned:
    """A session page's state: its session, last touch, evictability, heap version."""

    stream: _Stream
    stamp: int = 0
    evictable: bool = False
    version: int = 0


class SessionEviction(Generic[N]):
    """``session`` (module docstring): ``capacity`` is the pool's size in pages (for the fallback).

    ``tool_gap_s``, ``human_gap_s``, ``other_gap_s``: the gap estimates before any gap was
    observed. ``fallback``: the order of pages used without a session (``lru`` or ``arc``).
    """

    def __init__(
        self,
        capacity: int,
        depth: Callable[[N], int],
        ghost_key: Callable[[N], Hashable],
        *,
        fallback: str = "arc",
        tool_gap_s: float = DEFAULT_TOOL_GAP_S,
        human_gap_s: float = DEFAULT_HUMAN_GAP_S,
        other_gap_s: float = DEFAULT_OTHER_GAP_S,
    ) -> None:
        if fallback == "arc":
            self.fallback: LRUEviction[N] | ARCEviction[N] = ARCEviction(capacity, depth, ghost_key)
        elif fallback == "lru":
            self.fallback = LRUEviction(depth)
        else:
            raise ValueError(f"fallback policy {fallback!r} is not one of lru, arc")
        if min(tool_gap_s, human_gap_s, other_gap_s) <= 0:
            raise ValueError("gap estimates must be positive")
        self._defaults = {STOP_TOOL_USE: tool_gap_s, STOP_END_TURN: human_gap_s}
        self._other_gap = other_gap_s
        self._depth = depth
        self._clock = 0
        self._now = 0.0
        self._seq = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._owned: dict[N, _Owned] = {}
        self._current: _Stream | None = None
        self._global_gaps: dict[str, _Gaps] = {}
        self._global_responses = _Gaps(GLOBAL_GAP_MEMORY)
        # sessions whose latest request may have left pages off its path (an ordered set)
        self._branched: dict[_Stream, None] = {}
        self._fallback_time: dict[N, float] = {}  # fallback pages' last touch, in seconds
        self._ranking: list[tuple[float, float, int, _Stream]] = []
        self._ranking_epoch = -1

    def __len__(self) -> int:
        return len(self._owned) + len(self.fallback)

    # -- hints --------------------------------------------------------------------------------

    def begin_request(self) -> None:
        self._clock += 1
        self._current = None
        self.fallback.begin_request()

    def _stream(self, name: str, kind: str) -> _Stream:
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = _Stream(name, kind)
        return stream

    def _observe_gap(self, stream: _Stream, stop: str, gap: float) -> None:
        for table, limit in ((stream.gaps, GAP_MEMORY), (self._global_gaps, GLOBAL_GAP_MEMORY)):
            gaps = table.get(stop)
            if gaps is None:
                gaps = table[stop] = _Gaps(limit)
            gaps.add(max(gap, 0.0))

    def _ended(self, stream: _Stream, stop: str, end_s: float) -> None:
        if stream.end_s is None or end_s >= stream.end_s:
            stream.end_s, stream.stop = end_s, stop

    def hint_request(self, hints: RequestHints) -> None:
        """The request now being served (after ``begin_request``, before its pages are used)."""
        self._now = max(self._now, hints.now_s)
        if hints.session is None:
            self._current = None
            return
        stream = self._stream(hints.session, hints.kind)
        if hints.previous_stop is not None and hints.previous_end_s is not None:
            self._ended(stream, hints.previous_stop, hints.previous_end_s)
        if stream.stop is not None and stream.end_s is not None and not stream.in_flight:
            self._observe_gap(stream, stream.stop, hints.now_s - stream.end_s)
        stream.arrival_s = hints.now_s
        stream.ended = any(a.action == "session_end" for a in hints.actions)
        if hints is not stream.latest_hints:  # not the same request announced again
            stream.latest, stream.latest_hints = self._clock, hints
            self._branched[stream] = None
        self._current = stream

    def hint_response(self, end: ResponseEnd) -> None:
        """A response of ``end.session`` has ended (handed over no earlier than ``end.end_s``)."""
        self._now = max(self._now, end.end_s)
        stream = self._streams.get(end.session)
        if stream is None:
            return
        if stream.in_flight and stream.arrival_s is not None and end.end_s >= stream.arrival_s:
            duration = end.end_s - stream.arrival_s
            stream.responses.add(duration)
            self._global_responses.add(duration)
        self._ended(stream, end.stop, end.end_s)

    def _gap(self, stream: _Stream, stop: str) -> float:
        own = stream.gaps.get(stop)
        median = own.median() if own is not None else None
        if median is None:
            shared = self._global_gaps.get(stop)
            median = shared.median() if shared is not None else None
        if median is None:
            median = self._defaults.get(stop, self._other_gap)
        return median

    def predicted_return(self, stream_name: str) -> float:
        """When the session ``stream_name`` is expected to send its next request (seconds on
        the hints' clock; ``inf``: never, a finished subagent)."""
        return self._predict(self._streams[stream_name])

    def _predict(self, stream: _Stream) -> float:
        now = self._now
        if stream.ended:
            return math.inf
        if stream.in_flight or stream.stop is None or stream.end_s is None:
            return self._response_end(stream) + self._gap(stream, STOP_TOOL_USE)
        if stream.kind == "subagent" and stream.stop == STOP_END_TURN:
            return math.inf
        expected = stream.end_s + self._gap(stream, stream.stop)
        if expected >= now:
            return expected
        return now + (now - stream.end_s)

    def _response_end(self, stream: _Stream) -> float:
        """When the response in flight of ``stream`` is expected to end (``now`` if no
        response time longer than it has run so far was seen)."""
        now = self._now
        if stream.arrival_s is None:
            return now
        running = now - stream.arrival_s
        duration = stream.responses.median_beyond(running)
        if duration is None:
            duration = self._global_responses.median_beyond(running)
        return now if duration is None else stream.arrival_s + duration

    # -- pages --------------------------------------------------------------------------------

    def _push(self, node: N, owned: _Owned) -> None:
        owned.version = next(self._seq)
        if owned.evictable:
            stream = owned.stream
            heapq.heappush(stream.heap, (owned.stamp, -self._depth(node), owned.version, node))
            if len(stream.heap) > 2 * stream.live + 64:
                stream.heap = [e for e in stream.heap if self._current_entry(e, stream)]
                heapq.heapify(stream.heap)
            self._rank(stream)

    def _current_entry(self, entry: tuple[int, int, int, object], stream: _Stream) -> bool:
        owned = self._owned.get(entry[3])  # type: ignore[arg-type]
        return (
            owned is not None
            and owned.stream is stream
            and owned.evictable
            and owned.version == entry[2]
        )

    def admit(self, node: N) -> None:
        if node in self._owned:
            raise ValueError(f"{node!r} is already resident")
        if self._current is None:
            self.fallback.admit(node)
            self._fallback_time[node] = self._now
            return
        self._owned[node] = _Owned(self._current, self._clock)

    def touch(self, node: N) -> None:
        owned = self._owned.get(node)
        stream = self._current
        if owned is None:
            if stream is None:
                self.fallback.touch(node)
                self._fallback_time[node] = self._now
                return
            # a fallback page used by a session: it joins the session.
            evictable = self._fallback_evictable(node)
            self.fallback.evict(node)
            del self._fallback_time[node]
            owned = self._owned[node] = _Owned(stream, self._clock, evictable)
            if evictable:
                stream.live += 1
        elif stream is not None and owned.stream is not stream:
            if owned.evictable:
                owned.stream.live -= 1
                stream.live += 1
            owned.stream = stream
        owned.stamp = self._clock
        self._push(node, owned)

    def touch_path(self, nodes: Sequence[N]) -> None:
        """``touch`` of each of ``nodes`` in order (a request's cached prefix), faster."""
        stream = self._current
        owned_of = self._owned
        clock = self._clock
        for node in nodes:
            owned = owned_of.get(node)
            if owned is None or stream is None or owned.stream is not stream or owned.evictable:
                self.touch(node)
            else:
                owned.stamp = clock

    def _fallback_evictable(self, node: N) -> bool:
        leaves = self.fallback._leaves  # the fallback is this policy's own part
        return leaves.states[node].evictable

    def set_evictable(self, node: N, evictable: bool) -> None:
        owned = self._owned.get(node)
        if owned is None:
            self.fallback.set_evictable(node, evictable)
            return
        if owned.evictable != evictable:
            owned.evictable = evictable
            owned.stream.live += 1 if evictable else -1
            self._push(node, owned)

    def _rank(self, stream: _Stream) -> None:
        """Put ``stream`` in this epoch's ranking (if the ranking exists and it is not in it)."""
        if self._ranking_epoch == self._clock and stream.ranked != self._clock and stream.live:
            stream.ranked = self._clock
            predicted = self._predict(stream)
            heapq.heappush(
                self._ranking, (-predicted, stream.end_s or 0.0, next(self._seq), stream)
            )

    def _session_victim(self) -> tuple[N, float] | None:
        if self._ranking_epoch != self._clock:
            self._ranking_epoch = self._clock
            self._ranking = []
            for stream in self._streams.values():
                stream.ranked = -1
                self._rank(stream)
        ranking = self._ranking
        while ranking:
            stream = ranking[0][3]
            heap = stream.heap
            while heap and not self._current_entry(heap[0], stream):
                heapq.heappop(heap)
            if heap:
                return heap[0][3], -ranking[0][0]  # type: ignore[return-value]
            heapq.heappop(ranking)
            stream.ranked = -1
        return None

    def _off_path_victim(self) -> N | None:
        """A leaf of a session that its latest request did not use, or None."""
        for stream in list(self._branched):
            heap = stream.heap
            while heap and not self._current_entry(heap[0], stream):
                heapq.heappop(heap)
            if heap and heap[0][0] < stream.latest:
                return heap[0][3]  # type: ignore[return-value]
            del self._branched[stream]  # none now: the next request may leave some
        return None

    def victim(self) -> N | None:
        off_path = self._off_path_victim()
        if off_path is not None:
            return off_path
        session = self._session_victim()
        if not self.fallback_pages:
            return None if session is None else session[0]
        other = self.fallback.victim()
        if session is None or other is None:
            return other if session is None else session[0]
        other_next = self._now + (self._now - self._fallback_time[other])
        return session[0] if session[1] >= other_next else other

    @property
    def fallback_pages(self) -> int:
        """Resident pages ordered by the fallback (used without a session since last used by
        one)."""
        return len(self.fallback)

    def evict(self, node: N) -> None:
        owned = self._owned.pop(node, None)
        if owned is None:
            self.fallback.evict(node)
            del self._fallback_time[node]
            return
        if owned.evictable:
            owned.stream.live -= 1


def make_eviction_policy(
    name: str,
    capacity: int,
    depth: Callable[[N], int],
    ghost_key: Callable[[N], Hashable],
) -> LRUEviction[N] | ARCEviction[N] | SessionEviction[N]:
    """The policy ``name`` (one of ``EVICTION_POLICIES``) for a pool of ``capacity`` pages."""
    if name == "lru":
        return LRUEviction(depth)
    if name == "arc":
        return ARCEviction(capacity, depth, ghost_key)
    if name == "session":
        return SessionEviction(capacity, depth, ghost_key)
    raise ValueError(f"eviction policy {name!r} is not one of {', '.join(EVICTION_POLICIES)}")
