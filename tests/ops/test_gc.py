"""``hicache-store gc``: the planner against a model, objects without mtime, failed deletions,
the parent cache, interruption and resume, and the command as an operator runs it."""

from __future__ import annotations

import asyncio
import heapq
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_store.backends import (
    Backend,
    ObjectStat,
    open_backend,
    register_backend,
    unregister_backend,
)
from hicache_store.backends.errors import BackendIOError
from hicache_store.backends.memory import MemoryBackend
from hicache_store.cli import main
from hicache_store.objects.io import ObjectIO
from hicache_store.ops import gc as gc_ops
from hicache_store.ops.gc import GcError, GcState, collect_garbage, plan_gc
from hicache_store.testing.chains import chain_objects, chains_are_prefixes, write_chains

NS = "0123456789abcdef"
CLI = [str(Path(sys.executable).with_name("hicache-store"))]


# -- the planner against a model ----------------------------------------------------------------


def model_plan(
    entries: Sequence[ObjectStat], parents: Mapping[str, str | None], now: float,
    max_bytes: int | None, max_age: float | None,
) -> tuple[list[str], list[str]]:
    """gc's rules with a plain in-memory heap (what gc did before it streamed)."""
    pages: dict[str, list[ObjectStat]] = {}
    for e in entries:
        if not e.key.startswith("M_"):
            pages.setdefault(e.key.split("_", 1)[0], []).append(e)
    undated = {p: any(e.mtime is None for e in objs) for p, objs in pages.items()}
    newest = {p: max((e.mtime for e in objs if e.mtime is not None), default=0.0)
              for p, objs in pages.items()}
    # Undated pages after every dated one; among them, by their newest known time.
    key = {p: (int(undated[p]), newest[p], p) for p in pages}
    children = dict.fromkeys(pages, 0)
    for p in pages:
        q = parents.get(p)
        if q is not None and q in pages and q != p:
            children[q] += 1
    heap = [key[p] for p in pages if children[p] == 0]
    heapq.heapify(heap)
    total = sum(e.size for objs in pages.values() for e in objs)
    expired: list[str] = []
    over: list[str] = []

    def drop(p: str, into: list[str]) -> None:
        nonlocal total
        into.extend(sorted(e.key for e in pages[p]))
        total -= sum(e.size for e in pages[p])
        q = parents.get(p)
        if q is not None and q in pages and q != p:
            children[q] -= 1
            if children[q] == 0:
                heapq.heappush(heap, key[q])

    waiting = []
    while heap:
        item = heapq.heappop(heap)
        p = item[2]
        if max_age is not None and not undated[p] and newest[p] < now - max_age:
            drop(p, expired)
        else:
            waiting.append(item)
    heap = waiting
    heapq.heapify(heap)
    while heap and max_bytes is not None and total > max_bytes:
        drop(heapq.heappop(heap)[2], over)
    return expired, over


def page(i: int) -> str:
    return f"{i:032x}"


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 5))
def test_the_planner_matches_the_model(data: st.DataObject, batch: int) -> None:
    n = data.draw(st.integers(1, 30))
    parents = {page(i): (page(data.draw(st.integers(0, i - 1))) if i and data.draw(st.booleans())
                         else None) for i in range(n)}
    entries = []
    for i in range(n):
        for obj in range(data.draw(st.integers(1, 3))):
            mtime = data.draw(st.one_of(st.none(), st.integers(0, 20).map(float)))
            size = data.draw(st.integers(1, 50))
            entries.append(ObjectStat(f"{page(i)}_{NS}_L{obj}-{obj}", size, mtime))
    entries.append(ObjectStat(f"M_{NS}", 5, 0.0))
    total = sum(e.size for e in entries[:-1])
    max_bytes = data.draw(st.one_of(st.none(), st.integers(0, total)))
    max_age = data.draw(st.one_of(st.none(), st.integers(0, 20).map(float)))
    with mock.patch.object(gc_ops, "PLAN_BATCH", batch):  # exercise the batch merge
        expired, over = plan_gc(entries, now=20.0, max_bytes=max_bytes, max_age=max_age,
                                parents=parents)
    want_expired, want_over = model_plan(entries, parents, 20.0, max_bytes, max_age)
    assert sorted(expired) == sorted(want_expired)
    assert over == want_over, "the budget phase pops tails in exactly the heap's order"
    # Children before parents, in the order the deletions happen.
    order = {k.split("_")[0]: i for i, k in enumerate(expired + over)}
    for child, parent in parents.items():
        if parent in order and child in parents and child in order:
            assert order[child] < order[parent]
    assert not any(k.startswith("M_") for k in expired + over), "manifests are never planned"


