"""gc and retention: pinned and retained pages stay (with the pages before them), expired
holds are ordinary data, a pin made after the scan still holds, and a dry run says so."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hicache_store.backends import Backend, Retention
from hicache_store.backends.file import FileBackend
from hicache_store.backends.memory import MemoryBackend
from hicache_store.ops.gc import collect_garbage
from hicache_store.testing import Clock
from hicache_store.testing.chains import chains_are_prefixes, write_chains

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
    """Another client pins ``late`` between gc's scan and its deletes (at gc's second
    ``retention_of``: the first is the scan's)."""

    def __init__(self) -> None:
        super().__init__()
        self.late: list[str] = []
        self.asked = 0

    async def _retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        self.asked += 1
        if self.asked == 2:
            await self._retain(self.late, Retention("late", None, pinned=True))
        return await super()._retention_of(keys)


async def test_a_page_pinned_after_the_scan_is_kept_with_its_ancestors(tmp_path: Path) -> None:
    store = PinnedAfterTheScan()
    chains = await write_chains(store, 2, 4)
    store.late = (await page_keys(store, chains[0][2]))[1:]
    report = await collect_garbage(store, max_bytes=0, max_age=None, state_dir=tmp_path / "gc")
    assert store.asked >= 2
    assert report.held == 0 and report.kept_pages == 3  # page 2 and the two before it
    left = await stored_pages(store)
    assert left == set(chains[0][:3])
    assert chains_are_prefixes(left, chains)


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
    result = subprocess.run([*CLI, "gc", url, "--max-bytes", "0", "--dry-run", "--no-progress"],
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
