"""Block-level prefix-cache simulation of a trace: the references a replay is judged against.

Independent of the cache tier: these work on the trace's block ids alone, in microseconds per
block, so a whole trace at several capacities takes seconds.

Accounting (the same as ``shared/traces/README.md``, and the one source of it here:
``prefix_hit_tokens``): a request hits the longest prefix of its ``hash_ids`` that is cached,
counted in tokens and capped at its ``input_length``; then every block of the request is
inserted or touched, and the cache evicts down to its capacity in blocks. The token hit rate is
hit tokens over input tokens, over all requests and over the second half of them (a warm
cache, as the literature reports it).

* ``lru_reference``: plain LRU over blocks. The request's blocks are touched in order, so a
  chain's head is older than its tail and LRU can evict a head first, leaving a tail that can
  no longer hit: the pathology of block-level LRU in a prefix cache, kept because it is the
  published reference.
* ``belady``: the clairvoyant bound: the block whose next use is farthest in the future goes
  first (never used again first; among equal next uses the deeper block, so a chain loses its
  tail first). The block just inserted may be the victim (it is then simply not kept). It
  maximises block hits (checked against exhaustive search in the tests); under the prefix rule
  it is the usual optimistic reference, not a proven optimum.
* ``simulate``: a prefix-closed cache, as the tier keeps one: only leaves (cached blocks with
  no cached child) are evicted, in the order of one of the tier's own eviction policies
  (``hicache_store.tier.eviction``; ``block_policy`` builds one over block ids). A policy
  that takes hints (``session``) gets them as an engine would hand them over
  (``request_hints``): each request's ``RequestHints`` when it arrives, and each response's
  ``ResponseEnd`` before the first request arriving at or after its end; never anything
  later. In a trace without sessions the hints carry the clock only.

Hit rates of traces of sessions are also counted per request kind (``main``, ``subagent``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from hicache_store.tier.eviction import (
    EvictionPolicy,
    HintedEvictionPolicy,
    make_eviction_policy,
    takes_hints,
)
from hicache_store.tier.hints import RequestHints, ResponseEnd

from .trace_format import Trace, TraceRequest

#: next use of a block that is never used again (orders after every request index).
NEVER = 1 << 62


def prefix_hit_tokens(cached_blocks: int, input_length: int, block_tokens: int) -> int:
    """Tokens a request of ``input_length`` tokens hits when its first ``cached_blocks`` blocks
    are cached: the blocks' tokens, capped at the prompt (the last block may be partial)."""
    return min(cached_blocks * block_tokens, input_length)


@dataclass
class HitCount:
    """Token hits of a replay, over all requests and over the second half of them.

    ``block_hits``: blocks of requests that were cached when the request arrived, wherever they
    lie in its chain (the measure Belady's rule is optimal for; tokens count only the prefix).
    """

    requests: int
    block_hits: int = 0
    hit_tokens: int = 0
    input_tokens: int = 0
    second_half_hit_tokens: int = 0
    second_half_input_tokens: int = 0
    #: [hit tokens, input tokens] per request kind (traces of sessions only)
    by_kind: dict[str, list[int]] = field(default_factory=dict)

    def add(
        self,
        index: int,
        hit_tokens: int,
        input_tokens: int,
        block_hits: int = 0,
        kind: str | None = None,
    ) -> None:
        """Count request ``index`` (0-based, of ``requests``), of ``kind`` if it has one."""
        if kind is not None:
            tally = self.by_kind.setdefault(kind, [0, 0])
            tally[0] += hit_tokens
            tally[1] += input_tokens
        self.block_hits += block_hits
        self.hit_tokens += hit_tokens
        self.input_tokens += input_tokens
        if index >= self.requests // 2:
            self.second_half_hit_tokens += hit_tokens
            self.second_half_input_tokens += input_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def second_half_hit_rate(self) -> float:
        if not self.second_half_input_tokens:
            return 0.0
        return self.second_half_hit_tokens / self.second_half_input_tokens

    @property
    def kind_hit_rates(self) -> dict[str, float]:
        """Token hit rate per request kind (empty for a trace without sessions)."""
        return {k: (h / n if n else 0.0) for k, (h, n) in sorted(self.by_kind.items())}


def request_kind(request: TraceRequest) -> str | None:
    """The request's kind (``main``, ``subagent``; None: no session)."""
    return None if request.session is None else request.session.kind


def request_hints(request: TraceRequest) -> RequestHints:
    """What an engine knows of ``request`` when it arrives (``tier.hints.RequestHints``)."""
    now = request.timestamp_ms / 1000
    info = request.session
    if info is None:
        return RequestHints(now)
    parent = info.session if info.agent is not None else None
    previous_end = None if info.previous_end_ms is None else info.previous_end_ms / 1000
    if previous_end is not None and previous_end > now:
        # The trace has the next request arrive before the previous response's recorded end
        # (rounding, or the client did not wait): the engine has seen no end yet.
        return RequestHints(
            now, info.stream, parent, info.kind, session_start=info.subagent_start
        )
    return RequestHints(
        now,
        info.stream,
        parent,
        info.kind,
        info.previous_stop,
        previous_end,
        info.subagent_start,
    )


class HintFeed:
    """Hands over what an engine would know, request by request (module docstring):
    ``arrive(request)`` first gives ``on_response`` every response that ended by the request's
    arrival, in end order, then returns the request's own hints; the request's response is held
    back until it ends. The simulator hands both to a hinted policy; the tier replay passes the
    hints to ``HiCache.match`` and the ends to ``HiCache.response_end``, as an engine does."""

    def __init__(self, on_response: Callable[[ResponseEnd], None]) -> None:
        self._on_response = on_response
        self._pending: list[tuple[int, int, ResponseEnd]] = []
        self._order = 0

    def arrive(self, request: TraceRequest) -> RequestHints:
        now_ms = request.timestamp_ms
        pending = self._pending
        while pending and pending[0][0] <= now_ms:
            self._on_response(heapq.heappop(pending)[2])
        info = request.session
        if info is not None:
            end_ms = max(info.end_ms, now_ms)
            self._order += 1
            end = ResponseEnd(info.stream, info.stop, end_ms / 1000)
            heapq.heappush(pending, (end_ms, self._order, end))
        return request_hints(request)


