"""Tier bookkeeping at scale: per-request cost and time to find a victim as known pages grow.

For each size N (pages the tier knows: L1 holds N pages, all in the tree), the tier is filled
with distinct prompts until L1 is full, then measured:

* **request, L1 full**: the tier's bookkeeping per request (``Request.bookkeeping_s``: match,
  planning, eviction, insertion; no I/O, no model compute) for new prompts of ``--request-pages``
  pages, each of which must evict that many pages; in brackets the engine thread's CPU time for
  the whole request (hashing included), which other work on a shared machine does not inflate;
* **request, free space**: the same with a tier whose L1 has room (no eviction);
* **victim**: the time to find one L1 victim (``PageTree.pop_victim``, the LRU policy's choice
  among the evictable leaves; each victim is then cached again, untimed, so every sample sees
  the full tree);
* **bytes/page**: Python heap bytes the tier's bookkeeping holds per known page (tracemalloc
  around the fill, the pools excluded: they are allocated before tracing starts).

No KV is computed: the bench drives ``match`` / ``prepare`` / ``complete`` as an engine would,
with the tiniest namespace (one layer, one KV head of 4 dims, page 16), so what is timed is the
bookkeeping. Medians over the samples.

Usage: .venv/bin/python bench/bench_tier_scale.py [--sizes 1000,10000,100000,1000000]
       [--request-pages 64] [--samples 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from typing import Any

import torch

from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.cache import HiCache
from hicache_store.tier.components import KV_TAG
from hicache_store.tier.config import TierConfig
from hicache_store.tier.radix import Tier

PAGE = 16
NS = Namespace.create("scale", ModelShape.mha(1, 1, 4), "float16", PAGE, Grid(1, 1))


def tier(l1_pages: int) -> HiCache:
    pool = DeviceKVPool(
        num_layers=1, num_kv_heads=1, head_dim=4, num_pages=l1_pages, page_size=PAGE,
        dtype=torch.float16,
    )
    return HiCache(NS, TierConfig(l1_pages=l1_pages), pool)


def prompt(rng: random.Random, pages: int) -> list[int]:
    # +1 token: a prompt keeps its last token to compute, so every full page is cached.
    return [rng.randrange(1 << 30) for _ in range(pages * PAGE + 1)]


def serve(t: HiCache, tokens: list[int]) -> tuple[float, float]:
    """One request without compute: (the tier's bookkeeping seconds, wall clock, as the tier
    counts them; the engine thread's CPU seconds for match + prepare + complete)."""
    cpu = time.thread_time()
    req = t.match(tokens)
    t.prepare(req)
    t.complete(req)
    return req.bookkeeping_s, time.thread_time() - cpu


def fill(t: HiCache, pages: int, rng: random.Random, chunk: int) -> None:
    while len(t.tree) + chunk <= pages:
        serve(t, prompt(rng, chunk))
    if pages - len(t.tree):
        serve(t, prompt(rng, pages - len(t.tree)))


def victim_seconds(t: HiCache, samples: int) -> float:
    """Median time of ``pop_victim`` (the policy's choice among the evictable leaves). Each
    victim is then evicted and cached again as a fresh page (untimed), so every sample sees a
    full tree and a different victim."""
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        node = t.tree.pop_victim(Tier.L1, KV_TAG)
        times.append(time.perf_counter() - started)
        assert node is not None
        page = node.copy(KV_TAG).l1
        t.tree.begin_request()
        t.tree.lock(node, KV_TAG)  # holding nothing for a moment, it would leave the tree
        t.tree.set_copy(node, KV_TAG, Tier.L1, None)
        t.tree.set_copy(node, KV_TAG, Tier.L1, page)
        t.tree.unlock(node, KV_TAG)
    return statistics.median(times)


def measure(n: int, request_pages: int, samples: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    full = tier(n + 1)  # + the partial last page of a prompt
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    fill(full, n, rng, chunk=min(1024, n // 2))
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(full.tree) == n, (len(full.tree), n)
    evicting = [serve(full, prompt(rng, request_pages)) for _ in range(samples)]
    victim = victim_seconds(full, samples * 10)
    roomy = tier(n + request_pages * (samples + 1) + 1)
    fill(roomy, n, rng, chunk=min(1024, n // 2))
    free = [serve(roomy, prompt(rng, request_pages)) for _ in range(samples)]
    return {
        "known_pages": n,
        "request_l1_full_ms": statistics.median(w for w, _ in evicting) * 1e3,
        "request_l1_full_cpu_ms": statistics.median(c for _, c in evicting) * 1e3,
        "request_free_ms": statistics.median(w for w, _ in free) * 1e3,
        "request_free_cpu_ms": statistics.median(c for _, c in free) * 1e3,
        "victim_us": victim * 1e6,
        "bytes_per_page": held / n,
        "tree_nodes": len(full.tree),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--request-pages", type=int, default=64)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    print(
        "| known pages | request, L1 full: bookkeeping (CPU) | request, free space: "
        "bookkeeping (CPU) | victim | bytes/page |"
    )
    print("|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        row = measure(n, args.request_pages, args.samples, args.seed)
        rows.append(row)
        print(
            f"| {n:,} | {row['request_l1_full_ms']:.2f} ms ({row['request_l1_full_cpu_ms']:.2f}) "
            f"| {row['request_free_ms']:.2f} ms ({row['request_free_cpu_ms']:.2f}) | "
            f"{row['victim_us']:.1f} us | {row['bytes_per_page']:.0f} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
