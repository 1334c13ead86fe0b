"""The optional abilities (``backends.protocols``): a flag, an accessor, a protocol each.

Without its flag an accessor refuses (``NotSupportedError``), closed it refuses as every call
does, and with the flag it validates what a public method validates before the backend's hook
runs. The built-in backends declare what they offer: the file backend its inline lookups and
(with the C accelerator) native reads; hf3fs the same plus host buffers, its POSIX path being
the file backend's own engine; a faulty wrapper none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache_store.backends import (
    BackendClosedError,
    NotSupportedError,
    open_backend,
)
from hicache_store.backends._file_io import SUMS_IN_C, PosixEngine, _fileio
from hicache_store.backends.faulty import FaultyBackend
from hicache_store.backends.file import FileBackend
from hicache_store.backends.hf3fs import HF3FSBackend
from hicache_store.backends.memory import MemoryBackend
from hicache_store.layout.errors import InvalidKeyError
from hicache_store.testing import pattern


class Able(MemoryBackend):
    """A memory backend that declares all three abilities and records its hooks' calls."""

    capabilities = MemoryBackend.capabilities.replace(
        host_buffers=True, inline_exists=True, native_reads=False)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    async def _register_host_buffer(self, buffer: Any) -> bool:
        self.calls.append(("register", len(memoryview(buffer))))
        return False

    async def _unregister_host_buffer(self, buffer: Any) -> None:
        self.calls.append(("unregister", len(memoryview(buffer))))

    def _exists_now(self, keys: list[str], max_age_s: float) -> list[bool] | None:
        self.calls.append(("now", (tuple(keys), max_age_s)))
        return None

    def _exists_blocking(self, keys: list[str]) -> list[bool]:
        self.calls.append(("blocking", tuple(keys)))
        return [False] * len(keys)


async def test_an_accessor_refuses_without_its_flag_and_when_closed() -> None:
    plain = MemoryBackend()
    for accessor in (plain.host_buffers, plain.inline_exists, plain.native_reads,
                     plain.native_writes, plain.change_feed):
        with pytest.raises(NotSupportedError):
            accessor()
    able = Able()
    with pytest.raises(NotSupportedError, match="native_reads"):
        able.native_reads()
    buffers, inline = able.host_buffers(), able.inline_exists()
    await able.close()
    with pytest.raises(BackendClosedError):
        able.host_buffers()
    with pytest.raises(BackendClosedError):
        await buffers.register(bytearray(8))
    with pytest.raises(BackendClosedError):
        inline.blocking(["a0"])
    assert inline.now(["a0"]) is None  # no answer at once: ``exists`` says what is wrong
    await buffers.unregister(bytearray(8))  # closed: its registrations went with it
    assert able.calls == []


async def test_capacity_usage_reads_the_backends_own_counters_until_it_closes() -> None:
    store = MemoryBackend(capacity_bytes=4096)
    usage = store.capacity_usage()
    assert usage.usage() == (4096, 0)
    await store.put(["a0"], [bytes(100)])
    assert usage.usage() == (4096, 100)
    await store.delete(["a0"])
    assert usage.usage() == (4096, 0)
    await store.close()
    with pytest.raises(BackendClosedError):
        usage.usage()
    with pytest.raises(BackendClosedError):
        store.capacity_usage()


async def test_the_hooks_run_on_validated_input_and_answer_in_one_type() -> None:
    able = Able()
    assert await able.host_buffers().register(bytearray(64)) is False
    await able.host_buffers().unregister(bytearray(64))
    inline = able.inline_exists()
    assert inline.now(["a0", "b1"], max_age_s=2.0) is None
    assert inline.blocking(["a0"]) == [False]
    assert inline.now([]) == [] and inline.blocking([]) == []  # no hook for nothing
    with pytest.raises(InvalidKeyError):
        inline.now(["../etc/passwd"])
    with pytest.raises(InvalidKeyError):
        inline.blocking(["a0", "a/b"])
    assert able.calls == [("register", 64), ("unregister", 64), ("now", (("a0", "b1"), 2.0)),
                          ("blocking", ("a0",))]
    await able.close()


async def test_the_built_in_backends_declare_what_they_offer(tmp_path: Path) -> None:
    file = FileBackend(tmp_path / "f")
    assert file.capabilities.inline_exists and not file.capabilities.host_buffers
    assert file.capabilities.native_reads == (_fileio is not None and SUMS_IN_C)
    posix = FileBackend(tmp_path / "f", io_engine="posix")
    assert posix.io_engine == "posix" and not posix.capabilities.native_reads
    # native writes: the put's own pool job, whichever engine; never on a read-only store
    assert file.capabilities.native_writes and posix.capabilities.native_writes
    reader = FileBackend(tmp_path / "f", read_only=True)
    assert not reader.capabilities.native_writes
    with pytest.raises(NotSupportedError, match="native_writes"):
        reader.native_writes()
    await reader.close()
    faulty = FaultyBackend(file)
    assert faulty.capabilities == file.capabilities.replace(
        inline_exists=False, native_reads=False, native_writes=False, host_buffers=False)
    hf3fs = HF3FSBackend(tmp_path / "h", engine="posix")
    assert hf3fs.capabilities.host_buffers and hf3fs.capabilities.inline_exists
    assert await hf3fs.host_buffers().register(bytearray(4096)) is True  # reads land directly
    from hicache_store.backends.mooncake import MooncakeBackend

    assert MooncakeBackend.capabilities.host_buffers
    memory = open_backend("memory://")
    assert memory.capabilities == MemoryBackend.capabilities
    assert not (memory.capabilities.host_buffers or memory.capabilities.inline_exists
                or memory.capabilities.native_reads)
    # capacity usage: where the bound is counted (an index, memory), never an estimate
    assert file.capabilities.capacity_usage and memory.capabilities.capacity_usage
    assert faulty.capacity_usage().usage() == file.capacity_usage().usage()
    unindexed = FileBackend(tmp_path / "n", index="none")
    assert not unindexed.capabilities.capacity_usage
    with pytest.raises(NotSupportedError, match="capacity_usage"):
        unindexed.capacity_usage()
    for store in (posix, faulty, hf3fs, memory, unindexed):
        await store.close()


@pytest.mark.skipif(_fileio is None, reason="the C accelerator is not built (setup.py)")
async def test_hf3fs_on_its_posix_path_is_the_file_backends_native_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The POSIX path of hf3fs:// used to fall back to one Python system call at a time (it
    # overrode the file backend's reads); it is the file backend's own engine now: reads,
    # scatter reads, summed reads and writes of the C accelerator, the same bytes.
    store = HF3FSBackend(tmp_path / "h", engine="posix")
    assert store.engine == "posix" and store.io_engine == "native"

    def refuse(*args: object) -> None:
        raise AssertionError("the Python reader ran")

    monkeypatch.setattr(PosixEngine, "read", refuse)
    monkeypatch.setattr(PosixEngine, "_read_into", refuse)
    data = [pattern(9000 + i, i) for i in range(4)]
    keys = [f"{i:04x}" for i in range(4)]
    await store.put(keys, data)
    bufs = [bytearray(10_000) for _ in keys]
    assert await store.get_into(keys, bufs) == [len(d) for d in data]
    assert [bytes(b[: len(d)]) for b, d in zip(bufs, data, strict=True)] == data
    head, body = bytearray(100), bytearray(9000)
    assert await store.get_scatter(keys[0], [head, body], None) == 9000
    assert bytes(head) + bytes(body[:8900]) == data[0]
    assert store.capabilities.native_reads == SUMS_IN_C
    await store.close()
