"""gc and retention: pinned and retained pages stay (with the pages before them), expired
holds are ordinary data, a pin made after the scan still holds (also one made by another
process in the window between gc's last look and its delete, and one made while gc runs),
and a dry run says so."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from hicache_store.backends import Backend, DeletedUntilHeld, Retention
from hicache_store.backends.file import FileBackend
from hicache_store.backends.memory import MemoryBackend
from hicache_store.ops import gc as gc_module
from hicache_store.ops.gc import collect_garbage
from hicache_store.testing import Clock
from hicache_store.testing.chains import chain_objects, chains_are_prefixes, write_chains

CLI = [str(Path(sys.executable).with_name("hicache-store"))]


async def stored_pages(store: Backend) -> set[str]:
    return {k.split("_")[0] async for k in store.list_prefix()}


async def page_keys(store: Backend, page: str) -> list[str]:
    return [k async for k in store.list_prefix(page)]


async def test_gc_keeps_pinned_and_retained_pages_and_collects_expired_ones(
    tmp_path: Path,
) -> None:
    clock = Clock()
    store = FileBackend(tmp_path / "store", durability="none", direct_io="never",
                        capacity_bytes=1 << 20, pin_fraction=1.0, clock=clock)
    try:
        chains = await write_chains(store, 3, 4)
        # chain 0: one object of page 2 pinned; chain 1: its last page retained; chain 2:
        # page 1 retained until a deadline that passes before gc runs
        await store.retain((await page_keys(store, chains[0][2]))[:1],
                           Retention("engine", None, pinned=True))
        await store.retain(await page_keys(store, chains[1][3]),
                           Retention("session-1", 2000.0, pinned=False, priority=2))
        await store.retain(await page_keys(store, chains[2][1]),
                           Retention("session-2", 1500.0, pinned=False))
        clock.now = 1600.0
        before = await stored_pages(store)
        dry = await collect_garbage(store, max_bytes=0, max_age=None, dry_run=True,
                                    state_dir=tmp_path / "gc")
        assert (dry.held, dry.held_pages) == (3, 2)
        assert dry.over_budget_pages == 1 + 4  # chain 0's page 3, and chain 2 whole
        assert await stored_pages(store) == before  # a dry run deletes nothing
        report = await collect_garbage(store, max_bytes=0, max_age=None,
                                       state_dir=tmp_path / "gc")
        assert report.deleted == 2 * 5 and report.failures == 0
        left = await stored_pages(store)
        assert left == set(chains[0][:3]) | set(chains[1])
        assert chains_are_prefixes(left, chains)
        assert [len(h) for h in await store.retention_of(
            await page_keys(store, chains[1][3]))] == [1, 1]
    finally:
        await store.close()


class PinnedAfterTheScan(MemoryBackend):
    """Another client pins ``late`` after every look gc takes at the holds and before its
    first deleting call runs: a pin that commits between gc's check and the store's delete."""

    def __init__(self) -> None:
        super().__init__()
        self.late: list[str] = []
        self.deleting = 0

    async def _pin_once(self) -> None:
        self.deleting += 1
        if self.deleting == 1:
            await self._retain(self.late, Retention("late", None, pinned=True))

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        await self._pin_once()
        return await super()._delete(keys)

    async def _delete_until_held(self, groups: list[list[str]]) -> DeletedUntilHeld:
        await self._pin_once()
        return await super()._delete_until_held(groups)


async def test_a_page_pinned_after_the_scan_is_kept_with_its_ancestors(tmp_path: Path) -> None:
    store = PinnedAfterTheScan()
    chains = await write_chains(store, 2, 4)
    store.late = (await page_keys(store, chains[0][2]))[1:]
    report = await collect_garbage(store, max_bytes=0, max_age=None, state_dir=tmp_path / "gc")
    assert store.deleting >= 1
    assert report.held == 0 and report.kept_pages == 3  # page 2 and the two before it
    left = await stored_pages(store)
    assert left == set(chains[0][:3])
    assert chains_are_prefixes(left, chains)


PIN_IN_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from hicache_store.backends import Retention
    from hicache_store.backends.file import FileBackend

    async def main(root, *keys):
        store = FileBackend(root, durability="none", direct_io="never", capacity_bytes=1 << 30,
                            pin_fraction=1.0)
        await store.retain(list(keys), Retention("other-process", None, pinned=True))
        held = await store.retention_of(list(keys))
        print(" ".join(k for k, h in zip(keys, held) if h))
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)


class PinnedByAnotherProcess(FileBackend):
    """A file store whose first deleting call first waits for another process to pin
    ``late`` (after every check gc made, before the store deletes)."""

    late: list[str]
    confirmed: list[str]
    deleting = 0

    async def _pin_once(self) -> None:
        self.deleting += 1
        if self.deleting == 1:
            child = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", PIN_IN_CHILD, str(self.root), *self.late],
                capture_output=True, text=True, timeout=120, check=False)
            assert child.returncode == 0, child.stderr
            self.confirmed = child.stdout.split()

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        await self._pin_once()
        return await super()._delete(keys)

    async def _delete_until_held(self, groups: list[list[str]]) -> DeletedUntilHeld:
        await self._pin_once()
        return await super()._delete_until_held(groups)


async def test_pins_by_another_process_in_gcs_window_are_never_deleted(tmp_path: Path) -> None:
    """240 objects pinned by another process after gc's last look at the holds and before
    its delete: none is deleted, nor any page before them in their chains."""
    store = PinnedByAnotherProcess(tmp_path / "store", durability="none", direct_io="never",
                                   capacity_bytes=1 << 30, pin_fraction=1.0)
    try:
        chains = await write_chains(store, 40, 6)
        # one object of each of three pages per chain (the rest of those pages unpinned)
        store.late = [(await page_keys(store, chain[i]))[i % 2]
                      for chain in chains for i in (1, 3, 4)]
        report = await collect_garbage(store, max_bytes=0, max_age=None,
                                       state_dir=tmp_path / "gc")
        assert sorted(store.confirmed) == sorted(store.late) and len(store.late) == 120
        assert await store.exists(store.late) == [True] * len(store.late)
        left = await stored_pages(store)
        assert left == {page for chain in chains for page in chain[:5]}
        assert chains_are_prefixes(left, chains)
        assert report.deleted == 40 * 2 and report.kept_pages == 40 * 5
    finally:
        await store.close()


PINNER = textwrap.dedent(
    """
    import asyncio, os, random, sys
    from hicache_store.backends import Retention
    from hicache_store.backends.file import FileBackend

    async def main(root, stop):
        store = FileBackend(root, durability="none", direct_io="never", capacity_bytes=1 << 30,
                            pin_fraction=1.0)
        keys = [k async for k in store.list_prefix("")]
        rng = random.Random(5)
        print("ready", flush=True)
        while not os.path.exists(stop):
            pick = rng.sample(keys, 3)
            await store.retain(pick, Retention("pinner", None, pinned=True))
            for key, held in zip(pick, await store.retention_of(pick)):
                if held:  # held from its retain on: gc must never delete it
                    print(key, flush=True)
            await asyncio.sleep(0.005)  # gc deletes between the pins
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)


