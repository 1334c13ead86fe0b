"""``hicache-store gc``: the pure planner, then a real run against SeaweedFS."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from hicache_store.backends import open_backend
from hicache_store.commands.gc import Entry, collect_garbage, parse_duration, plan_gc, run

from .seaweed import SeaweedServer


def test_parse_duration() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("30m") == 1800
    assert parse_duration("7d") == 7 * 86400
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")


def test_plan_expires_then_drops_whole_pages_tails_first() -> None:
    # Page "aa" written first (t=100), chain b0 -> b1 -> b2 at t=200, page "cc" at t=300;
    # one object older than the max age.
    entries = [
        Entry("aa_ns_L0-1", 10, 100.0),
        Entry("aa_ns_L2-3", 10, 100.1),
        Entry("b0_ns", 10, 200.1),
        Entry("b1_ns", 10, 200.2),
        Entry("b2_ns", 10, 200.3),
        Entry("cc_ns", 10, 300.0),
        Entry("dd_ns", 10, 1.0),
    ]
    parents = {"b1": "b0", "b2": "b1"}
    expired, over = plan_gc(entries, now=1000.0, max_bytes=40, max_age=950, parents=parents)
    assert [e.key for e in expired] == ["dd_ns"]
    # 60 bytes left, budget 40: page aa (both objects) goes first, whole.
    assert [e.key for e in over] == ["aa_ns_L0-1", "aa_ns_L2-3"]
    _, over = plan_gc(entries, now=1000.0, max_bytes=30, max_age=950, parents=parents)
    assert [e.key for e in over][2:] == ["b2_ns"], "the chain's tail goes before its head"
    assert plan_gc(entries, now=1000.0, max_bytes=None, max_age=None) == ([], [])


def test_plan_never_holes_a_chain_whatever_the_write_times() -> None:
    # b1 is the oldest object, but it sits in the middle of b0 -> b1 -> b2: by age alone it
    # would go first and hole the chain. With the parent links, b2 goes, then b1, then b0.
    entries = [
        Entry("b0_ns", 10, 500.0),
        Entry("b1_ns", 10, 100.0),
        Entry("b2_ns", 10, 600.0),
        Entry("M_0123456789abcdef", 10, 1.0),
    ]
    parents = {"b1": "b0", "b2": "b1", "b0": None}
    _, over = plan_gc(entries, now=1000.0, max_bytes=20, max_age=None, parents=parents)
    assert [e.key for e in over] == ["b2_ns"]
    _, over = plan_gc(entries, now=1000.0, max_bytes=0, max_age=None, parents=parents)
    assert [e.key for e in over] == ["b2_ns", "b1_ns", "b0_ns"], "manifests are never deleted"
    # Age: b1 is expired but its child b2 is fresh, so b1 stays (no hole).
    expired, _ = plan_gc(entries, now=1000.0, max_bytes=None, max_age=450, parents=parents)
    assert expired == []


async def test_gc_on_a_memory_backend_uses_list_and_stat() -> None:
    store = open_backend("memory://")
    await store.put(["a0", "a1", "a2"], [b"x" * 100] * 3)
    report = await collect_garbage(store, max_bytes=150, max_age=None, now=0.0)
    assert report.over_budget == 2
    assert report.scanned == 3
    assert sum(await store.exists(["a0", "a1", "a2"])) == 1
    await store.close()


@pytest.mark.s3
async def test_gc_against_seaweedfs(
    seaweed: SeaweedServer,
    s3_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = open_backend(f"s3://{seaweed.bucket}/{s3_prefix}", **seaweed.options)
    keys = [f"{i:02x}_0a" for i in range(10)]
    await store.put(keys, [b"y" * 1000] * 10)
    dry = await collect_garbage(store, max_bytes=4000, max_age=None, dry_run=True)
    assert (dry.scanned, dry.over_budget, dry.deleted_bytes) == (10, 6, 6000)
    assert await store.exists(keys) == [True] * 10
    done = await collect_garbage(store, max_bytes=4000, max_age=None)
    assert done.failures == 0
    assert sum(await store.exists(keys)) == 4
    await store.close()
    # The CLI entry point, with credentials from the environment (boto3's chain).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    url = f"s3://{seaweed.bucket}/{s3_prefix}?endpoint_url={seaweed.endpoint_url}&region=us-east-1"
    args = argparse.Namespace(url=url, max_bytes="0", max_age=None, prefix="", dry_run=False)
    assert await asyncio.to_thread(run, args) == 0
    assert "deleted 0 expired and 4 over budget" in capsys.readouterr().out
