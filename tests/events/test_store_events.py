"""Store-wide KV events from a file store's named change feed: a subscriber that keeps the set
of stored pages from the events alone ends with exactly the pages the store lists, whoever
wrote, evicted or deleted them; also across a pruned feed, a feed written without names, and
(with real processes: two writers, one evicting, gc, the ``events`` command) end to end."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _kv_subscriber import Batch, Subscriber

from hicache_store.backends import BackendUnavailableError, open_backend
from hicache_store.backends.base import Backend
from hicache_store.backends.errors import NotSupportedError
from hicache_store.backends.file import FileBackend
from hicache_store.events.publisher import EventPublisher, PublisherConfig
from hicache_store.events.store import StoreEvents
from hicache_store.layout.keys import object_key_parts

sys.path.insert(0, str(Path(__file__).parent))
import store_writer

WRITER = Path(__file__).parent / "store_writer.py"


def listed_pages(backend: Backend) -> set[bytes]:
    async def keys() -> list[str]:
        return [k async for k in backend.list_prefix("")]

    pages = set()
    for key in asyncio.run(keys()):
        parts = object_key_parts(key)
        if parts is not None and parts[1] == store_writer.DIGEST:
            pages.add(bytes.fromhex(parts[0]))
    return pages


def pages_from(batches: list[Batch]) -> tuple[set[bytes], int, int]:
    """The stored set the events describe, and how many pages were stored / removed."""
    held: set[bytes] = set()
    stored = removed = 0
    for _, batch in batches:
        for event in batch[1]:
            if event["type"] == "AllBlocksCleared":  # a publisher's start
                held.clear()
                continue
            assert event["medium"] == "STORAGE"
            if event["type"] == "BlockStored":
                assert event["token_ids"] == [] and event["parent_block_hash"] is None
                held.update(event["block_hashes"])
                stored += len(event["block_hashes"])
            else:
                assert event["type"] == "BlockRemoved"
                held.difference_update(event["block_hashes"])
                removed += len(event["block_hashes"])
    return held, stored, removed


def replayed(publisher: EventPublisher) -> list[Batch]:
    assert publisher.drain()
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        batches = sub.replay(0)
    finally:
        sub.close()
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    return batches


def put_pages(backend: Backend, pages: range, size: int = 1000) -> None:
    keys = [store_writer.key(i, g) for i in pages for g in range(store_writer.GROUPS)]
    asyncio.run(backend.put(keys, [os.urandom(size) for _ in keys]))


def test_events_follow_every_process_puts_evictions_and_deletes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    # Two handles on one root: the watcher's and another writer's (as another process).
    one = open_backend(f"file://{root}?capacity_bytes=60000")
    other = open_backend(f"file://{root}?capacity_bytes=60000")
    assert isinstance(one, FileBackend)
    publisher = EventPublisher(PublisherConfig(f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r",
                                               history=100_000))
    watcher = StoreEvents(one, publisher)
    try:
        put_pages(one, range(5))
        watcher.poll()  # the whole store at start, after clearing what came before
        first = replayed(publisher)[0][1][1]
        assert first[0] == {"type": "AllBlocksCleared"} and len(first) == 2
        put_pages(other, range(5, 20))  # 40 objects of 1000 bytes
        watcher.poll()
        put_pages(other, range(20, 40))  # past the bound: the oldest are evicted
        asyncio.run(one.delete([store_writer.key(30, 0)]))  # one object of a page: it stays
        asyncio.run(other.delete([store_writer.key(31, g) for g in range(2)]))  # page gone
        watcher.poll()
        assert other.stats.evictions > 0
        held, stored, removed = pages_from(replayed(publisher))
        assert held == listed_pages(one)
        assert bytes.fromhex(store_writer.page_hash(30)) in held
        assert bytes.fromhex(store_writer.page_hash(31)) not in held
        # 40 pages written; page 31 came and went within one look: it is not reported.
        assert removed > 0 and stored == 39
        assert watcher.resyncs == 1  # the start only: every later change was named
        # A compaction prunes the feed: the watcher lists the store and sends the difference.
        put_pages(other, range(40, 45))
        assert one.change_feed().compact()
        put_pages(one, range(45, 48))
        watcher.poll()
        assert watcher.resyncs == 2
        assert pages_from(replayed(publisher))[0] == listed_pages(one)
        # Rows that do not name their changes (written before the feed named them): the same.
        put_pages(other, range(48, 52))
        with sqlite3.connect(root / "index" / "index.sqlite3") as con:
            con.execute("UPDATE feed SET keys = NULL")
        watcher.poll()
        assert watcher.resyncs == 3
        assert pages_from(replayed(publisher))[0] == listed_pages(one)
    finally:
        publisher.close()
        asyncio.run(one.close())
        asyncio.run(other.close())


def test_a_store_without_its_index_cannot_report(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path}?index=none")
    assert isinstance(backend, FileBackend)
    with pytest.raises(NotSupportedError, match="index=none"):
        backend.change_feed()
    asyncio.run(backend.close())


def _start(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


@pytest.mark.slow
def test_end_to_end_with_real_processes_the_subscriber_set_equals_the_listing(
        tmp_path: Path) -> None:
    root = tmp_path / "store"
    url = f"file://{root}"
    asyncio.run(open_backend(url).close())  # an empty store: the command opens existing ones
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    events = _start([sys.executable, "-m", "hicache_store", "events", url, "--namespace",
                     store_writer.DIGEST, "--pub", pub, "--replay", replay,
                     "--history", "1000000", "--interval", "0.02"])
    try:
        assert events.stdout is not None
        first = events.stdout.readline()
        assert first.startswith("publishing ipc://"), first + (events.stderr.read()
                                                               if events.stderr else "")
        sub = Subscriber(pub, replay)
        time.sleep(0.5)
        capacity = 150_000
        writers = [
            _start([sys.executable, str(WRITER), str(root), str(seed), "400", str(capacity),
                    str(size)])
            for seed, size in ((1, 700), (2, 900), (3, 4000))  # the third evicts the most
        ]
        results = []
        for writer in writers:
            out, err = writer.communicate(timeout=300)
            assert writer.returncode == 0, err
            results.append([int(x) for x in out.split()[1:]])
        backend = open_backend(url)
        before_gc = len(listed_pages(backend))
        asyncio.run(backend.close())
        gc = subprocess.run(
            [sys.executable, "-m", "hicache_store", "gc", url, "--max-bytes", "60000B", "--yes",
             "--state-dir", str(tmp_path / "gc"), "--no-progress"], check=False,
            capture_output=True, text=True, timeout=300)
        assert gc.returncode == 0, gc.stderr
        backend = open_backend(url)
        listing = listed_pages(backend)
        asyncio.run(backend.close())
        # The store is still now: the subscriber's set must converge to the listing exactly.
        live: dict[int, list[Any]] = {}
        deadline = time.monotonic() + 60
        while True:
            while (got := sub.recv(0.5)) is not None:
                live[got[0]] = got[1]
            for seq, batch in sub.replay(0):  # whatever the subscription missed at the start
                live.setdefault(seq, batch)
            batches = [(s, live[s]) for s in sorted(live)]
            assert [s for s, _ in batches] == list(range(len(batches)))
            held, stored, removed = pages_from(batches)
            if held == listing or time.monotonic() > deadline:
                break
        sub.close()
    finally:
        events.terminate()  # SIGTERM: a clean stop
        events.wait(30)
    evictions = sum(r[2] for r in results)
    print(f"\nstore-wide events: writers {results} (puts, deletes, evictions); gc: {before_gc} -> "
          f"{len(listing)} pages (60000 bytes); {len(batches)} batches, {stored} pages stored, {removed} removed; "
          f"subscriber {len(held)} pages, listing {len(listing)} pages")
    assert held == listing, (len(held - listing), len(listing - held))
    assert evictions > 0 and removed > 0 and 0 < len(listing) < before_gc
    assert events.returncode == 0


def test_the_command_refuses_what_it_cannot_serve_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "store"
    asyncio.run(open_backend(f"file://{root}").close())
    cases = {
        f"file://{root}?index=none": "index=none",  # no index, no change feed
        f"file://{tmp_path}/absent": "no hicache-store store",
    }
    for url, expected in cases.items():
        result = subprocess.run(
            [sys.executable, "-m", "hicache_store", "events", url, "--pub",
             f"ipc://{tmp_path}/p"], capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode != 0 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "hicache_store", "events", f"file://{root}", "--pub",
         "http://127.0.0.1:1"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "not a tcp://" in result.stderr


VIEW_SUBSCRIBER = Path(__file__).parent / "view_subscriber.py"


def _view(path: Path) -> tuple[set[bytes], int] | None:
    """A view the subscriber process wrote: (pages, last sequence number applied)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    return {bytes.fromhex(line) for line in lines[:-1]}, int(lines[-1].split()[1])


