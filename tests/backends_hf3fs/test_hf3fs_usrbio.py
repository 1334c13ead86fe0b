"""The hf3fs backend's own promises: engine choice (and saying so), batching, zero-copy host
regions, release of every USRBIO resource at close. USRBIO runs against the FAKE here."""

from __future__ import annotations

import logging
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from hicache_store.backends import aligned_buffer, open_backend
from hicache_store.backends._hf3fs_usrbio import (
    UsrbioEngine,
    is_hf3fs_fstype,
    mount_of,
    shm_mapping_of,
)
from hicache_store.backends.errors import BackendError, BackendUnavailableError
from hicache_store.backends.file import FileBackend
from hicache_store.backends.hf3fs import HF3FSBackend, HF3FSStats
from hicache_store.testing import pattern

KEYS = [f"{i:064x}" for i in range(24)]


async def test_auto_is_posix_without_the_module(tmp_path: Path, no_usrbio: None,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hicache_store.backends.hf3fs"):
        store = HF3FSBackend(tmp_path / "kv")
    assert store.engine == "posix" and "not importable" in store.engine_reason
    assert "engine=posix" in caplog.text
    await store.put(["a0"], [b"x" * 5000])
    assert await store.get_bytes("a0") == b"x" * 5000
    assert isinstance(store.stats, HF3FSStats) and store.stats.usrbio_ios == 0
    await store.close()


async def test_the_posix_path_is_the_file_backend_as_configured_by_default(
        tmp_path: Path, no_usrbio: None) -> None:
    # What a comparison of hf3fs:// POSIX with file:// rests on: the same engine, threads,
    # O_DIRECT and page-cache policy; only the index differs (a 3FS root is shared by hosts).
    hf3fs = HF3FSBackend(tmp_path / "h", engine="posix")
    file = FileBackend(tmp_path / "f")
    try:
        def shape(store: FileBackend) -> tuple[object, ...]:
            return (store.io_engine, store.io_threads, store.direct_io, store.page_cache,
                    store.durability)

        assert shape(hf3fs) == shape(file)
        assert (hf3fs.index_kind, file.index_kind) == ("none", "sqlite")
    finally:
        await hf3fs.close()
        await file.close()


async def test_auto_is_posix_off_a_3fs_mount(tmp_path: Path, fake_usrbio: ModuleType,
                                              fake_mount: Path) -> None:
    # The module imports and the fake calls this a mount, but /proc/mounts says it is not 3FS.
    store = HF3FSBackend(fake_mount / "kv")
    assert store.engine == "posix" and "not on a 3FS FUSE mount" in store.engine_reason
    await store.close()
    assert fake_usrbio.STATE.calls == []


async def test_usrbio_required_but_unavailable(tmp_path: Path, no_usrbio: None) -> None:
    with pytest.raises(BackendError, match="not importable"):
        HF3FSBackend(tmp_path / "kv", engine="usrbio")


async def test_usrbio_required_but_not_a_mount(tmp_path: Path, fake_usrbio: ModuleType) -> None:
    with pytest.raises(BackendError, match="not under a 3FS mount"):
        HF3FSBackend(tmp_path / "kv", engine="usrbio")
    assert not list((tmp_path / "kv" / "tmp").iterdir())


def test_bad_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        HF3FSBackend(tmp_path, engine="rdma")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        HF3FSBackend(tmp_path, ring_entries=0)


def test_mounts_parsing(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "hf3fs.stage /mnt/3fs fuse.hf3fs rw,nosuid 0 0\n"
        "tmpfs /mnt/3fs/x tmpfs rw 0 0\n"
    )
    assert mount_of("/mnt/3fs/kv/a", str(mounts)) == ("/mnt/3fs", "fuse.hf3fs")
    assert mount_of("/mnt/3fs/x/y", str(mounts)) == ("/mnt/3fs/x", "tmpfs")
    assert mount_of("/mnt/3fsother", str(mounts)) == ("/", "ext4")
    assert is_hf3fs_fstype("fuse.hf3fs") and not is_hf3fs_fstype("fuse.sshfs")


@pytest.fixture
async def usrbio_store(fake_usrbio: ModuleType, fake_mount: Path,
                       caplog: pytest.LogCaptureFixture) -> HF3FSBackend:
    with caplog.at_level(logging.INFO, logger="hicache_store.backends.hf3fs"):
        store = open_backend(f"hf3fs://{fake_mount}/kv?engine=usrbio&ring_entries=64",
                             staging_bytes="1MiB")
    assert isinstance(store, HF3FSBackend)
    assert store.engine == "usrbio" and store.mount_point == str(fake_mount)
    assert "engine=usrbio" in caplog.text
    return store


async def test_batch_is_few_ring_submissions(usrbio_store: HF3FSBackend,
                                             fake_usrbio: ModuleType) -> None:
    store = usrbio_store
    datas = [pattern(20_000 + i, i) for i in range(len(KEYS))]
    await store.put(KEYS, datas)
    assert store.stats.usrbio_submissions == 1 and store.stats.usrbio_ios == len(KEYS)
    bufs = [bytearray(len(d)) for d in datas]
    assert await store.get_into(KEYS, bufs) == [len(d) for d in datas]
    assert [bytes(b) for b in bufs] == datas
    assert store.stats.usrbio_submissions == 2
    assert fake_usrbio.STATE.calls.count("submit") == 2
    assert store.stats.usrbio_staged_bytes == 2 * sum(map(len, datas))
    await store.close()
    assert fake_usrbio.STATE.check_clean() == []


async def test_objects_larger_than_staging_are_split(usrbio_store: HF3FSBackend,
                                                     fake_usrbio: ModuleType) -> None:
    store = usrbio_store
    big = pattern(3 * (1 << 20) + 123, 7)  # 3+ staging regions
    await store.put(["b0"], [big])
    assert store.stats.usrbio_ios == 4
    assert await store.get_bytes("b0") == big
    await store.close()
    assert fake_usrbio.STATE.check_clean() == []


async def test_host_region_reads_and_writes_are_zero_copy(usrbio_store: HF3FSBackend,
                                                          fake_usrbio: ModuleType) -> None:
    store = usrbio_store
    page = 64 * 1024
    pool = await store.allocate_host_buffer(8 * page)
    arr = np.frombuffer(pool, dtype=np.uint8)
    arr[:] = np.frombuffer(pattern(8 * page, 3), dtype=np.uint8)
    keys = KEYS[:8]
    await store.put(keys, [pool[i * page : (i + 1) * page] for i in range(8)])
    assert store.stats.usrbio_zero_copy_bytes == 8 * page
    assert store.stats.usrbio_staged_bytes == 0
    expected = bytes(pool)
    arr[:] = 0
    # Read them back into the region in reverse page order: straight into the pool.
    got = await store.get_into(keys, [pool[(7 - i) * page : (8 - i) * page] for i in range(8)])
    assert got == [page] * 8
    for i in range(8):
        assert bytes(pool[(7 - i) * page : (8 - i) * page]) == expected[i * page : (i + 1) * page]
    assert store.stats.usrbio_zero_copy_bytes == 16 * page
    assert store.stats.usrbio_staged_bytes == 0
    del arr, pool
    await store.close()
    assert fake_usrbio.STATE.check_clean() == []


async def test_register_existing_shared_memory(usrbio_store: HF3FSBackend,
                                               fake_usrbio: ModuleType) -> None:
    store = usrbio_store
    shm = SharedMemory(create=True, size=1 << 20)
    try:
        assert await store.register_host_buffer(shm)
        shm.buf[:4096] = pattern(4096, 1)
        await store.put(["c0"], [shm.buf[:4096]])
        assert store.stats.usrbio_zero_copy_bytes == 4096
        view = shm.buf[8192 : 8192 + 4096]
        assert await store.get_into(["c0"], [view]) == [4096]
        assert bytes(view) == pattern(4096, 1)
        view.release()
        # A numpy view of the same memory (found through /proc/self/maps) also registers.
        arr = np.frombuffer(shm.buf, dtype=np.uint8)[4096:8192]
        assert shm_mapping_of(arr.ctypes.data) is not None
        assert await store.register_host_buffer(arr)
        await store.unregister_host_buffer(arr)
        await store.unregister_host_buffer(shm)
        del arr
    finally:
        await store.close()
        shm.close()
        shm.unlink()
    assert fake_usrbio.STATE.check_clean() == []


async def test_anonymous_memory_bounces_through_staging(usrbio_store: HF3FSBackend,
                                                        fake_usrbio: ModuleType) -> None:
    store = usrbio_store
    buf = aligned_buffer(1 << 16)
    assert not await store.register_host_buffer(buf)
    buf[:] = pattern(1 << 16, 5)
    await store.put(["d0"], [buf])
    assert store.stats.usrbio_staged_bytes == 1 << 16 and store.stats.usrbio_zero_copy_bytes == 0
    await store.close()
    assert fake_usrbio.STATE.check_clean() == []


async def test_posix_host_buffer_is_aligned(tmp_path: Path, no_usrbio: None) -> None:
    store = HF3FSBackend(tmp_path / "kv")
    buf = await store.allocate_host_buffer(1 << 16)
    assert np.frombuffer(buf, dtype=np.uint8).ctypes.data % 4096 == 0
    assert await store.register_host_buffer(buf)
    await store.close()


async def test_eviction_and_put_if_absent_under_usrbio(fake_usrbio: ModuleType,
                                                       fake_mount: Path) -> None:
    store = HF3FSBackend(fake_mount / "kv", engine="usrbio", capacity_bytes=100_000,
                         staging_bytes="64KiB", durability="full")
    for i in range(10):
        await store.put([f"e{i}"], [pattern(30_000, i)])
    assert store.used_bytes <= 100_000 and store.stats.evictions >= 7
    assert await store.exists(["e9"]) == [True]
    assert await store.put_if_absent("e9", b"other") is False
    assert await store.put_if_absent("f0", b"new") is True
    assert await store.get_bytes("f0") == b"new"
    assert not list((fake_mount / "kv" / "tmp").iterdir())
    await store.close()
    assert fake_usrbio.STATE.check_clean() == []


async def test_failed_io_is_an_error_and_leaves_no_temp(usrbio_store: HF3FSBackend,
                                                        fake_usrbio: ModuleType,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    store = usrbio_store
    real_submit = fake_usrbio.ioring.submit

    def failing_submit(self: object) -> object:
        out = real_submit(self)
        for pending in self._done:  # type: ignore[attr-defined]
            pending.result = -28  # ENOSPC reported by the ring
        return out

    monkeypatch.setattr(fake_usrbio.ioring, "submit", failing_submit)
    from hicache_store.backends.errors import OutOfSpaceError

    with pytest.raises(OutOfSpaceError):
        await store.put(["c1", "c2"], [b"a" * 100, b"b" * 100])
    assert await store.exists(["c1", "c2"]) == [False, False]
    assert not list((store.root / "tmp").iterdir())
    await store.close()
    assert fake_usrbio.STATE.check_clean() == []


class _SlowRing:
    """A ring whose I/Os complete only after ``late`` empty waits (each a timed-out period)."""

    def __init__(self, late: int, count: int) -> None:
        self.late, self.count, self.waits = late, count, 0

    def wait(self, *, min_results: int, timeout: object) -> list[object]:
        self.waits += 1
        if self.waits <= self.late:
            return []
        return [SimpleNamespace(result=1, userdata=i) for i in range(self.count)]


@pytest.mark.parametrize("zero_copy", [True, False])
def test_io_into_caller_memory_is_waited_for_past_the_timeout(zero_copy: bool) -> None:
    # Buffer lifetime: a ring that still moves bytes into registered caller memory cannot be
    # given up on (the call would return while the bytes land); staged I/O can (the staging
    # region is then never reused: the ring is marked broken).
    engine = SimpleNamespace(timeout=timedelta(seconds=0.01), _broken=None)
    channel = SimpleNamespace(ring=_SlowRing(late=3, count=2))
    if zero_copy:
        done = UsrbioEngine._wait_all(engine, channel, 2, until_done=True)  # type: ignore[arg-type]
        assert len(done) == 2 and channel.ring.waits == 4
        assert engine._broken is None
    else:
        with pytest.raises(BackendUnavailableError, match="timed out"):
            UsrbioEngine._wait_all(engine, channel, 2)  # type: ignore[arg-type]
        assert engine._broken is not None
