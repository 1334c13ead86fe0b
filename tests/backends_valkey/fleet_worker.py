"""One writer process of the fleet test (``python fleet_worker.py URL WORKER SEED SECONDS LOG``).

It opens the store at ``URL`` (a file root or an S3 prefix, with its index) and, until
``SECONDS`` have passed, does a random mix of what an engine and an operator do to a shared
store: puts of chain prefixes of prompts (two objects a page: two head groups of the fleet's
namespace, ``fleet_namespace``), reads that verify every byte, pins (the first few kept for
good, the others released a little later), retention, and deletes of whole pages. Prompts are
drawn from a pool every worker shares, so pages are written, rewritten and read across workers
and hosts.

Object bytes are a function of the key (``content``): a read that returns anything else is
wrong KV, logged ``BAD``. The log (one line per event, flushed): ``P <key>`` a pin kept for
good (taken after its object was stored: the fleet test checks that no such object is ever
evicted), ``BAD <key>``, and at the end ``done <counts as JSON>``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any, TextIO

import xxhash

from hicache_store.backends import (
    BackendUnavailableError,
    CapacityError,
    PinBudgetError,
    Retention,
    WriterFencedError,
    open_backend,
)
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import ObjectCoords, object_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace

#: the fleet's namespace: 2 KV heads, one per head group: two objects a page.
PAGE_TOKENS = 4
OBJECT_BYTES = 4096
GROUPS = 2
PROMPTS = 60
PROMPT_PAGES = 8
#: prompts whose pages are deleted now and then (and never pinned: a delete drops pins)
DELETABLE = range(50, 60)
#: pins a worker keeps for good (the others are released)
KEPT_PINS = 2


def fleet_namespace() -> Namespace:
    return Namespace.create("fleet-test", ModelShape.mha(2, GROUPS, 64), "bfloat16",
                            PAGE_TOKENS, Grid(2, 1))


def prompts() -> list[list[int]]:
    """The prompt pool every worker draws from (a shared seed)."""
    rng = random.Random(12345)
    return [[rng.randrange(1000) for _ in range(PROMPT_PAGES * PAGE_TOKENS)]
            for _ in range(PROMPTS)]


def page_keys(namespace: Namespace, page_hash: str) -> list[str]:
    coords = [ObjectCoords(0, namespace.num_layers, g) for g in range(GROUPS)]
    return [object_key(page_hash, namespace.digest, c) for c in coords]


def content(key: str) -> bytes:
    """The bytes of ``key``'s object (every writer writes these, so a rewrite is the same)."""
    return xxhash.xxh3_128_digest(key.encode()) * (OBJECT_BYTES // 16)


async def main(url: str, worker: str, seed: int, seconds: float, log: TextIO) -> None:
    rng = random.Random(seed)
    namespace = fleet_namespace()
    chains = [page_hashes(p, PAGE_TOKENS, algo=namespace.hash_algo) for p in prompts()]
    counts = {"puts": 0, "reads": 0, "verified": 0, "pins": 0, "retains": 0, "deletes": 0,
              "fenced": 0, "refused": 0, "capacity": 0, "budget": 0, "bad": 0}
    store: Any = None
    written: list[tuple[int, str]] = []  # (prompt, page hash) this worker stored
    pinned: list[str] = []  # keys under a pin to release later
    kept = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if store is None:
                store = open_backend(url)
            roll = rng.random()
            if roll < 0.55:
                prompt = rng.randrange(PROMPTS)
                chain = chains[prompt][: rng.randint(1, PROMPT_PAGES)]
                keys = [k for h in chain for k in page_keys(namespace, h)]
                await store.put(keys, [content(k) for k in keys])
                written.extend((prompt, h) for h in chain)
                counts["puts"] += 1
            elif roll < 0.80 and written:
                for key in page_keys(namespace, rng.choice(written)[1]):
                    got = await store.get_bytes(key)
                    counts["reads"] += 1
                    if got is None:
                        continue  # evicted or deleted by someone: a miss
                    if got != content(key):
                        counts["bad"] += 1
                        log.write(f"BAD {key}\n")
                    else:
                        counts["verified"] += 1
            elif roll < 0.88 and written:
                prompt, page = rng.choice(written)
                if prompt in DELETABLE:
                    continue
                keys = page_keys(namespace, page)
                if not all(await store.exists(keys)):
                    continue
                # a kept pin has an owner of its own: releasing the others never drops it
                owner = worker + ("#kept" if kept < KEPT_PINS else "")
                try:
                    await store.retain(keys, Retention(owner, None, pinned=True))
                except PinBudgetError:
                    counts["budget"] += 1
                    continue
                held = await store.retention_of(keys)
                if not all(any(r.owner == owner for r in entries) for entries in held):
                    continue  # evicted between the check and the pin: nothing held
                counts["pins"] += 1
                if kept < KEPT_PINS:
                    kept += 1
                    for key in keys:
                        log.write(f"P {key}\n")
                else:
                    pinned.extend(keys)
                    if len(pinned) > 8:
                        await store.release(pinned[:4], worker)
                        del pinned[:4]
            elif roll < 0.95 and written:
                keys = page_keys(namespace, rng.choice(written)[1])
                await store.retain(keys, Retention(worker + "#r", time.time() + 30, pinned=False,
                                                   priority=rng.randrange(3)))
                counts["retains"] += 1
            elif written:
                prompt, page = rng.choice(written)
                if prompt in DELETABLE:  # (never pinned: a delete drops a page's holds)
                    await store.delete(page_keys(namespace, page))
                    counts["deletes"] += 1
        except WriterFencedError:
            counts["fenced"] += 1
        except BackendUnavailableError:
            counts["refused"] += 1
            await asyncio.sleep(0.05)
        except CapacityError:
            counts["capacity"] += 1
    if store is not None:
        await store.close()
    log.write(f"done {json.dumps(counts)}\n")


if __name__ == "__main__":
    url, name, seed, seconds, log_path = sys.argv[1:6]
    with open(log_path, "a", buffering=1) as out:
        asyncio.run(main(url, name, int(seed), float(seconds), out))
