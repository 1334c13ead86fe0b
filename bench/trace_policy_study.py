"""The eviction-policy study behind the tier's default: policies x capacities on the traces.

    .venv/bin/python bench/trace_policy_study.py [--traces conversation,synthetic]
        [--capacities 1000,4000,16000,64000] [--only NAME,...] [--characterize | --auc-curve]

Every policy is simulated at block level with the hit accounting of
``hicache_store.demo.bench.trace_sim`` (a hit is the longest cached prefix, in tokens); prints one
Markdown table per trace: token hit rate over all requests / over the second half, in %.

Rows:
* references: ``LRU (published)`` (block LRU, ``trace_sim.lru_reference``) and ``Belady``;
* prefix-closed (the tier's structure: only leaves go): ``lru`` and ``arc``, the tier's own
  policies (``hicache_store.tier.eviction``, the very code the tier runs), and two variants
  of ``arc``: textbook (ghost lists as long as the cache, no recall memory) and the previous
  default (ghost lists 4x the cache, which adapt ``p`` too, no separate recall memory);
* literature policies over plain blocks (no leaf rule; a hole cuts the prefix): FIFO, SLRU
  (20% probation), S3-FIFO (10% small queue, ghost), ARC, W-TinyLFU (1% window, SLRU main,
  count-min admission);
* online, age-conditioned (``OnlineHazard``, learned from the past only, classes a tier can
  see: reuse count; for a new block, how deep the request's known prefix reaches and how far
  past it the block lies): ``online: hazard per class`` (the class head least likely to be
  reused within the cache's mean eviction age goes), ``online: LHD (hit density per class)``
  (Beckmann et al., NSDI'18: hits per block-request of residency expected from its age on),
  ``online: arc with T1 by hazard per class`` (ARC whose T1 evicts by the hazard);
* online, Mockingjay-style (``OnlineETR``: reuse distances learned per conversation signature,
  the leaf with the largest estimated time remaining goes): ``online: ETR (Mockingjay-style)``
  (the prediction fixed at the touch, |ETR| counting down and up again when overdue) and
  ``online: ETR given age (Mockingjay-style)`` (the expected remaining wait given the age);
* what no online policy can have: ``oracle admission`` (LRU that never keeps a block with no
  future use), and two in-sample ceilings for the request-level signals an online cache does
  see (how many times the chain was extended before, how many blocks the request adds, how
  far past its hit a block lies), whose statistics are measured on the very trace they are
  then applied to: ``ceiling: P(reuse given features)`` (priority = time + tau * in-sample
  reuse probability of the block's feature bucket) and
  ``ceiling: hazard per class`` (per-class LRU queues, evict the class head least likely to be
  reused within the next two minutes given its age; ``... and offset``: classes split by the
  offset bucket too).

``--characterize`` prints what the trace offers an online cache (reuse shares, continuation
odds, gaps, the AUC of every field for "used again"); ``--auc-curve`` measures the hit rate of
the ``P(reuse given features)`` priority given noisy oracles of known ROC AUC instead of the
features: how good a reuse predictor a target hit rate takes.
"""

from __future__ import annotations

import abc
import argparse
import bisect
import heapq
import itertools
import math
import random
import statistics
import zlib
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hicache_store.demo.bench.trace_format import Trace, TraceRequest, read_trace
from hicache_store.demo.bench.trace_sim import (
    NEVER,
    HitCount,
    belady,
    block_policy,
    lru_reference,
    next_uses,
    prefix_hit_tokens,
    simulate,
)
from hicache_store.tier.eviction import ARCEviction, LRUEviction

TRACES = Path(__file__).resolve().parent / "traces"


# -- literature policies over plain blocks -----------------------------------------------------


class BlockCache(abc.ABC):
    """A plain block cache: ``contains`` for the hit, ``access`` for every block of a request."""

    @abc.abstractmethod
    def contains(self, block: int) -> bool: ...

    @abc.abstractmethod
    def access(self, block: int) -> None: ...


class FIFO(BlockCache):
    def __init__(self, capacity: int) -> None:
        self.capacity, self.queue = capacity, OrderedDict[int, None]()

    def contains(self, block: int) -> bool:
        return block in self.queue

    def access(self, block: int) -> None:
        if block not in self.queue:
            self.queue[block] = None
            if len(self.queue) > self.capacity:
                self.queue.popitem(last=False)


class SLRU(BlockCache):
    """Segmented LRU: new blocks on probation; a second access protects them."""

    def __init__(self, capacity: int, probation: float = 0.2) -> None:
        self.probation_size = max(1, int(capacity * probation))
        self.protected_size = capacity - self.probation_size
        self.probation = OrderedDict[int, None]()
        self.protected = OrderedDict[int, None]()

    def contains(self, block: int) -> bool:
        return block in self.probation or block in self.protected

    def access(self, block: int) -> None:
        if block in self.protected:
            self.protected.move_to_end(block)
            return
        if block in self.probation:
            del self.probation[block]
            self.protected[block] = None
            if len(self.protected) > self.protected_size:
                demoted, _ = self.protected.popitem(last=False)
                self.probation[demoted] = None
        else:
            self.probation[block] = None
        while len(self.probation) > self.probation_size:
            self.probation.popitem(last=False)


class S3FIFO(BlockCache):
    """S3-FIFO (Yang et al., SOSP'23): small FIFO, main FIFO with reinsertion, ghost FIFO."""

    def __init__(self, capacity: int, small: float = 0.1) -> None:
        self.small_size = max(1, int(capacity * small))
        self.main_size = capacity - self.small_size
        self.small = OrderedDict[int, None]()
        self.main = OrderedDict[int, None]()
        self.ghost = OrderedDict[int, None]()
        self.freq: dict[int, int] = {}

    def contains(self, block: int) -> bool:
        return block in self.small or block in self.main

    def access(self, block: int) -> None:
        if block in self.freq:
            self.freq[block] = min(self.freq[block] + 1, 3)
            return
        self.freq[block] = 0
        if block in self.ghost:
            del self.ghost[block]
            self._insert_main(block)
            return
        self.small[block] = None
        while len(self.small) > self.small_size:
            old, _ = self.small.popitem(last=False)
            if self.freq[old] > 0:
                self.freq[old] = 0
                self._insert_main(old)
            else:
                del self.freq[old]
                self.ghost[old] = None
                if len(self.ghost) > self.main_size:
                    self.ghost.popitem(last=False)

    def _insert_main(self, block: int) -> None:
        self.main[block] = None
        while len(self.main) > self.main_size:
            old, _ = self.main.popitem(last=False)
            if self.freq[old] > 0:
                self.freq[old] -= 1
                self.main[old] = None
            else:
                del self.freq[old]


