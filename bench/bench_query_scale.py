"""The prefix query server's cost at 10 k and 1 M stored objects, by prompt length.

Run from the repository root::

    .venv/bin/python bench/bench_query_scale.py --objects 10000,1000000 --rounds 20

For each store size: a memory store holding chains of ``CHAIN`` pages (one object per page:
a namespace whose grid is the whole page; tiny payloads, existence is what a query reads) and
the namespace's manifest; ``QueryServer`` (``hicache-store serve-query``'s server) on
127.0.0.1; then, for prompts of 16, 256 and 4,096 pages whose first half is stored, the median
seconds of one ``POST /query`` (real HTTP, JSON tokens) and the backend round trips and keys
it cost (``exists`` calls counted on the store). Every answer is checked against the half
stored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Sequence

from hicache_store.backends.memory import MemoryBackend
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import ObjectCoords, object_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.objects.manifest import ensure_manifest
from hicache_store.query import QueryServer
from hicache_store.reader import KVReader

PAGE = 16
CHAIN = 4096
NAMESPACE = Namespace.create("bench-query", ModelShape.mha(4, 4, 8), "float16", PAGE, Grid(4, 4))
COORDS = ObjectCoords(0, 4, 0)
LENGTHS = (16, 256, 4096)


class Counted(MemoryBackend):
    """The memory store, counting ``exists`` round trips and keys."""

    calls = 0
    keys = 0

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        Counted.calls += 1
        Counted.keys += len(keys)
        return await super()._exists(keys)


def build(objects: int, rng: random.Random) -> tuple[Counted, list[int]]:
    """A store of ``objects`` pages in chains of ``CHAIN``; the tokens of the first chain."""
    backend = Counted()
    asyncio.run(ensure_manifest(backend, NAMESPACE))
    first: list[int] = []
    left = objects
    while left > 0:
        pages = min(CHAIN, left)
        tokens = [rng.randrange(32000) for _ in range(pages * PAGE)]
        if not first:
            first = tokens
        keys = [object_key(h, NAMESPACE.digest, COORDS) for h in page_hashes(tokens, PAGE)]
        for at in range(0, len(keys), 4096):
            chunk = keys[at:at + 4096]
            asyncio.run(backend.put(chunk, [b"x"] * len(chunk)))
        left -= pages
    return backend, first


def query(url: str, tokens: list[int]) -> int:
    body = json.dumps({"tokens": tokens}).encode()
    request = urllib.request.Request(url + "/query", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(json.loads(response.read())["medium"]["STORAGE"]["matched_pages"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", default="10000,1000000")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    print("| objects stored | prompt pages (half stored) | median ms per query | exists "
          "round trips | keys probed |")
    print("|---|---|---|---|---|")
    for objects in (int(n) for n in args.objects.split(",")):
        rng = random.Random(objects)
        started = time.perf_counter()
        backend, chain = build(objects, rng)
        built = time.perf_counter() - started
        server = QueryServer(KVReader(backend, NAMESPACE)).start()
        try:
            for length in LENGTHS:
                if length > len(chain) // PAGE:
                    continue
                stored = length // 2
                prompt = chain[:stored * PAGE] + [rng.randrange(32000)
                                                  for _ in range((length - stored) * PAGE)]
                times = []
                Counted.calls = Counted.keys = 0
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    got = query(server.url, prompt)
                    times.append(time.perf_counter() - t0)
                    assert got == stored, (got, stored)
                print(f"| {objects:,} | {length:,} ({stored:,}) | "
                      f"{statistics.median(times) * 1000:.1f} | {Counted.calls / args.rounds:.0f} "
                      f"| {Counted.keys / args.rounds:.0f} |", flush=True)
        finally:
            server.close()
        print(f"<!-- store of {objects:,} objects built in {built:.1f} s -->", flush=True)


if __name__ == "__main__":
    main()
