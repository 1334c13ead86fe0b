"""The FAKE ``hf3fs_fuse.io`` has teeth: every illegal USRBIO call sequence it promises to catch
is caught, and a backend that breaks the sequence fails its tests."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from types import ModuleType

import pytest

from hicache_store.backends._hf3fs_usrbio import UsrbioEngine
from hicache_store.backends.hf3fs import HF3FSBackend

from .fakes.hf3fs_fuse.io import UsrbioViolation


@pytest.fixture
def setup(fake_usrbio: ModuleType, fake_mount: Path) -> Iterator[tuple[ModuleType, str, int, object]]:
    io = fake_usrbio
    assert io.FAKE
    shm = SharedMemory(create=True, size=1 << 16)
    iov = io.make_iovec(shm, str(fake_mount))
    path = fake_mount / "f"
    path.write_bytes(b"z" * 8192)
    fd = os.open(path, os.O_RDWR)
    yield io, str(fake_mount), fd, iov
    io.STATE.registered.pop(fd, None)
    io.STATE.outstanding.clear()
    del iov
    shm.close()
    shm.unlink()
    with contextlib.suppress(OSError):
        os.close(fd)


def test_legal_sequence_is_clean(setup: tuple[ModuleType, str, int, object]) -> None:
    io, mount, fd, iov = setup
    ring = io.make_ioring(mount, 4, for_read=True)
    io.register_fd(fd)
    ring.prepare(iov[0:4096], True, fd, 0, userdata=7)
    results = ring.submit().wait(min_results=1)
    assert [(r.result, r.userdata) for r in results] == [(4096, 7)]
    assert bytes(iov.buf[:4096]) == b"z" * 4096
    io.deregister_fd(fd)
    assert io.STATE.violations == []


def test_unregistered_fd(setup: tuple[ModuleType, str, int, object]) -> None:
    io, mount, fd, iov = setup
    ring = io.make_ioring(mount, 4)
    with pytest.raises(UsrbioViolation, match="not registered"):
        ring.prepare(iov[0:10], True, fd, 0)


def test_raw_memory_instead_of_an_iovec(setup: tuple[ModuleType, str, int, object]) -> None:
    io, mount, fd, _iov = setup
    ring = io.make_ioring(mount, 4)
    io.register_fd(fd)
    with pytest.raises(UsrbioViolation, match="not a slice of a registered iovec"):
        ring.prepare(memoryview(bytearray(10)), True, fd, 0)


def test_slice_outside_the_region(setup: tuple[ModuleType, str, int, object]) -> None:
    _io, _mount, _fd, iov = setup
    with pytest.raises(UsrbioViolation, match="outside"):
        iov[(1 << 16) - 10 : (1 << 16) + 10]


def test_wrong_direction(setup: tuple[ModuleType, str, int, object]) -> None:
    io, mount, fd, iov = setup
    ring = io.make_ioring(mount, 4, for_read=False)
    io.register_fd(fd)
    with pytest.raises(UsrbioViolation, match="for_read=False"):
        ring.prepare(iov[0:10], True, fd, 0)


def test_wait_without_submit(setup: tuple[ModuleType, str, int, object]) -> None:
    io, mount, fd, iov = setup
    ring = io.make_ioring(mount, 4)
    io.register_fd(fd)
    ring.prepare(iov[0:10], True, fd, 0)
    with pytest.raises(UsrbioViolation, match="never submitted"):
        ring.wait(min_results=1)


def test_wait_for_more_than_submitted(setup: tuple[ModuleType, str, int, object]) -> None:
    io, mount, fd, iov = setup
    ring = io.make_ioring(mount, 4)
    io.register_fd(fd)
    ring.prepare(iov[0:10], True, fd, 0).submit()
    with pytest.raises(UsrbioViolation, match="block forever"):
        ring.wait(min_results=2)


def test_deregister_with_unreaped_io(setup: tuple[ModuleType, str, int, object]) -> None:
    io, mount, fd, iov = setup
    ring = io.make_ioring(mount, 4)
    io.register_fd(fd)
    ring.prepare(iov[0:10], True, fd, 0).submit()
    with pytest.raises(UsrbioViolation, match="not yet reaped"):
        io.deregister_fd(fd)


def test_register_twice_and_close_while_registered(
    setup: tuple[ModuleType, str, int, object],
) -> None:
    io, _mount, fd, _iov = setup
    io.register_fd(fd)
    with pytest.raises(UsrbioViolation, match="already registered"):
        io.register_fd(fd)
    os.close(fd)
    with pytest.raises(UsrbioViolation, match="closed"):
        io.deregister_fd(fd)


def test_ring_overflow(setup: tuple[ModuleType, str, int, object]) -> None:
    io, mount, fd, iov = setup
    ring = io.make_ioring(mount, 2)
    io.register_fd(fd)
    ring.prepare(iov[0:10], True, fd, 0)
    ring.prepare(iov[10:20], True, fd, 10)
    with pytest.raises(UsrbioViolation, match="more than 2 outstanding"):
        ring.prepare(iov[20:30], True, fd, 20)


def test_leaks_are_reported(setup: tuple[ModuleType, str, int, object]) -> None:
    io, _mount, fd, _iov = setup
    io.register_fd(fd)
    problems = io.STATE.check_clean()
    assert any("still registered" in p for p in problems)
    assert any("iovecs still alive" in p for p in problems)


def test_a_ring_kept_only_by_a_reference_cycle_is_collected_not_reported(
    fake_usrbio: ModuleType, fake_mount: Path
) -> None:
    io = fake_usrbio
    gc.disable()  # the cycle stays uncollected until check_clean collects it
    try:
        holder: list[object] = [io.make_ioring(str(fake_mount), 2)]
        holder.append(holder)
        del holder
        assert len(io.STATE.rings) == 1
        assert io.STATE.check_clean() == []
        assert len(io.STATE.rings) == 0
    finally:
        gc.enable()


def test_a_ring_still_referenced_is_reported(fake_usrbio: ModuleType, fake_mount: Path) -> None:
    ring = fake_usrbio.make_ioring(str(fake_mount), 2)
    assert fake_usrbio.STATE.check_clean() == ["1 iorings still alive"]
    del ring


async def test_a_backend_that_skips_deregistration_is_caught(
    fake_usrbio: ModuleType, fake_mount: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(UsrbioEngine, "deregister_fd", lambda self, fd: None)
    store = HF3FSBackend(fake_mount / "kv", engine="usrbio")
    await store.put(["a0"], [b"x" * 100])  # closes its fd while still registered
    await store.close()
    assert any("still registered" in p for p in fake_usrbio.STATE.check_clean())


async def test_a_backend_that_does_not_wait_is_caught(
    fake_usrbio: ModuleType, fake_mount: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(UsrbioEngine, "_wait_all", lambda self, channel, count: [])
    store = HF3FSBackend(fake_mount / "kv", engine="usrbio")
    with pytest.raises(UsrbioViolation, match="not yet reaped"):
        await store.put(["a0"], [b"x" * 100])
    await store.close()
    assert fake_usrbio.STATE.violations