class ARC(BlockCache):
    """ARC (Megiddo and Modha, FAST'03)."""

    def __init__(self, capacity: int) -> None:
        self.c, self.p = capacity, 0
        self.t1, self.t2 = OrderedDict[int, None](), OrderedDict[int, None]()
        self.b1, self.b2 = OrderedDict[int, None](), OrderedDict[int, None]()

    def contains(self, block: int) -> bool:
        return block in self.t1 or block in self.t2

    def _replace(self, block: int) -> None:
        if self.t1 and (len(self.t1) > self.p or (block in self.b2 and len(self.t1) == self.p)):
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None
        else:
            old, _ = self.t2.popitem(last=False)
            self.b2[old] = None

    def access(self, block: int) -> None:
        if block in self.t1:
            del self.t1[block]
            self.t2[block] = None
        elif block in self.t2:
            self.t2.move_to_end(block)
        elif block in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) // max(len(self.b1), 1), 1))
            self._replace(block)
            del self.b1[block]
            self.t2[block] = None
        elif block in self.b2:
            self.p = max(0, self.p - max(len(self.b1) // max(len(self.b2), 1), 1))
            self._replace(block)
            del self.b2[block]
            self.t2[block] = None
        else:
            l1 = len(self.t1) + len(self.b1)
            total = l1 + len(self.t2) + len(self.b2)
            if l1 == self.c:
                if len(self.t1) < self.c:
                    self.b1.popitem(last=False)
                    self._replace(block)
                else:
                    self.t1.popitem(last=False)
            elif l1 < self.c and total >= self.c:
                if total == 2 * self.c:
                    self.b2.popitem(last=False)
                self._replace(block)
            self.t1[block] = None


class CountMin:
    """A 4-row count-min sketch with 4-bit counters, halved every ``10 * width`` additions."""

    def __init__(self, width: int) -> None:
        self.width, self.rows, self.added = width, [[0] * width for _ in range(4)], 0

    def _cells(self, block: int) -> list[tuple[int, int]]:
        return [(r, zlib.crc32(f"{r}:{block}".encode()) % self.width) for r in range(4)]

    def add(self, block: int) -> None:
        for r, i in self._cells(block):
            self.rows[r][i] = min(self.rows[r][i] + 1, 15)
        self.added += 1
        if self.added >= 10 * self.width:
            self.added = 0
            self.rows = [[v // 2 for v in row] for row in self.rows]

    def estimate(self, block: int) -> int:
        return min(self.rows[r][i] for r, i in self._cells(block))


class WTinyLFU(BlockCache):
    """W-TinyLFU (Einziger et al.): a 1% LRU window; a block leaving it enters the SLRU main
    cache only if the sketch says it is more frequent than main's victim."""

    def __init__(self, capacity: int, window: float = 0.01) -> None:
        self.window_size = max(1, int(capacity * window))
        self.main = SLRU(capacity - self.window_size)
        self.window = OrderedDict[int, None]()
        self.sketch = CountMin(max(64, capacity))

    def contains(self, block: int) -> bool:
        return block in self.window or self.main.contains(block)

    def access(self, block: int) -> None:
        self.sketch.add(block)
        if block in self.window:
            self.window.move_to_end(block)
            return
        if self.main.contains(block):
            self.main.access(block)
            return
        self.window[block] = None
        if len(self.window) <= self.window_size:
            return
        candidate, _ = self.window.popitem(last=False)
        main = self.main
        if len(main.probation) + len(main.protected) < main.probation_size + main.protected_size:
            main.access(candidate)
            return
        victim = next(iter(main.probation or main.protected))
        if self.sketch.estimate(candidate) > self.sketch.estimate(victim):
            (main.probation if victim in main.probation else main.protected).pop(victim)
            main.access(candidate)


def replay_blocks(trace: Trace, cache: BlockCache) -> HitCount:
    count = HitCount(len(trace))
    for index, request in enumerate(trace.requests):
        hit = 0
        for block in request.hash_ids:
            if not cache.contains(block):
                break
            hit += 1
        count.add(index, prefix_hit_tokens(hit, request.input_length, trace.block_tokens),
                  request.input_length)
        for block in request.hash_ids:
            cache.access(block)
    return count


# -- what no online policy has -------------------------------------------------------------------


def oracle_admission(trace: Trace, capacity: int) -> HitCount:
    """LRU that drops every block the future never uses again (knows *whether*, not *when*)."""
    uses = next_uses(trace)
    cache = OrderedDict[int, None]()
    count = HitCount(len(trace))
    for index, request in enumerate(trace.requests):
        hit = 0
        for block in request.hash_ids:
            if block not in cache:
                break
            hit += 1
        count.add(index, prefix_hit_tokens(hit, request.input_length, trace.block_tokens),
                  request.input_length)
        for block, use in zip(request.hash_ids, uses[index], strict=True):
            if use == NEVER:
                cache.pop(block, None)
            elif block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return count


def _bucket(value: int, bounds: Sequence[int]) -> int:
    return bisect.bisect_left(bounds, value)


def request_features(trace: Trace) -> list[tuple[int, int, int]]:
    """Per request, with an unbounded cache: (turns of the chain it extends, capped at 5;
    bucket of its new blocks; blocks it hits). The signals of the in-sample ceilings."""
    seen: dict[int, int] = {}
    out = []
    for request in trace.requests:
        blocks, hit = request.hash_ids, 0
        while hit < len(blocks) and blocks[hit] in seen:
            hit += 1
        turns = seen[blocks[hit - 1]] if hit else 0
        for block in blocks[hit:]:
            seen[block] = turns + 1
        out.append((min(turns, 5), _bucket(len(blocks) - hit, (1, 3, 8, 32)), hit))
    return out


class ScoredPriority(LRUEviction[int]):
    """LRU order, but a block's time is its request's arrival plus ``tau_s`` times a given
    probability that it is used again (``reuse[request][depth]``, one per block access)."""

    def __init__(self, trace: Trace, reuse: Sequence[Sequence[float]], tau_s: float) -> None:
        depths = _depths(trace)
        super().__init__(depths.__getitem__)
        self.depth_of, self.reuse, self.tau_s = depths, reuse, tau_s
        self.index = -1
        self.times = [r.timestamp_ms / 1000 for r in trace.requests]

    def begin_request(self) -> None:
        super().begin_request()
        self.index += 1

    def touch(self, node: int) -> None:
        state = self._leaves.states[node]
        probability = self.reuse[self.index][self.depth_of[node]]
        state.stamp = self.times[self.index] + self.tau_s * probability  # type: ignore[assignment]
        self._leaves.push(node)


def feature_reuse(trace: Trace) -> list[list[float]]:
    """Per block access, P(block used again | turns, new-block bucket, offset bucket), the
    probability measured on the whole trace beforehand (in-sample)."""
    features = request_features(trace)

    def key(index: int, depth: int) -> tuple[int, ...]:
        turns, new, hit = features[index]
        return (turns, new, _bucket(max(depth - hit, 0), (0, 1, 2, 4, 8, 16, 32, 64, 128)))

    uses = next_uses(trace)
    totals: defaultdict[tuple[int, ...], list[int]] = defaultdict(lambda: [0, 0])
    for index, row in enumerate(uses):
        for depth, use in enumerate(row):
            cell = totals[key(index, depth)]
            cell[0] += 1
            cell[1] += use != NEVER
    p = {cell: used / seen for cell, (seen, used) in totals.items()}
    return [[p[key(index, depth)] for depth in range(len(row))] for index, row in enumerate(uses)]


def in_sample_priority(trace: Trace, capacity: int, tau_s: float = 1000.0) -> HitCount:
    """``ceiling: P(reuse given features)``: ``ScoredPriority`` over ``feature_reuse``."""
    return simulate(trace, capacity, ScoredPriority(trace, feature_reuse(trace), tau_s))


def hazard_ceiling(
    trace: Trace, capacity: int, horizon_s: float = 120.0, by_offset: bool = False
) -> HitCount:
    """Per-class LRU queues of leaves (class = turns x new-block bucket, and with ``by_offset``
    the bucket of how far past the request's hit the block lies); the victim is the class head
    least likely, given its age, to be reused within ``horizon_s`` (gap distributions measured
    in-sample)."""
    features = request_features(trace)
    times = [r.timestamp_ms / 1000 for r in trace.requests]

    def class_of(index: int, depth: int) -> tuple[int, ...]:
        turns, new, hit = features[index]
        if not by_offset:
            return (turns, new)
        return (turns, new, _bucket(max(depth - hit, 0), (0, 2, 8, 32)))

    gaps: defaultdict[tuple[int, ...], list[float]] = defaultdict(list)
    for index, uses in enumerate(next_uses(trace)):
        for depth, use in enumerate(uses):
            gap = times[use] - times[index] if use != NEVER else math.inf
            gaps[class_of(index, depth)].append(gap)
    for values in gaps.values():
        values.sort()

    def score(cls: tuple[int, ...], age: float) -> float:
        values = gaps[cls]
        alive = len(values) - bisect.bisect_right(values, age)
        soon = bisect.bisect_right(values, age + horizon_s) - bisect.bisect_right(values, age)
        return soon / alive if alive else 0.0

    parent: dict[int, int] = {}
    state: dict[int, tuple[float, int, tuple[int, ...]]] = {}  # block -> (time, -depth, class)
    children: dict[int, int] = {}
    heaps: defaultdict[tuple[int, ...], list[tuple[tuple[float, int, tuple[int, ...]], int]]] = (
        defaultdict(list)
    )
    count = HitCount(len(trace))
    for index, request in enumerate(trace.requests):
        blocks = request.hash_ids
        hit = 0
        while hit < len(blocks) and blocks[hit] in state:
            hit += 1
        count.add(index, prefix_hit_tokens(hit, request.input_length, trace.block_tokens),
                  request.input_length)
        for depth, block in enumerate(blocks):
            if block not in state:
                children[block] = 0
                if depth:
                    parent[block] = blocks[depth - 1]
                    children[blocks[depth - 1]] += 1
            state[block] = (times[index], -depth, class_of(index, depth))
        for block in blocks:
            if children[block] == 0:
                heapq.heappush(heaps[state[block][2]], (state[block], block))
        while len(state) > capacity:
            best: tuple[float, tuple[int, ...]] | None = None
            for key, heap in heaps.items():
                while heap and (state.get(heap[0][1]) != heap[0][0] or children[heap[0][1]]):
                    heapq.heappop(heap)
                if heap:
                    candidate = (score(key, times[index] - heap[0][0][0]), key)
                    if best is None or candidate[0] < best[0]:
                        best = candidate
            assert best is not None
            _, victim = heapq.heappop(heaps[best[1]])
            del state[victim], children[victim]
            up = parent.pop(victim, None)
            if up is not None and up in state:
                children[up] -= 1
                if children[up] == 0:
                    heapq.heappush(heaps[state[up][2]], (state[up], up))
    return count


# -- online, age-conditioned policies (learned from the past only) --------------------------------


#: upper edges of the age / reuse-gap buckets, in requests: geometric (x1.25), so the policy
#: resolves the few requests a 1k-block cache holds a page as well as the thousands at 64k.
_AGE_EDGES = sorted({round(1.25**i) for i in range(90)})[:64]


def _age_bucket(age: int) -> int:
    return min(max(bisect.bisect_right(_AGE_EDGES, age) - 1, 0), len(_AGE_EDGES) - 1)


def _log2_bucket(value: int) -> int:
    return min(max(value, 0).bit_length(), 12)


class OnlineHazard:
    """Leaves in per-class LRU queues; the victim is the class head that scores lowest for its
    age. Everything is learned online from what the cache has seen (the protocol of
    ``hicache_store.tier.eviction``; time = requests, as the tier counts it).

    Class of a page, set at each touch: a page used by an earlier request (or whose key a
    bounded memory of recent touches still holds) is ``reused`` (x its reuse count, capped at 3);
    a new page is classed by how deep the request's known prefix reaches (log2 of its pages)
    and how far past it the page lies (log2): the signals of the in-sample ceilings that a tier
    can see (a first turn knows only the shared system prompt; a later turn, its history).

    Scores (``mode``):
    * ``hazard``: P(reused within the next h requests | class, age), from the reuse gaps
      observed through the touch memory (``window`` requests, at most ``memory_factor`` x
      capacity keys; a key leaving it unused counts as "not reused"), h = the running mean age
      at eviction: LHD's idea with the cache's own time scale;
    * ``density``: LHD proper (Beckmann et al., NSDI'18): hits per page-request of residency
      expected from this age on, from the ages at which pages of the class were hit or evicted.
    With ``arc``, pages used once and reused pages are ARC's T1 and T2 (target ``p`` adapted on
    1x ghost lists, the touch memory as recall); only T1 is ordered by the score, T2 is LRU.
    """

    def __init__(
        self,
        capacity: int,
        depth: Callable[[int], int],
        mode: str = "hazard",
        arc: bool = False,
        window: int = 4000,
        memory_factor: float = 8.0,
        halve_every: int = 200_000,
    ) -> None:
        self.capacity, self.depth, self.mode, self.arc = capacity, depth, mode, arc
        self.window, self.memory_limit = window, int(memory_factor * capacity)
        self.halve_every, self.observed = halve_every, 0
        self.clock = 0
        buckets = len(_AGE_EDGES) + 1  # the last: not reused within the memory
        self.gaps: defaultdict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0] * buckets)
        self.hits: defaultdict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0] * buckets)
        self.evictions: defaultdict[tuple[int, ...], list[float]] = defaultdict(
            lambda: [0.0] * buckets
        )
        self.tables: dict[tuple[int, ...], tuple[list[float], list[float], list[float]]] = {}
        self.memory: dict[int, tuple[int, tuple[int, ...], int]] = {}  # key -> (clock, cls, uses)
        self.touches: deque[tuple[int, int]] = deque()  # (clock, key), oldest first
        # page -> [stamp, class, evictable, version, reuses, remembered touch or None]
        self.pages: dict[int, list[Any]] = {}
        self.heaps: defaultdict[tuple[int, ...], list[tuple[int, int, int, int]]] = (
            defaultdict(list)
        )
        self.seq = itertools.count()
        self.known_depth = -1  # deepest page of the current request that was known
        self.eviction_age = 0.0  # running mean age at eviction (the hazard's horizon)
        self.p, self.ghosts = 0.0, {1: OrderedDict[int, None](), 2: OrderedDict[int, None]()}
        self.resident = {1: 0, 2: 0}

    def __len__(self) -> int:
        return len(self.pages)

    def _count(self, table: defaultdict[tuple[int, ...], list[float]], cls: tuple[int, ...],
               bucket: int) -> None:
        table[cls][bucket] += 1
        self.tables.pop(cls, None)
        self.observed += 1
        if self.observed >= self.halve_every:  # decay: the statistics follow the traffic
            self.observed = 0
            for t in (self.gaps, self.hits, self.evictions):
                for row in t.values():
                    row[:] = [v / 2 for v in row]
            self.tables.clear()

    def begin_request(self) -> None:
        self.clock += 1
        self.known_depth = -1
        while self.touches and (
            self.touches[0][0] <= self.clock - self.window
            or len(self.touches) > self.memory_limit
        ):
            stamp, key = self.touches.popleft()
            entry = self.memory.get(key)
            if entry is not None and entry[0] == stamp:  # left the memory unused
                del self.memory[key]
                self._count(self.gaps, entry[1], len(_AGE_EDGES))

    def admit(self, node: int) -> None:
        remembered = self.memory.get(node)
        if self.arc:
            b1, b2 = self.ghosts[1], self.ghosts[2]
            if node in b1:
                self.p = min(float(self.capacity), self.p + max(len(b2) / len(b1), 1.0))
                del b1[node]
            elif node in b2:
                self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
                del b2[node]
        uses = 0 if remembered is None else remembered[2] + 1
        self.pages[node] = [self.clock, None, False, 0, uses, remembered]

    @staticmethod
    def _segment(klass: tuple[int, ...] | None) -> int:
        return 2 if klass is not None and klass[0] == -1 else 1

    def touch(self, node: int) -> None:
        page = self.pages[node]
        remembered = page[5]
        if remembered is not None or page[0] < self.clock:  # used before: a hit or a recall
            if remembered is None:
                self._count(self.hits, page[1], _age_bucket(self.clock - page[0]))
                remembered = self.memory.get(node)
            if remembered is not None and remembered[0] < self.clock:
                self._count(self.gaps, remembered[1], _age_bucket(self.clock - remembered[0]))
                page[4] = remembered[2] + 1
            self.known_depth = max(self.known_depth, self.depth(node))
        page[5] = None
        if page[4]:
            cls: tuple[int, ...] = (-1, min(page[4], 3))
        else:
            known = self.known_depth + 1
            cls = (_log2_bucket(known), _log2_bucket(self.depth(node) - known))
        if page[1] is not None:
            self.resident[self._segment(page[1])] -= 1
        self.resident[self._segment(cls)] += 1
        page[0], page[1] = self.clock, cls
        self.memory[node] = (self.clock, cls, page[4])
        self.touches.append((self.clock, node))
        self._push(node)

    def _push(self, node: int) -> None:
        page = self.pages[node]
        page[3] = next(self.seq)
        if page[2] and page[1] is not None:
            queue = (-1,) if self.arc and page[1][0] == -1 else page[1]
            heapq.heappush(self.heaps[queue], (page[0], -self.depth(node), page[3], node))

    def set_evictable(self, node: int, evictable: bool) -> None:
        page = self.pages[node]
        if page[2] != evictable:
            page[2] = evictable
            self._push(node)

    def _head(self, queue: tuple[int, ...]) -> tuple[int, int, int, int] | None:
        heap = self.heaps[queue]
        while heap:
            page = self.pages.get(heap[0][3])
            if page is not None and page[2] and page[3] == heap[0][2]:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _table(self, cls: tuple[int, ...]) -> tuple[list[float], list[float], list[float]]:
        """Suffix sums from each age bucket on: (hazard: gaps+unused; density: hits, hits +
        evictions, their ages)."""
        table = self.tables.get(cls)
        if table is None:
            n = len(_AGE_EDGES)
            gaps, hits, evictions = self.gaps[cls], self.hits[cls], self.evictions[cls]
            tail, hit_tail, end_tail, age_tail = ([0.0] * (n + 2) for _ in range(4))
            for i in range(n, -1, -1):
                tail[i] = tail[i + 1] + gaps[i]
                if i < n:
                    ends = hits[i] + evictions[i]
                    hit_tail[i] = hit_tail[i + 1] + hits[i]
                    end_tail[i] = end_tail[i + 1] + ends
                    age_tail[i] = age_tail[i + 1] + ends * _AGE_EDGES[i]
            table = self.tables[cls] = (tail, hit_tail, end_tail) if self.mode == "hazard" else (
                hit_tail, end_tail, age_tail)
        return table

    def score(self, cls: tuple[int, ...], age: int) -> float:
        a = _age_bucket(age)
        if self.mode == "hazard":
            tail = self._table(cls)[0]
            b = _age_bucket(age + max(1, round(self.eviction_age)))
            return (tail[a] - tail[b]) / tail[a] if tail[a] else 0.5
        hit_tail, end_tail, age_tail = self._table(cls)
        if not end_tail[a]:
            return 1.0  # ages this class never reached: keep it (explore)
        return hit_tail[a] / max(age_tail[a] - age * end_tail[a], 1.0)

    def victim(self) -> int | None:
        best: tuple[float, tuple[int, int, int, int]] | None = None
        for queue in list(self.heaps):
            if self.arc and queue == (-1,):
                continue
            head = self._head(queue)
            if head is not None:
                candidate = (self.score(self.pages[head[3]][1], self.clock - head[0]), head)
                if best is None or candidate < best:
                    best = candidate
        t1 = None if best is None else best[1][3]
        if not self.arc:
            return t1
        t2_head = self._head((-1,))
        t2 = None if t2_head is None else t2_head[3]
        if t1 is not None and (self.resident[1] > self.p or t2 is None):
            return t1
        return t2 if t2 is not None else t1

    def evict(self, node: int) -> None:
        page = self.pages.pop(node)
        age = self.clock - page[0]
        self.eviction_age += (age - self.eviction_age) / 1000
        if page[1] is not None:
            self._count(self.evictions, page[1], _age_bucket(age))
            segment = self._segment(page[1])
            self.resident[segment] -= 1
            if self.arc:
                ghosts = self.ghosts[segment]
                ghosts[node] = None
                while len(ghosts) > self.capacity:
                    ghosts.popitem(last=False)


