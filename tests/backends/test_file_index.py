"""The file backend's shared index: opening, visibility across processes, eviction order,
repairs, snapshots, upgrades and the read policy (see ``backends/_file_index.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from file_audit import audit, snapshot_files

from hicache_store.backends import BackendClosedError, BackendUnavailableError, aligned_buffer
from hicache_store.backends import _file_index as index_module
from hicache_store.backends import _file_index_db as index_db
from hicache_store.backends import _file_index_membership as membership
from hicache_store.backends import _file_index_recovery as recovery
from hicache_store.backends._file_io import PosixEngine
from hicache_store.backends._pagecache import is_cached
from hicache_store.backends.file import FileBackend
from hicache_store.testing import pattern

WRITE_IN_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from hicache_store.backends.file import FileBackend

    async def main(root, keys):
        store = FileBackend(root, durability="none")
        await store.put(keys, [k.encode() * 3 for k in keys])
        await store.close()

    asyncio.run(main(sys.argv[1], sys.argv[2:]))
    """
)


def write_in_child(root: Path, keys: list[str]) -> None:
    subprocess.run([sys.executable, "-c", WRITE_IN_CHILD, str(root), *keys], check=True)


async def test_another_process_writes_are_found_without_a_stat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileBackend(tmp_path / "s", durability="none")
    await store.put(["a0"], [b"mine"])
    assert await store.exists(["a0", "b0", "b1"]) == [True, False, False]
    write_in_child(tmp_path / "s", ["b0", "b1"])

    real_stat = os.stat

    def no_stat(path: object, *args: object, **kwargs: object) -> object:
        if str(path).endswith((index_module.DB_NAME, "host.json")):  # the index's 1 s checks
            return real_stat(path, *args, **kwargs)  # type: ignore[call-overload]
        raise AssertionError("exists must not stat an object")

    monkeypatch.setattr(os, "stat", no_stat)
    assert await store.exists(["a0", "b0", "b1", "b2"]) == [True, True, True, False]
    monkeypatch.undo()
    assert await store.get_bytes("b1") == b"b1" * 3
    assert store.used_bytes == len(b"mine") + 2 * len(b"b0b0b0")
    await store.close()
    assert audit(tmp_path / "s").ok


async def test_open_reads_no_object_and_holds_no_object_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileBackend(tmp_path / "s", durability="none")
    keys = [f"e{i:05d}" for i in range(3000)]
    for s in range(0, len(keys), 500):
        await store.put(keys[s : s + 500], [b"x"] * 500)
    await store.close()

    real_scandir = os.scandir

    def no_scan(path: str, *args: object, **kwargs: object) -> object:
        if "objects" in str(path):
            raise AssertionError("open must not list objects/")
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", no_scan)
    again = FileBackend(tmp_path / "s", durability="none")
    monkeypatch.undo()
    assert await again.exists(keys[::100]) == [True] * 30
    assert again.used_bytes == 3000
    assert [k async for k in again.list_prefix("e0299")] == [f"e0299{i}" for i in range(10)]
    await again.close()


