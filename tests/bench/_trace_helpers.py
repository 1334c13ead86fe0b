"""Small traces for the trace tests: hand-written ones and random prefix-consistent ones."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hicache_store.demo.bench.trace_format import Trace, TraceRequest


def make_trace(
    chains: Sequence[Sequence[int]], block: int = 4, lengths: Sequence[int] | None = None
) -> Trace:
    """A trace of ``chains`` (full blocks unless ``lengths`` says otherwise), 1 s apart."""
    requests = []
    for index, chain in enumerate(chains):
        length = lengths[index] if lengths is not None else len(chain) * block
        requests.append(TraceRequest(1000 * index, length, 1, tuple(chain)))
    return Trace("hand", block, tuple(requests))


def random_tree_trace(
    rng: random.Random, requests: int, block: int, *, depth: int = 6, reuse: float = 0.7
) -> Trace:
    """Requests that walk a random tree of block ids (prefix-consistent by construction);
    each goes down ``1..depth`` levels, following an existing child with probability
    ``reuse``; the last block is partial."""
    children: dict[int, list[int]] = {-1: []}
    next_id = 0
    out = []
    for index in range(requests):
        path, node = [], -1
        for _level in range(rng.randint(1, depth)):
            kids = children[node]
            if kids and rng.random() < reuse:
                node = rng.choice(kids)
            else:
                node, next_id = next_id, next_id + 1
                kids.append(node)
                children[node] = []
            path.append(node)
        length = (len(path) - 1) * block + rng.randint(1, block)
        out.append(TraceRequest(index, length, 0, tuple(path)))
    return Trace("random", block, tuple(out))
