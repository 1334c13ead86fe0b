"""The token synthesizer: deterministic per id, prefix-consistent, and the page-hash chain over
its tokens shares exactly what the trace's block ids share."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from _trace_helpers import random_tree_trace

from hicache_store.demo.bench.trace_format import TraceRequest, read_trace
from hicache_store.demo.bench.trace_tokens import blocks_tokens, request_tokens
from hicache_store.layout.hashing import page_hashes

TRACES = Path(__file__).resolve().parents[2] / "bench" / "traces"


def test_same_id_same_tokens_different_ids_differ() -> None:
    a = blocks_tokens([3, 9], 512)
    assert a.dtype == np.uint32
    assert a.shape == (1024,)
    assert np.array_equal(a[512:], blocks_tokens([9], 512))  # position in the request is moot
    assert np.array_equal(a, blocks_tokens([3, 9], 512))  # and so is the call
    assert not np.array_equal(a[:512], a[512:])
    assert np.count_nonzero(a[:512] == a[512:]) < 5  # unrelated streams, not shifted copies
    assert not np.array_equal(blocks_tokens([3], 512, seed=1), a[:512])
    small = blocks_tokens(range(50), 64, vocab_size=1000)
    assert small.max() < 1000
    assert len(np.unique(small)) > 900  # spread over the vocabulary


def test_request_tokens_cut_at_input_length_partial_block_is_a_prefix() -> None:
    full = request_tokens(TraceRequest(0, 1024, 0, (4, 5)), 512)
    partial = request_tokens(TraceRequest(0, 700, 0, (4, 5)), 512)
    assert len(full) == 1024
    assert len(partial) == 700
    assert np.array_equal(partial, full[:700])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        blocks_tokens([1], 0)
    with pytest.raises(ValueError, match="vocab_size"):
        blocks_tokens([1], 8, vocab_size=1)


def common_prefix(a: list[str] | tuple[int, ...], b: list[str] | tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("page", [8, 16, 64])
def test_page_hash_chain_shares_exactly_what_the_ids_share(page: int) -> None:
    block = 64
    rng = random.Random(page)
    reqs = random_tree_trace(rng, 60, block).requests
    hashes = [page_hashes(request_tokens(r, block), page) for r in reqs]
    for r, h in zip(reqs, hashes, strict=True):
        assert len(h) == r.input_length // page
    for i in range(len(reqs)):
        for j in range(i + 1, len(reqs)):
            a, b = reqs[i], reqs[j]
            shared_blocks = common_prefix(a.hash_ids, b.hash_ids)
            shared_tokens = min(shared_blocks * block, a.input_length, b.input_length)
            assert common_prefix(hashes[i], hashes[j]) == shared_tokens // page, (a, b)


def test_real_trace_pages_map_one_to_one_onto_block_ids() -> None:
    """Over the first 400 conversation requests at 64-token pages, every page hash stands for
    exactly one (block id, page within block) and vice versa: the replay's page-hash chain is
    the trace's block chain, refined."""
    trace = read_trace(TRACES / "mooncake_conversation_trace.jsonl.gz")
    page = 64
    per_block = trace.block_tokens // page
    by_hash: dict[str, tuple[int, int]] = {}
    by_block_page: dict[tuple[int, int], str] = {}
    for request in trace.requests[:400]:
        hashes = page_hashes(request_tokens(request, trace.block_tokens), page)
        for index, digest in enumerate(hashes):
            where = (request.hash_ids[index // per_block], index % per_block)
            assert by_hash.setdefault(digest, where) == where
            assert by_block_page.setdefault(where, digest) == digest
    assert len(by_hash) == len(by_block_page) > 10_000