def test_a_plan_run_again_on_its_own_state_is_the_same_plan() -> None:
    # A run interrupted while planning resumes at "plan" over the batches it had written:
    # planning again resets them and plans exactly as the first time.
    chains = [[page(c * 10 + i) for i in range(10)] for c in range(6)]
    parents = {h: (chain[i - 1] if i else None) for chain in chains for i, h in enumerate(chain)}
    entries = [ObjectStat(f"{h}_{NS}_L0-0", 10, float(n)) for n, h in enumerate(parents)]
    state = GcState(None)
    try:
        state.reset("plan", 100.0)
        with state.transaction() as db:
            db.executemany("INSERT INTO objects (page, tail, size, mtime) VALUES (?, ?, ?, ?)",
                           [(gc_ops.page_of(e.key), e.key[32:], e.size, e.mtime)
                            for e in entries])
        gc_ops._group_pages(state)
        with state.transaction() as db:
            db.executemany("UPDATE pages SET parent = ?, parent_known = 1 WHERE page = ?",
                           [(q, p) for p, q in parents.items()])
        # Chains 0-3 expire whole; chain 4 keeps its expired half under fresh pages; then
        # five tails go for the budget (chain 4's, oldest first).
        policy = gc_ops.GcPolicy(max_bytes=150, max_age=55.0)
        plans = []
        for _ in range(2):
            gc_ops._plan(state, policy, 100.0)
            plans.append(state.db.execute(
                "SELECT page, step, rule, children FROM pages ORDER BY page").fetchall())
        assert plans[0] == plans[1]
        rules = [rule for _, step, rule, _ in plans[0] if step is not None]
        assert (rules.count(gc_ops._EXPIRED), rules.count(gc_ops._OVER_BUDGET)) == (40, 5)
    finally:
        state.close(finished=True)


def test_plan_expires_then_drops_whole_pages_tails_first() -> None:
    # Page a written first (t=100), chain b0 -> b1 -> b2 at t=200, page c at t=300; one
    # page older than the max age.
    a, b0, b1, b2, c, d = (page(i) for i in range(6))
    entries = [
        ObjectStat(f"{a}_{NS}_L0-1", 10, 100.0),
        ObjectStat(f"{a}_{NS}_L2-3", 10, 100.1),
        ObjectStat(f"{b0}_{NS}_L0-1", 10, 200.1),
        ObjectStat(f"{b1}_{NS}_L0-1", 10, 200.2),
        ObjectStat(f"{b2}_{NS}_L0-1", 10, 200.3),
        ObjectStat(f"{c}_{NS}_L0-1", 10, 300.0),
        ObjectStat(f"{d}_{NS}_L0-1", 10, 1.0),
    ]
    parents = {b1: b0, b2: b1}
    expired, over = plan_gc(entries, now=1000.0, max_bytes=40, max_age=950, parents=parents)
    assert expired == [f"{d}_{NS}_L0-1"]
    # 60 bytes left, budget 40: page a (both objects) goes first, whole.
    assert over == [f"{a}_{NS}_L0-1", f"{a}_{NS}_L2-3"]
    _, over = plan_gc(entries, now=1000.0, max_bytes=30, max_age=950, parents=parents)
    assert over[2:] == [f"{b2}_{NS}_L0-1"], "the chain's tail goes before its head"
    assert plan_gc(entries, now=1000.0, max_bytes=None, max_age=None) == ([], [])


