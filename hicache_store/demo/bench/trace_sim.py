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
  (``hicache_store.tier.eviction``; ``block_policy`` builds one over block ids).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from hicache_store.tier.eviction import EvictionPolicy, make_eviction_policy

from .trace_format import Trace

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

    def add(self, index: int, hit_tokens: int, input_tokens: int, block_hits: int = 0) -> None:
        """Count request ``index`` (0-based, of ``requests``)."""
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
                  request.input_length)
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
                  request.input_length, blocks_in)
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
    blocks may be evicted at once (not kept). Nothing is locked.
    """
    _check_capacity(capacity)
    children: dict[int, int] = {}  # cached block -> cached children
    parent: dict[int, int] = {}
    count = HitCount(len(trace))
    for index, request in enumerate(trace.requests):
        blocks = request.hash_ids
        hit = _cached_prefix(blocks, children)
        count.add(index, prefix_hit_tokens(hit, request.input_length, trace.block_tokens),
                  request.input_length)
        policy.begin_request()
        for depth, block in enumerate(blocks):
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
