"""Non-KV component objects: framed and namespaced in L3, own L1/L2 pools, backup rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.hybrid.components import ComponentSpec, HitRule, Location
from hicache_store.hybrid.state_l3 import StateL3
from hicache_store.hybrid.store import ComponentStore, StoreFullError
from hicache_store.layout.framing import decode_header
from hicache_store.layout.keys import parse_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace

SNAP = ComponentSpec("recurrent", 2, HitRule.CHECKPOINT, num_layers=2)
SHAPE = (2, 8)
H = [f"{i:064x}" for i in range(1, 20)]


def namespace() -> Namespace:
    return Namespace.create("hybrid-test", ModelShape.mha(4, 2, 16), "float32", 4, Grid(4, 2))


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "memory":
        return open_backend("memory://")
    return open_backend(f"file://{tmp_path}/l3")


def state(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def test_objects_are_namespaced_and_framed(backend: Backend) -> None:
    ns = namespace()
    link = StateL3(backend, ns, SNAP, payload_bytes=64)
    payload = state(1).numpy().tobytes()
    assert run_sync(link.put(H[0], payload, parent_hash=H[1]))
    key = link.key(H[0])
    parsed = parse_key(key)
    assert parsed.coords.component == 2 and parsed.namespace_digest == ns.digest
    assert key.endswith("_L0-1_C2")
    raw = run_sync(backend.get_bytes(key))
    assert raw is not None
    header = decode_header(raw, object_length=len(raw))
    assert header.coords.component == 2 and header.parent_hash == H[1]
    assert run_sync(link.get(H[0])) == payload
    assert run_sync(link.exists([H[0], H[2]])) == [True, False]
    assert run_sync(link.get(H[2])) is None
    assert (link.io.hits, link.io.misses, link.io.corruptions) == (1, 1, 0)
    # another namespace (another model) never sees it
    other = Namespace.create("other", ModelShape.mha(4, 2, 16), "float32", 4, Grid(4, 2))
    assert run_sync(StateL3(backend, other, SNAP).get(H[0])) is None


def test_corrupt_snapshot_is_a_counted_miss(backend: Backend) -> None:
    link = StateL3(backend, namespace(), SNAP, payload_bytes=64)
    assert run_sync(link.put(H[0], state(1).numpy().tobytes()))
    raw = bytearray(run_sync(backend.get_bytes(link.key(H[0]))) or b"")
    raw[-1] ^= 0xFF  # flip a payload bit
    run_sync(backend.put([link.key(H[0])], [bytes(raw)]))
    assert run_sync(link.get(H[0])) is None
    # an object copied under another page's key is detected too (header names the page)
    run_sync(link.put(H[1], state(2).numpy().tobytes()))
    good = run_sync(backend.get_bytes(link.key(H[1])))
    run_sync(backend.put([link.key(H[3])], [good]))
    assert run_sync(link.get(H[3])) is None
    assert link.io.corruptions == 2 and link.io.hits == 0


def test_store_tiers_restore_bit_exact(backend: Backend) -> None:
    l3 = StateL3(backend, namespace(), SNAP)
    store = ComponentStore(SNAP, SHAPE, torch.float32, l1_slots=2, l2_slots=2, l3=l3)
    states = {h: state(i) for i, h in enumerate(H[:3])}
    for h, s in states.items():
        store.save(h, s)
        assert store.backup(h)
    # three saves into two L1 / L2 slots: the oldest was evicted from both, but lives in L3
    assert store.location(H[0]) is Location.L3
    assert store.location(H[2]) is Location.L1
    store.evict_all(Location.L1)
    assert store.availability(H[:4]) == [Location.L3, Location.L2, Location.L2, None]
    for h, s in states.items():
        got = store.load(h)
        assert got is not None and torch.equal(got, s)
    assert store.metrics.loads_l3 >= 1 and store.metrics.loads_l2 >= 1
    assert store.load(H[5]) is None
    store.check_invariants()


def test_l3_known_by_a_fresh_instance(backend: Backend) -> None:
    ns = namespace()
    writer = ComponentStore(
        SNAP, SHAPE, torch.float32, l1_slots=1, l2_slots=0, l3=StateL3(backend, ns, SNAP)
    )
    writer.save(H[0], state(3))
    assert writer.backup(H[0])
    reader = ComponentStore(
        SNAP, SHAPE, torch.float32, l1_slots=1, l2_slots=1, l3=StateL3(backend, ns, SNAP)
    )
    assert reader.availability([H[0], H[1]]) == [None, None]
    assert reader.availability([H[0], H[1]], check_l3=True) == [Location.L3, None]
    got = reader.load(H[0])
    assert got is not None and torch.equal(got, state(3))


def test_backup_copies_only_what_is_missing(backend: Backend) -> None:
    l3 = StateL3(backend, namespace(), SNAP)
    store = ComponentStore(SNAP, SHAPE, torch.float32, l1_slots=4, l2_slots=4, l3=l3)
    store.save(H[0], state(1))
    assert store.backup(H[0])
    assert (store.metrics.backups_l2, store.metrics.backups_l3, l3.io.puts) == (1, 1, 1)
    assert store.backup(H[0])  # already everywhere: nothing moves
    assert (store.metrics.backups_l2, l3.io.puts, store.metrics.backups_skipped) == (1, 1, 1)
    assert not store.backup(H[9])  # unknown


def test_locked_entries_are_not_evicted() -> None:
    store = ComponentStore(SNAP, SHAPE, torch.float32, l1_slots=1, l2_slots=0)
    store.save(H[0], state(1))
    store.lock(H[0])
    with pytest.raises(StoreFullError):
        store.save(H[1], state(2))
    store.unlock(H[0])
    store.save(H[1], state(2))
    assert store.location(H[0]) is None and store.location(H[1]) is Location.L1
    with pytest.raises(ValueError):
        store.save(H[2], torch.zeros(3))
    store.check_invariants()