class OnlineETR:
    """Mockingjay-style eviction (Shah, Jain and Lin, "Effective Mimicry of Belady's MIN
    Policy", HPCA'22) over a prefix-closed pool: every page carries an *estimated time
    remaining* until its next use (ETR; time in requests, as the tier counts it) and the
    evictable leaf with the largest ETR goes. A page predicted beyond what the pool can hold
    is thereby the first victim (Mockingjay's bypass).

    Reuse distances are learned per *signature*, online from the past only, like Mockingjay's
    sampled sets: a memory of recent touches (``window`` requests, at most ``memory_factor`` x
    capacity keys) keeps each key's last touch and signature; a key touched again observes its
    gap (in buckets of ``_AGE_EDGES``), a key leaving the memory unused is *dead*, and counts
    as a reuse distance of ``dead`` x ``window`` (Mockingjay's INF_RD). Keys still unused in
    the memory count as censored at their age (Kaplan-Meier), so a signature learns that its
    pages do not come back as they age, not a ``window`` later. Counts are halved every
    ``halve_every`` observations; the estimates are refreshed every ``refresh`` requests. A
    signature with under 16 pages observed at an age falls back to its turns alone, then to
    every page, then counts as dead.

    Signature of a page at a touch: its conversation, identified as ``characterize`` does (a
    request continues the conversation of the deepest remembered page it touches past the
    first; otherwise it starts one), described by its turns so far (capped at 5) and its own
    last inter-turn gap (none, under 64, 256, 1,024 requests, more), and where the page lies:
    in the request's known prefix, or how far past it (0, 1-2, 3-8, 9+ pages).

    * Mockingjay proper (``given_age`` False): the prediction is the signature's mean reuse
      distance, fixed at the touch; ETR = touch + prediction - now counts down, and an
      overdue page's |ETR| grows again, so the victim is the leaf with the largest |ETR|
      (far off, or long overdue: presumed dead).
    * ``given_age``: ETR = the mean *residual* reuse distance of the signature given the
      page's age, E[gap - age | gap > age]: a heavy-tailed gap makes an unused page's
      expected wait grow with its age, so each signature keeps its leaves in LRU order and
      the victim is the signature head with the largest ETR (the older on a tie). Not O(log
      n) as the tier's policies are: a victim scans the signature heads (up to 150).
    """

    def __init__(
        self,
        capacity: int,
        depth: Callable[[int], int],
        given_age: bool = False,
        window: int = 4000,
        memory_factor: float = 8.0,
        halve_every: int = 200_000,
        refresh: int = 16,
        dead: float = 16.0,
    ) -> None:
        self.capacity, self.depth, self.given_age = capacity, depth, given_age
        self.window, self.memory_limit = window, int(memory_factor * capacity)
        self.halve_every, self.observed, self.refresh = halve_every, 0, refresh
        self.dead = dead * window  # the reuse distance a key that left the memory unused counts
        self.clock = 0
        buckets = len(_AGE_EDGES) + 1  # the last: not reused within the memory
        self.gaps: defaultdict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0] * buckets)
        self.tables: dict[tuple[int, ...], tuple[list[float], list[float], list[float]]] = {}
        # signature -> {clock: keys of the memory touched then and unused since}
        self.unused: defaultdict[tuple[int, ...], defaultdict[int, int]] = defaultdict(
            lambda: defaultdict(int)
        )
        # key -> (clock of its last touch, signature, conversation)
        self.memory: dict[int, tuple[int, tuple[int, ...], int]] = {}
        self.touches: deque[tuple[int, int]] = deque()  # (clock, key), oldest first
        # conversation -> [turns, clock of its last request, last inter-turn gap or 0]
        self.conversations: dict[int, list[int]] = {}
        self.turns_seen: deque[tuple[int, int]] = deque()  # (clock, conversation)
        self.next_conversation = 0
        # page -> [last touch, signature, evictable, version, predicted next use]
        self.pages: dict[int, list[Any]] = {}
        self.far: list[tuple[float, int, int, int]] = []  # (-predicted, -depth, version, page)
        self.due: list[tuple[float, int, int, int]] = []  # (predicted, -depth, version, page)
        self.heaps: defaultdict[tuple[int, ...], list[tuple[int, int, int, int]]] = (
            defaultdict(list)
        )
        self.live = 0
        self.seq = itertools.count()
        self.pending: list[int] = []  # pages touched by the current request, not yet classed
        self.continues: int | None = None  # the conversation the current request continues
        self.known_depth = -1  # deepest page of the current request touched before

    def __len__(self) -> int:
        return len(self.pages)

    # -- the reuse-distance predictor --

    def _observe(self, signature: tuple[int, ...], bucket: int) -> None:
        for level in (signature, signature[:1], ()):
            self.gaps[level][bucket] += 1
        self.observed += 1
        if self.observed >= self.halve_every:  # decay: the estimates follow the traffic
            self.observed = 0
            for row in self.gaps.values():
                row[:] = [v / 2 for v in row]

    def _refresh(self) -> None:
        """Survival of each level's reuse gap (Kaplan-Meier: the keys still unused in the
        memory are censored at their age). Per level and age bucket: (pages at risk from it
        on, survival to it, the survival-weighted sum of the gaps from it on, the mass
        surviving the last bucket counted as dead)."""
        n = len(_AGE_EDGES)
        values = [*_AGE_EDGES, self.dead]
        censored: defaultdict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0] * (n + 1))
        for signature, stamps in self.unused.items():
            for stamp, keys in stamps.items():
                bucket = _age_bucket(self.clock - stamp)
                for level in (signature, signature[:1], ()):
                    censored[level][bucket] += keys
        self.tables.clear()
        for level, row in self.gaps.items():
            lost = censored[level]
            risk = [0.0] * (n + 2)
            for i in range(n, -1, -1):
                risk[i] = risk[i + 1] + row[i] + lost[i]
            survival = [1.0] * (n + 2)
            for i in range(n):
                survival[i + 1] = survival[i] * (1 - row[i] / risk[i] if risk[i] else 1.0)
            total = [0.0] * (n + 2)
            total[n] = survival[n] * values[n]
            for i in range(n - 1, -1, -1):
                total[i] = total[i + 1] + (survival[i] - survival[i + 1]) * values[i]
            self.tables[level] = (risk, survival, total)

    def _remaining(self, signature: tuple[int, ...], age: int) -> float:
        """E[gap - age | gap > age] for the signature (or the first coarser level with 16 pages
        at risk at this age); a page older than any seen reused is presumed dead."""
        a = _age_bucket(age)
        for level in (signature, signature[:1], ()):
            table = self.tables.get(level)
            if table is not None and table[0][a] >= 16:
                _, survival, total = table
                if survival[a] <= 0:
                    break
                return total[a] / survival[a] - age
        return self.dead

    def _used(self, entry: tuple[int, tuple[int, ...], int]) -> None:
        stamps = self.unused[entry[1]]
        stamps[entry[0]] -= 1
        if not stamps[entry[0]]:
            del stamps[entry[0]]

    # -- the protocol --

    def begin_request(self) -> None:
        self._flush()
        self.clock += 1
        self.continues, self.known_depth = None, -1
        if self.clock % self.refresh == 0:
            self._refresh()
        while self.touches and (
            self.touches[0][0] <= self.clock - self.window
            or len(self.touches) > self.memory_limit
        ):
            stamp, key = self.touches.popleft()
            entry = self.memory.get(key)
            if entry is not None and entry[0] == stamp:  # left the memory unused: "infinite"
                del self.memory[key]
                self._observe(entry[1], len(_AGE_EDGES))
                self._used(entry)
        while self.turns_seen and self.turns_seen[0][0] <= self.clock - self.window:
            stamp, conversation = self.turns_seen.popleft()
            state = self.conversations.get(conversation)
            if state is not None and state[1] == stamp:
                del self.conversations[conversation]

    def admit(self, node: int) -> None:
        self.pages[node] = [self.clock, None, False, -1, 0.0]

    def touch(self, node: int) -> None:
        entry = self.memory.get(node)
        if entry is not None and entry[0] < self.clock:  # touched by an earlier request
            self._observe(entry[1], _age_bucket(self.clock - entry[0]))
            self._used(entry)
            depth = self.depth(node)
            self.known_depth = max(self.known_depth, depth)
            if depth >= 1 and entry[2] in self.conversations:
                self.continues = entry[2]  # path order: the deepest known page decides
        self.pending.append(node)

    def _flush(self) -> None:
        """Class the pages the current request touched (its conversation is known now)."""
        if not self.pending:
            return
        conversation = self.continues
        if conversation is None:
            conversation = self.continues = self.next_conversation
            self.next_conversation += 1
            self.conversations[conversation] = [0, self.clock, 0]
            self.turns_seen.append((self.clock, conversation))
        state = self.conversations[conversation]
        if state[1] < self.clock:  # a new turn of the conversation
            state[0], state[2], state[1] = state[0] + 1, self.clock - state[1], self.clock
            self.turns_seen.append((self.clock, conversation))
        turns = min(state[0], 5)
        gap = _bucket(state[2], (0, 64, 256, 1024))
        for node in self.pending:
            page = self.pages.get(node)
            if page is None:
                continue
            offset = self.depth(node) - self.known_depth - 1
            signature = (turns, gap, 0 if offset < 0 else 1 + _bucket(offset, (0, 2, 8)))
            page[0], page[1] = self.clock, signature
            page[4] = self.clock + self._remaining(signature, 0)
            self.memory[node] = (self.clock, signature, conversation)
            self.unused[signature][self.clock] += 1
            self.touches.append((self.clock, node))
            self._push(node)
        self.pending.clear()

    def _push(self, node: int) -> None:
        page = self.pages[node]
        page[3] = next(self.seq)
        if not page[2] or page[1] is None:
            return
        depth = -self.depth(node)
        if self.given_age:
            heapq.heappush(self.heaps[page[1]], (page[0], depth, page[3], node))
            return
        heapq.heappush(self.far, (-page[4], depth, page[3], node))
        heapq.heappush(self.due, (page[4], depth, page[3], node))
        if len(self.far) > 2 * self.live + 64:
            self.far = [e for e in self.far if self._current(e)]
            self.due = [e for e in self.due if self._current(e)]
            heapq.heapify(self.far)
            heapq.heapify(self.due)

    def _current(self, entry: tuple[float, int, int, int]) -> bool:
        page = self.pages.get(entry[3])
        return page is not None and page[2] and page[3] == entry[2]

    def _head(self, heap: list[Any]) -> Any:
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def set_evictable(self, node: int, evictable: bool) -> None:
        page = self.pages[node]
        if page[2] != evictable:
            page[2] = evictable
            self.live += 1 if evictable else -1
            self._push(node)

    def victim(self) -> int | None:
        self._flush()
        if self.given_age:
            best: tuple[float, int, int] | None = None
            for signature, heap in self.heaps.items():
                head = self._head(heap)
                if head is not None:
                    age = self.clock - head[0]
                    candidate = (self._remaining(signature, age), age, head[3])
                    if best is None or candidate[:2] > best[:2]:
                        best = candidate
            return None if best is None else best[2]
        far, due = self._head(self.far), self._head(self.due)
        if far is None:
            return None
        return far[3] if -far[0] - self.clock >= self.clock - due[0] else due[3]

    def evict(self, node: int) -> None:
        if self.pages.pop(node)[2]:
            self.live -= 1