async def test_a_file_removed_behind_the_index_is_a_miss_that_fixes_it(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s")
    await store.put(["a0", "a1"], [b"x" * 10, b"y" * 20])
    store.path_of("a1").unlink()
    assert await store.exists(["a1"]) == [True]  # the index trusts what it was told
    assert await store.get_into(["a1"], [bytearray(20)]) == [None]
    assert await store.exists(["a0", "a1"]) == [True, False]
    assert store.used_bytes == 10
    await store.close()
    assert audit(tmp_path / "s").ok


async def test_adopt_indexes_files_placed_by_other_means(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s")
    path = store.path_of("c0")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"restored")
    assert await store.exists(["c0"]) == [False]
    assert await store.adopt(["c0", "c1"]) == 1
    assert await store.exists(["c0", "c1"]) == [True, False]
    assert store.used_bytes == len(b"restored")
    await store.close()
    assert audit(tmp_path / "s").ok


async def test_a_version_1_root_is_indexed_once_at_its_first_open(tmp_path: Path) -> None:
    # What a root written before the index existed looks like: files and a v1 marker.
    root = tmp_path / "old"
    sizes = {f"{i:064x}": 100 + i for i in range(40)}
    for key, size in sizes.items():
        probe = FileBackend(tmp_path / "probe")  # only to compute the shard path
        rel = probe.path_of(key).relative_to(probe.root)
        await probe.close()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(pattern(size, 1))
    (root / "tmp").mkdir()
    (root / "layout.json").write_text(
        json.dumps({"format": "hicache-store/file", "version": 1, "shard_levels": 2}))
    store = FileBackend(root)
    assert store._index.rebuilt
    assert json.loads((root / "layout.json").read_text())["version"] == 2
    assert await store.exists(list(sizes)) == [True] * 40
    assert store.used_bytes == sum(sizes.values())
    assert sorted([k async for k in store.list_prefix("")]) == sorted(sizes)
    await store.close()
    assert audit(root).ok
    again = FileBackend(root)
    assert not again._index.rebuilt
    await again.close()


async def test_a_removed_index_is_rebuilt_from_the_files(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s")
    await store.put(["a0", "a1"], [b"x", b"yy"])
    await store.close()
    for name in os.listdir(tmp_path / "s" / "index"):
        os.unlink(tmp_path / "s" / "index" / name)
    again = FileBackend(tmp_path / "s")
    assert again._index.rebuilt and await again.exists(["a0", "a1"]) == [True, True]
    assert again.used_bytes == 3
    await again.close()


async def test_a_rebuilt_index_sees_what_another_process_writes_next(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s", durability="none")
    await store.put(["a0"], [b"x"])
    await store.close()
    for name in os.listdir(tmp_path / "s" / "index"):
        os.unlink(tmp_path / "s" / "index" / name)
    (tmp_path / "s" / "index" / "fp-0000000000000001.u64.1-dead.tmp").write_bytes(b"")
    os.utime(tmp_path / "s" / "index" / "fp-0000000000000001.u64.1-dead.tmp", (0, 0))
    rebuilt = FileBackend(tmp_path / "s", durability="none")
    assert rebuilt._index.rebuilt
    write_in_child(tmp_path / "s", ["b0"])
    assert await rebuilt.exists(["a0", "b0", "c0"]) == [True, True, False]
    fresh = FileBackend(tmp_path / "s", durability="none")
    assert await fresh.exists(["a0", "b0", "c0"]) == [True, True, False]
    assert [n for n in snapshot_files(tmp_path / "s") if n.endswith(".tmp")] == [], \
        "a killed compactor's temp file was left"
    await rebuilt.close()
    await fresh.close()
    assert audit(tmp_path / "s").ok


async def test_a_process_follows_its_index_when_it_is_removed_and_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """index/ removed while a process has it open (what the message of an unreadable index
    tells an operator to do), rebuilt by another opener that then writes: the process must
    see those writes, and its own must reach the index the others read. It used to go on
    with the removed file: blind to every later write of the others, and they to its own,
    for its lifetime."""
    monkeypatch.setattr(index_db, "REPLACED_CHECK_SECONDS", 0.0)
    root = tmp_path / "s"
    store = FileBackend(root, durability="none")
    await store.put(["a0"], [b"aaa"])
    assert await store.exists(["a0", "b0"]) == [True, False]
    shutil.rmtree(root / "index")
    write_in_child(root, ["b0"])  # rebuilds the index from the files, then writes b0
    await store.put(["a1"], [b"a11"])
    assert await store.exists(["a0", "a1", "b0"]) == [True, True, True]
    fresh = FileBackend(root, durability="none")
    assert not fresh._index.rebuilt
    assert await fresh.exists(["a0", "a1", "b0"]) == [True, True, True]
    assert fresh.used_bytes == store.used_bytes == 3 + 3 + len(b"b0b0b0")
    await fresh.close()
    await store.close()
    assert audit(root).ok


async def test_a_process_rebuilds_its_removed_index_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_db, "REPLACED_CHECK_SECONDS", 0.0)
    root = tmp_path / "s"
    store = FileBackend(root, durability="none")
    await store.put(["a0"], [b"aaa"])
    assert await store.exists(["a0"]) == [True]
    shutil.rmtree(root / "index")
    assert await store.exists(["a0", "a1"]) == [True, False]
    assert (root / "index" / index_module.DB_NAME).exists()
    await store.put(["a1"], [b"a11"])
    fresh = FileBackend(root, durability="none")
    assert not fresh._index.rebuilt, "the process rebuilt it: no second build"
    assert await fresh.exists(["a0", "a1"]) == [True, True] and fresh.used_bytes == 6
    await fresh.close()
    await store.close()
    assert audit(root).ok


async def test_snapshots_replace_the_change_feed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membership, "MIN_DELTA", 50)
    store = FileBackend(tmp_path / "s", durability="none")
    other = FileBackend(tmp_path / "s", durability="none")
    keys = [f"a{i:04d}" for i in range(400)]
    for s in range(0, 400, 40):
        await store.put(keys[s : s + 40], [b"v"] * 40)
        await asyncio.sleep(0)
    for _ in range(200):  # compaction runs on a background thread
        if snapshot_files(tmp_path / "s"):
            break
        await asyncio.sleep(0.02)
    assert snapshot_files(tmp_path / "s"), "no snapshot was written"
    await store.delete(keys[:10])
    assert await other.exists(keys) == [False] * 10 + [True] * 390
    assert await store.exists(["a9999"]) == [False]
    db = sqlite3.connect(tmp_path / "s" / "index" / "index.sqlite3")
    feed = db.execute("SELECT COALESCE(SUM(length(recs)), 0) / 9 FROM feed").fetchone()[0]
    db.close()
    assert feed < 400, "the feed was not pruned"
    await store.close()
    await other.close()
    assert audit(tmp_path / "s").ok


def _to_unpacked_feed(root: Path) -> int:
    """Rewrite the index's change feed as the code before the packed feed wrote it (a table
    ``changes``, one row per change, numbered per change); return how many rows it has."""
    from hicache_store.backends import _fingerprints as fpmod

    db = sqlite3.connect(root / "index" / "index.sqlite3", isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    db.execute("CREATE TABLE changes (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
               "fp INTEGER NOT NULL, present INTEGER NOT NULL)")
    rows: list[tuple[int, int, int]] = []
    for seq, recs in db.execute("SELECT seq, recs FROM feed ORDER BY seq").fetchall():
        changes = fpmod.decode_changes(recs)
        for i, (fp, present) in enumerate(changes.tolist()):
            signed = fp - (1 << 64) if fp >= 1 << 63 else fp
            rows.append((seq - len(changes) + 1 + i, signed, present))
    db.executemany("INSERT INTO changes VALUES (?, ?, ?)", rows)
    last = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'feed'").fetchone()[0]
    db.execute("DROP TABLE feed")
    db.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'changes'", (last,))
    db.execute("COMMIT")
    db.close()
    return len(rows)


async def test_an_index_with_the_unpacked_feed_is_converted_at_open(tmp_path: Path) -> None:
    """An index written before the feed was packed: its changes since the snapshot are found
    after the conversion, and new writes (another process's too) after it."""
    root = tmp_path / "s"
    store = FileBackend(root, durability="none")
    await store.put([f"a{i}" for i in range(20)], [b"v"] * 20)
    await store.delete(["a3", "a4"])
    await store.put(["a3"], [b"again"])
    await store.close()
    assert _to_unpacked_feed(root) == 20 + 2 + 1
    opened = FileBackend(root, durability="none")
    write_in_child(root, ["b0"])
    want = [i != 4 for i in range(20)]
    assert await opened.exists([f"a{i}" for i in range(20)]) == want
    assert await opened.exists(["b0", "b1"]) == [True, False]
    fresh = FileBackend(root, durability="none")
    assert await fresh.exists([f"a{i}" for i in range(20)] + ["b0"]) == [*want, True]
    db = sqlite3.connect(root / "index" / "index.sqlite3")
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    last = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'feed'").fetchone()[0]
    db.close()
    assert "changes" not in tables and "feed" in tables
    assert last == 20 + 2 + 1 + 1, "change numbers were not carried over"
    await opened.close()
    await fresh.close()
    assert audit(root).ok


async def test_eviction_is_chain_aware_across_processes(tmp_path: Path) -> None:
    size = 100_000
    first = FileBackend(tmp_path / "s", capacity_bytes=6 * size)
    chain = [f"c{i}" for i in range(4)]
    await first.put(chain, [pattern(size, i) for i in range(4)])
    await asyncio.sleep(0.01)
    second = FileBackend(tmp_path / "s", capacity_bytes=6 * size)
    await second.put(["d0", "d1", "d2"], [pattern(size, 9)] * 3)  # one must go: c3
    assert [first.path_of(k).exists() for k in chain] == [True, True, True, False]
    assert second.used_bytes == first.used_bytes == 6 * size
    assert await first.exists(chain) == [True, True, True, False]
    await first.close()
    await second.close()
    assert audit(tmp_path / "s").ok


def test_a_put_waits_for_an_earlier_put_in_flight_instead_of_failing(tmp_path: Path) -> None:
    """Two live callers' puts in flight fill the store (one rewrites a key, so its row cannot
    go either): the earlier put counts only its own bytes and goes on; the later one waits
    for it to settle, then evicts (it failed with ``CapacityError`` while both were in
    flight); it gives up after ``lock_timeout`` when the earlier put never settles."""
    import threading

    from hicache_store.backends import CapacityError

    first = FileBackend(tmp_path / "s", durability="none", capacity_bytes=100)
    second = FileBackend(tmp_path / "s", durability="none", capacity_bytes=100, lock_timeout=0.3)
    asyncio.run(first.put(["a"], [b"x" * 50]))
    early = first._index.reserve(["a", "b"], [60, 40], 100)  # +10 for a (busy), +40 for b
    late = second._index.reserve(["c"], [40], 100)
    assert first._index.make_room(100, early).evicted == 0  # 50 stored + 50: fits
    t0 = time.monotonic()
    with pytest.raises(CapacityError, match="no room"):
        second._index.make_room(100, late)  # the earlier put never settles within 0.3 s
    assert time.monotonic() - t0 >= 0.3

    def settle_early() -> None:
        time.sleep(0.1)
        for key, size in (("a", 60), ("b", 40)):
            first.path_of(key).parent.mkdir(parents=True, exist_ok=True)
            first.path_of(key).write_bytes(b"y" * size)
        first._index.settle_put(early)

    settler = threading.Thread(target=settle_early)
    settler.start()
    second._index.lock_timeout = 30.0
    assert second._index.make_room(100, late).evicted >= 1  # waited for it, then evicted
    settler.join()
    first.path_of("c").parent.mkdir(parents=True, exist_ok=True)
    first.path_of("c").write_bytes(b"z" * 40)
    second._index.settle_put(late)
    assert second.used_bytes <= 100
    asyncio.run(first.close())
    asyncio.run(second.close())
    assert audit(tmp_path / "s").ok


def test_a_reservation_that_fits_needs_no_room_and_one_that_does_not_gets_it(
    tmp_path: Path,
) -> None:
    """``reserve`` says whether the put and the puts before it fit (``fits``): then
    ``make_room`` returns at once and a put skips it; a later put counts the earlier ones'
    bytes, so the store fits once all settle. A put that does not fit evicts as before."""
    store = FileBackend(tmp_path / "s", durability="none", capacity_bytes=100)
    asyncio.run(store.put(["a"], [b"x" * 40]))
    early = store._index.reserve(["b"], [30], 100)  # 40 + 30: fits
    late = store._index.reserve(["c"], [40], 100)  # 40 + 30 (earlier, in flight) + 40: not
    assert early.fits and not late.fits
    assert store._index.make_room(100, early).evicted == 0
    for reservation, key, size in ((early, "b", 30), (late, "c", 40)):
        if not reservation.fits:
            assert store._index.make_room(100, reservation).evicted == 1  # "a", oldest
        store.path_of(key).parent.mkdir(parents=True, exist_ok=True)
        store.path_of(key).write_bytes(b"y" * size)
        store._index.settle_put(reservation)
    assert store.used_bytes == 70 <= 100
    # through the backend: puts that fit evict nothing, the one that does not evicts
    asyncio.run(store.put(["d"], [b"z" * 20]))  # 70 + 20
    assert store.stats.evictions == 0
    asyncio.run(store.put(["e"], [b"w" * 30]))  # 90 + 30: "b" goes
    assert store.stats.evictions == 1 and store.used_bytes <= 100
    asyncio.run(store.close())
    assert audit(tmp_path / "s").ok


async def test_a_key_busy_in_a_live_process_waits_then_fails(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s", lock_timeout=0.3)
    await store.put(["a0"], [b"x"])
    db = sqlite3.connect(tmp_path / "s" / "index" / "index.sqlite3")
    # A delete in flight in another live process (pid: ours; another owner token).
    db.execute("INSERT INTO pending VALUES ('a0', 'del', 0, ?, ?, 'other', 1, ?)",
               (os.getpid(), recovery.pid_namespace(), time.time()))
    db.commit()
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError):
        await store.put(["a0"], [b"y"])
    assert time.monotonic() - t0 >= 0.3
    # The same row from a process that is gone is settled at once.
    db.execute("UPDATE pending SET pid = 999999999")
    db.commit()
    db.close()
    await store.put(["a0"], [b"y"])
    assert await store.get_bytes("a0") == b"y"
    await store.close()
    assert audit(tmp_path / "s").ok


async def test_a_cancelled_put_settles_before_the_cancellation_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileBackend(tmp_path / "s", io_threads=2, io_engine="posix")  # a job per object
    engine = store._engine
    assert isinstance(engine, PosixEngine)
    real = engine.write_one
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow(key: str, view: memoryview, exclusive: bool) -> bool:
        loop.call_soon_threadsafe(started.set)
        time.sleep(0.3)
        return real(key, view, exclusive)

    monkeypatch.setattr(engine, "write_one", slow)
    data = bytearray(b"z" * 1000)
    task = asyncio.create_task(store.put(["a0", "a1"], [data, data]))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Returned: the writes are done, the index agrees with the files, nothing pending.
    data[:] = b"!" * 1000
    assert await store.get_bytes("a0") == b"z" * 1000
    assert audit(tmp_path / "s").ok
    await store.close()


async def test_warm_bytes_come_from_the_page_cache_and_cold_ones_do_not_fill_it(
    tmp_path: Path,
) -> None:
    store = FileBackend(tmp_path / "s", direct_io="auto")
    if not store.direct_io:
        pytest.skip("no O_DIRECT on the filesystem under tmp_path")
    size = 1 << 20
    src = aligned_buffer(size)
    src[:] = pattern(size, 5)
    await store.put(["a0"], [src])

    def cached() -> bool | None:
        fd = os.open(store.path_of("a0"), os.O_RDONLY)
        try:
            return is_cached(fd, 0, size)
        finally:
            os.close(fd)

    def drop_from_page_cache(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    if cached() is None:
        pytest.skip("the kernel has no cachestat (Linux < 6.5)")
    drop_from_page_cache(store.path_of("a0"))
    dst = aligned_buffer(size)
    assert await store.get_into(["a0"], [dst]) == [size] and bytes(dst) == bytes(src)
    assert cached() is False, "a first cold read must stay O_DIRECT"
    dst[:] = bytes(size)
    assert await store.get_into(["a0"], [dst]) == [size] and bytes(dst) == bytes(src)
    assert cached() is True, "a second cold read is admitted to the page cache"
    dst[:] = bytes(size)
    assert await store.get_into(["a0"], [dst]) == [size] and bytes(dst) == bytes(src)
    await store.close()

    never = FileBackend(tmp_path / "s", page_cache="never")
    drop_from_page_cache(never.path_of("a0"))
    for _ in range(3):
        assert await never.get_into(["a0"], [dst]) == [size] and bytes(dst) == bytes(src)
    assert cached() is False
    await never.close()


@pytest.mark.parametrize("fold_min", [4096, 16])
@pytest.mark.parametrize(("batch", "uniform"), [(97, False), (97, True), (1, True)])
def test_lookup_agrees_with_a_set_of_fingerprints(
    fold_min: int, batch: int, uniform: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changes applied in batches of records (merged into the bulk arrays, or kept in the
    recent layer, by ``fold_min``), with fingerprints changed several times, also within one
    batch: the latest change wins, whichever layer holds it. ``uniform``: every change of a
    batch has one presence (a put's or a delete's feed row; merged by a plain sort)."""
    import random

    import numpy as np

    from hicache_store.backends import _fingerprints as fpmod

    monkeypatch.setattr(fpmod, "FOLD_MIN", fold_min)
    rng = random.Random(7 + batch)
    stored = {rng.getrandbits(64) for _ in range(5000)}
    snapshot = fpmod.Snapshot(np.array(sorted(stored), dtype=np.uint64))
    changed = rng.sample(sorted(stored), 300) + [rng.getrandbits(64) for _ in range(300)]
    changes = [(fp, rng.random() < 0.5) for fp in changed for _ in range(rng.randint(1, 3))]
    rng.shuffle(changes)
    delta = fpmod.Delta()
    latest: dict[int, bool] = {}
    folds = 0
    for start in range(0, len(changes), batch):
        part = changes[start : start + batch]
        if uniform:
            part = [(fp, part[0][1]) for fp, _ in part]
        blob = b"".join(fpmod.encode_changes([fp], present) for fp, present in part)
        bulk = len(delta.fps)
        delta.apply(fpmod.decode_changes(blob))
        folds += len(delta.fps) != bulk
        latest.update(part)
        for layer in (delta.fps, delta.recent_fps):  # each layer sorted and unique
            assert (np.diff(layer.astype(np.float64)) >= 0).all() and len(set(layer)) == len(layer)
        if start % 10 == 0 or start + batch >= len(changes):
            now = (stored | {fp for fp, present in latest.items() if present}) - {
                fp for fp, present in latest.items() if not present}
            probes = rng.sample(changed, 50) + rng.sample(sorted(stored), 20)
            got = index_module.lookup(snapshot, delta, np.array(probes, dtype=np.uint64))
            assert got == [fp in now for fp in probes]
    assert (folds > 0) == (fold_min < len(changes)), "the merge into the bulk did not happen"
    now = (stored | {fp for fp, present in latest.items() if present}) - {
        fp for fp, present in latest.items() if not present}
    probes = rng.sample(sorted(stored), 1000) + changed + [rng.getrandbits(64) for _ in range(1000)]
    rng.shuffle(probes)
    wanted = np.array(probes, dtype=np.uint64)
    assert index_module.lookup(snapshot, delta, wanted) == [fp in now for fp in probes]
    assert index_module.lookup(snapshot, fpmod.Delta(), wanted) == [fp in stored for fp in probes]
    empty = np.zeros(0, dtype=np.uint64)
    nothing = fpmod.Snapshot(empty)
    assert index_module.lookup(nothing, delta, wanted) == [latest.get(fp, False) for fp in probes]
    assert index_module.lookup(snapshot, delta, empty) == []


@pytest.mark.parametrize("size", [0, 1, 2, 255, 256, 257, 511, 512, 513, 3000])
def test_the_two_level_snapshot_search_agrees_with_a_set(size: int) -> None:
    """Every stored fingerprint is found, its neighbours and random values are not, at sizes
    around the block boundaries (a partial last block, none, exactly full), the extreme values
    0 and 2^64 - 1 included."""
    import numpy as np

    from hicache_store.backends import _fingerprints as fpmod

    rng = np.random.default_rng(size)
    stored = np.unique(rng.integers(0, 2**64 - 1, size, dtype=np.uint64, endpoint=True))
    if size > 3:
        stored[0], stored[-1] = 0, np.uint64(2**64 - 1)
        stored = np.unique(stored)
    one = np.uint64(1)
    probes = np.concatenate([
        stored, stored + one, stored - one,  # neighbours (wrapping at the extremes)
        rng.integers(0, 2**64 - 1, 2000, dtype=np.uint64, endpoint=True),
        np.array([0, 1, 2**63, 2**64 - 1], dtype=np.uint64),
    ])
    got = fpmod.Snapshot(stored).members(probes)
    assert got.dtype == bool
    assert got.tolist() == np.isin(probes, stored).tolist()


@pytest.mark.parametrize("accelerated", [True, False])
def test_batch_fingerprints_are_the_single_key_fingerprints(
    accelerated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch hash (C where built, else per key) is ``fingerprint`` of each key: every length
    up to past the longest key, non-ASCII keys, and batches the C loop hands back (a key over
    240 UTF-8 bytes, a str subclass)."""
    import random

    import numpy as np

    from hicache_store.backends import _fingerprints as fpmod
    from hicache_store.layout import keys as keys_module

    if accelerated and keys_module._accelerated is None:
        pytest.skip("the C accelerator (layout/_keys.c) is not built here")
    if not accelerated:
        monkeypatch.setattr(keys_module, "_accelerated", None)
    rng = random.Random(3)
    alphabet = "0123456789abcdefkuvABCXYZ_-"
    keys = ["".join(rng.choice(alphabet) for _ in range(n)) for n in range(300)]
    keys += ["é" * 10, "a\u20ac" * 30, "\U0001f600" * 60, "x" * 121 + "é"]  # 240 / 242 bytes
    for batch in (keys[:241], keys[241:], keys, ["ab", "ab"], [], tuple(keys[:50])):
        got = fpmod.fingerprints(batch)
        assert got.dtype == np.uint64
        assert got.tolist() == [fpmod.fingerprint(k) for k in batch]

    class Key(str):
        pass

    assert fpmod.fingerprints([Key("abc"), "abc"]).tolist() == [fpmod.fingerprint("abc")] * 2


def test_a_torn_feed_row_is_refused() -> None:
    from hicache_store.backends import _fingerprints as fpmod

    blob = fpmod.encode_changes([1, 2], True)
    assert list(fpmod.decode_changes(blob)["fp"]) == [1, 2]
    with pytest.raises(ValueError, match="whole number of records"):
        fpmod.decode_changes(blob[:-1])


async def test_a_recent_answer_never_misses_this_processs_changes_and_ages_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``inline_exists().now(max_age_s=...)``: the in-memory set as last brought up to date,
    # with no database call, only while that began after this process's last put or delete and at
    # most ``max_age_s`` ago; other processes' writes of that window may be missed.
    store = FileBackend(tmp_path / "s", durability="none")
    inline = store.inline_exists()
    await store.put(["a0"], [b"mine"])
    assert inline.now(["a0"], max_age_s=60) is None  # the put is newer than the set
    assert await store.exists(["a0"]) == [True]  # brings it up to date
    assert inline.now(["a0", "b0"], max_age_s=60) == [True, False]
    write_in_child(tmp_path / "s", ["b0"])
    # another process's write, not seen yet: the recent answer misses it, an exact one cannot
    # be had at once, a blocking one (the caller's thread) finds it
    assert inline.now(["b0"], max_age_s=60) == [False]
    assert inline.now(["b0"]) is None
    assert inline.blocking(["b0", "c0"]) == [True, False]
    assert inline.now(["b0"], max_age_s=60) == [True]
    await store.delete(["a0"])
    assert inline.now(["a0"], max_age_s=60) is None  # this process's delete
    assert inline.blocking(["a0"]) == [False]
    clock = [time.monotonic()]
    monkeypatch.setattr(index_module.time, "monotonic", lambda: clock[0])
    assert inline.now(["b0"], max_age_s=1.0) == [True]
    clock[0] += 1.5
    assert inline.now(["b0"], max_age_s=1.0) is None  # too old now
    monkeypatch.undo()
    await store.close()
    with pytest.raises(BackendClosedError):
        inline.blocking(["b0"])
    assert inline.now(["b0"], max_age_s=60) is None


def test_write_transactions_of_a_process_are_granted_in_the_order_they_asked(
    tmp_path: Path,
) -> None:
    """16 threads commit index transactions back to back: none waits behind more than about
    one transaction of each other thread (first come, first served). SQLite's own wait for
    its write lock polls with growing sleeps (up to 100 ms): a thread that found it taken
    kept losing it to the others, and with thousands of puts in flight one put waited 30 s
    (``lock_timeout``) for its reservation and gave up."""
    import threading

    store = FileBackend(tmp_path / "s", durability="none")
    index = store._index
    assert isinstance(index, index_module.FileIndex)
    threads, rounds = 16, 60
    granted = 0  # transactions committed so far (changed only inside one)
    overtaken: list[int] = []

    def commit_back_to_back() -> None:
        nonlocal granted
        with index._db.write():
            pass  # this thread's connection, opened before counting
        for _ in range(rounds):
            asked = granted
            with index._db.write() as con:
                con.execute("UPDATE meta SET value = value WHERE name = 'count'")
                overtaken.append(granted - asked)
                granted += 1

    workers = [threading.Thread(target=commit_back_to_back) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert granted == threads * rounds
    assert max(overtaken) <= 2 * threads, sorted(overtaken)[-10:]
    asyncio.run(store.close())
