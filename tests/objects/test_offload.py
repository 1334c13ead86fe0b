"""Sealing and opening large payloads on worker threads (``objects.offload``): where the work
runs, that a failed check still raises, and that a cancelled read ends only after its
in-place work has (the buffer lifetime contract)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

import numpy as np
import pytest

from hicache_store.backends.file import FileBackend
from hicache_store.layout.errors import TamperedObjectError
from hicache_store.layout.framing import ObjectHeader
from hicache_store.layout.keys import ObjectCoords, ObjectKey
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.sealing import TenantKey
from hicache_store.objects import FRAMED, Frame, ObjectIO
from hicache_store.objects.offload import OFFLOAD_BYTES
from hicache_store.objects.sealed import SealedFormat

# 4 layers x 64 tokens x 8 KV heads x 128 x bf16: 256 KiB layer blocks, 1 MiB payloads.
BIG = Namespace.create("m", ModelShape.mha(4, 8, 128), "bfloat16", 64, Grid(4, 8))
SMALL = Namespace.create("m", ModelShape.mha(4, 2, 8), "float16", 4, Grid(4, 2))
COORDS = ObjectCoords(0, 4, 0)
H1 = f"{1:064x}"


def payload_bytes(ns: Namespace) -> int:
    return 2 * ns.page_size * ns.num_kv_heads * ns.head_dim * 2 * ns.num_layers


def frame_of(io: ObjectIO, ns: Namespace, seed: int) -> tuple[Frame, np.ndarray]:
    size = payload_bytes(ns)
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    header = io.header_bytes(COORDS.num_layers)
    buf = memoryview(bytearray(header + size))
    np.frombuffer(buf, dtype=np.uint8)[header:] = data
    return Frame(ObjectKey(H1, ns.digest, COORDS), buf), data


class _Recording:
    """The framed format, recording the thread each seal and open runs on; ``gate`` (when
    set) holds ``open_blocks`` until released, and records when the open ended."""

    name = "recording-test"
    sealed = False

    def __init__(self) -> None:
        self.threads: dict[str, list[str]] = {"seal": [], "open": []}
        self.gate: threading.Event | None = None
        self.opening = threading.Event()
        self.opened = threading.Event()

    def stored_hash(self, page_hash: str) -> str:
        return page_hash

    def storage_key(self, key: ObjectKey) -> str:
        return FRAMED.storage_key(key)

    def header_bytes(self, num_layers: int) -> int:
        return FRAMED.header_bytes(num_layers)

    def seal(self, key: ObjectKey, frame: memoryview, *, kv_planes: int, parent_hash: str | None) -> None:
        self.threads["seal"].append(threading.current_thread().name)
        FRAMED.seal(key, frame, kv_planes=kv_planes, parent_hash=parent_hash)

    def open_header(self, key: ObjectKey, header: memoryview, *, payload_bytes: int) -> ObjectHeader:
        return FRAMED.open_header(key, header, payload_bytes=payload_bytes)

    def open_blocks(self, header: ObjectHeader, data: memoryview, layer_start: int, layer_stop: int) -> None:
        self.threads["open"].append(threading.current_thread().name)
        self.opening.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test never released the open"
        FRAMED.open_blocks(header, data, layer_start, layer_stop)
        self.opened.set()



async def test_large_payloads_are_sealed_and_opened_on_workers_small_ones_inline(
    store: FileBackend,
) -> None:
    assert payload_bytes(BIG) >= OFFLOAD_BYTES > payload_bytes(SMALL)
    loop_thread = threading.current_thread().name
    for ns, where in ((BIG, "worker"), (SMALL, "loop")):
        fmt = _Recording()
        io = ObjectIO(store, ns, fmt=fmt)
        frame, data = frame_of(io, ns, 1)
        assert await io.put([frame]) == [True]
        dest = np.zeros(len(data), dtype=np.uint8)
        assert await io.read_blocks(frame.key, dest.data, payload_bytes=len(data))
        assert np.array_equal(dest, data)
        for op in ("seal", "open"):
            (thread,) = fmt.threads[op]
            if where == "worker":
                assert thread.startswith("hicache-seal"), (ns.digest, op, thread)
            else:
                assert thread == loop_thread, (ns.digest, op, thread)


async def test_tamper_found_on_a_worker_is_raised_to_the_reader(store: FileBackend) -> None:
    sealed = dataclasses.replace(BIG, sealed=True)
    io = ObjectIO(store, sealed, fmt=SealedFormat(TenantKey(os.urandom(32))))
    frame, data = frame_of(io, sealed, 2)
    assert await io.put([frame]) == [True]
    path = store.path_of(io.storage_key(frame.key))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1  # one bit of the last layer block's ciphertext
    path.write_bytes(bytes(raw))
    dest = np.zeros(len(data), dtype=np.uint8)
    with pytest.raises(TamperedObjectError, match="layer 3"):
        await io.read_blocks(frame.key, dest.data, payload_bytes=len(data))


async def test_a_cancelled_read_ends_only_after_its_in_place_open(store: FileBackend) -> None:
    fmt = _Recording()
    io = ObjectIO(store, BIG, fmt=fmt)
    frame, data = frame_of(io, BIG, 3)
    assert await io.put([frame]) == [True]
    fmt.gate = threading.Event()
    dest = np.zeros(len(data), dtype=np.uint8)
    read = asyncio.create_task(io.read_blocks(frame.key, dest.data, payload_bytes=len(data)))
    assert await asyncio.get_running_loop().run_in_executor(None, fmt.opening.wait, 10)
    read.cancel()
    await asyncio.sleep(0.05)
    assert not read.done(), "the read ended while its open still wrote into the caller's buffer"
    fmt.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert fmt.opened.is_set()
