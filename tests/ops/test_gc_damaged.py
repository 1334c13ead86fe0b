"""gc on damaged file stores: one bad object of a page must neither hole its chain nor stop
every run; a store that fails every read still stops the run (resumable). And a key prefix,
which would hole every chain, is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicache_store.backends import Backend, open_backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.backends.file import FileBackend
from hicache_store.cli import main
from hicache_store.ops.gc import GcError, collect_garbage
from hicache_store.testing.chains import chain_objects, chains_are_prefixes, write_chains


async def stored_pages(store: Backend) -> set[str]:
    return {k.split("_")[0] async for k in store.list_prefix()}


async def stored_bytes(store: Backend) -> int:
    return sum([st.size async for st in store.list_entries("")])


def file_store(tmp_path: Path) -> FileBackend:
    store = open_backend(f"file://{tmp_path / 'store'}")
    assert isinstance(store, FileBackend)
    return store


def damage(store: FileBackend, key: str, how: str, chain: list[str]) -> bytes | None:
    """Damage one stored object; the bytes to put under ``key`` instead, if any."""
    objects = chain_objects(chain)
    if how == "foreign":  # another page's valid object under this key
        return objects[min(k for k in objects if k.startswith(chain[1]))]
    if how == "truncated":
        return objects[key][:100]
    path = store.path_of(key)
    os.unlink(path)  # behind the index's back: it still lists the key
    if how == "directory":  # the store cannot read it (as a file without read permission)
        os.mkdir(path)
    return None


@pytest.mark.parametrize("how", ["foreign", "truncated", "vanished", "directory"])
async def test_one_damaged_object_of_a_page_does_not_hole_its_chain(
    tmp_path: Path, how: str
) -> None:
    """Page 3's first object (the one gc reads the page's parent from) is damaged; its
    other object is intact and names page 2 as the parent. Over budget by one page, gc must
    drop the chain's tail (page 5), not page 2: page 3's intact object and pages 4-5 would
    be stranded behind the hole (a reader of head group 1 stops at page 2)."""
    store = file_store(tmp_path)
    (chain,) = await write_chains(store, 1, 6)
    first = min(k for k in chain_objects(chain) if k.startswith(chain[3]))
    replacement = damage(store, first, how, chain)
    if replacement is not None:
        await store.put([first], [replacement])
    budget = await stored_bytes(store) - 1
    report = await collect_garbage(store, max_bytes=budget, max_age=None,
                                   state_dir=tmp_path / "gc")
    left = await stored_pages(store)
    assert chains_are_prefixes(left, [chain]), sorted(left)
    assert left == set(chain[:5])
    assert report.over_budget_pages == 1 and report.headers_unreadable == 0
    await store.close()


async def test_a_page_the_store_cannot_read_at_all_is_counted_not_fatal(tmp_path: Path) -> None:
    """Every object of page 3 unreadable (a directory under each key: EISDIR, as EACCES for
    a file without read permission when not root): gc used to stop at it on every run,
    never bounding the store again. It is an unreadable header (a chain of its own)."""
    store = file_store(tmp_path)
    (chain,) = await write_chains(store, 1, 6)
    for key in (k for k in chain_objects(chain) if k.startswith(chain[3])):
        damage(store, key, "directory", chain)
    report = await collect_garbage(store, max_bytes=0, max_age=None, dry_run=True,
                                   state_dir=tmp_path / "gc")
    assert report.headers_unreadable == 1 and report.pages == 6
    assert report.doomed == 12  # every object is planned; the dry run deletes none
    assert await stored_pages(store) == set(chain)
    await store.close()


async def test_a_store_that_fails_every_header_read_stops_the_run(tmp_path: Path) -> None:
    """Reading key by key must not turn a store that is down into "every header unreadable"
    (every page a chain of its own: parents planned before their children)."""
    inner = open_backend(f"file://{tmp_path / 'store'}")
    (chain,) = await write_chains(inner, 1, 6)
    store = FaultyBackend(inner, FaultConfig())

    def progress(phase: str, done: int, total: int | None) -> None:
        if phase == "parents":
            store.faults = FaultConfig(read_error_rate=1.0)

    with pytest.raises(GcError, match="reading object headers failed"):
        await collect_garbage(store, max_bytes=0, max_age=None, state_dir=tmp_path / "gc",
                              progress=progress)
    assert await stored_pages(inner) == set(chain)
    store.faults = FaultConfig()
    report = await collect_garbage(store, max_bytes=0, max_age=None, state_dir=tmp_path / "gc")
    assert report.resumed_from == "parents" and report.deleted == 12
    await store.close()


async def test_a_key_prefix_is_refused_before_it_holes_every_chain(tmp_path: Path) -> None:
    """Page hashes are spread over the key space: ``--prefix a`` saw pages 1, 3 and 5 of this
    chain without their children, took each for a tail and deleted them, leaving 0, 2, 4."""
    store = file_store(tmp_path)
    chain = [f"{c}{i:031x}" for i, c in enumerate("bababa")]
    objects = chain_objects(chain)
    await store.put(list(objects), list(objects.values()))
    with pytest.raises(GcError, match="a key prefix is refused"):
        await collect_garbage(store, max_bytes=0, max_age=None, prefix="a",
                              state_dir=tmp_path / "gc")
    assert await stored_pages(store) == set(chain)
    await store.close()


def test_the_cli_refuses_a_key_prefix_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path / 'store'}"
    code = main(["gc", url, "--prefix", "a", "--max-bytes", "0B"])
    assert code == 2 and "a key prefix is refused" in capsys.readouterr().err
    assert not (tmp_path / "store").exists(), "refused before the store was opened"