def _cached_prefix(hash_ids: Sequence[int], cached: object) -> int:
    count = 0
    for block in hash_ids:
        if block not in cached:  # type: ignore[operator]
            break
        count += 1
    return count


def _check_capacity(capacity: int | None) -> None:
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be at least one block, got {capacity}")


def lru_reference(trace: Trace, capacity: int | None) -> HitCount:
    """Plain block LRU (the published reference); ``capacity`` in blocks, None = unbounded."""
    _check_capacity(capacity)
    cache: OrderedDict[int, None] = OrderedDict()
    count = HitCount(len(trace))
    for index, request in enumerate(trace.requests):
        hit = _cached_prefix(request.hash_ids, cache)
        count.add(index, prefix_hit_tokens(hit, request.input_length, trace.block_tokens),
                  request.input_length, kind=request_kind(request))
        for block in request.hash_ids:
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return count


def next_uses(trace: Trace) -> list[list[int]]:
    """For each request and each of its blocks, the index of the next request using that
    block (``NEVER`` if none)."""
    following: dict[int, int] = {}
    result: list[list[int]] = [[] for _ in trace.requests]
    for index in range(len(trace.requests) - 1, -1, -1):
        blocks = trace.requests[index].hash_ids
        result[index] = [following.get(block, NEVER) for block in blocks]
        for block in blocks:
            following[block] = index
    return result


def belady(trace: Trace, capacity: int | None) -> HitCount:
    """The clairvoyant bound (see the module docstring); ``capacity`` in blocks."""
    _check_capacity(capacity)
    uses = next_uses(trace)
    cached: dict[int, tuple[int, int]] = {}  # block -> (next use, depth): its current rank
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), stale entries skipped
    count = HitCount(len(trace))
    for index, request in enumerate(trace.requests):
        hit = _cached_prefix(request.hash_ids, cached)
        blocks_in = sum(1 for block in request.hash_ids if block in cached)
        count.add(index, prefix_hit_tokens(hit, request.input_length, trace.block_tokens),
                  request.input_length, blocks_in, request_kind(request))
        for depth, (block, use) in enumerate(zip(request.hash_ids, uses[index], strict=True)):
            cached[block] = (use, depth)
            heapq.heappush(heap, (-use, -depth, block))
        while capacity is not None and len(cached) > capacity:
            neg_use, neg_depth, block = heapq.heappop(heap)
            if cached.get(block) == (-neg_use, -neg_depth):
                del cached[block]
    return count


def simulate(trace: Trace, capacity: int, policy: EvictionPolicy[int]) -> HitCount:
    """A prefix-closed cache of ``capacity`` blocks that evicts leaves as ``policy`` says.

    This plays the tier's part in the protocol of ``hicache_store.tier.eviction`` with block
    ids as nodes: per request, ``begin_request``, then every block in chain order is admitted
    (if new) and touched; then victims are evicted until the cache fits. A request's own new
    blocks may be evicted at once (not kept). Nothing is locked. A policy that takes hints gets
    them after ``begin_request`` (``HintFeed``); one with ``touch_path`` gets the request's
    cached prefix in one call.
    """
    _check_capacity(capacity)
    children: dict[int, int] = {}  # cached block -> cached children
    parent: dict[int, int] = {}
    count = HitCount(len(trace))
    hinted = cast("HintedEvictionPolicy[int] | None", policy if takes_hints(policy) else None)
    feed = None if hinted is None else HintFeed(hinted.hint_response)
    touch_path = getattr(policy, "touch_path", None)
    for index, request in enumerate(trace.requests):
        blocks = request.hash_ids
        hit = _cached_prefix(blocks, children)
        count.add(index, prefix_hit_tokens(hit, request.input_length, trace.block_tokens),
                  request.input_length, kind=request_kind(request))
        policy.begin_request()
        if hinted is not None and feed is not None:
            hinted.hint_request(feed.arrive(request))
        # The cached blocks are a prefix (the cache is prefix-closed), the rest are new.
        if touch_path is not None:
            touch_path(blocks[:hit])
        else:
            for block in blocks[:hit]:
                policy.touch(block)
        for depth in range(hit, len(blocks)):
            block = blocks[depth]
            if block not in children:
                children[block] = 0
                policy.admit(block)
                policy.set_evictable(block, True)
                if depth:
                    up = parent[block] = blocks[depth - 1]
                    children[up] += 1
                    if children[up] == 1:
                        policy.set_evictable(up, False)
            policy.touch(block)
        while len(children) > capacity:
            victim = policy.victim()
            if victim is None:  # pragma: no cover - a non-empty cache always has a leaf
                raise RuntimeError("the eviction policy offered no victim")
            policy.evict(victim)
            del children[victim]
            if victim in parent:
                up = parent.pop(victim)
                children[up] -= 1
                if children[up] == 0:
                    policy.set_evictable(up, True)
    return count


def block_policy(name: str, trace: Trace, capacity: int) -> EvictionPolicy[int]:
    """The tier's eviction policy ``name`` over ``trace``'s block ids, for ``simulate``."""
    depth = {block: d for r in trace.requests for d, block in enumerate(r.hash_ids)}
    return make_eviction_policy(name, capacity, depth.__getitem__, _identity)


def _identity(block: int) -> int:
    return block