# -- what the trace offers a cache -------------------------------------------------------------------


def characterize(trace: Trace) -> list[str]:
    """What an online cache could learn from: reuse shares, continuation odds, gaps."""
    uses: defaultdict[int, int] = defaultdict(int)
    for request in trace.requests:
        for block in request.hash_ids:
            uses[block] += 1
    once = sum(1 for n in uses.values() if n == 1) / len(uses)
    # A request continues the request whose chain end it hits deepest (unbounded cache).
    last_user: dict[int, int] = {}
    turns = [0] * len(trace)
    continued = [False] * len(trace)
    gaps: list[float] = []
    offset_reuse: defaultdict[int, list[int]] = defaultdict(lambda: [0, 0])
    for index, request in enumerate(trace.requests):
        blocks, hit = request.hash_ids, 0
        while hit < len(blocks) and blocks[hit] in last_user:
            hit += 1
        if hit >= 2:  # past a shared first block (a system prompt): a continuation
            before = last_user[blocks[hit - 1]]
            turns[index] = turns[before] + 1
            continued[before] = True
            gaps.append((request.timestamp_ms - trace.requests[before].timestamp_ms) / 1000)
        for offset, block in enumerate(blocks[hit:-1]):
            if block not in last_user:
                cell = offset_reuse[_bucket(offset, (0, 2, 8, 32))]
                cell[0] += 1
                cell[1] += uses[block] > 1
        for block in blocks:
            last_user[block] = index
    by_turn: defaultdict[int, list[int]] = defaultdict(lambda: [0, 0])
    for turn, went_on in zip(turns, continued, strict=True):
        by_turn[min(turn, 5)][0] += 1
        by_turn[min(turn, 5)][1] += went_on
    gaps.sort()

    def pct(q: float) -> float:
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else 0.0

    labels = ("0", "1-2", "3-8", "9-32", "33+")
    return [
        f"blocks used by one request only: {100 * once:.0f}%",
        "a request is followed by a continuation, by turns before it: "
        + ", ".join(f"{t if t < 5 else '5+'}: {100 * c / n:.0f}%"
                    for t, (n, c) in sorted(by_turn.items())),
        f"continuation gap (s): p10 {pct(0.1):.0f}, p50 {pct(0.5):.0f}, p90 {pct(0.9):.0f}",
        "new blocks used again, by blocks past the request's hit: "
        + ", ".join(f"{labels[b]}: {100 * c / n:.0f}%" for b, (n, c) in sorted(offset_reuse.items())),
        *reuse_predictability(trace),
    ]