def test_plan_never_holes_a_chain_whatever_the_write_times() -> None:
    # b1 is the oldest, but it sits in the middle of b0 -> b1 -> b2: by age alone it would go
    # first and hole the chain. With the parent links, b2 goes, then b1, then b0.
    b0, b1, b2 = page(1), page(2), page(3)
    entries = [ObjectStat(f"{b0}_{NS}_L0-0", 10, 500.0), ObjectStat(f"{b1}_{NS}_L0-0", 10, 100.0),
               ObjectStat(f"{b2}_{NS}_L0-0", 10, 600.0), ObjectStat(f"M_{NS}", 10, 1.0)]
    parents = {b1: b0, b2: b1, b0: None}
    _, over = plan_gc(entries, now=1000.0, max_bytes=20, max_age=None, parents=parents)
    assert over == [f"{b2}_{NS}_L0-0"]
    _, over = plan_gc(entries, now=1000.0, max_bytes=0, max_age=None, parents=parents)
    assert [k[:32] for k in over] == [b2, b1, b0], "manifests are never deleted"
    # Age: b1 is expired but its child b2 is fresh, so b1 stays (no hole).
    expired, _ = plan_gc(entries, now=1000.0, max_bytes=None, max_age=450, parents=parents)
    assert expired == []


# -- objects without mtime (issue 18, item 1) -----------------------------------------------------


async def test_objects_without_mtime_are_never_aged_out(tmp_path: Path) -> None:
    # A backend that records no mtime (the contract allows it; the template backend and
    # mooncake do): 971 objects a few seconds old must survive a 7-day max age (they used to
    # count as written at the epoch, and 970 would go).
    store = MemoryWithTimes({})
    keys = [f"{page(i)}_{NS}_L0-0" for i in range(971)]
    await store.put(keys, [b"x" * 10] * len(keys))
    assert (await store.stat(keys[:1]))[0].mtime is None  # type: ignore[union-attr]
    report = await collect_garbage(store, max_bytes=None, max_age=7 * 86400.0,
                                   state_dir=tmp_path / "state")
    assert (report.expired, report.undated, report.deleted) == (0, 971, 0)
    assert sum(await store.exists(keys)) == 971
    # The budget still applies: undated pages are the last to go, dated ones first.
    dated = MemoryWithTimes(dict.fromkeys(keys[:3], 5.0))
    await dated.put(keys[:6], [b"x" * 10] * 6)
    report = await collect_garbage(dated, max_bytes=20, max_age=None, now=10.0)
    assert report.over_budget == 4 and report.undated == 3
    assert await dated.exists(keys[:6]) == [False, False, False, False, True, True]
    await store.close()
    await dated.close()


class NoMtimeBackend(MemoryBackend):
    """A backend that does not declare ``mtime`` (and records none)."""

    capabilities = MemoryBackend.capabilities.replace(mtime=False)

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        return [None if st is None else ObjectStat(st.key, st.size)
                for st in await super()._stat(keys)]


def test_max_age_on_a_backend_without_mtime_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    register_backend("nomtime", NoMtimeBackend)
    try:
        assert main(["gc", "nomtime://", "--max-age", "7d"]) == 2
        line = capsys.readouterr().err.strip()
        assert "records no modification times" in line and "--max-bytes" in line
        assert main(["gc", "nomtime://", "--max-bytes", "1GiB", "--no-progress"]) == 0
    finally:
        unregister_backend("nomtime")


