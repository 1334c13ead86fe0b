"""The eviction-policy study behind the tier's default: policies x capacities on the traces.

    .venv/bin/python bench/trace_policy_study.py [--traces conversation,synthetic]
        [--capacities 1000,4000,16000,64000] [--only NAME,...]

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
* what no online policy can have: ``oracle admission`` (LRU that never keeps a block with no
  future use), and two in-sample ceilings for the request-level signals an online cache does
  see (how many times the chain was extended before, how many blocks the request adds, how
  far past its hit a block lies), whose statistics are measured on the very trace they are
  then applied to: ``ceiling: P(reuse given features)`` (priority = time + tau * in-sample
  reuse probability of the block's feature bucket) and
  ``ceiling: hazard per class`` (per-class LRU queues, evict the class head least likely to be
  reused within the next two minutes given its age).
"""

from __future__ import annotations

import abc
import argparse
import bisect
import heapq
import math
import zlib
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

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


class InSamplePriority(LRUEviction[int]):
    """LRU order, but a block's time is its request's arrival plus tau * P(block used again |
    turns, new-block bucket, offset bucket), the probability measured on the whole trace
    beforehand."""

    def __init__(self, trace: Trace, tau_s: float) -> None:
        depths = _depths(trace)
        super().__init__(depths.__getitem__)
        self.depth_of = depths
        self.tau_s, self.features = tau_s, request_features(trace)
        self.index = -1
        totals: defaultdict[tuple[int, ...], list[int]] = defaultdict(lambda: [0, 0])
        for index, uses in enumerate(next_uses(trace)):
            for depth, use in enumerate(uses):
                cell = totals[self._key(index, depth)]
                cell[0] += 1
                cell[1] += use != NEVER
        self.p = {key: used / seen for key, (seen, used) in totals.items()}
        self.times = [r.timestamp_ms / 1000 for r in trace.requests]

    def _key(self, index: int, depth: int) -> tuple[int, ...]:
        turns, new, hit = self.features[index]
        return (turns, new, _bucket(max(depth - hit, 0), (0, 1, 2, 4, 8, 16, 32, 64, 128)))

    def begin_request(self) -> None:
        super().begin_request()
        self.index += 1

    def touch(self, node: int) -> None:
        key = self._key(self.index, self.depth_of[node])
        state = self._leaves.states[node]
        state.stamp = self.times[self.index] + self.tau_s * self.p[key]  # type: ignore[assignment]
        self._leaves.push(node)


def hazard_ceiling(trace: Trace, capacity: int, horizon_s: float = 120.0) -> HitCount:
    """Per-class LRU queues of leaves (class = turns x new-block bucket); the victim is the class
    head least likely, given its age, to be reused within ``horizon_s`` (gap distributions
    measured in-sample)."""
    features = request_features(trace)
    classes = [f[:2] for f in features]
    times = [r.timestamp_ms / 1000 for r in trace.requests]
    gaps: defaultdict[tuple[int, int], list[float]] = defaultdict(list)
    for index, uses in enumerate(next_uses(trace)):
        for use in uses:
            gaps[classes[index]].append(times[use] - times[index] if use != NEVER else math.inf)
    for values in gaps.values():
        values.sort()

    def score(cls: tuple[int, int], age: float) -> float:
        values = gaps[cls]
        alive = len(values) - bisect.bisect_right(values, age)
        soon = bisect.bisect_right(values, age + horizon_s) - bisect.bisect_right(values, age)
        return soon / alive if alive else 0.0

    parent: dict[int, int] = {}
    state: dict[int, tuple[float, int, tuple[int, int]]] = {}  # block -> (time, -depth, class)
    children: dict[int, int] = {}
    heaps: defaultdict[tuple[int, int], list[tuple[tuple[float, int, tuple[int, int]], int]]] = (
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
        cls = classes[index]
        for depth, block in enumerate(blocks):
            if block not in state:
                children[block] = 0
                if depth:
                    parent[block] = blocks[depth - 1]
                    children[blocks[depth - 1]] += 1
            state[block] = (times[index], -depth, cls)
        for block in blocks:
            if children[block] == 0:
                heapq.heappush(heaps[cls], (state[block], block))
        while len(state) > capacity:
            best: tuple[float, tuple[int, int]] | None = None
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
    ]


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
    "ceiling: P(reuse given features)": lambda t, c: simulate(t, c, InSamplePriority(t, 1000.0)),
    "ceiling: hazard per class": hazard_ceiling,
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
    args = parser.parse_args()
    capacities = [int(c) for c in args.capacities.split(",")]
    names = args.only.split(",") if args.only else list(POLICIES)
    for trace_name in args.traces.split(","):
        trace = split_blocks(read_trace(TRACES / f"mooncake_{trace_name}_trace.jsonl.gz"),
                             args.split)
        if args.characterize:
            print(f"\n{trace_name}:\n  " + "\n  ".join(characterize(trace)))
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