def reuse_predictability(trace: Trace) -> list[str]:
    """How well every field of the trace predicts whether a new block is ever used again: the
    ROC AUC (0.5: a coin; 1: what ``oracle admission`` knows) of an in-sample lookup table of
    the reuse rate per combination of features, each added in turn (optimistic: a table with
    thousands of cells fitted and scored on the same blocks)."""
    uses = next_uses(trace)
    times = [r.timestamp_ms / 1000 for r in trace.requests]
    last_user: dict[int, int] = {}
    turns = [0] * len(trace)
    rows: list[tuple[tuple[int, ...], bool]] = []
    for index, request in enumerate(trace.requests):
        blocks, hit = request.hash_ids, 0
        while hit < len(blocks) and blocks[hit] in last_user:
            hit += 1
        gap = -1
        if hit >= 2:  # past a shared first block: a continuation (as in ``characterize``)
            before = last_user[blocks[hit - 1]]
            turns[index] = turns[before] + 1
            gap = _bucket(int(times[index] - times[before]), (30, 60, 120, 300, 600))
        new = _bucket(len(blocks) - hit, (1, 2, 3, 5, 8, 16, 32))
        output = _bucket(request.output_length, (32, 64, 128, 256, 512))
        partial = request.input_length % trace.block_tokens != 0
        for depth in range(hit, len(blocks)):
            offset = _bucket(depth - hit, (0, 1, 2, 4, 8, 16, 32))
            last = int(partial and depth == len(blocks) - 1)
            features = (min(turns[index], 8), new, offset, gap, output, last)
            rows.append((features, uses[index][depth] != NEVER))
        for block in blocks:
            last_user[block] = index
    names = ("turns", "new blocks", "offset past the hit", "gap since the last turn",
             "output length", "partial last block")
    out = [f"new blocks: {len(rows)}, used again: {sum(y for _, y in rows)}; in-sample AUC of "
           "'used again' given"]
    for n in range(1, len(names) + 1):
        cells: defaultdict[tuple[int, ...], list[int]] = defaultdict(lambda: [0, 0])
        for key, reused in rows:
            cells[key[:n]][0] += 1
            cells[key[:n]][1] += reused
        rates = {key: hits / seen for key, (seen, hits) in cells.items()}
        auc = roc_auc([rates[key[:n]] for key, _ in rows], [reused for _, reused in rows])
        out.append(f"  + {names[n - 1]}: {auc:.3f} ({len(cells)} cells)")
    return out