class MemoryWithTimes(MemoryBackend):
    """A memory backend that reports the given mtimes (None for the other keys), and can
    refuse to delete some keys."""

    def __init__(self, times: Mapping[str, float], undeletable: Sequence[str] = ()) -> None:
        super().__init__()
        self.times = dict(times)
        self.undeletable = set(undeletable)
        self.delete_calls = 0

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        return [None if st is None else ObjectStat(st.key, st.size, self.times.get(st.key))
                for st in await super()._stat(keys)]

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        self.delete_calls += 1
        allowed = [k for k in keys if k not in self.undeletable]
        done = await super()._delete(allowed)
        if len(allowed) < len(keys):
            raise BackendIOError("refused", backend="memory", operation="delete")
        return done


# -- framed chains in a real store ------------------------------------------------------------------


async def stored_pages(store: Backend) -> set[str]:
    return {k.split("_")[0] async for k in store.list_prefix()}


async def test_a_failed_deletion_keeps_the_pages_above_it(tmp_path: Path) -> None:
    store = MemoryWithTimes({})
    chains = await write_chains(store, 2, 6)
    victim = next(k for k in chain_objects(chains[0]) if k.startswith(chains[0][3]))
    store.undeletable = {victim}
    with mock.patch.object(gc_ops, "DELETE_CHUNK", 2):  # one page per call
        report = await collect_garbage(store, max_bytes=0, max_age=None,
                                       state_dir=tmp_path / "s")
    # Chain 0 loses pages 5 and 4; page 3 cannot go, so 2, 1 and 0 stay (no hole); chain 1
    # goes whole.
    assert report.failures == 2 and report.kept_pages == 3
    assert await stored_pages(store) == set(chains[0][:4])
    assert report.deleted == 2 * 8 and report.doomed == 24


async def test_a_failure_inside_one_call_leaves_at_most_an_unreachable_page(
    tmp_path: Path,
) -> None:
    # A store that deletes a batch in any order (S3's DeleteObjects) may drop a page's parent
    # in the same call that fails on the page: the page is unreachable, as if deleted, and
    # the next run deletes it (now a chain of its own).
    store = MemoryWithTimes({})
    chains = await write_chains(store, 1, 6)
    victim = next(k for k in chain_objects(chains[0]) if k.startswith(chains[0][3]))
    store.undeletable = {victim}
    report = await collect_garbage(store, max_bytes=0, max_age=None, state_dir=tmp_path / "s")
    assert report.failures == 2 and report.deleted == 10
    assert await stored_pages(store) == {chains[0][3]}
    store.undeletable = set()
    again = await collect_garbage(store, max_bytes=0, max_age=None, state_dir=tmp_path / "s")
    assert again.deleted == 1 and await stored_pages(store) == set()  # the object left


async def test_the_parent_cache_reads_each_header_once(tmp_path: Path) -> None:
    store = open_backend(f"file://{tmp_path / 'store'}")
    chains = await write_chains(store, 3, 4)
    state = tmp_path / "state"
    dry = await collect_garbage(store, max_bytes=0, max_age=None, dry_run=True, state_dir=state)
    assert (dry.headers_read, dry.headers_cached, dry.doomed) == (12, 0, 24)
    assert await stored_pages(store) == {h for c in chains for h in c}
    reads = store.stats.reads
    real = await collect_garbage(store, max_bytes=6 * 10240, max_age=None, state_dir=state)
    assert (real.headers_read, real.headers_cached) == (0, 12)
    assert store.stats.reads == reads, "no header read again"
    assert real.deleted == 12 and chains_are_prefixes(await stored_pages(store), chains)
    # Nothing to delete: no header is read at all.
    quiet = await collect_garbage(store, max_bytes=1 << 40, max_age=None)
    assert (quiet.headers_read, quiet.doomed) == (0, 0)
    await store.close()


class Interrupt(BaseException):
    """Stands for a kill in the middle of a call."""


