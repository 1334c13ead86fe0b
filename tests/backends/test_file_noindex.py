"""The file backend with ``index=none`` (a root several hosts write; ``_file_noindex``)."""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_file import FileOracle

from hicache_store.backends import Backend, BackendError, open_backend
from hicache_store.backends.file import FileBackend
from hicache_store.testing import BackendTests, pattern


class TestFileBackendNoIndex(FileOracle, BackendTests):
    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        store = open_backend(f"file://{tmp_path}/store?index=none", capacity_bytes="256MiB")
        assert isinstance(store, FileBackend) and store.index_kind == "none"
        yield store
        await store.close()


def on_disk(store: FileBackend) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (store.root / "objects").glob("*/*/*")}


async def test_no_index_is_kept_and_other_writers_are_seen_at_once(tmp_path: Path) -> None:
    first = FileBackend(tmp_path / "s", index="none")
    second = FileBackend(tmp_path / "s", index="none")  # another host, as far as it knows
    assert not (tmp_path / "s" / "index").exists()
    await first.put(["a0", "a1"], [b"x" * 10, b"y" * 20])
    assert await second.exists(["a0", "a1", "a2"]) == [True, True, False]
    assert sorted([k async for k in second.list_prefix("a")]) == ["a0", "a1"]
    assert await second.delete(["a1"]) == [True]
    assert await first.exists(["a1"]) == [False]
    await first.close()
    await second.close()
    third = FileBackend(tmp_path / "s", index="none")
    assert third.used_bytes == 10  # a store this small is measured, not estimated
    await third.close()


async def test_capacity_holds_and_a_call_loses_its_tail_first(tmp_path: Path) -> None:
    size = 100_000
    store = FileBackend(tmp_path / "s", index="none", capacity_bytes=6 * size)
    chain = [f"c{i}" for i in range(4)]
    await store.put(chain, [pattern(size, i) for i in range(4)])
    await store.put(["d0", "d1"], [pattern(size, 8), pattern(size, 9)])
    await store.put(["d2"], [pattern(size, 10)])  # one must go: the chain's tail
    assert [store.path_of(k).exists() for k in chain] == [True, True, True, False]
    for i in range(20):
        await store.put([f"e{i:02d}"], [pattern(size, 20 + i)])
        assert sum(on_disk(store).values()) <= 6 * size
    assert store.used_bytes == sum(on_disk(store).values())
    assert store.stats.evictions == 20 + 1
    await store.close()


async def test_eviction_goes_past_an_undeletable_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 300_000
    store = FileBackend(tmp_path / "s", index="none", capacity_bytes=1 << 20)
    await store.put(["a0"], [pattern(size, 0)])
    await store.put(["a1", "a2"], [pattern(size, 1), pattern(size, 2)])
    stuck = str(store.path_of("a0"))
    real_unlink = os.unlink

    def unlink(path: str, *args: object, **kwargs: object) -> None:
        if str(path) == stuck:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    await store.put(["b0"], [pattern(size, 7)])
    assert store.stats.eviction_failures >= 1 and store.stats.evictions == 1
    assert store.path_of("a0").exists() and await store.get_bytes("b0") == pattern(size, 7)
    await store.close()


async def test_one_root_one_index(tmp_path: Path) -> None:
    await FileBackend(tmp_path / "a", index="none").close()
    with pytest.raises(BackendError, match="index=none"):
        FileBackend(tmp_path / "a")
    await FileBackend(tmp_path / "b").close()
    with pytest.raises(BackendError, match="index=sqlite"):
        FileBackend(tmp_path / "b", index="none")
    with pytest.raises(ValueError, match="index must be one of"):
        FileBackend(tmp_path / "c", index="maybe")  # type: ignore[arg-type]
