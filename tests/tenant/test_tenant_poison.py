"""Tenants sharing one store (real files): an attacker with full store access but without the
tenant's secret cannot poison, probe or read the tenant's KV; rotation keeps old KV readable.

The attacker here can list every key, read every byte, compute the public sha256 page-hash
chain of any prompt, read the namespace (digest, model, salt) and write correctly framed
objects with valid checksums anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from hicache_store.backends import aligned_buffer, open_backend
from hicache_store.backends.file import FileBackend
from hicache_store.layout.framing import decode_header, encode_object
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.keys import parse_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.objects import DEFAULT_IO_TIMEOUT_S, IOStats, L3Link
from hicache_store.tenant import KeyRing, parse_key_ring, retire_text, rotate_text

PLAIN = Namespace.create("m", ModelShape.mha(4, 4, 8), "float16", 4, Grid(4, 2), tenant_salt="t")
SEALED = dataclasses.replace(PLAIN, sealed=True)
VICTIM_TEXT = f"active {'11' * 32}\n"
VICTIM = parse_key_ring(VICTIM_TEXT)
ATTACKER = parse_key_ring(f"active {'22' * 32}\n")
PROMPT = list(range(1000, 1016))  # four pages of four tokens
PUBLIC = page_hashes(PROMPT, PLAIN.page_size)
ONE = Topology(1, 1)


def link(store: FileBackend, keys: KeyRing | None, ns: Namespace = SEALED,
         topology: Topology = ONE, rank: int = 0) -> L3Link:
    return L3Link(store, ns, topology, rank, max_inflight_bytes=1 << 20,
                  io_timeout_s=DEFAULT_IO_TIMEOUT_S, keys=keys)


def page(seed: int) -> np.ndarray:
    nbytes = UnifiedPageLayout.full_page(PLAIN).page_bytes
    row = np.frombuffer(aligned_buffer(nbytes), dtype=np.uint8)
    row[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return row


async def write_prompt(target: L3Link, seed: int = 0) -> list[np.ndarray]:
    rows = [page(seed + i) for i in range(len(PUBLIC))]
    for i, (h, row) in enumerate(zip(PUBLIC, rows, strict=True)):
        assert await target.write_page(h, row, IOStats(), PUBLIC[i - 1] if i else None)
    return rows


async def read(target: L3Link, h: str, io: IOStats) -> np.ndarray | None:
    row = np.frombuffer(aligned_buffer(target.read_plan.page.page_bytes), dtype=np.uint8)
    return row if await target.read_page(h, row, io) else None


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FileBackend]:
    backend = open_backend(f"file://{tmp_path}/shared")
    assert isinstance(backend, FileBackend)
    yield backend
    await backend.close()


async def keys_of(store: FileBackend) -> list[str]:
    return sorted([k async for k in store.list_prefix("")])


async def test_sealed_round_trip_stores_ciphertext_under_keyed_names(store: FileBackend) -> None:
    tenant = link(store, VICTIM)
    rows = await write_prompt(tenant)
    stored = await keys_of(store)
    assert len(stored) == 2 * len(PUBLIC)
    assert not {parse_key(k).page_hash for k in stored} & set(PUBLIC)
    for key in stored:
        data = await store.get_bytes(key)
        assert data is not None
        for row in rows:
            assert row[:256].tobytes() not in data  # no plaintext at rest
    assert await tenant.exists_prefix(PUBLIC) == len(PUBLIC)
    io = IOStats()
    for h, row in zip(PUBLIC, rows, strict=True):
        got = await read(tenant, h, io)
        assert got is not None and np.array_equal(got, row)
    assert io.tampered == io.corruptions == 0
    # Chains survive keying: each header's parent is the keyed previous page (gc's links).
    headers = [decode_header((await store.get_bytes(k)) or b"") for k in stored]
    parents = {h.page_hash: h.parent_hash for h in headers}
    keyed = [tenant.stored_hash(h) for h in PUBLIC]
    assert [parents[h] for h in keyed] == [None, *keyed[:-1]]


async def test_poison_plain_objects_with_valid_checksums_are_never_served(
    store: FileBackend,
) -> None:
    tenant = link(store, VICTIM)
    await write_prompt(tenant)
    # The attacker lists the store and overwrites every object of the tenant with a correctly
    # framed plain object (its own payload, every checksum valid) under the very same key.
    for key in await keys_of(store):
        obj = parse_key(key)
        size = SEALED.object_payload_bytes(0)
        await store.put([key], [encode_object(obj, b"\x5a" * size, SEALED.kv_planes)])
    io = IOStats()
    assert [await read(tenant, h, io) for h in PUBLIC] == [None] * len(PUBLIC)
    assert io.tampered == len(PUBLIC) and io.corruptions == 0


async def test_poison_objects_sealed_with_the_attackers_key_are_never_served(
    store: FileBackend,
) -> None:
    tenant = link(store, VICTIM)
    await write_prompt(tenant)
    attacker_key = ATTACKER.active
    for key in await keys_of(store):
        obj = parse_key(key)
        forged = bytearray(encode_object(obj, b"\x5a" * SEALED.object_payload_bytes(0),
                                         SEALED.kv_planes, seal=attacker_key))
        forged[120:128] = bytes.fromhex(VICTIM.active.key_id)  # even claiming the victim's id
        await store.put([key], [bytes(forged)])
    io = IOStats()
    assert [await read(tenant, h, io) for h in PUBLIC] == [None] * len(PUBLIC)
    assert io.tampered == len(PUBLIC)


async def test_tamper_swapped_and_replayed_objects_are_misses(store: FileBackend) -> None:
    tenant = link(store, VICTIM)
    await write_prompt(tenant)
    stored = await keys_of(store)
    # Swap: page A's valid object stored under page B's key.
    a = parse_key(stored[0])
    b = next(k for k in stored
             if parse_key(k).page_hash != a.page_hash and parse_key(k).coords == a.coords)
    await store.put([b], [(await store.get_bytes(stored[0])) or b""])
    # Replay across tenants: the same prompt sealed by another tenant in the same namespace,
    # copied over the victim's object of page 3.
    other = link(store, ATTACKER)
    await other.write_page(PUBLIC[3], page(99), IOStats())
    victim_name = tenant.read_plan.object_keys(tenant.stored_hash(PUBLIC[3]))[0]
    other_name = other.read_plan.object_keys(other.stored_hash(PUBLIC[3]))[0]
    await store.put([victim_name], [(await store.get_bytes(other_name)) or b""])
    io = IOStats()
    by_key = {tenant.stored_hash(h): h for h in PUBLIC}
    swapped = by_key[parse_key(b).page_hash]
    assert await read(tenant, swapped, io) is None
    assert await read(tenant, PUBLIC[3], io) is None
    assert io.tampered == 2


async def test_poison_membership_probing_without_the_secret_finds_nothing(
    store: FileBackend,
) -> None:
    tenant = link(store, VICTIM)
    await write_prompt(tenant)
    assert await tenant.exists_prefix(PUBLIC) == len(PUBLIC)
    # The attacker knows the prompt, the namespace (digest, salt) and the public chain.
    probe = link(store, None, PLAIN)
    assert await probe.exists_prefix(PUBLIC) == 0
    names = [n for h in PUBLIC for n in probe.read_plan.object_keys(h)]
    names += [n.replace(PLAIN.digest, SEALED.digest) for n in names]
    assert not any(await store.exists(names))
    listed = {parse_key(k).page_hash for k in await keys_of(store)}
    candidates = set(PUBLIC) | set(page_hashes(PROMPT, PLAIN.page_size, algo="xxh3_128"))
    assert not listed & candidates
    # Another tenant's key (the "wrong key") finds nothing and reads nothing either.
    wrong = link(store, ATTACKER)
    assert await wrong.exists_prefix(PUBLIC) == 0
    io = IOStats()
    assert await read(wrong, PUBLIC[0], io) is None
    assert io.tampered == 0  # a plain miss: nothing is stored under its names


async def test_poison_needs_the_key_even_to_try(store: FileBackend) -> None:
    with pytest.raises(ValueError, match="sealed: a tenant key ring"):
        link(store, None, SEALED)
    with pytest.raises(ValueError, match="not sealed"):
        link(store, VICTIM, PLAIN)


async def test_poison_rotation_reads_old_and_new_and_retired_keys_miss(
    store: FileBackend,
) -> None:
    before = link(store, VICTIM)
    old_rows = await write_prompt(before)
    rotated_text = rotate_text(VICTIM_TEXT)
    rotated = parse_key_ring(rotated_text)
    assert rotated.readable[1] == VICTIM.active
    after = link(store, rotated)
    # Everything written under the old key still hits, and reads back byte for byte.
    assert await after.exists_prefix(PUBLIC) == len(PUBLIC)
    io = IOStats()
    got = await read(after, PUBLIC[1], io)
    assert got is not None and np.array_equal(got, old_rows[1])
    # New pages go under the new key; a prefix that crosses the rotation still hits whole.
    more = [*PROMPT, *range(2000, 2008)]
    more_hashes = page_hashes(more, PLAIN.page_size)
    new_rows = [page(50), page(51)]
    for h, row in zip(more_hashes[4:], new_rows, strict=True):
        assert await after.write_page(h, row, IOStats())
    assert await after.exists_prefix(more_hashes) == 6
    got = await read(after, more_hashes[5], io)
    assert got is not None and np.array_equal(got, new_rows[1])
    new_names = after.read_plan.object_keys(after.stored_hash(more_hashes[5]))
    header = decode_header((await store.get_bytes(new_names[0])) or b"")
    assert header.key_id == rotated.active.key_id
    # The old key alone does not see the new pages.
    assert await before.exists_prefix(more_hashes) == 4
    # Retire the old key: its pages are misses; the new key's pages still hit.
    retired = parse_key_ring(retire_text(rotated_text, VICTIM.active.key_id))
    late = link(store, retired)
    assert await late.exists_prefix(more_hashes) == 0  # the prefix now starts with a miss
    assert await late.exists_prefix(more_hashes[4:]) == 2  # the new key's pages themselves
    assert await read(late, PUBLIC[0], io) is None
    got = await read(late, more_hashes[4], io)
    assert got is not None and np.array_equal(got, new_rows[0])
    assert io.tampered == 0
    # What an operator sees: every stored object names the key that sealed it.
    ids = {decode_header((await store.get_bytes(k)) or b"").key_id for k in await keys_of(store)}
    assert ids == {VICTIM.active.key_id, rotated.active.key_id}
    assert {retired.state(i) for i in ids} == {"retired", "active"}


async def test_layer_range_reads_of_sealed_objects(store: FileBackend) -> None:
    tenant = link(store, VICTIM)
    rows = await write_prompt(tenant)
    reader = link(store, VICTIM, topology=Topology(1, 2), rank=1)  # layers 2-3 of each object
    io = IOStats()
    got = await read(reader, PUBLIC[2], io)
    assert got is not None
    block = PLAIN.layer_block_bytes()
    per_group = PLAIN.object_payload_bytes(0)
    want = np.concatenate([rows[2][g * per_group + 2 * block : (g + 1) * per_group]
                           for g in range(2)])
    assert np.array_equal(got, want)
    assert io.bytes_fetched == 2 * 2 * block  # only two layers of each object were read