def _events_command(url: str, pub: str, replay: str) -> subprocess.Popen[str]:
    events = _start([sys.executable, "-m", "hicache_store", "events", url, "--namespace",
                     store_writer.DIGEST, "--pub", pub, "--replay", replay,
                     "--interval", "0.02"])
    assert events.stdout is not None
    first = events.stdout.readline()
    assert first.startswith("publishing ipc://"), first + (events.stderr.read()
                                                           if events.stderr else "")
    return events


def _until_view_is(path: Path, want: set[bytes], after_seq: int | None = None,
                   timeout_s: float = 120) -> tuple[set[bytes], int]:
    """The subscriber's view once it equals ``want`` (with a batch numbered below
    ``after_seq`` applied since, when given), or the last one seen past ``timeout_s``: a hang
    detector; the assertion on the view is the caller's."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = _view(path)
        if got is not None and got[0] == want and (after_seq is None or got[1] < after_seq):
            return got
        if time.monotonic() > deadline:
            return got or (set(), -1)
        time.sleep(0.05)


def test_a_subscriber_that_keeps_its_view_across_a_restart_of_the_events_process(
        tmp_path: Path) -> None:
    """Pages removed while the ``events`` process was down leave the view of a subscriber
    process that kept it: the restarted publisher's first batch clears, then lists."""
    root = tmp_path / "store"
    url = f"file://{root}"
    backend = open_backend(f"{url}?capacity_bytes=10000000")
    put_pages(backend, range(40))
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    out, stop = tmp_path / "view", tmp_path / "stop"
    subscriber = _start([sys.executable, str(VIEW_SUBSCRIBER), pub, replay, str(out),
                         str(stop)])
    events = _events_command(url, pub, replay)
    try:
        time.sleep(0.5)  # the subscription reaches the publisher (a later one replays anyway)
        for start in range(40, 80, 4):  # batches numbered past those of the next run
            put_pages(backend, range(start, start + 4))
            time.sleep(0.1)
        before, last = _until_view_is(out, listed_pages(backend))
        assert before == listed_pages(backend) and len(before) == 80
        events.terminate()
        assert events.wait(60) == 0
        # while no publisher runs: 35 pages go, 5 come
        asyncio.run(backend.delete([store_writer.key(i, g) for i in range(10, 45)
                                    for g in range(store_writer.GROUPS)]))
        put_pages(backend, range(80, 85))
        events = _events_command(url, pub, replay)
        time.sleep(0.5)
        put_pages(backend, range(85, 87))  # later batches: the subscriber sees the restart
        listing = listed_pages(backend)
        after, seq = _until_view_is(out, listing, after_seq=last)
        kept = after - listing
        assert after == listing, f"{len(kept)} pages removed while the publisher was down kept"
        assert seq < last and len(listing) == 80 - 35 + 7
    finally:
        stop.touch()
        events.terminate()
        events.wait(60)
        subscriber.wait(60)
        asyncio.run(backend.close())
    assert subscriber.returncode == 0, subscriber.stderr.read() if subscriber.stderr else ""


def test_a_failing_feed_is_logged_once_per_outage(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A look at the feed every 50 ms while the index cannot answer (a fleet's server down for
    a while) is one log record with its traceback, and one when it answers again: a line per
    look filled the log (and blocked an events process whose stderr was a pipe)."""
    import logging
    import threading

    from hicache_store.events.store import StoreEvents

    backend = open_backend(f"file://{tmp_path}/s")
    publisher = EventPublisher(PublisherConfig(f"ipc://{tmp_path}/p", f"ipc://{tmp_path}/r",
                                               bind=True))
    watcher = StoreEvents(backend, publisher)
    polls = {"n": 0}
    stop = threading.Event()

    def poll() -> int:
        polls["n"] += 1
        if polls["n"] <= 20:
            raise BackendUnavailableError("down", backend="index", operation="changes_after")
        if polls["n"] >= 25:
            stop.set()
        return 0

    watcher.poll = poll  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="hicache_store.events.store")
    try:
        watcher.run(stop, interval_s=0.001)
    finally:
        publisher.close()
        asyncio.run(backend.close())
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "failed" in messages[0] and "answers again (20 looks failed)" in messages[1]
