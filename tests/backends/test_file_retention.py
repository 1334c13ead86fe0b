"""Retention on the file backend: the shared retention suite, then what only a shared,
persistent index promises: holds seen by every process of a root, outliving a SIGKILLed
pinner, and refused with a clear error where there is no index."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from file_audit import audit

from hicache_store.backends import (
    Backend,
    CapacityError,
    NotSupportedError,
    PinBudgetError,
    Retention,
    open_backend,
)
from hicache_store.backends.file import FileBackend
from hicache_store.layout.errors import ConfigError
from hicache_store.testing import CapacityUsageTests, RetentionTests

OBJECT = 1000


class TestFileRetention(RetentionTests):
    async def open_retention_backend(
        self, where: Path, capacity_bytes: int, pin_fraction: float, clock: Callable[[], float]
    ) -> Backend:
        return FileBackend(where, durability="none", direct_io="never",
                           capacity_bytes=capacity_bytes, pin_fraction=pin_fraction, clock=clock)


class TestFileCapacityUsage(CapacityUsageTests):
    async def open_bounded_backend(self, where: Path, capacity_bytes: int) -> Backend:
        return FileBackend(where, durability="none", direct_io="never",
                           capacity_bytes=capacity_bytes)


class TestFileNoIndexCapacityUsage(CapacityUsageTests):
    """Without an index the bytes used are an estimate: not declared (the suite checks the
    refusal)."""

    async def open_bounded_backend(self, where: Path, capacity_bytes: int) -> Backend:
        return FileBackend(where, durability="none", direct_io="never", index="none",
                           capacity_bytes=capacity_bytes)


def _store(root: Path, capacity: int = 10 * OBJECT, pin_fraction: float = 0.5) -> FileBackend:
    return FileBackend(root, durability="none", direct_io="never", capacity_bytes=capacity,
                       pin_fraction=pin_fraction)


def _blob(i: int) -> bytes:
    return bytes([i % 251]) * OBJECT


FILL = textwrap.dedent(
    """
    import asyncio, sys
    from hicache_store.backends.file import FileBackend

    async def main(root, capacity, count):
        store = FileBackend(root, durability="none", direct_io="never", capacity_bytes=capacity)
        for i in range(count):  # one object per call: each one has to make room
            await store.put([f"c{i:03x}"], [bytes([i % 251]) * 1000])
        print(store.stats.evictions)
        await store.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
    """
)


async def _run_child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", script, *args],
        capture_output=True, text=True, timeout=120, check=False,
    )


async def test_pins_survive_another_processes_capacity_eviction(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = _store(root)
    try:
        keys = [f"a{i:03x}" for i in range(10)]
        for i, key in enumerate(keys):
            await store.put([key], [_blob(i)])
        await store.retain(keys[:2], Retention("engine-1", None, pinned=True))
        await store.retain(keys[2:3], Retention("engine-1", None, pinned=False, priority=7))
        child = await _run_child(FILL, str(root), str(10 * OBJECT), "30")
        assert child.returncode == 0, child.stderr
        assert int(child.stdout) == 30  # every put of the other process had to evict
        # pinned and retained stay; every unretained object of this process went first
        assert await store.exists(keys) == [True, True, True] + [False] * 7
        assert await store.exists(["c01d", "c000"]) == [True, False]
        assert store.path_of(keys[0]).read_bytes() == _blob(0)
        assert [r.pinned for r in (await store.retention_of(keys[:3])) for r in r] == [
            True, True, False]
    finally:
        await store.close()
    report = audit(root)
    assert report.ok, report.problems
    assert report.total_bytes <= 10 * OBJECT


PIN_THEN_DIE = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from hicache_store.backends import Retention
    from hicache_store.backends.file import FileBackend

    async def main(root, capacity):
        # (the Python writes, whose rename is os.rename)
        store = FileBackend(root, durability="none", direct_io="never", capacity_bytes=capacity,
                            pin_fraction=0.5, io_engine="posix")
        await store.put(["P000", "P001", "P002"], [b"p" * 1000] * 3)
        await store.retain(["P000", "P001"], Retention("child", None, pinned=True))
        await store.retain(["P002"], Retention("child", None, pinned=False, priority=3))
        # killed mid-way through its next put: the object renamed, the index not settled
        os.rename = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        await store.put(["P003"], [b"q" * 1000])

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


async def test_pins_outlive_a_sigkilled_pinner(tmp_path: Path) -> None:
    root = tmp_path / "s"
    child = await _run_child(PIN_THEN_DIE, str(root), str(5 * OBJECT))
    assert child.returncode == -signal.SIGKILL, child.stderr
    store = _store(root, capacity=5 * OBJECT)  # the next open recovers the dead put
    try:
        assert store.removed_temp_files == 1  # the dead put's object, never published
        held = await store.retention_of(["P000", "P001", "P002", "P003"])
        assert [[(r.owner, r.pinned, r.priority) for r in h] for h in held] == [
            [("child", True, 0)], [("child", True, 0)], [("child", False, 3)], []]
        assert store.pinned_bytes() == 2 * OBJECT
        # the dead process's pins count against this process's budget (2,500 bytes)
        await store.put(["Q000"], [_blob(1)])
        with pytest.raises(PinBudgetError, match="budget 2500 bytes, used 2000, asked 1000"):
            await store.retain(["Q000"], Retention("me", None, pinned=True))
        for i in range(1, 6):  # fill well past the capacity, one object per call
            await store.put([f"Q{i:03x}"], [_blob(i)])
        assert await store.exists(["P000", "P001", "P002"]) == [True, True, True]
        with pytest.raises(CapacityError, match="pinned"):
            await store.put(["R000"], [b"r" * 4 * OBJECT])  # only the pins would make room
        assert await store.exists(["P000", "P001", "P002"]) == [True, True, True]
        await store.put(["R000"], [b"r" * 3 * OBJECT])  # the retained p002 goes last
        assert await store.exists(["P000", "P001", "P002", "R000"]) == [True, True, False, True]
        await store.release(["P000"], "child")  # anyone may release an owner's entry by name
        await store.put(["R001"], [b"s" * OBJECT])
        assert await store.exists(["P000", "P001"]) == [False, True]
    finally:
        await store.close()
    report = audit(root)
    assert report.ok, report.problems


async def test_pins_are_kept_across_reopen_and_dropped_by_delete(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = _store(root)
    await store.put(["d000", "d001"], [_blob(0), _blob(1)])
    await store.retain(["d000", "d001"], Retention("o", 4e9, pinned=True))
    await store.close()
    store = _store(root)
    try:
        assert [len(h) for h in await store.retention_of(["d000", "d001"])] == [1, 1]
        await store.delete(["d000"])
        assert store.pinned_bytes() == OBJECT
        await store.put(["d000"], [_blob(2)])
        assert await store.retention_of(["d000"]) == [()]
    finally:
        await store.close()


async def test_index_none_does_not_declare_retention(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s", index="none", capacity_bytes=10 * OBJECT)
    try:
        assert not store.capabilities.retention
        assert FileBackend.capabilities.retention
        await store.put(["N000"], [_blob(0)])
        for call in (store.retain(["N000"], Retention("o", None, pinned=True)),
                     store.release(["N000"], "o"), store.retention_of(["N000"])):
            with pytest.raises(NotSupportedError, match="index=none"):
                await call
        assert store.pinned_bytes() == 0
    finally:
        await store.close()


async def test_an_index_from_before_retention_gets_the_table(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = _store(root)
    await store.put(["u000"], [_blob(0)])
    await store.close()
    with sqlite3.connect(root / "index" / "index.sqlite3") as con:
        con.execute("DROP TABLE retention")
    store = _store(root)
    try:
        await store.retain(["u000"], Retention("o", None, pinned=True))
        assert [len(h) for h in await store.retention_of(["u000"])] == [1]
    finally:
        await store.close()


async def test_pin_fraction_is_a_url_option(tmp_path: Path) -> None:
    store = open_backend(f"file://{tmp_path}/s?capacity_bytes=1000&pin_fraction=0.4")
    try:
        assert isinstance(store, FileBackend)
        assert store.pin_budget_bytes == 400
    finally:
        await store.close()
    with pytest.raises(ConfigError, match="pin_fraction"):
        open_backend(f"file://{tmp_path}/t?capacity_bytes=1000&pin_fraction=1.5")
    assert not (tmp_path / "t").exists()  # a refused option creates nothing


PIN_TWO = textwrap.dedent(
    """
    import asyncio, sys
    from hicache_store.backends import PinBudgetError, Retention
    from hicache_store.backends.file import FileBackend

    async def main(root, owner, *keys):
        store = FileBackend(root, durability="none", direct_io="never", capacity_bytes=10_000)
        try:
            await store.retain(list(keys), Retention(owner, None, pinned=True))
            print("pinned")
        except PinBudgetError as exc:
            print("refused", exc)
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)


