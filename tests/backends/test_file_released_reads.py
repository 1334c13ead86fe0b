"""The file backend's batched reads and writes through the C accelerator (``backends/_fileio.c``):
the same bytes, misses and errors as the pure-Python path, the same read policy (O_DIRECT for
aligned cold reads, buffered for cached bytes), nothing written past what was read, checksums
equal to xxhash's, and the same files written."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash

from hicache_store.backends import _file_io as engines
from hicache_store.backends import aligned_buffer
from hicache_store.backends._file_io import SUMS_IN_C, PosixEngine
from hicache_store.backends._pagecache import is_cached
from hicache_store.backends.errors import (
    BackendClosedError,
    BackendIOError,
    InvalidRangeError,
    NotSupportedError,
)
from hicache_store.backends.file import FileBackend
from hicache_store.backends.file_layout import object_path
from hicache_store.backends.types import ByteRange

fileio = pytest.importorskip(
    "hicache_store.backends._fileio", reason="the C accelerator is not built (setup.py)")


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed * 7) % 251 for i in range(n))


SIZES = [4096 * 3, 5000, 4096 + 65536, 1]


async def read_batch(store: FileBackend, keys: list[str], ranges: list[ByteRange | None],
                     aligned: bool) -> tuple[list[int | None], list[bytes]]:
    def buffer(n: int) -> memoryview:
        return aligned_buffer(n) if aligned else memoryview(bytearray(n + 1))[1:]

    bufs = [buffer(70_000) for _ in keys]
    got = await store.get_into(keys, bufs, ranges)
    return got, [bytes(b) for b in bufs]


async def stored_patterns(tmp_path: Path) -> tuple[FileBackend, list[str]]:
    """A file store holding one object of each of ``SIZES`` (``pattern`` bytes), and its keys."""
    store = FileBackend(tmp_path / "s", io_threads=2)
    assert store.io_engine == "native"
    keys = [f"{i:04x}" for i in range(len(SIZES))]
    await store.put(keys, [pattern(n, i) for i, n in enumerate(SIZES)])
    return store, keys


async def with_python_engine(store: FileBackend) -> FileBackend:
    """``store`` closed and its root opened again with the posix engine (the Python reads)."""
    await store.close()
    python = FileBackend(store.root, io_threads=store.io_threads, io_engine="posix")
    assert python.io_engine == "posix"
    return python


@pytest.mark.parametrize("aligned", [True, False])
async def test_the_released_path_reads_what_the_python_path_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aligned: bool
) -> None:
    store, keys = await stored_patterns(tmp_path)
    asked = [*keys, "ffff", keys[0], keys[2]]
    ranges = [None] * len(keys) + [None, ByteRange(4096, 8192), ByteRange(100, 4196)]
    released = await read_batch(store, asked, ranges, aligned)
    store = await with_python_engine(store)
    python = await read_batch(store, asked, ranges, aligned)
    assert released == python
    got, data = released
    assert got == [*SIZES, None, 4096, 4096]
    for i, n in enumerate(SIZES):
        assert data[i][:n] == pattern(n, i)
        assert data[i][n:] == bytes(70_000 - n), "nothing written past the object"
    assert data[5][:4096] == pattern(SIZES[0], 0)[4096:8192]
    await store.close()


@pytest.mark.parametrize("aligned", [True, False])
async def test_a_scatter_read_is_the_python_paths_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aligned: bool
) -> None:
    store = FileBackend(tmp_path / "s")
    size = 4096 + 65536 + 17  # header block, payload, an unaligned tail
    await store.put(["a0"], [pattern(size, 5)])
    assert store.io_engine == "native"

    def buffers() -> list[memoryview]:
        if aligned:
            return [aligned_buffer(4096), aligned_buffer(size - 4096)]
        return [memoryview(bytearray(4097))[1:], memoryview(bytearray(size - 4096))]

    out = []
    for accelerated in (True, False):
        if not accelerated:
            store = await with_python_engine(store)
        head, body = buffers()
        assert await store.get_scatter("a0", [head, body], None) == size
        part = aligned_buffer(8192)
        assert await store.get_scatter("a0", [part], ByteRange(4096, 12288)) == 8192
        with pytest.raises(InvalidRangeError):
            await store.get_scatter("a0", [aligned_buffer(4096)], None)
        assert await store.get_scatter("ffff", [aligned_buffer(4096)], None) is None
        out.append((bytes(head) + bytes(body), bytes(part)))
    assert out[0] == out[1]
    assert out[0][0] == pattern(size, 5)
    await store.close()


async def test_a_read_is_used_by_the_run_and_not_the_python_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The accelerated path really runs (the Python per-key reader is never called).
    store = FileBackend(tmp_path / "s")
    await store.put(["a0"], [pattern(9000, 1)])

    def refuse(*args: object) -> None:
        raise AssertionError("the per-key Python reader ran")

    monkeypatch.setattr(PosixEngine, "_read_into", refuse)
    monkeypatch.setattr(PosixEngine, "read", refuse)
    buf = bytearray(9000)
    assert await store.get_into(["a0"], [buf], [None]) == [9000]
    assert bytes(buf) == pattern(9000, 1)
    await store.close()


async def test_a_miss_repairs_the_index(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s")
    await store.put(["a0", "a1"], [pattern(100, 0), pattern(100, 1)])
    store.path_of("a1").unlink()  # gone behind the index's back
    assert await store.exists(["a1"]) == [True]
    assert await store.get_into(["a0", "a1"], [bytearray(100), bytearray(100)], [None, None]) == [
        100, None]
    assert await store.exists(["a1"]) == [False]
    await store.close()


@pytest.mark.parametrize(
    ("buffer", "rng", "error"),
    [
        (100, None, InvalidRangeError),  # the object does not fit
        (100, ByteRange(4950, 5050), InvalidRangeError),  # the range reaches past its end
    ],
)
async def test_errors_are_the_python_paths_and_the_batch_still_reads_the_rest(
    tmp_path: Path, buffer: int, rng: ByteRange | None, error: type[Exception]
) -> None:
    store = FileBackend(tmp_path / "s")
    await store.put(["a0", "a1"], [pattern(5000, 0), pattern(300, 1)])
    ok = bytearray(300)
    with pytest.raises(error):
        await store.get_into(["a0", "a1"], [bytearray(buffer), ok], [rng, None])
    await store.close()


async def test_a_fifo_under_a_key_is_an_error_not_a_hang(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s")
    await store.put(["a0"], [pattern(10, 0)])
    path = store.path_of("a0")
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(BackendIOError, match="not a regular file"):
        await store.get_into(["a0"], [bytearray(10)], [None])
    await store.close()


def test_a_short_file_is_reported_not_filled(tmp_path: Path) -> None:
    # The module's own contract: a range inside the size but a file that ends early cannot
    # happen through one fd; a range outside is status 3, a missing file status 1 (ENOENT).
    path = tmp_path / "f"
    path.write_bytes(pattern(5000, 3))
    buf = bytearray(6000)
    (status, value, size, _, _), = fileio.read_files([(str(path), [buf], 0, 6000, False)])
    assert (status, size) == (3, 5000)
    assert buf == bytearray(6000)
    (status, value, size, _, _), = fileio.read_files([(str(tmp_path / "none"), [buf], 0, -1, False)])
    assert (status, value, size) == (1, 2, -1)
    two = [bytearray(1000), bytearray(10_000)]
    (status, value, size, _, _), = fileio.read_files([(str(path), two, 0, -1, False)])
    assert (status, value, size) == (0, 5000, 5000)
    assert bytes(two[0]) + bytes(two[1][:4000]) == pattern(5000, 3)
    assert two[1][4000:] == bytearray(6000)


async def test_o_direct_only_for_aligned_cold_reads(tmp_path: Path) -> None:
    store = FileBackend(tmp_path / "s", direct_io="auto")
    await store.close()
    if not store.direct_io:
        pytest.skip("the filesystem under tmp_path has no O_DIRECT")
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | engines._O_DIRECT, 0o644)
    src = aligned_buffer(8192)
    src[:] = pattern(8192, 4)
    os.write(fd, src)
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    known = is_cached(fd, 0, 8192) is not None  # cachestat answers on this kernel
    aligned = aligned_buffer(8192)
    (status, _, _, flags, _), = fileio.read_files([(str(path), [aligned], 0, -1, True)])
    assert status == 0 and bytes(aligned) == bytes(src)
    assert flags & 1 and flags & 4, "an aligned cold read goes O_DIRECT"
    unaligned = memoryview(bytearray(8193))[1:]
    (status, _, _, flags, _), = fileio.read_files([(str(path), [unaligned], 0, -1, True)])
    assert status == 0 and bytes(unaligned) == bytes(src)
    assert not flags & 1 and not flags & 4, "an unaligned buffer is read buffered"
    (status, _, _, flags, _), = fileio.read_files([(str(path), [aligned], 0, -1, False)])
    assert not flags & 1, "direct=False reads buffered"
    os.pread(fd, 8192, 0)  # now in the page cache
    (status, _, _, flags, _), = fileio.read_files([(str(path), [aligned], 0, -1, True)])
    assert bytes(aligned) == bytes(src)
    os.close(fd)
    if known:
        assert not flags & 2 and not flags & 1, "cached bytes are read buffered"


def test_checksums_of_spans_are_xxhashs_own_and_only_of_bytes_read(tmp_path: Path) -> None:
    # ``bind_xxh3`` took the hash from the xxhash package the library checks with: every span
    # (in either buffer of a scatter read, empty ones too) sums as xxhash sums it in Python.
    import xxhash

    assert SUMS_IN_C, "the file backend binds xxh3 when the accelerator is built"
    data = pattern(9000, 5)
    path = tmp_path / "f"
    path.write_bytes(data)
    two = [bytearray(4096), bytearray(6000)]
    spans = [(0, 4096), (4096, 4904), (10, 1), (5000, 0), (6000, 3000)]
    (status, value, _, _, sums), = fileio.read_files([(str(path), two, 0, -1, False, spans)])
    assert (status, value) == (0, 9000)
    whole = bytes(two[0]) + bytes(two[1])
    assert sums == tuple(xxhash.xxh3_64_intdigest(whole[o : o + n]) for o, n in spans)
    # A span past the bytes read (a short object) gives no sums at all; nor does a miss.
    (status, value, _, _, sums), = fileio.read_files(
        [(str(path), [bytearray(10_000)], 0, -1, False, [(0, 100), (8000, 2000)])])
    assert (status, value, sums) == (0, 9000, ())
    (status, _, _, _, sums), = fileio.read_files(
        [(str(tmp_path / "none"), [bytearray(10)], 0, -1, False, [(0, 10)])])
    assert (status, sums) == (1, ())
    # A span across two buffers, or outside them, is refused before anything is read.
    for bad in [(4000, 200), (-1, 5), (10_000, 200)]:
        buf = [bytearray(4096), bytearray(6000)]
        with pytest.raises(ValueError, match="inside one buffer"):
            fileio.read_files([(str(path), buf, 0, -1, False, [bad])])
        assert buf == [bytearray(4096), bytearray(6000)]


@pytest.mark.parametrize("aligned", [True, False])
async def test_summed_reads_are_the_python_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aligned: bool
) -> None:
    # ``native_reads().get_into_summed`` in one C call (reads and sums) against the Python
    # engine's reads, then sums in Python: the same sizes, misses, bytes and checksums.
    store, keys = await stored_patterns(tmp_path)
    asked = [*keys, "ffff"]
    spans = [[(0, 1), (0, n), (n // 2, n - n // 2)] for n in SIZES] + [[(0, 10)]]

    def buffers() -> list[memoryview]:
        return [aligned_buffer(70_000) if aligned else memoryview(bytearray(70_001))[1:]
                for _ in asked]

    async def summed() -> tuple[list[int | None], list[tuple[int, ...]], list[bytes]]:
        bufs = buffers()
        got, sums = await store.native_reads().get_into_summed(asked, bufs, spans)
        return got, sums, [bytes(b) for b in bufs]

    async def read_then_summed() -> tuple[list[int | None], list[tuple[int, ...]], list[bytes]]:
        bufs = buffers()
        got = await store.get_into(asked, bufs)
        sums = [() if n is None or any(o + k > n for o, k in item) else
                tuple(xxhash.xxh3_64_intdigest(b[o : o + k]) for o, k in item)
                for b, item, n in zip(bufs, spans, got, strict=True)]
        return got, sums, [bytes(b) for b in bufs]

    assert store.capabilities.native_reads
    released = await summed()
    with pytest.raises(ValueError, match="outside a buffer"):
        await store.native_reads().get_into_summed(keys[:1], [bytearray(10)], [[(5, 6)]])
    store = await with_python_engine(store)
    assert not store.capabilities.native_reads
    python = await read_then_summed()
    assert released == python
    got, sums, _ = released
    assert got == [*SIZES, None]
    assert sums[-1] == () and all(len(s) == 3 for s in sums[:-1])
    await store.close()


@pytest.mark.parametrize("durability", ["none", "data", "full"])
async def test_released_writes_make_the_python_paths_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str
) -> None:
    # One C call for a put's writes (``_fileio.write_files``) against the Python writes: the
    # same objects, byte for byte, aligned (O_DIRECT, with and without an unaligned tail) or
    # not, and no temp file left behind.
    sizes = [4096 * 3, 4096 * 2 + 100, 5000, 1]
    data = [pattern(n, i) for i, n in enumerate(sizes)]

    def buffers() -> list[memoryview]:
        out = []
        for i, chunk in enumerate(data):
            buf = aligned_buffer(len(chunk)) if i < 2 else memoryview(bytearray(chunk))
            buf[:] = chunk
            out.append(buf)
        return out

    stores = {}
    for path in ("released", "python"):
        store = FileBackend(tmp_path / path, durability=durability,  # type: ignore[arg-type]
                            io_engine="native" if path == "released" else "posix")
        assert store.io_engine == ("native" if path == "released" else "posix")
        keys = [f"{i:04x}" for i in range(len(sizes))]
        await store.put(keys, buffers())
        stores[path] = [await store.get_bytes(k) for k in keys]
        assert list((store.root / "tmp").iterdir()) == []
        await store.close()
    assert stores["released"] == stores["python"] == data


@pytest.mark.parametrize("released", [True, False])
async def test_a_failed_write_fails_its_own_key_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, released: bool
) -> None:
    # A directory where an object's file must go: its rename fails (EISDIR), in C as in
    # Python; the put raises that error and the other object of the batch is stored.
    store = FileBackend(tmp_path / "s", durability="none",
                        io_engine="native" if released else "posix")
    assert store.io_engine == ("native" if released else "posix")
    store.path_of("bbbb").mkdir(parents=True)
    with pytest.raises(BackendIOError) as caught:
        await store.put(["aaaa", "bbbb"], [b"a" * 5000, b"b" * 5000])
    assert caught.value.key == "bbbb"
    assert await store.get_bytes("aaaa") == b"a" * 5000
    assert store.path_of("bbbb").is_dir()
    assert list((store.root / "tmp").iterdir()) == []
    await store.close()


def test_reads_started_on_their_own_thread_are_read_files_own(tmp_path: Path) -> None:
    # ``start_read_files`` runs the same reads on a thread that never takes the GIL: the
    # caller polls ``done`` (held GIL, no wait) and takes ``wait``'s outcomes, equal to
    # ``read_files``' for the same items (bytes, misses, errors and sums).
    paths = [tmp_path / f"f{i}" for i in range(3)]
    for i, path in enumerate(paths):
        path.write_bytes(pattern(5000 + i, i))
    items_of = [(str(p), 6000, [(0, 100), (100, 4900)]) for p in paths]
    items_of.append((str(tmp_path / "none"), 10, [(0, 10)]))
    items_of.append((str(paths[0]), 100, []))  # does not fit: status 3

    def items() -> tuple[list[bytearray], list[tuple[object, ...]]]:
        bufs = [bytearray(n) for _, n, _ in items_of]
        return bufs, [(p, [b], 0, -1, False, spans) for (p, _, spans), b in zip(items_of, bufs, strict=True)]

    bufs, batch = items()
    expected = fileio.read_files(batch)
    started_bufs, started = items()
    job = fileio.start_read_files(started)
    while not job.done():
        pass
    assert job.wait() == expected and job.wait() == expected  # the same, each time
    assert started_bufs == bufs
    assert [status for status, *_ in expected] == [0, 0, 0, 1, 3]
    # Dropped before its reads end, a job waits for them before it lets its buffers go.
    for _ in range(20):
        fileio.start_read_files(items()[1])
    # Bad items are refused before any thread starts, as read_files refuses them.
    with pytest.raises(BufferError):
        fileio.start_read_files([(str(paths[0]), [b"read-only"], 0, -1, False)])


async def test_a_started_summed_read_is_get_into_summeds_own(tmp_path: Path) -> None:
    # ``native_reads().start``: the same sizes, misses, bytes, sums and statistics as
    # ``get_into_summed``; a miss repairs the index (on the pool, not the caller's thread);
    # an error is raised by ``result`` (each time), a bad span before anything is read.
    store, keys = await stored_patterns(tmp_path)
    store.path_of(keys[1]).unlink()  # gone behind the index's back
    asked = [*keys, "ffff"]
    spans = [[(0, 1), (0, n)] for n in SIZES] + [[(0, 10)]]

    def buffers() -> list[memoryview]:
        return [aligned_buffer(70_000) for _ in asked]

    expected_bufs = buffers()
    reads = store.native_reads()
    expected = await reads.get_into_summed(asked, expected_bufs, spans)
    assert expected[0][1] is None and expected[0][-1] is None
    reads_before = store.stats.reads
    bufs = buffers()
    pending = reads.start(asked, bufs, spans)
    assert pending is not None
    pending.wait()
    assert pending.done()
    assert pending.result() == expected and pending.result() == expected
    assert [bytes(b) for b in bufs] == [bytes(b) for b in expected_bufs]
    assert store.stats.reads == reads_before + len(asked)  # counted once
    # an object larger than its buffer: InvalidRangeError from result(), as get_into_summed
    pending = reads.start([keys[2]], [bytearray(100)], [[(0, 100)]])
    assert pending is not None
    for _ in range(2):
        with pytest.raises(InvalidRangeError):
            pending.result()
    with pytest.raises(ValueError, match="outside a buffer"):
        reads.start(keys[:1], [bytearray(10)], [[(5, 6)]])
    await store.close()
    with pytest.raises(BackendClosedError):
        reads.start(keys[:1], [bytearray(10)], [[(0, 10)]])


async def test_without_the_accelerator_nothing_is_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, keys = await stored_patterns(tmp_path)
    store = await with_python_engine(store)
    buf = bytearray(70_000)
    assert not store.capabilities.native_reads
    with pytest.raises(NotSupportedError):
        store.native_reads().start(keys[:1], [buf], [[(0, 10)]])
    assert buf == bytearray(70_000)  # nothing read
    await store.close()


@pytest.mark.parametrize("slow_files", [False, True])
async def test_a_batch_spread_over_the_pool_stores_every_object_and_fails_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_files: bool
) -> None:
    # Where files are slow to make (the engine's ``write_cost_s`` over the rule) a put's
    # writes go in several jobs of at least ``_WRITE_JOB_MIN`` objects, else in one: either
    # way every object lands as written, and a failure in one job fails only its own key.
    store = FileBackend(tmp_path / "s", durability="none", io_threads=4)
    assert store.io_engine == "native"
    engine = store._engine
    jobs: list[int] = []
    write_run = engine.write

    def counted(keys: Any, buffers: Any) -> Any:
        jobs.append(len(keys))
        return write_run(keys, buffers)

    monkeypatch.setattr(engine, "write", counted)
    cost = 1.0 if slow_files else 0.0
    engine.write_cost_s = cost  # type: ignore[attr-defined]
    keys = [f"{i:04x}" for i in range(32)]
    data = [pattern(700 + i, i) for i in range(32)]
    store.path_of(keys[20]).mkdir(parents=True)  # its rename fails (EISDIR)
    with pytest.raises(BackendIOError) as caught:
        await store.put(keys, data)
    assert caught.value.key == keys[20]
    expected_jobs = [8, 8, 8, 8] if slow_files else [32]
    assert jobs == expected_jobs
    for key, chunk in zip(keys, data, strict=True):
        if key != keys[20]:
            assert await store.get_bytes(key) == chunk
    assert list((store.root / "tmp").iterdir()) == []
    await store.close()


def test_released_writes_make_missing_directories(tmp_path: Path) -> None:
    # ``write_files`` makes an object's directory and its missing ancestors (as
    # ``os.makedirs``), at once or after its directory was removed; a rename that still
    # fails is the item's errno, its temp file removed.
    (tmp_path / "tmp").mkdir()
    blocked = tmp_path / "file"
    blocked.write_bytes(b"x")
    finals = [tmp_path / "a" / "b" / "k0", tmp_path / "a" / "b" / "k1", tmp_path / "a" / "c" / "k2",
              blocked / "d" / "k3"]
    items = [(str(tmp_path / "tmp" / f"{i}.tmp"), str(f), memoryview(pattern(100 + i, i)), False, flush)
             for i, (f, flush) in enumerate(zip(finals, [0, 2, 1, 0], strict=True))]
    got = fileio.write_files(items)
    assert got[:3] == [(0, 0)] * 3
    assert got[3] == (1, errno.ENOTDIR)  # "file" is no directory
    assert [f.read_bytes() for f in finals[:3]] == [pattern(100 + i, i) for i in range(3)]
    assert list((tmp_path / "tmp").iterdir()) == []
    (finals[2]).unlink()
    (tmp_path / "a" / "c").rmdir()
    assert fileio.write_files([items[2]]) == [(0, 0)]
    assert finals[2].read_bytes() == pattern(102, 2)


@pytest.mark.parametrize("engine", ["native", "posix"])
@pytest.mark.parametrize("durability", ["none", "full"])
async def test_puts_make_a_removed_shard_again(tmp_path: Path, durability: str,
                                               engine: str) -> None:
    # Either engine's puts make a shard's directories where they are missing, also after a
    # shard the store wrote to was emptied and removed (by an operator's clean-up), where a
    # cached "this directory exists" would fail the put.
    store = FileBackend(tmp_path / "s", durability=durability,  # type: ignore[arg-type]
                        io_engine=engine)
    assert store.io_engine == engine
    keys = [f"{i:04x}" for i in range(40)]
    data = [pattern(64 + i, i) for i in range(len(keys))]
    await store.put(keys, data)
    assert [await store.get_bytes(k) for k in keys] == data
    shard = object_path(store.root, keys[0]).parent
    same = next(k for k in (f"{i:06x}" for i in range(1 << 20)) if k not in keys
                and object_path(store.root, k).parent == shard)
    await store.delete([k for k in keys if object_path(store.root, k).parent == shard])
    shard.rmdir()
    if not any(shard.parent.iterdir()):
        shard.parent.rmdir()
    await store.put([same], [b"again"])
    assert await store.get_bytes(same) == b"again"
    assert list((store.root / "tmp").iterdir()) == []
    await store.close()


def test_started_writes_of_one_key_end_in_the_order_they_were_started(tmp_path: Path) -> None:
    # ``start_write_files`` writes a job's items on several writer threads side by side, yet
    # one key's writes (one final path) go to the same writer, taken in submission order: of
    # many jobs rewriting the same objects, each object holds the last job's bytes.
    (tmp_path / "tmp").mkdir()
    finals = [tmp_path / "objects" / f"{i:02x}" / f"k{i}" for i in range(8)]
    jobs = []
    for round_ in range(40):
        items = [(str(tmp_path / "tmp" / f"{round_}-{i}.tmp"), str(final),
                  memoryview(pattern(4096 + round_, round_ * 8 + i)), False, 0)
                 for i, final in enumerate(finals)]
        jobs.append(fileio.start_write_files(items, time.monotonic() + 60))
    outcomes = [job.wait() for job in jobs]
    assert all(done == [(0, 0)] * len(finals) for done, _, _ in outcomes)
    assert all(began is not None and ended is not None and began <= ended
               for _, began, ended in outcomes)
    assert [f.read_bytes() for f in finals] == [pattern(4096 + 39, 39 * 8 + i)
                                               for i in range(len(finals))]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_started_writes_begun_late_write_none_of_their_items(tmp_path: Path) -> None:
    # A job is begun or not as a whole (its first item decides): past ``start_by``, none of
    # its items is written, whichever writer takes them; an empty job ends at once.
    (tmp_path / "tmp").mkdir()
    items = [(str(tmp_path / "tmp" / f"{i}.tmp"), str(tmp_path / "o" / f"k{i}"),
              memoryview(pattern(100, i)), False, 0) for i in range(6)]
    assert fileio.start_write_files(items, time.monotonic() - 1.0).wait() == (
        [(2, 0)] * 6, None, None)
    assert not (tmp_path / "o").exists() and list((tmp_path / "tmp").iterdir()) == []
    done, began, ended = fileio.start_write_files([], time.monotonic() + 60).wait()
    assert done == [] and began is not None and began == ended
    assert fileio.start_write_files([], time.monotonic() - 1.0).wait() == ([], None, None)
