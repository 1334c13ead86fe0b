"""A process that writes pages to a file store (run as ``python store_writer.py ROOT SEED N
CAPACITY OBJECT_BYTES``), for the store-wide events tests: ``N`` random puts of 1-2 objects of
pages from a small pool (so pages are rewritten and completed), and now and then a delete of a
page's objects. The store is opened with ``CAPACITY`` bytes: puts past it evict other
processes' objects. Prints ``done PUTS DELETES EVICTIONS`` at the end."""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys

from hicache_store.backends import open_backend
from hicache_store.layout.keys import ObjectCoords, object_key

DIGEST = "0123456789abcdef"
GROUPS = 2


def page_hash(i: int) -> str:
    return hashlib.sha256(f"page-{i}".encode()).hexdigest()


def key(i: int, group: int) -> str:
    return object_key(page_hash(i), DIGEST, ObjectCoords(0, 4, group))


async def main(root: str, seed: int, count: int, capacity: int, size: int) -> None:
    rng = random.Random(seed)
    backend = open_backend(f"file://{root}?capacity_bytes={capacity}")
    puts = deletes = 0
    try:
        for _ in range(count):
            page = rng.randrange(400)
            if rng.random() < 0.1:
                await backend.delete([key(page, g) for g in range(GROUPS)])
                deletes += 1
                continue
            groups = rng.sample(range(GROUPS), rng.randint(1, GROUPS))
            await backend.put([key(page, g) for g in groups],
                              [rng.randbytes(size) for _ in groups])
            puts += 1
        evictions = backend.stats.evictions
    finally:
        await backend.close()
    print(f"done {puts} {deletes} {evictions}", flush=True)


if __name__ == "__main__":
    root, seed, count, capacity, size = sys.argv[1:6]
    asyncio.run(main(root, int(seed), int(count), int(capacity), int(size)))