class Crashing(MemoryWithTimes):
    """Raises ``Interrupt`` at the ``crash_deletes_at``-th delete call, or in the read that
    reaches the ``crash_reads_at``-th object read."""

    crash_deletes_at = 0
    crash_reads_at = 0
    reads = 0

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        if self.delete_calls + 1 == self.crash_deletes_at:
            self.delete_calls += 1
            await super(MemoryWithTimes, self)._delete(keys[: len(keys) // 2])
            raise Interrupt
        return await super()._delete(keys)

    async def _get_into(self, keys, buffers, ranges):  # type: ignore[no-untyped-def]
        # ``reads`` counts objects read; the call that reaches ``crash_reads_at`` crashes.
        self.reads += len(keys)
        if self.reads - len(keys) < self.crash_reads_at <= self.reads:
            raise Interrupt
        return await super()._get_into(keys, buffers, ranges)


@pytest.mark.parametrize("where", ["parents", "delete"])
async def test_an_interrupted_gc_resumes_where_it_stopped(tmp_path: Path, where: str) -> None:
    store = Crashing({})
    chains = await write_chains(store, 40, 25)  # 1,000 pages, 2,000 objects
    budget = 2 * 1024 * 900  # about 300 pages must go
    expected = plan_gc([st async for st in store.list_entries()], now=0.0, max_bytes=budget,
                       max_age=None, parents={h: (c[i - 1] if i else None) for c in chains
                                              for i, h in enumerate(c)})
    state = tmp_path / "state"
    if where == "parents":
        store.crash_reads_at = 350  # 3 batches of 100 headers recorded, the 4th cut
    else:
        store.crash_deletes_at = 3
    with mock.patch.object(gc_ops, "DELETE_CHUNK", 100), \
            mock.patch.object(gc_ops, "HEADER_READS_IN_FLIGHT", 100), \
            mock.patch.object(gc_ops, "HEADER_BATCH", 10), pytest.raises(Interrupt):
        await collect_garbage(store, max_bytes=budget, max_age=None, state_dir=state)
    assert (state / "run.sqlite").exists(), "the working set survives the interruption"
    if where == "delete":
        gone = {h for c in chains for h in c} - await stored_pages(store)
        assert 0 < len(gone) < len(expected[1]) // 2
    reads = store.reads
    with mock.patch.object(gc_ops, "DELETE_CHUNK", 100):
        done = await collect_garbage(store, max_bytes=budget, max_age=None, state_dir=state)
    assert done.resumed_from == where
    # The resumed run reads only the headers not recorded before.
    assert store.reads - reads == (700 if where == "parents" else 0)
    assert done.headers_read == 1000
    assert done.deleted == len(expected[1]) and done.failures == 0
    left = await stored_pages(store)
    assert left == {h for c in chains for h in c} - {k.split("_")[0] for k in expected[1]}
    assert chains_are_prefixes(left, chains)
    assert not (state / "run.sqlite").exists(), "a finished run leaves only the parent cache"


async def test_other_options_start_over_and_two_runs_never_share_state(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = GcState(state)
    with pytest.raises(GcError, match="another gc is running"):
        GcState(state)
    first.close(finished=False)
    store = Crashing({})
    await write_chains(store, 4, 5)
    store.crash_deletes_at = 1
    with pytest.raises(Interrupt):
        await collect_garbage(store, max_bytes=0, max_age=None, state_dir=state)
    store.crash_deletes_at = 0
    other = await collect_garbage(store, max_bytes=10**9, max_age=None, state_dir=state)
    assert other.resumed_from is None and other.doomed == 0
    # The same options resume; ``fresh`` starts over (and rescans what is left).
    store.crash_deletes_at = store.delete_calls + 1
    with pytest.raises(Interrupt):
        await collect_garbage(store, max_bytes=0, max_age=None, state_dir=state)
    again = await collect_garbage(store, max_bytes=0, max_age=None, state_dir=state, fresh=True)
    assert again.resumed_from is None and again.scanned < 40
    assert await stored_pages(store) == set()


# -- the command ------------------------------------------------------------------------------------


def cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120,
                          check=False)


@pytest.mark.parametrize("command", [["gc", "--max-bytes", "1B", "--dry-run"], ["inspect"]])
def test_read_only_commands_never_create_an_fsspec_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    command: list[str],
) -> None:
    # fsspec makes its root directory at open: it declares creates_location, so these
    # commands open it with create=False.
    pytest.importorskip("fsspec")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    typo = tmp_path / "typo"
    assert main([command[0], f"fsspec+file://{typo}", *command[1:]]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(typo) in err and "nothing was created" in err
    assert not typo.exists()


@pytest.mark.parametrize("command", [["gc", "--max-bytes", "1B", "--dry-run"], ["inspect"],
                                     ["inspect", "--verify"]])
def test_read_only_commands_never_create_a_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    command: list[str],
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    typo = tmp_path / "typo"
    argv = [command[0], f"file://{typo}", *command[1:]]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(typo) in err and "nothing was created" in err
    assert not typo.exists()
    # An existing folder that holds no store: refused, and left exactly as it was.
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"meow")
    assert main([command[0], f"file://{folder}", *command[1:]]) == 1
    assert str(folder) in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["cat.jpg"]


def test_gc_json_and_progress_in_a_log(tmp_path: Path) -> None:
    import asyncio

    url = f"file://{tmp_path / 'store'}"

    async def setup() -> None:
        store = open_backend(url)
        await write_chains(store, 3, 4)
        await store.close()

    asyncio.run(setup())
    result = cli(["gc", url, "--max-bytes", "20KiB", "--json", "--yes"], tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["scanned"] == 24 and report["pages"] == 12
    assert report["over_budget"] == report["deleted"] == 20 and report["failures"] == 0
    # stderr is not a terminal here: plain lines per phase, never a carriage return.
    assert "\r" not in result.stderr
    for phase in ("gc scan", "gc parents", "gc delete"):
        assert phase in result.stderr, result.stderr
    quiet = cli(["gc", url, "--max-bytes", "20KiB", "--no-progress", "--yes"], tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert "deleted 0 expired and 0 over budget" in quiet.stdout


def _object_files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "objects").rglob("*_*"))


def test_gc_refuses_bare_numbers_and_most_of_the_store_without_yes(tmp_path: Path) -> None:
    """``--max-age 7`` used to mean 7 seconds and ``--max-bytes 5`` 5 bytes (either emptied
    the store, exit 0): units are required, and a plan that deletes more than half of the
    store asks for ``--yes``, saying how much; nothing is deleted until then."""
    import asyncio

    root = tmp_path / "store"
    url = f"file://{root}"

    async def setup() -> None:
        store = open_backend(url)
        await write_chains(store, 4, 5)  # 40 objects of 5,120 bytes
        await store.close()

    asyncio.run(setup())
    before = _object_files(root)
    for flags, hint in ((["--max-age", "7"], "give a unit: 7d, 7h, 7min or 7s"),
                        (["--max-bytes", "5"], "give a unit: 5GiB, 5MiB or 5B for bytes"),
                        (["--max-bytes", "5", "--dry-run"], "give a unit"),
                        (["--max-age", "7 days"], "expected a duration like 30min")):
        bare = cli(["gc", url, *flags, "--no-progress"], tmp_path)
        assert bare.returncode == 2 and hint in bare.stderr, (flags, bare.stderr)
        assert len(bare.stderr.strip().splitlines()) == 1
    assert _object_files(root) == before
    most = cli(["gc", url, "--max-bytes", "40KiB", "--no-progress"], tmp_path)
    assert most.returncode == 2, most.stdout
    line = most.stderr.strip()
    assert len(line.splitlines()) == 1
    assert "would delete 32 of 40 objects (80%) and 160.0 KiB of 200.0 KiB (80%)" in line
    assert "nothing was deleted" in line and "--yes" in line and "--dry-run" in line
    assert _object_files(root) == before
    dry = cli(["gc", url, "--max-bytes", "40KiB", "--dry-run", "--no-progress"], tmp_path)
    assert dry.returncode == 0 and "would delete 0 expired and 32 over budget" in dry.stdout
    half = cli(["gc", url, "--max-bytes", "100KiB", "--no-progress"], tmp_path)  # 20 of 40
    assert half.returncode == 0 and "deleted 0 expired and 20 over budget" in half.stdout
    assert len(_object_files(root)) == 20
    refused = cli(["gc", url, "--max-bytes", "0B", "--no-progress"], tmp_path)
    assert refused.returncode == 2 and "20 of 20 objects (100%)" in refused.stderr
    confirmed = cli(["gc", url, "--max-bytes", "0B", "--no-progress", "--yes"], tmp_path)
    assert confirmed.returncode == 0, confirmed.stderr
    assert "resumed an interrupted gc (at its delete phase)" in confirmed.stdout
    assert _object_files(root) == []


@pytest.mark.slow
def test_gc_killed_mid_run_resumes(tmp_path: Path) -> None:
    # A real kill (SIGKILL) of the command while it deletes, then the same command again.
    import asyncio

    root = tmp_path / "store"

    async def setup() -> list[list[str]]:
        store = open_backend(f"file://{root}")
        chains = await write_chains(store, 1, 2000)
        await store.close()
        return chains

    chains = asyncio.run(setup())
    # A slow store: every call waits 0.5 s; 4,000 objects are 4 delete calls of 1,000.
    url = f"faulty://?inner=file://{root}&latency_s=0.5"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.Popen([*CLI, "gc", url, "--max-bytes", "0B", "--yes"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("gc delete"):
            break
    # Kill once the first delete call has removed objects (polled, not timed: on a loaded
    # machine a fixed sleep can land before any delete or after the last one).
    objects = root / "objects"
    total = sum(1 for _ in objects.rglob("*_*"))
    deadline = time.monotonic() + 60
    while sum(1 for _ in objects.rglob("*_*")) == total and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = {p.name.split("_")[0] for p in (root / "objects").rglob("*_*")}
    assert 0 < len(left) < 2000 and chains_are_prefixes(left, chains)
    again = cli(["gc", url, "--max-bytes", "0B", "--yes"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resumed an interrupted gc (at its delete phase)" in again.stdout
    assert not any((root / "objects").rglob("*_*"))


async def listed_times(store: Backend) -> dict[str, float | None]:
    return {st.key: st.mtime async for st in store.list_entries("")}


async def test_gc_and_inspect_reads_leave_the_last_use_times(tmp_path: Path) -> None:
    """The file backend lists each object's last write or read as its mtime (its eviction
    rank): gc's header reads and inspect --verify's reads must not move it, or one run would
    make the whole store look just used (the next age-based gc would expire nothing)."""
    from hicache_store.ops.inspection import inspect_store

    store = open_backend(f"file://{tmp_path / 'store'}")
    await write_chains(store, 2, 3)
    before = await listed_times(store)
    await asyncio.sleep(0.01)  # ranks have ms resolution: a counted read would move every time
    dry = await collect_garbage(store, max_bytes=0, max_age=None, dry_run=True)
    assert dry.headers_read == 6
    report = await inspect_store(store, verify=True)
    assert report.verify is not None and report.verify.checked == len(before)
    await store.close()  # writes any buffered read recency to the index
    store = open_backend(f"file://{tmp_path / 'store'}")
    assert await listed_times(store) == before
    # The control: an engine's read of the same objects is a use.
    key = next(iter(before))
    assert await ObjectIO(store).read_object(key) is not None
    await store.close()
    store = open_backend(f"file://{tmp_path / 'store'}")
    after = await listed_times(store)
    assert after[key] is not None and before[key] is not None and after[key] > before[key]
    await store.close()