def roc_auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """The ROC AUC of ``scores`` for ``labels`` (tied scores count half), 0.5 if one class is
    empty."""
    ranked = sorted(zip(scores, labels, strict=True))
    positives = sum(labels)
    negatives = len(labels) - positives
    if not positives or not negatives:
        return 0.5
    area = below = 0.0
    for _, group in itertools.groupby(ranked, key=lambda pair: pair[0]):
        members = [label for _, label in group]
        hits = sum(members)
        area += hits * (below + (len(members) - hits) / 2)
        below += len(members) - hits
    return area / (positives * negatives)


# -- hit rate against the quality of a reuse predictor ---------------------------------------------

#: the ROC AUCs of the noisy oracles of ``--auc-curve``, and the priority weights tried for each
#: (the best one is kept: optimistic, as for the ceilings).
CURVE_AUCS = (0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
CURVE_TAUS_S = (60.0, 300.0, 1000.0, 3000.0, 10000.0, 30000.0)


def calibrated(scores: Sequence[float], labels: Sequence[bool], bins: int = 64) -> list[float]:
    """Each score replaced by the rate of ``labels`` among the scores of its quantile bin."""
    edges = sorted(scores)
    edges = [edges[len(edges) * k // bins] for k in range(1, bins)]
    where = [bisect.bisect_right(edges, score) for score in scores]
    seen, used = [0] * bins, [0] * bins
    for cell, label in zip(where, labels, strict=True):
        seen[cell] += 1
        used[cell] += label
    return [used[cell] / seen[cell] for cell in where]


def noisy_oracle_reuse(trace: Trace, auc: float, seed: int = 1) -> list[list[float]]:
    """A predictor of whether each block access is followed by another use, of ROC AUC about
    ``auc``: the truth plus Gaussian noise, one draw per request (a predictor built from
    request-level fields errs for all of a request's blocks at once), calibrated in-sample to
    a probability. ``auc`` 1 is the oracle itself."""
    uses = next_uses(trace)
    if auc >= 1.0:
        return [[float(use != NEVER) for use in row] for row in uses]
    sigma = 1 / (math.sqrt(2) * statistics.NormalDist().inv_cdf(auc))
    draw = random.Random(seed)
    labels, scores = [], []
    for row in uses:
        noise = sigma * draw.gauss(0.0, 1.0)
        for use in row:
            labels.append(use != NEVER)
            scores.append(labels[-1] + noise)
    flat = iter(calibrated(scores, labels))
    return [[next(flat) for _ in row] for row in uses]


def auc_curve(trace: Trace, capacities: Sequence[int]) -> list[str]:
    """Markdown rows: hit rate % (best ``CURVE_TAUS_S``) of ``ScoredPriority`` given noisy
    oracles of increasing AUC, and given the fields of the trace (``feature_reuse``), with each
    predictor's AUC over every block access and over first accesses only."""
    uses = next_uses(trace)
    labels = [use != NEVER for row in uses for use in row]
    first, seen = [], set()
    for request in trace.requests:
        for block in request.hash_ids:
            first.append(block not in seen)
            seen.add(block)
    predictors = [(f"noisy oracle, AUC {auc:.2f}", noisy_oracle_reuse(trace, auc))
                  for auc in CURVE_AUCS]
    predictors.append(("fields of the trace (the `P(reuse given features)` ceiling)",
                       feature_reuse(trace)))
    rows = []
    for name, reuse in predictors:
        flat = [p for row in reuse for p in row]
        new = roc_auc([p for p, f in zip(flat, first, strict=True) if f],
                      [y for y, f in zip(labels, first, strict=True) if f])
        cells = []
        for capacity in capacities:
            rate, tau = max((simulate(trace, capacity, ScoredPriority(trace, reuse, tau)).hit_rate,
                             tau) for tau in CURVE_TAUS_S)
            cells.append(f"{100 * rate:.1f} ({tau:g} s)")
        rows.append(f"| {name} | {roc_auc(flat, labels):.3f} | {new:.3f} | " + " | ".join(cells)
                    + " |")
    return rows


# -- the table ---------------------------------------------------------------------------------------

Runner = Callable[[Trace, int], HitCount]


def _depths(trace: Trace) -> dict[int, int]:
    return {b: d for r in trace.requests for d, b in enumerate(r.hash_ids)}


def _same(block: int) -> int:
    return block


POLICIES: dict[str, Runner] = {
    "LRU (published)": lru_reference,
    "lru (prefix-closed; tier)": lambda t, c: simulate(t, c, block_policy("lru", t, c)),
    "arc (prefix-closed; tier default)": lambda t, c: simulate(t, c, block_policy("arc", t, c)),
    "arc: ghosts 4x adapting p (previous default)": lambda t, c: simulate(
        t, c, ARCEviction(c, _depths(t).__getitem__, _same, ghost_factor=4.0, recall_factor=0.0)
    ),
    "arc: textbook (ghosts 1x; no recall)": lambda t, c: simulate(
        t, c, ARCEviction(c, _depths(t).__getitem__, _same, ghost_factor=1.0, recall_factor=0.0)
    ),
    "FIFO": lambda t, c: replay_blocks(t, FIFO(c)),
    "SLRU": lambda t, c: replay_blocks(t, SLRU(c)),
    "S3-FIFO": lambda t, c: replay_blocks(t, S3FIFO(c)),
    "ARC": lambda t, c: replay_blocks(t, ARC(c)),
    "W-TinyLFU": lambda t, c: replay_blocks(t, WTinyLFU(c)),
    "ceiling: P(reuse given features)": in_sample_priority,
    "online: hazard per class": lambda t, c: simulate(t, c, OnlineHazard(c, _depths(t).__getitem__)),
    "online: LHD (hit density per class)": lambda t, c: simulate(
        t, c, OnlineHazard(c, _depths(t).__getitem__, mode="density")
    ),
    "online: arc with T1 by hazard per class": lambda t, c: simulate(
        t, c, OnlineHazard(c, _depths(t).__getitem__, arc=True, memory_factor=4.0)
    ),
    "online: ETR (Mockingjay-style)": lambda t, c: simulate(
        t, c, OnlineETR(c, _depths(t).__getitem__, window=1000, dead=1.0)
    ),
    "online: ETR given age (Mockingjay-style)": lambda t, c: simulate(
        t, c, OnlineETR(c, _depths(t).__getitem__, given_age=True)
    ),
    "ceiling: hazard per class": hazard_ceiling,
    "ceiling: hazard per class and offset": lambda t, c: hazard_ceiling(t, c, by_offset=True),
    "oracle admission": oracle_admission,
    "Belady": belady,
}


def split_blocks(trace: Trace, parts: int) -> Trace:
    """The same trace over pages of ``block_tokens / parts`` tokens (page ids derived from
    block ids; a partial last block keeps only its pages that hold tokens)."""
    if parts == 1:
        return trace
    if parts < 1 or trace.block_tokens % parts:
        raise SystemExit(f"--split {parts} must divide the {trace.block_tokens}-token block")
    page = trace.block_tokens // parts
    requests = []
    for r in trace.requests:
        ids = tuple(b * parts + j for b in r.hash_ids for j in range(parts))
        requests.append(TraceRequest(r.timestamp_ms, r.input_length, r.output_length,
                                     ids[: -(-r.input_length // page)]))
    return Trace(trace.name, page, tuple(requests))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="conversation,synthetic")
    parser.add_argument("--capacities", default="1000,4000,16000,64000")
    parser.add_argument("--only", help="comma-separated policy names (default: all)")
    parser.add_argument("--split", type=int, default=1,
                        help="simulate pages of block/N tokens (capacities scale with N)")
    parser.add_argument("--characterize", action="store_true",
                        help="print what the trace offers an online cache, not the table")
    parser.add_argument("--auc-curve", action="store_true",
                        help="hit rate against the AUC of a reuse predictor, not the table")
    args = parser.parse_args()
    capacities = [int(c) for c in args.capacities.split(",")]
    names = args.only.split(",") if args.only else list(POLICIES)
    for trace_name in args.traces.split(","):
        trace = split_blocks(read_trace(TRACES / f"mooncake_{trace_name}_trace.jsonl.gz"),
                             args.split)
        if args.characterize:
            print(f"\n{trace_name}:\n  " + "\n  ".join(characterize(trace)))
            continue
        if args.auc_curve:
            print(f"\n{trace_name}: token hit rate % of a priority LRU given a reuse predictor "
                  "(the best tau)\n")
            print("| predictor | AUC, all accesses | AUC, first accesses | "
                  + " | ".join(f"{c:,} blocks" for c in capacities) + " |")
            print("|---|---|---|" + "---|" * len(capacities))
            for row in auc_curve(trace, [c * args.split for c in capacities]):
                print(row, flush=True)
            continue
        print(f"\n{trace_name}: token hit rate %, all requests / second half\n")
        print("| policy | " + " | ".join(f"{c:,} blocks" for c in capacities) + " |")
        print("|---|" + "---|" * len(capacities))
        for name in names:
            counts = [POLICIES[name](trace, c * args.split) for c in capacities]
            cells = [f"{100 * n.hit_rate:.1f} / {100 * n.second_half_hit_rate:.1f}" for n in counts]
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