async def test_another_process_pinning_while_gc_runs_loses_no_held_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process pins random objects in a loop while gc deletes the whole store, many small
    delete calls: every object it saw held is still there, bytes intact, chains prefixes."""
    monkeypatch.setattr(gc_module, "DELETE_CHUNK", 16)
    root = tmp_path / "store"
    store = FileBackend(root, durability="none", direct_io="never", capacity_bytes=1 << 30,
                        pin_fraction=1.0)
    try:
        chains = await write_chains(store, 60, 8)
        objects = {k: v for c in chains for k, v in chain_objects(c).items()}
        stop = tmp_path / "stop"
        pinner = await asyncio.to_thread(
            subprocess.Popen, [sys.executable, "-c", PINNER, str(root), str(stop)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert pinner.stdout is not None
            assert (await asyncio.to_thread(pinner.stdout.readline)).strip() == "ready"
            report = await collect_garbage(store, max_bytes=0, max_age=None,
                                           state_dir=tmp_path / "gc")
        finally:
            stop.touch()
            out, err = await asyncio.to_thread(pinner.communicate, timeout=120)
        assert pinner.returncode == 0, err
        confirmed = sorted(set(out.split()))
        assert confirmed and report.deleted > 0
        assert await store.exists(confirmed) == [True] * len(confirmed)
        for key in confirmed:
            assert await store.get_bytes(key) == objects[key]
        left = await stored_pages(store)
        assert chains_are_prefixes(left, chains)
        print(f"\n{len(confirmed)} objects held by the pinner, {report.deleted} deleted, "
              f"{report.kept_pages} pages kept")
    finally:
        await store.close()


async def test_gc_on_a_backend_without_retention_is_unchanged(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "store", index="none", durability="none")
    try:
        await write_chains(store, 2, 3)
        report = await collect_garbage(store, max_bytes=0, max_age=None,
                                       state_dir=tmp_path / "gc")
        assert report.held == 0 and report.deleted == 12
        assert await stored_pages(store) == set()
    finally:
        await store.close()


def test_gc_dry_run_shows_what_retention_keeps(tmp_path: Path) -> None:
    import asyncio

    url = f"file://{tmp_path / 'store'}"

    async def setup() -> list[list[str]]:
        store = FileBackend(tmp_path / "store")
        chains = await write_chains(store, 2, 3)
        await store.retain(await page_keys(store, chains[0][2]),
                           Retention("engine", None, pinned=True))
        await store.close()
        return chains

    chains = asyncio.run(setup())
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = subprocess.run([*CLI, "gc", url, "--max-bytes", "0B", "--dry-run", "--no-progress"],
                            capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "would delete 0 expired and 6 over budget" in result.stdout
    assert "2 objects in 1 pages pinned or retained: kept" in result.stdout

    async def check() -> set[str]:
        store = FileBackend(tmp_path / "store")
        try:
            return await stored_pages(store)
        finally:
            await store.close()

    assert asyncio.run(check()) == set(chains[0]) | set(chains[1])