async def test_the_pin_budget_holds_across_racing_processes(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = _store(root, capacity=10_000, pin_fraction=0.25)  # 2,500 bytes of pins
    try:
        await store.put(["B000", "B001", "B002", "B003"], [_blob(i) for i in range(4)])
        first, second = await asyncio.gather(
            _run_child(PIN_TWO, str(root), "one", "B000", "B001"),
            _run_child(PIN_TWO, str(root), "two", "B002", "B003"),
        )
        outcomes = sorted(child.stdout.split()[0] for child in (first, second))
        assert outcomes == ["pinned", "refused"], (first.stderr, second.stderr)
        assert store.pinned_bytes() == 2 * OBJECT
        owners = {r.owner for h in await store.retention_of(["B000", "B002"]) for r in h}
        assert len(owners) == 1
    finally:
        await store.close()


REWRITE = textwrap.dedent(
    """
    import asyncio, sys
    from hicache_store.backends import PinBudgetError
    from hicache_store.backends.file import FileBackend

    async def main(root, key, size):
        store = FileBackend(root, durability="none", direct_io="never", capacity_bytes=1 << 20)
        try:
            await store.put([key], [b"w" * int(size)])
            print("stored")
        except PinBudgetError as exc:
            print("refused", exc)
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)


async def test_another_process_cannot_grow_a_pinned_object_past_the_budget(tmp_path: Path) -> None:
    """1 MiB store, 256 KiB of pins: a pinned 4 KiB object rewritten at 900 KiB by another
    process would leave 900 KiB pinned (unevictable); the rewrite is charged as a pin and
    refused, the old object and its pin stay, and a rewrite within the budget is stored."""
    root = tmp_path / "s"
    store = _store(root, capacity=1 << 20, pin_fraction=0.25)
    try:
        await store.put(["ab00"], [b"p" * 4096])
        await store.retain(["ab00"], Retention("engine", None, pinned=True))
        child = await _run_child(REWRITE, str(root), "ab00", str(900 * 1024))
        assert child.returncode == 0, child.stderr
        assert child.stdout.startswith("refused pin budget exceeded by rewriting pinned"), (
            child.stdout)
        assert await store.get_bytes("ab00") == b"p" * 4096
        assert store.pinned_bytes() == 4096
        child = await _run_child(REWRITE, str(root), "ab00", str(200 * 1024))
        assert child.stdout.startswith("stored"), child.stdout + child.stderr
        assert store.pinned_bytes() == 200 * 1024
        assert [r.owner for r in (await store.retention_of(["ab00"]))[0]] == ["engine"]
    finally:
        await store.close()
    report = audit(root)
    assert report.ok, report.problems
