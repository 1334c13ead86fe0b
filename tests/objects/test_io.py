"""``ObjectIO``: frames sealed in place, verified reads (whole, layer range), exact stored size,
byte budgets, timeouts, reused staging, and the format seam (one place to seal, one to open)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.backends.file import FileBackend
from hicache_store.layout.errors import (
    CorruptObjectError,
    InvalidKeyError,
    KeyMismatchError,
    PayloadChecksumError,
    TruncatedObjectError,
)
from hicache_store.layout.framing import ObjectHeader, decode_header
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace, kv_scales_digest
from hicache_store.layout.topology import Topology
from hicache_store.objects import (
    DEFAULT_IO_TIMEOUT_S,
    FRAMED,
    ByteBudget,
    Frame,
    IOStats,
    L3Link,
    ObjectIO,
)

NS = Namespace.create("m", ModelShape.mha(4, 2, 8), "float16", 4, Grid(4, 2))
COORDS = ObjectCoords(0, 4, 0)
BLOCK = 2 * 4 * 2 * 8 * 2  # K/V x tokens x heads x dim x 2 bytes: one layer block
PAYLOAD = 4 * BLOCK
H1, H2 = f"{1:064x}", f"{2:064x}"


def key(page_hash: str = H1) -> ObjectKey:
    return ObjectKey(page_hash, NS.digest, COORDS)


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, PAYLOAD, dtype=np.uint8)


def frame_of(io: ObjectIO, data: np.ndarray, page_hash: str = H1, parent: str | None = None) -> Frame:
    header = io.header_bytes(COORDS.num_layers)
    buf = memoryview(bytearray(header + PAYLOAD))
    np.frombuffer(buf, dtype=np.uint8)[header:] = data
    return Frame(key(page_hash), buf, parent)



async def test_put_seals_the_callers_frame_in_place_and_reads_back(store: FileBackend) -> None:
    io = ObjectIO(store, NS)
    data = payload(1)
    frame = frame_of(io, data, parent=H2)
    assert await io.put([frame]) == [True]
    stored = store.path_of(format_key(key())).read_bytes()
    assert stored == bytes(frame.buffer), "the caller's buffer is the object, header included"
    header = decode_header(frame.buffer, expected=key())
    assert header.parent_hash == H2
    out = memoryview(bytearray(len(frame.buffer)))
    (got,) = await io.read_frames([key()], [out])
    assert isinstance(got, ObjectHeader)
    assert bytes(out) == stored


async def test_read_frame_miss_is_none(store: FileBackend) -> None:
    io = ObjectIO(store, NS)
    out = memoryview(bytearray(io.frame_bytes(4, PAYLOAD)))
    assert await io.read_frames([key()], [out]) == [None]


@pytest.mark.parametrize("damage", ["appended", "truncated", "flipped", "swapped"])
async def test_read_frame_refuses_every_stored_size_but_the_frames(
    store: FileBackend, damage: str
) -> None:
    io = ObjectIO(store, NS)
    frame = frame_of(io, payload(2))
    assert await io.put([frame]) == [True]
    path = store.path_of(format_key(key()))
    raw = bytearray(path.read_bytes())
    if damage == "appended":
        raw += b"\x00" * 16  # garbage after a valid object: the stored size is wrong
    elif damage == "truncated":
        raw = raw[:-1]
    elif damage == "flipped":
        raw[-1] ^= 0x40
    path.write_bytes(bytes(raw))
    if damage == "swapped":  # another page's valid object under this key
        other = frame_of(io, payload(3), H2)
        assert await io.put([other]) == [True]
        path.write_bytes(store.path_of(format_key(key(H2))).read_bytes())
    out = memoryview(bytearray(len(frame.buffer)))
    expected = {
        "appended": CorruptObjectError,
        "truncated": TruncatedObjectError,
        "flipped": PayloadChecksumError,
        "swapped": KeyMismatchError,
    }[damage]
    (got,) = await io.read_frames([key()], [out])
    assert isinstance(got, expected)


async def test_read_blocks_lands_exactly_the_layers_asked_for(store: FileBackend) -> None:
    io = ObjectIO(store, NS)
    data = payload(4)
    assert await io.put([frame_of(io, data)]) == [True]
    for layers, requests in (((0, 2), 1), ((1, 3), 2), ((0, 4), 1)):
        dest = np.zeros(PAYLOAD, dtype=np.uint8)
        before = store.stats.reads
        header = await io.read_blocks(key(), dest.data, payload_bytes=PAYLOAD, layers=layers)
        assert header is not None
        a, b = layers[0] * BLOCK, layers[1] * BLOCK
        assert np.array_equal(dest[: b - a], data[a:b])
        assert not dest[b - a :].any(), "nothing written past the blocks asked for"
        assert store.stats.reads - before == requests


async def test_read_blocks_verifies_only_what_it_reads(store: FileBackend) -> None:
    io = ObjectIO(store, NS)
    frame = frame_of(io, payload(5))
    assert await io.put([frame]) == [True]
    path = store.path_of(format_key(key()))
    raw = bytearray(path.read_bytes())
    raw[io.header_bytes(4) + 3 * BLOCK + 1] ^= 1  # layer 3
    path.write_bytes(bytes(raw))
    dest = np.zeros(PAYLOAD, dtype=np.uint8)
    assert await io.read_blocks(key(), dest.data, payload_bytes=PAYLOAD, layers=(0, 3))
    with pytest.raises(PayloadChecksumError):
        await io.read_blocks(key(), dest.data, payload_bytes=PAYLOAD, layers=(2, 4))


@pytest.mark.parametrize("url", ["file", "memory://"])
@pytest.mark.parametrize("damage", ["appended", "truncated"])
async def test_a_whole_object_read_into_blocks_refuses_a_wrong_stored_size(
    tmp_path: Path, url: str, damage: str
) -> None:
    # The cache tier's read (header and blocks in one scatter read): the stored size must be
    # the frame's. Garbage appended after a valid object used to go unseen (the read's length
    # came from the plan), on the file backend's one-request scatter and the generic one.
    backend = open_backend(f"file://{tmp_path}/s" if url == "file" else url)
    io = ObjectIO(backend, NS)
    frame = frame_of(io, payload(9))
    assert await io.put([frame]) == [True]
    raw = bytes(frame.buffer)
    stored = raw + b"\x00" * 16 if damage == "appended" else raw[:-1]
    name = format_key(key())
    await backend.delete([name])
    await backend.put([name], [stored])
    dest = np.zeros(PAYLOAD, dtype=np.uint8)
    with pytest.raises(TruncatedObjectError if damage == "truncated" else CorruptObjectError):
        await io.read_blocks(key(), dest.data, payload_bytes=PAYLOAD)
    # A part of the object (the first layers) cannot see past its own end: still served.
    assert await io.read_blocks(key(), dest.data, payload_bytes=PAYLOAD, layers=(0, 2))
    await backend.close()


async def test_read_blocks_with_the_wrong_payload_size_is_corrupt(store: FileBackend) -> None:
    io = ObjectIO(store, NS)
    assert await io.put([frame_of(io, payload(6))]) == [True]
    dest = np.zeros(2 * PAYLOAD, dtype=np.uint8)
    # The reader's namespace says the payload is twice as long: the header disagrees.
    with pytest.raises(CorruptObjectError):
        await io.read_blocks(key(), dest.data, payload_bytes=2 * PAYLOAD)


async def test_header_and_object_reads_for_tools(store: FileBackend) -> None:
    io = ObjectIO(store, NS)
    data = payload(7)
    assert await io.put([frame_of(io, data, parent=H2)]) == [True]
    (header,) = await io.read_headers([format_key(key())])
    assert isinstance(header, ObjectHeader)
    assert header.parent_hash == H2
    found = await io.read_object(format_key(key()))
    assert found is not None
    assert np.array_equal(np.frombuffer(found[1], dtype=np.uint8), data)
    assert await io.read_headers([format_key(key(H2))]) == [None]
    assert await io.read_object(format_key(key(H2))) is None
    # A valid object stored under another page's key: its header does not describe that key.
    assert await io.put([frame_of(io, payload(8), H2)]) == [True]
    store.path_of(format_key(key(H2))).write_bytes(store.path_of(format_key(key())).read_bytes())
    (mismatch,) = await io.read_headers([format_key(key(H2))])
    assert isinstance(mismatch, KeyMismatchError)


@pytest.mark.parametrize("bad", [123, None, b"abc", "../etc/passwd", ""])
async def test_the_tools_reads_refuse_what_is_no_storage_key(store: FileBackend, bad: object) -> None:
    io = ObjectIO(store, NS)
    with pytest.raises(InvalidKeyError):
        await io.read_object(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError):
        await io.verify_stored(bad, memoryview(bytearray(4096)))  # type: ignore[arg-type]
    # A storage key that names no object is the store's (corrupt), not the caller's.
    with pytest.raises(CorruptObjectError):
        await io.read_object("NOT_AN_OBJECT_KEY")


async def test_many_headers_in_one_call_for_tools(store: FileBackend) -> None:
    # gc reads one header per page of a whole store: one backend call for a batch, each
    # header checked against its key; misses, short and swapped objects answered per key.
    io = ObjectIO(store, NS)
    hashes = [f"{i:064x}" for i in range(1, 7)]
    assert await io.put([frame_of(io, payload(i), h, parent=hashes[i - 1] if i else None)
                         for i, h in enumerate(hashes[:4])]) == [True] * 4
    keys = [format_key(key(h)) for h in hashes]
    calls = []
    real = store.get_into

    async def counting(*args: object, **kwargs: object) -> object:
        calls.append(args[0])
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store, "get_into", counting)
        clean = await io.read_headers(keys)
    assert len(calls) == 1 and len(calls[0]) == 6, "one backend call for the batch"
    assert [h.parent_hash if isinstance(h, ObjectHeader) else h for h in clean] == [
        None, hashes[0], hashes[1], hashes[2], None, None]
    store.path_of(keys[1]).write_bytes(store.path_of(keys[0]).read_bytes())  # swapped
    await store.put([keys[2]], [b"short"])  # shorter than any header: key by key
    got = await io.read_headers(keys)
    assert isinstance(got[0], ObjectHeader) and got[0].parent_hash is None
    assert isinstance(got[1], KeyMismatchError)
    assert isinstance(got[2], CorruptObjectError)
    assert isinstance(got[3], ObjectHeader) and got[3].parent_hash == hashes[2]
    assert got[4:] == [None, None]
    assert await io.read_headers([]) == []


async def test_many_headers_are_checked_against_every_part_of_their_key(
        store: FileBackend) -> None:
    # read_headers parses each distinct key tail once and compares the storage key: a header
    # of the same page under other coordinates, or under another namespace, is a mismatch;
    # a key that is no object key (upper case) is read and decoded unchecked, as read_header does.
    io = ObjectIO(store, NS)
    assert await io.put([frame_of(io, payload(1))]) == [True]
    stored = store.path_of(format_key(key())).read_bytes()
    other_coords = format_key(ObjectKey(H1, NS.digest, ObjectCoords(4, 8, 0)))
    other_ns = format_key(ObjectKey(H1, "fedcba9876543210", COORDS))
    for name in (other_coords, other_ns, "NOT-AN-OBJECT"):
        await store.put([name], [stored])
    got = await io.read_headers([format_key(key()), other_coords, other_ns,
                                 "NOT-AN-OBJECT"])
    assert isinstance(got[0], ObjectHeader) and got[0].key() == key()
    assert isinstance(got[1], KeyMismatchError) and isinstance(got[2], KeyMismatchError)
    assert isinstance(got[3], ObjectHeader) and got[3].key() == key()


async def test_a_stalled_backend_ends_within_the_timeout(store: FileBackend) -> None:
    slow = FaultyBackend(store, FaultConfig(latency_s=5.0))
    io = ObjectIO(slow, NS, io_timeout_s=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await io.put([frame_of(io, payload(8))]) == [False]
    with pytest.raises(TimeoutError):
        await io.read_blocks(key(), np.zeros(PAYLOAD, dtype=np.uint8).data, payload_bytes=PAYLOAD)
    assert loop.time() - started < 2.0


async def test_writes_wait_for_the_byte_budget() -> None:
    budget = ByteBudget(100)
    assert await budget.acquire(60) == 60
    waiter = asyncio.ensure_future(budget.acquire(60))
    await asyncio.sleep(0.01)
    assert not waiter.done(), "60 + 60 bytes exceed the limit of 100"
    await budget.release(60)
    assert await waiter == 60
    await budget.release(60)
    assert await budget.acquire(1000) == 100, "a request over the limit takes the whole budget"


async def test_puts_in_flight_stay_within_the_write_budget() -> None:
    store = FaultyBackend(open_backend("memory://"), FaultConfig(latency_s=0.02))
    frame = ObjectIO(store, NS).frame_bytes(4, PAYLOAD)
    io = ObjectIO(store, NS, max_inflight_bytes=2 * frame)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, io.write_budget.used)
            await asyncio.sleep(0.001)

    watcher = asyncio.ensure_future(watch())
    results = await asyncio.gather(
        *(io.put([frame_of(io, payload(i), f"{i + 10:064x}")]) for i in range(8))
    )
    watcher.cancel()
    assert all(r == [True] for r in results)
    assert 0 < peak <= 2 * frame
    await store.close()


async def test_page_writes_reuse_their_staging() -> None:
    store = open_backend("memory://")
    link = L3Link(store, NS, Topology(), 0, max_inflight_bytes=1 << 20,
                  io_timeout_s=DEFAULT_IO_TIMEOUT_S)
    row = np.zeros(link.read_plan.page.page_bytes, dtype=np.uint8)
    for i in range(50):
        row[:] = i
        assert await link.write_page(f"{i + 100:064x}", row, IOStats())
        got = np.empty_like(row)
        assert await link.read_page(f"{i + 100:064x}", got, IOStats())
        assert (got == i).all()
    frames = link._frames.made()
    assert len(frames) == 1
    assert frames[0].blocks == 1, "one mapping for 50 pages, not one per object"
    assert all(a.blocks == 1 for a in link.io._headers.made())
    await store.close()


class _XorFormat:
    """A toy sealing format: the framed format, with the payload XOR-ed in place at ``seal``
    and back at ``open_blocks``: where an authenticated cipher plugs in (issue 24)."""

    name = "xor-test"
    sealed = False

    def stored_hash(self, page_hash: str) -> str:
        return page_hash

    def storage_key(self, key: ObjectKey) -> str:
        return FRAMED.storage_key(key)

    def header_bytes(self, num_layers: int) -> int:
        return FRAMED.header_bytes(num_layers)

    def seal(self, key: ObjectKey, frame: memoryview, *, kv_planes: int, parent_hash: str | None) -> None:
        body = np.frombuffer(frame, dtype=np.uint8)[self.header_bytes(key.coords.num_layers) :]
        body ^= 0x5A
        FRAMED.seal(key, frame, kv_planes=kv_planes, parent_hash=parent_hash)

    def open_header(self, key: ObjectKey, header: memoryview, *, payload_bytes: int) -> ObjectHeader:
        return FRAMED.open_header(key, header, payload_bytes=payload_bytes)

    def open_blocks(self, header: ObjectHeader, data: memoryview, layer_start: int, layer_stop: int) -> None:
        FRAMED.open_blocks(header, data, layer_start, layer_stop)
        np.frombuffer(data, dtype=np.uint8)[...] ^= 0x5A


async def test_a_format_seals_and_opens_in_one_place_each(store: FileBackend) -> None:
    io = ObjectIO(store, NS, fmt=_XorFormat())
    data = payload(9)
    assert await io.put([frame_of(io, data)]) == [True]
    stored = store.path_of(format_key(key())).read_bytes()[io.header_bytes(4) :]
    assert np.array_equal(np.frombuffer(stored, dtype=np.uint8), data ^ 0x5A)
    dest = np.zeros(PAYLOAD, dtype=np.uint8)
    assert await io.read_blocks(key(), dest.data, payload_bytes=PAYLOAD, layers=(1, 3))
    assert np.array_equal(dest[: 2 * BLOCK], data[BLOCK : 3 * BLOCK])
    # The plain format reads the sealed bytes as they are stored (its checksums still hold).
    plain = await ObjectIO(store, NS).read_object(format_key(key()))
    assert plain is not None
    assert np.array_equal(np.frombuffer(plain[1], dtype=np.uint8), data ^ 0x5A)


def fp8_namespace(dtype: str, k_scales: list[float], v_scales: list[float]) -> Namespace:
    return Namespace.create("m", ModelShape.mha(4, 2, 8), dtype, 4, Grid(4, 2),
                            kv_scales=kv_scales_digest(k_scales, v_scales))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
async def test_fp8_pages_round_trip_exactly_and_only_under_their_scales(
    store: FileBackend, dtype: torch.dtype
) -> None:
    """float8 pages (every bit pattern: NaNs, infinities, negative zero) come back byte for
    byte under their scales; under other scales they are not found, never served."""
    name = str(dtype).removeprefix("torch.")
    k_scales, v_scales = [0.5, 0.25, 2.0, 1.0], [1.0, 0.125, 4.0, 1.0]
    ns = fp8_namespace(name, k_scales, v_scales)
    assert ns.layer_block_bytes() * 4 == PAYLOAD // 2  # one byte a value: half float16's
    pages = torch.arange(PAYLOAD // 2, dtype=torch.int64).remainder(256).to(torch.uint8)
    pages = pages[torch.randperm(pages.numel(), generator=torch.Generator().manual_seed(3))]
    kv = pages.view(dtype).reshape(4, 2, 4, 2, 8)  # layers x K/V x tokens x heads x dim
    io = ObjectIO(store, ns)
    header = io.header_bytes(4)
    buf = memoryview(bytearray(header + kv.numel()))
    np.frombuffer(buf, dtype=np.uint8)[header:] = kv.view(torch.uint8).flatten().numpy()
    fp8_key = ObjectKey(H1, ns.digest, COORDS)
    assert await io.put([Frame(fp8_key, buf)]) == [True]

    # The same scales, the digest rebuilt elsewhere (from float32 tensors): a hit.
    again = fp8_namespace(name, torch.tensor(k_scales).tolist(), torch.tensor(v_scales).tolist())
    assert again == ns
    out = memoryview(bytearray(len(buf)))
    (got,) = await ObjectIO(store, again).read_frames([ObjectKey(H1, again.digest, COORDS)], [out])
    assert isinstance(got, ObjectHeader)
    back = torch.frombuffer(bytearray(out[header:]), dtype=torch.uint8).view(dtype)
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8).flatten())

    # One layer's v scale differs: another namespace, nothing there.
    other = fp8_namespace(name, k_scales, [*v_scales[:3], 2.0])
    assert other.digest != ns.digest
    (miss,) = await ObjectIO(store, other).read_frames(
        [ObjectKey(H1, other.digest, COORDS)], [memoryview(bytearray(len(buf)))])
    assert miss is None
