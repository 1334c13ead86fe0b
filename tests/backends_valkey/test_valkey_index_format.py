"""The Valkey index's stored format: ranks kept in buckets, their merged order, and an index
written by the previous version (one rank set of every page) migrated at open."""

from __future__ import annotations

import secrets
import time
from collections import defaultdict
from typing import Any

import pytest

from hicache_store.backends import Retention
from hicache_store.backends._valkey_index import ValkeyIndex
from hicache_store.backends._valkey_keys import pack
from hicache_store.backends._valkey_scripts import FORMAT
from hicache_store.backends.errors import BackendError
from hicache_store.testing.index import MemorySite, put

from .valkey_server import ValkeyServer


def _open(valkey: ValkeyServer, root: str, site: MemorySite, **options: Any) -> ValkeyIndex:
    return ValkeyIndex(valkey.url, root, site, writer=secrets.token_hex(8), **options)


def _ranks(valkey: ValkeyServer, root: str) -> dict[bytes, float]:
    """Every page's rank, read from the bucket rank sets."""
    client = valkey.client()
    out: dict[bytes, float] = {}
    for name in client.scan_iter(f"hc:{{{root}}}:R:*", count=1000):
        out.update(dict(client.zrange(name, 0, -1, withscores=True)))
    return out


def _bucket_groups(groups: int, count: int) -> list[list[str]]:
    """``groups`` lists of ``count`` keys, the pages of each list in one bucket (the first two
    bytes of the fingerprint), each list's bucket its own."""
    seen: dict[bytes, list[str]] = defaultdict(list)
    full: list[list[str]] = []
    for i in range(1_000_000):
        found = seen[pack(f"k{i}").fp[:2]]
        found.append(f"k{i}")
        if len(found) == count:
            full.append(found)
            if len(full) == groups:
                return full
    raise AssertionError("unreachable: a million keys in 65,536 buckets")


def _later() -> None:
    time.sleep(0.003)  # calls at least a millisecond apart rank apart


def test_eviction_merges_the_buckets_in_rank_order(valkey: ValkeyServer) -> None:
    """Pages of two buckets put alternately: eviction takes the least recent pages wherever
    their buckets are, several in one step, and a read moves a page to the end of the line."""
    site = MemorySite()
    index = _open(valkey, secrets.token_hex(8), site)
    try:
        (a0, a1, a2), (b0, b1, b2) = _bucket_groups(2, 3)
        for key in (a0, b0, a1, b1, a2, b2):
            put(index, site, [key], capacity=600)
            _later()
        index.touch([a0])  # now the most recent
        index.flush_touches()
        _later()
        put(index, site, ["n0", "n1", "n2"], capacity=600)  # room for three in one step
        assert index.exists([b0, a1, b1]) == [False, False, False]
        assert index.exists([a2, b2, a0]) == [True, True, True]
        expected = [a2, b2, a0]
        for n in range(3):
            _later()
            put(index, site, [f"m{n}"], capacity=600)  # room for one: the least recent goes
            assert index.exists(expected) == [i > n for i in range(3)], n
    finally:
        index.close()


def _downgrade(valkey: ValkeyServer, root: str) -> None:
    """Turn an index into what the previous version stored: every page's rank in one set
    ``R``, no bucket rank sets, no format field."""
    client = valkey.client()
    prefix = f"hc:{{{root}}}:"
    for name in list(client.scan_iter(f"{prefix}R:*", count=1000)):
        ranked = client.zrange(name, 0, -1, withscores=True)
        client.zadd(f"{prefix}R", dict(ranked))
        client.delete(name)
    client.delete(f"{prefix}RB")
    client.hdel(f"{prefix}M", "format")


def test_an_index_of_the_previous_format_is_migrated_at_open(valkey: ValkeyServer) -> None:
    root = secrets.token_hex(8)
    site = MemorySite()
    index = _open(valkey, root, site)
    try:
        for key in ("a0", "b0", "c0", "d0"):
            put(index, site, [key], capacity=400)
            _later()
        index.retain(["a0"], Retention("pinner", None, pinned=True), pin_budget=100)
    finally:
        index.close()
    ranks = _ranks(valkey, root)
    assert len(ranks) == 4
    _downgrade(valkey, root)
    client = valkey.client()
    assert client.zcard(f"hc:{{{root}}}:R") == 4

    migrated = _open(valkey, root, site, lock_timeout=10.0)
    try:
        assert client.hget(f"hc:{{{root}}}:M", "format") == str(FORMAT).encode()
        assert not client.exists(f"hc:{{{root}}}:R")
        assert _ranks(valkey, root) == ranks  # the eviction order is kept
        assert migrated.totals() == (400, 4)
        assert [r.owner for r in migrated.retention_of(["a0"])[0]] == ["pinner"]
        put(migrated, site, ["e0"], capacity=400)  # a0 is pinned: b0, the next, goes
        assert migrated.exists(["a0", "b0", "c0", "d0", "e0"]) == [True, False, True, True, True]
        assert migrated.listing()[1] == ["a0", "c0", "d0", "e0"]
    finally:
        migrated.close()


def test_an_index_of_a_later_format_is_refused(valkey: ValkeyServer) -> None:
    root = secrets.token_hex(8)
    site = MemorySite()
    _open(valkey, root, site).close()
    valkey.client().hset(f"hc:{{{root}}}:M", "format", str(FORMAT + 1))
    with pytest.raises(BackendError, match="later version of hicache-store"):
        _open(valkey, root, site)
