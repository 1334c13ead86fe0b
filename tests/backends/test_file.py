"""The conformance suite on the file backend, then what only the file backend promises."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hicache_store.backends import (
    Backend,
    ByteRange,
    CapacityError,
    NotFoundError,
    NotSupportedError,
    ObjectStat,
    OutOfSpaceError,
    aligned_buffer,
    open_backend,
)
from hicache_store.backends import _file_io as file_io
from hicache_store.backends._aligned import is_aligned
from hicache_store.backends.errors import BackendIOError
from hicache_store.backends.file import FileBackend
from hicache_store.layout.errors import InvalidKeyError
from hicache_store.testing import INVALID_KEYS, BackendTests, pattern


class FileOracle:
    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, FileBackend)
        path = backend.path_of(key)
        return path.read_bytes() if path.exists() else None

    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, FileBackend)
        path = backend.path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        await backend.adopt([key])  # files placed behind the backend's back join the index

    async def reopen(self, backend: Backend) -> Backend | None:
        assert isinstance(backend, FileBackend)
        return FileBackend(backend.root, durability=backend.durability, index=backend.index_kind)

    def missing_location(self, backend: Backend, path: Path) -> str:
        assert isinstance(backend, FileBackend)
        return f"file://{path}?index={backend.index_kind}"


class TestFileBackend(FileOracle, BackendTests):
    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        store = open_backend(f"file://{tmp_path}/store?durability=data", capacity_bytes="256MiB")
        yield store
        await store.close()


class TestFileBackendBufferedNoSync(FileOracle, BackendTests):
    """The other code paths: buffered I/O only, no flushes, two threads."""

    stateful_max_examples = 5

    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        store = open_backend(
            {"url": f"file://{tmp_path}/s", "durability": "none", "direct_io": "never",
             "io_threads": "2"}
        )
        yield store
        await store.close()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FileBackend]:
    backend = FileBackend(tmp_path / "store", durability="full", capacity_bytes=1 << 20)
    yield backend
    await backend.close()


async def test_layout_is_sharded_and_temp_free(store: FileBackend) -> None:
    keys = [f"{i:064x}" for i in range(50)]
    await store.put(keys, [b"x"] * 50)
    files = [p for p in (store.root / "objects").rglob("*") if p.is_file()]
    assert len(files) == 50
    for path in files:
        rel = path.relative_to(store.root / "objects")
        assert len(rel.parts) == 3 and all(len(part) == 2 for part in rel.parts[:2])
    assert list((store.root / "tmp").iterdir()) == []


async def test_invalid_keys_never_touch_the_filesystem(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    touched: list[str] = []

    def spy(name: str) -> object:
        real = getattr(os, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            touched.append(name)
            return real(*args, **kwargs)

        return wrapper

    for name in ("open", "stat", "unlink", "rename", "link", "makedirs", "scandir"):
        monkeypatch.setattr(os, name, spy(name))
    for bad in [*INVALID_KEYS, "a/b", "..", "\x00", "k" * 10_000]:
        with pytest.raises(InvalidKeyError):
            await store.put([bad], [b"x"])  # type: ignore[list-item]
        with pytest.raises(InvalidKeyError):
            await store.get_into([bad], [bytearray(1)])  # type: ignore[list-item]
        with pytest.raises(InvalidKeyError):
            await store.exists([bad])  # type: ignore[list-item]
        with pytest.raises(InvalidKeyError):
            await store.delete([bad])  # type: ignore[list-item]
    assert touched == []


async def test_exists_finds_objects_of_another_writer_and_after_restart(tmp_path: Path) -> None:
    first = FileBackend(tmp_path / "s")
    second = FileBackend(tmp_path / "s")  # another "process": its own index
    await first.put(["a0"], [b"from first"])
    assert await second.exists(["a0", "a1"]) == [True, False]
    assert await second.get_bytes("a0") == b"from first"
    await second.put(["a1"], [b"from second"])
    assert await first.exists_prefix_length(["a0", "a1", "a2"]) == 2
    await first.close()
    await second.close()
    third = FileBackend(tmp_path / "s")
    assert await third.exists(["a0", "a1"]) == [True, True]
    assert third.used_bytes == len(b"from first") + len(b"from second")
    await third.close()


async def test_capacity_evicts_chain_tails_first(store: FileBackend) -> None:
    size = 200 * 1024  # capacity 1 MiB: five objects fit
    chain = [f"c{i}" for i in range(4)]
    await store.put(chain, [pattern(size, i) for i in range(4)])
    await store.put(["d0"], [pattern(size, 9)])
    await store.put(["d1"], [pattern(size, 10)])  # one must go: the chain's deepest page
    assert [store.path_of(k).exists() for k in chain] == [True, True, True, False]
    await store.get_into(["c0"], [bytearray(size)])  # the prefix is read again
    await store.put(["d2", "d3"], [pattern(size, 11), pattern(size, 12)])
    assert [store.path_of(k).exists() for k in chain] == [True, False, False, False]
    assert store.used_bytes <= store.capacity_bytes
    assert store.stats.evictions == 3


async def test_eviction_keeps_going_past_an_undeletable_object(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 300 * 1024
    await store.put(["a0", "a1", "a2"], [pattern(size, i) for i in range(3)])
    stuck = str(store.path_of("a2"))
    real_unlink = os.unlink

    def unlink(path: str, *args: object, **kwargs: object) -> None:
        if str(path) == stuck:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    await store.put(["b0"], [pattern(size, 7)])
    assert store.stats.eviction_failures == 1
    assert store.path_of("a2").exists() and not store.path_of("a1").exists()
    assert await store.get_bytes("a2") == pattern(size, 2)
    assert await store.get_bytes("b0") == pattern(size, 7)


async def test_capacity_error_when_nothing_can_be_evicted(
    store: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.put(["a0"], [b"x" * 700_000])
    monkeypatch.setattr(os, "unlink", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "no")))
    with pytest.raises(CapacityError):
        await store.put(["a1"], [b"y" * 700_000])
    with pytest.raises(CapacityError):
        await store.put(["a2"], [b"z" * (2 << 20)])
    assert await store.get_bytes("a0") == b"x" * 700_000


async def test_stale_temp_files_are_removed_at_open(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s")
    await store.close()
    tmp = tmp_path / "s" / "tmp"
    dead = tmp / "999999999-deadbeef-0.tmp"  # no such pid
    dead.write_bytes(b"torn")
    live = tmp / f"{os.getpid()}-cafe-0.tmp"  # a live writer's: left alone
    live.write_bytes(b"in flight")
    garbage = tmp / "whatever"
    garbage.write_bytes(b"?")
    again = FileBackend(tmp_path / "s")
    assert again.removed_temp_files == 2
    assert sorted(p.name for p in tmp.iterdir()) == [live.name]
    assert [k async for k in again.list_prefix("")] == []
    await again.close()


async def test_foreign_files_are_neither_listed_nor_evicted(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s", capacity_bytes=1000)
    foreign = tmp_path / "s" / "objects" / "00" / "00" / "notes.txt"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("mine")
    await store.put(["a0"], [b"x" * 600])
    await store.put(["a1"], [b"x" * 600])
    assert foreign.exists()
    assert [k async for k in store.list_prefix("")] == ["a1"]
    await store.close()


@pytest.mark.parametrize("index", ["rebuilt", "none"])
async def test_entries_that_are_not_files_are_never_objects(tmp_path: Path, index: str) -> None:
    """A directory or a symlink under a key's name in a shard directory (an operator's mkdir,
    a copy tool's link) is not an object: a rebuilt index, or a store without one, must not
    list it, report it present, or hand it to gc, whose read of it failed with EISDIR."""
    from hicache_store.backends.file_layout import shard_of

    root = tmp_path / "s"
    url = f"file://{root}" + ("?index=none" if index == "none" else "")
    store = open_backend(url)
    assert isinstance(store, FileBackend)
    await store.put(["a0"], [b"kept"])
    await store.close()
    for name in ("beef", "cafe"):
        top, sub = shard_of(name)
        (root / "objects" / top / sub).mkdir(parents=True, exist_ok=True)
    os.mkdir(root / "objects" / "/".join(shard_of("beef")) / "beef")
    os.symlink(store.path_of("a0"), root / "objects" / "/".join(shard_of("cafe")) / "cafe")
    if index == "rebuilt":
        shutil.rmtree(root / "index")
    again = open_backend(url)
    assert [k async for k in again.list_prefix("")] == ["a0"]
    assert [st.key async for st in again.list_entries("")] == ["a0"]
    assert await again.exists(["a0", "beef", "cafe"]) == [True, False, False]
    await again.close()


async def test_a_fifo_under_a_key_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """A FIFO put in place of an object file (the index still lists the key): opening it for
    reading blocked until some process opened it for writing, and a read waits for its I/O
    whatever its caller does, so the read hung for good. A watchdog opens the FIFO for
    writing after 20 s, so that a regression fails here instead of hanging the suite."""
    import threading

    store = FileBackend(tmp_path / "s")
    await store.put(["a0"], [b"x" * 100])
    path = store.path_of("a0")
    os.unlink(path)
    os.mkfifo(path)
    done = threading.Event()
    unblocked = threading.Event()

    def watchdog() -> None:
        if not done.wait(20):
            unblocked.set()
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        with pytest.raises(BackendIOError, match="not a regular file"):
            await store.get_bytes("a0")
    finally:
        done.set()
    assert not unblocked.is_set(), "the read waited for a writer to open the FIFO"
    await store.close()


def test_another_layout_is_refused(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "layout.json").write_text('{"format": "something-else"}')
    with pytest.raises(Exception, match="another layout"):
        FileBackend(tmp_path / "s")


def test_missing_root_without_create(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_backend(f"file://{tmp_path}/nope?create=false")


async def test_enospc_from_the_filesystem_is_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the Python writes, whose pwrite fails
    store = FileBackend(tmp_path / "store", durability="full", capacity_bytes=1 << 20,
                        io_engine="posix")
    await store.put(["a0"], [b"kept"])
    real_pwrite = os.pwrite

    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OutOfSpaceError):
        await store.put(["a1", "a2"], [b"x" * 5000, aligned_buffer(8192)])
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert await store.exists(["a1", "a2"]) == [False, False]
    assert await store.get_bytes("a0") == b"kept"
    assert list((store.root / "tmp").iterdir()) == []
    await store.close()


async def test_stat_reports_size_and_mtime(store: FileBackend) -> None:
    await store.put(["a0"], [b"12345"])
    (st,) = await store.stat(["a0"])
    assert isinstance(st, ObjectStat) and st.size == 5 and st.mtime is not None


async def test_direct_io_paths_round_trip(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s", direct_io="auto")
    size = 2 * (1 << 20) + 123
    src = aligned_buffer(size)
    src[:] = pattern(size, 1)
    await store.put(["a0"], [src])
    dst = aligned_buffer(size)
    assert await store.get_into(["a0"], [dst]) == [size]
    assert bytes(dst) == bytes(src)
    unaligned = bytearray(size + 1)
    assert await store.get_into(["a0"], [memoryview(unaligned)[1:]]) == [size]
    assert bytes(unaligned[1:]) == bytes(src)
    await store.close()


@pytest.mark.parametrize("populate", [False, True])
async def test_aligned_buffers_take_direct_reads(tmp_path: Path, populate: bool) -> None:
    # Populated buffers (huge-page advice, faulted in) behave like plain ones: aligned,
    # zero-filled, writable, private to the process, and O_DIRECT reads land in them exactly.
    size = 4 * (1 << 20) + 4096
    buf = aligned_buffer(size, populate=populate)
    assert len(buf) == size and not buf.readonly
    assert is_aligned(buf) and not any(bytes(buf[:: 1 << 16]))
    store = FileBackend(tmp_path / "s", direct_io="auto")
    src = aligned_buffer(size)
    src[:] = pattern(size, 3)
    await store.put(["a7"], [src])
    assert await store.get_into(["a7"], [buf]) == [size]
    assert bytes(buf) == bytes(src)
    await store.close()
    assert aligned_buffer(0, populate=populate) == b""
    with pytest.raises(ValueError):
        aligned_buffer(-1, populate=populate)


async def test_scatter_read_direct_and_buffered_paths_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pure-Python read path (the C accelerator's: test_file_released_reads.py).
    store = FileBackend(tmp_path / "s", direct_io="auto", io_engine="posix")
    if not store.direct_io:
        pytest.skip("the filesystem under tmp_path has no O_DIRECT")
    size = 4096 + 2 * (1 << 20) + 17  # header block, payload, an unaligned tail
    src = aligned_buffer(size)
    src[:] = pattern(size, 2)
    await store.put(["a0"], [src])
    direct: list[int] = []
    real = file_io._pread_direct

    def spy(fd: int, views: list[memoryview], offset: int, length: int) -> None:
        direct.append(len(views))
        real(fd, views, offset, length)

    monkeypatch.setattr(file_io, "_pread_direct", spy)
    whole = ByteRange(0, size)
    # Aligned buffers, aligned offset: O_DIRECT, both buffers in one vectored read.
    header, payload = aligned_buffer(4096), aligned_buffer(size - 4096)
    assert await store.get_scatter("a0", [header, payload], whole) == size
    assert direct == [2]
    assert bytes(header) + bytes(payload) == bytes(src)
    # A misaligned buffer forces the buffered path: the same bytes.
    raw = bytearray(size - 4096 + 1)
    header2 = aligned_buffer(4096)
    assert await store.get_scatter("a0", [header2, memoryview(raw)[1:]], whole) == size
    assert bytes(header2) + bytes(raw[1:]) == bytes(src)
    # So does a first buffer that is not a whole number of blocks, or an unaligned offset.
    small, rest = aligned_buffer(100), aligned_buffer(size - 100)
    assert await store.get_scatter("a0", [small, rest], whole) == size
    assert bytes(small) + bytes(rest) == bytes(src)
    part = aligned_buffer(size - 4097)
    assert await store.get_scatter("a0", [part], ByteRange(4097, size)) == size - 4097
    assert bytes(part) == bytes(src[4097:])
    assert direct == [2], "only the aligned read may use O_DIRECT"
    await store.close()


async def test_scatter_read_resumes_after_short_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # preadv may move fewer bytes than asked (signals, the kernel's per-call limit): the read
    # goes on from where it stopped, across buffer boundaries.
    # the pure-Python read path
    store = FileBackend(tmp_path / "s", direct_io="never", io_engine="posix")
    data = pattern(10_000, 4)
    await store.put(["a0"], [data])
    real = os.preadv

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real(fd, [memoryview(buffers[0])[:777]], offset)

    monkeypatch.setattr(os, "preadv", short)
    buffers = [bytearray(1000), bytearray(3), bytearray(8997)]
    assert await store.get_scatter("a0", buffers, ByteRange(0, 10_000)) == 10_000
    assert b"".join(buffers) == data
    monkeypatch.undo()
    await store.close()


async def test_a_batch_of_small_reads_is_a_few_pool_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One pool hand-off per key costs more than a 4 KiB read: a batch is split into at most
    # io_threads runs, and every run has finished when the call returns.
    store = FileBackend(tmp_path / "s", io_threads=4)
    keys = [f"{i:04x}" for i in range(100)]
    await store.put(keys, [pattern(5000, i) for i in range(100)])
    jobs: list[str] = []
    real_run = store._run_io

    async def counting(fn: object, *args: object) -> object:
        jobs.append(getattr(fn, "__name__", "?"))
        return await real_run(fn, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "_run_io", counting)
    bufs = [bytearray(4096) for _ in keys]
    got = await store.get_into(keys, bufs, [ByteRange(500, 4596)] * 100)
    assert got == [4096] * 100
    assert all(bytes(b) == pattern(5000, i)[500:4596] for i, b in enumerate(bufs))
    assert jobs.count("_read_run") == 4
    await store.close()


def _tree(root: Path) -> list[tuple[str, int]]:
    """Every file and its size, less SQLite's log and shared memory (which any reader of a
    WAL database makes where no process has it open)."""
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*")
                  if p.is_file() and not p.name.endswith(("-shm", "-wal")))


async def test_a_read_only_open_reads_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = FileBackend(root, durability="none", direct_io="never")
    await store.put(["aa00_b", "aa01_b"], [b"x" * 100, b"y" * 200])
    await store.close()
    shutil.rmtree(root / "tmp")
    before = _tree(root)
    reader = FileBackend(root, read_only=True)
    try:
        assert await reader.exists(["aa00_b", "ab00_b"]) == [True, False]
        assert await reader.get_bytes("aa01_b") == b"y" * 200
        assert await reader.get_bytes("ab00_b") is None  # a miss repairs nothing
        assert sorted([k async for k in reader.list_prefix("")]) == ["aa00_b", "aa01_b"]
        assert not reader.capabilities.retention
        for call in (reader.put(["ab00_b"], [b"z"]), reader.delete(["aa00_b"]),
                     reader.put_if_absent("ab00_b", b"z"), reader.adopt(["aa00_b"]),
                     reader.delete_until_held([["aa00_b"]])):
            with pytest.raises(NotSupportedError, match="read-only"):
                await call
    finally:
        await reader.close()
    assert _tree(root) == before  # no temp dir, no host record, no use recorded
    # A root whose index is gone is read from its files, and is not indexed by the reader.
    shutil.rmtree(root / "index")
    reader = FileBackend(root, read_only=True)
    try:
        assert await reader.exists(["aa00_b", "aa01_b"]) == [True, True]
    finally:
        await reader.close()
    assert not (root / "index").exists()
    with pytest.raises(NotFoundError):
        FileBackend(tmp_path / "absent", read_only=True)
    assert not (tmp_path / "absent").exists()
