"""``gc`` and ``inspect`` streaming over real S3 listings (SeaweedFS): several listing pages
(1,000 keys each), chains kept prefixes, the commands as an operator runs them."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from hicache_store.backends import open_backend
from hicache_store.backends.s3 import S3Backend
from hicache_store.commands.gc import parse_duration, run
from hicache_store.layout.keys import format_key, parse_key
from hicache_store.ops.gc import collect_garbage
from hicache_store.ops.inspection import inspect_store
from hicache_store.testing.chains import (
    CHAIN_OBJECT_BYTES,
    chain_objects,
    chains_are_prefixes,
    write_chains,
)

from .seaweed import SeaweedServer

pytestmark = pytest.mark.s3


def test_parse_duration() -> None:
    assert parse_duration("90s") == 90
    assert parse_duration("30m") == parse_duration("30min") == 1800
    assert parse_duration("7d") == 7 * 86400
    with pytest.raises(ValueError, match="duration"):
        parse_duration("soon")
    with pytest.raises(ValueError, match="give a unit: 90d, 90h, 90min or 90s"):
        parse_duration("90")


@pytest.mark.slow
async def test_gc_streams_the_listing_and_keeps_chains_prefixes(
    seaweed: SeaweedServer, s3_prefix: str, tmp_path: Path,
) -> None:
    store = open_backend(f"s3://{seaweed.bucket}/{s3_prefix}", **seaweed.options)
    assert isinstance(store, S3Backend)
    chains = await write_chains(store, 11, 50)  # 550 pages, 1,100 objects: 2 listing pages
    page_bytes = 2 * CHAIN_OBJECT_BYTES
    budget = 400 * page_bytes
    before = store.s3_stats.requests
    dry = await collect_garbage(store, max_bytes=budget, max_age=None, dry_run=True,
                                state_dir=tmp_path / "state")
    assert (dry.scanned, dry.pages, dry.over_budget_pages) == (1100, 550, 150)
    assert dry.undated == 0, "S3 listings carry LastModified"
    # 2 listing requests, one ranged GET per page header, nothing else (no HEAD per object).
    assert store.s3_stats.requests - before == 2 + 550
    done = await collect_garbage(store, max_bytes=budget, max_age=None,
                                 state_dir=tmp_path / "state")
    assert done.deleted == 300 and done.failures == 0 and done.headers_read == 0
    left = {st.key.split("_")[0] async for st in store.list_entries()}
    assert len(left) == 400 and chains_are_prefixes(left, chains)
    # An age no page reaches deletes nothing, and reads no header.
    fresh = await collect_garbage(store, max_bytes=None, max_age=3600.0)
    assert (fresh.doomed, fresh.headers_read) == (0, 0)
    await store.close()


@pytest.mark.slow
async def test_inspect_and_verify_over_s3(seaweed: SeaweedServer, s3_prefix: str) -> None:
    store = open_backend(f"s3://{seaweed.bucket}/{s3_prefix}", **seaweed.options)
    chains = await write_chains(store, 2, 260)  # 1,040 objects: 2 listing pages
    report = await inspect_store(store, verify=True, concurrency=8)
    (ns,) = report.namespaces
    assert (ns.objects, ns.pages, ns.bytes) == (1040, 520, 1040 * CHAIN_OBJECT_BYTES)
    assert report.verify is not None and report.verify.ok == 1040
    assert report.verify.bytes_read == 1040 * CHAIN_OBJECT_BYTES
    # One flipped bit in one stored object: found, named, and deleted on request.
    victim = next(iter(chain_objects(chains[1])))
    data = bytearray((await store.get_bytes(victim)) or b"")
    data[-1] ^= 1
    await store.put([victim], [bytes(data)])
    found = await inspect_store(store, verify=True, delete_corrupt=True)
    assert found.verify is not None and found.verify.corrupt == 1
    assert found.verify.corrupt_examples[0]["key"] == victim
    assert found.verify.deleted == 1 and (await store.exists([victim])) == [False]
    assert format_key(parse_key(victim)) == victim
    await store.close()


async def test_the_gc_command_against_seaweedfs(
    seaweed: SeaweedServer, s3_prefix: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    store = open_backend(f"s3://{seaweed.bucket}/{s3_prefix}", **seaweed.options)
    await write_chains(store, 2, 5)
    await store.close()
    # The CLI entry point, with credentials from the environment (boto3's chain).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = f"s3://{seaweed.bucket}/{s3_prefix}?endpoint_url={seaweed.endpoint_url}&region=us-east-1"
    args = argparse.Namespace(url=url, max_bytes="0B", max_age=None, prefix="", dry_run=False,
                              state_dir=None, json=True, no_progress=True, yes=True)
    assert await asyncio.to_thread(run, args) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["deleted"], report["over_budget_pages"], report["failures"]) == (20, 10, 0)
    assert list((tmp_path / "cache" / "hicache-store" / "gc").iterdir()), "the state's home"
