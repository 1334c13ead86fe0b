"""Layout benchmark: page hashing of a 128K-token prompt, and per-page planning cost.

Measures, in one run after warm-up:
  * our sha256 chain (the default) and xxh3_128 chain, from a list of Python ints (what engines
    pass) and from a uint32 numpy array;
  * SGLang's own ``get_hash_str(tokens, None, page_size=64)`` (a JIT-compiled native function in
    sglang 0.5.23) and its per-page call loop, in a peer interpreter that has sglang installed
    (``--peer-python``, default ``.build/bench-venv/bin/python``; see bench/setup_peers.sh);
    outputs must be identical to ours;
  * plan computation per (namespace, topology, rank) (cold, then cached), and the per-page
    planning work (cached plan lookup + formatting the page's object keys) next to the per-page
    hashing cost.

Usage: .venv/bin/python bench/bench_layout.py [--tokens 131072] [--page-size 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.plans import plan_reads, plan_writes
from hicache_store.layout.topology import Topology

ROOT = Path(__file__).resolve().parent.parent

PEER_SCRIPT = r"""
import json, sys, time, statistics
from sglang.srt.mem_cache.utils import get_hash_str
tokens = json.load(open(sys.argv[1]))
page, repeat = int(sys.argv[2]), int(sys.argv[3])
def per_page():
    out, prior = [], None
    for i in range(0, len(tokens) // page * page, page):
        prior = get_hash_str(tokens[i:i + page], prior)
        out.append(prior)
    return out
def timed(fn):
    fn(); fn()  # warm-up (the first call JIT-compiles the native module)
    samples = []
    for _ in range(repeat):
        t = time.perf_counter(); fn(); samples.append(time.perf_counter() - t)
    return statistics.median(samples)
batched = get_hash_str(tokens, None, page_size=page)
print(json.dumps({"batched_s": timed(lambda: get_hash_str(tokens, None, page_size=page)),
                  "per_page_s": timed(per_page), "hashes": batched, "per_page_equal": per_page() == batched}))
"""


def timed(fn: Callable[[], object], repeat: int) -> float:
    fn()
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_peer(python: Path, tokens: list[int], page: int, repeat: int) -> dict[str, Any] | None:
    if not python.exists():
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump(tokens, handle)
        handle.flush()
        out = subprocess.run(
            [str(python), "-c", PEER_SCRIPT, handle.name, str(page), str(repeat)],
            capture_output=True,
            text=True,
            check=True,
        )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".build/bench-venv/bin/python")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rng = random.Random(0)
    tokens = [rng.randrange(152_064) for _ in range(args.tokens)]
    as_array = np.array(tokens, dtype=np.uint32)
    page = args.page_size
    pages = args.tokens // page
    results: dict[str, Any] = {"tokens": args.tokens, "page_size": page, "pages": pages}

    ours = page_hashes(tokens, page)
    results["sha256_list_ms"] = 1e3 * timed(lambda: page_hashes(tokens, page), args.repeat)
    results["sha256_array_ms"] = 1e3 * timed(lambda: page_hashes(as_array, page), args.repeat)
    results["xxh3_128_list_ms"] = 1e3 * timed(
        lambda: page_hashes(tokens, page, algo="xxh3_128"), args.repeat
    )
    results["xxh3_128_array_ms"] = 1e3 * timed(
        lambda: page_hashes(as_array, page, algo="xxh3_128"), args.repeat
    )

    peer = run_peer(args.peer_python, tokens, page, args.repeat)
    if peer is not None:
        results["sglang_batched_ms"] = 1e3 * peer["batched_s"]
        results["sglang_per_page_ms"] = 1e3 * peer["per_page_s"]
        results["identical_to_sglang"] = peer["hashes"] == ours and peer["per_page_equal"]

    # Planning: Llama-3-8B-shaped namespace, TP4/PP2 writer and TP2/PP1 reader of the seed grid.
    ns = Namespace.create("bench", ModelShape.mha(60, 8, 128), "bfloat16", page, Grid(30, 2))
    writer, reader = Topology(4, 2), Topology(2, 1)
    cold = []
    for rank in range(writer.world_size):
        plan_writes.cache_clear()
        start = time.perf_counter()
        plan_writes(ns, writer, rank)
        cold.append(time.perf_counter() - start)
    results["plan_cold_us"] = 1e6 * statistics.median(cold)

    def per_page_planning(trusted: bool) -> None:
        # What the tier does per page: fetch the cached plan, name each object it reads
        # (4 objects per page for this reader). The tier passes hashes it computed itself
        # (trusted); hashes from an engine are validated first.
        plan = plan_reads(ns, reader, 0)
        for page_hash in ours[:256]:
            plan.object_keys(page_hash, trusted=trusted)

    results["plan_per_page_us"] = 1e6 * timed(lambda: per_page_planning(True), args.repeat) / 256
    results["plan_per_page_validated_us"] = (
        1e6 * timed(lambda: per_page_planning(False), args.repeat) / 256
    )
    results["hash_per_page_us"] = 1e3 * results["sha256_list_ms"] / pages

    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"page hashing, {args.tokens} tokens, page size {page} ({pages} pages), median of {args.repeat}"
    )
    rows = [
        ("hicache-store sha256 (list of ints)", results["sha256_list_ms"]),
        ("hicache-store sha256 (uint32 array)", results["sha256_array_ms"]),
        ("hicache-store xxh3_128 (list of ints)", results["xxh3_128_list_ms"]),
        ("hicache-store xxh3_128 (uint32 array)", results["xxh3_128_array_ms"]),
    ]
    if peer is not None:
        rows += [
            ("sglang get_hash_str(page_size=64)", results["sglang_batched_ms"]),
            ("sglang get_hash_str per page", results["sglang_per_page_ms"]),
        ]
    for name, ms in rows:
        print(f"  {name:<40} {ms:8.3f} ms")
    if peer is not None:
        print(f"  identical to SGLang: {results['identical_to_sglang']}")
    else:
        print(f"  (SGLang not measured: {args.peer_python} does not exist)")
    print(f"plan per (namespace, topology, rank), cold: {results['plan_cold_us']:.1f} us")
    print(
        f"per page: planning {results['plan_per_page_us']:.2f} us "
        f"({results['plan_per_page_validated_us']:.2f} us validating an engine's hash) "
        f"vs hashing {results['hash_per_page_us']:.2f} us"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
