"""A sealed model namespace seals its cache components too (window KV, recurrent checkpoints):
their objects are keyed and encrypted with the tenant's ring, a fresh tier holding the ring
resumes from them, and objects planted, swapped or replayed without the secret are misses
counted as ``tamper``, never state (the logits stay those of a full recompute)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from _serve import serve_checked

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.hybrid import HybridMiniLlama, RecurrentPool, WindowPool
from hicache_store.layout.errors import MissingKeyError
from hicache_store.layout.framing import decode_header, encode_object
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import parse_key
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.objects.sealed import SealedFormat
from hicache_store.tenant import KeyRing, parse_key_ring
from hicache_store.tier.cache import HiCache
from hicache_store.tier.config import TierConfig

PAGE = 4
CONFIG = MiniLlamaConfig(window_layers=(1, 3), sliding_window=8)
RING = parse_key_ring(f"active {'33' * 32}\n")


@pytest.fixture(scope="module")
def model() -> HybridMiniLlama:
    return HybridMiniLlama(CONFIG, state_dim=8)


@dataclass
class Tenant:
    tier: HiCache
    window: WindowPool
    recurrent: RecurrentPool
    model: HybridMiniLlama

    def serve(self, tokens: list[int]) -> int:
        """One request; its logits must equal a full recompute. Returns the reused tokens."""
        return serve_checked(
            self.tier, self.model, tokens, window=self.window, recurrent=self.recurrent
        ).start

    def extra(self, name: str) -> float:
        return self.tier.metrics.extra.get(name, 0)


def sealed_namespace(model: HybridMiniLlama) -> Namespace:
    config = model.config
    layers = len(config.full_layers)
    shape = ModelShape.mha(layers, config.num_kv_heads, config.head_dim)
    plain = Namespace.create("tenant-hybrid", shape, config.dtype, PAGE,
                             Grid(layers, config.num_kv_heads))
    return dataclasses.replace(plain, sealed=True)


def tenant(model: HybridMiniLlama, backend: Backend, keys: KeyRing | None) -> Tenant:
    ns = sealed_namespace(model)
    window = WindowPool(model.config, ns, 32, l2_slots=64)
    recurrent = RecurrentPool(model.state_dim, ns, 16, l2_slots=16)
    tier = HiCache(
        ns,
        TierConfig(l1_pages=64, l2_pages=64, prefetch_policy="wait_complete",
                   prefetch_threshold_tokens=PAGE),
        model.make_pool(64, PAGE),
        backend=backend,
        components=[window.component, recurrent.component],
        keys=keys,
    )
    return Tenant(tier, window, recurrent, model)


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]


def populate(model: HybridMiniLlama, backend: Backend, doc: list[int], rng: random.Random) -> Tenant:
    """The tenant serves two requests sharing ``doc``: a checkpoint at its end and the window
    before it are backed up to L3, with the KV."""
    writer = tenant(model, backend, RING)
    writer.serve(doc + rand(rng, 5))
    writer.serve(doc + rand(rng, 6))
    writer.tier.flush()
    return writer


def stored_objects(backend: Backend) -> dict[str, list[str]]:
    """Object keys by namespace digest (manifests left out)."""
    async def listed() -> list[str]:
        return [k async for k in backend.list_prefix("") if not k.startswith("M_")]

    out: dict[str, list[str]] = {}
    for key in run_sync(listed()):
        out.setdefault(parse_key(key).namespace_digest, []).append(key)
    return out


def test_tamper_sealed_components_store_ciphertext_under_keyed_names_and_resume(
    model: HybridMiniLlama, tmp_path: Path
) -> None:
    rng = random.Random(1)
    doc = rand(rng, 24)
    backend = open_backend(f"file://{tmp_path}/shared")
    writer = populate(model, backend, doc, rng)
    digests = {"kv": writer.tier.namespace.digest, "window": writer.window.namespace.digest,
               "recurrent": writer.recurrent.namespace.digest}
    assert writer.window.namespace.sealed and writer.recurrent.namespace.sealed
    writer.tier.close()
    stored = stored_objects(backend)
    assert set(stored) == set(digests.values()), "every component's objects are there"
    public = set(page_hashes(doc, PAGE))
    for keys in stored.values():
        for key in keys:
            assert parse_key(key).page_hash not in public, "names computable from tokens"
            header = decode_header(run_sync(backend.get_bytes(key)) or b"")
            assert header.sealed and header.key_id == RING.active.key_id
    # A fresh tier with the ring resumes after the document from L3: KV, the window's two
    # pages and the checkpoint, all authenticated and decrypted.
    reader = tenant(model, backend, RING)
    assert reader.serve(doc + rand(rng, 3)) == len(doc)
    assert reader.extra("restored_l3_window") == 2
    assert reader.extra("restored_l3_recurrent") == 1
    assert reader.tier.metrics.tampered == 0
    reader.tier.close()
    # Without the ring, the sealed namespace is refused, components included.
    with pytest.raises(MissingKeyError):
        tenant(model, backend, None)


@pytest.mark.parametrize("part", ["window", "recurrent"])
def test_poison_component_objects_planted_without_the_key_are_never_served(
    model: HybridMiniLlama, tmp_path: Path, part: str
) -> None:
    """A writer without the secret lists the store and overwrites every object of one
    component with a correctly framed plain object (every checksum valid) under the same key:
    the reader resumes from nothing that component needs, counts tampering, and its logits
    stay exact."""
    rng = random.Random(2)
    doc = rand(rng, 24)
    backend = open_backend(f"file://{tmp_path}/shared")
    writer = populate(model, backend, doc, rng)
    ns = getattr(writer, part).namespace
    writer.tier.close()
    planted = stored_objects(backend)[ns.digest]
    for key in planted:
        size = len(run_sync(backend.get_bytes(key)) or b"") - decode_header(
            run_sync(backend.get_bytes(key)) or b"").payload_offset
        forged = encode_object(parse_key(key), b"\x5a" * size, ns.kv_planes)
        run_sync(backend.put([key], [forged]))
    reader = tenant(model, backend, RING)
    start = reader.serve(doc + rand(rng, 3))
    assert start < len(doc), "a planted component object was used"
    assert reader.extra(f"restored_l3_{part}") == 0
    assert reader.tier.metrics.tampered >= 1
    assert reader.tier.metrics.corruptions == 0  # counted as tampering, not as disk rot
    reader.tier.close()


def test_tamper_kv_and_replayed_objects_under_component_names_are_misses(
    model: HybridMiniLlama, tmp_path: Path
) -> None:
    """Objects the tenant itself sealed, moved to another name: the checkpoint's name gets a
    KV object of the same page, each window name the window object of the other page. Every
    block authenticates its own key, so each is a miss."""
    rng = random.Random(3)
    doc = rand(rng, 24)
    backend = open_backend(f"file://{tmp_path}/shared")
    writer = populate(model, backend, doc, rng)
    kv_ns, window_ns = writer.tier.namespace, writer.window.namespace
    recurrent_ns = writer.recurrent.namespace
    writer.tier.close()
    stored = stored_objects(backend)
    keyed = [SealedFormat(RING.active).stored_hash(h) for h in page_hashes(doc, PAGE)]

    def named(digest: str, page_hash: str) -> str:
        (key,) = [k for k in stored[digest] if parse_key(k).page_hash == page_hash]
        return key

    # The checkpoint at the document's end, and the window pages a resume there needs.
    checkpoint = named(recurrent_ns.digest, keyed[-1])
    same_page = named(kv_ns.digest, keyed[-1])
    run_sync(backend.put([checkpoint], [run_sync(backend.get_bytes(same_page)) or b""]))
    windows = [named(window_ns.digest, h) for h in keyed[-2:]]
    first, second = (run_sync(backend.get_bytes(k)) or b"" for k in windows)
    run_sync(backend.put(windows, [second, first]))  # same size, swapped
    reader = tenant(model, backend, RING)
    assert reader.serve(doc + rand(rng, 3)) < len(doc)
    assert reader.extra("restored_l3_window") == reader.extra("restored_l3_recurrent") == 0
    assert reader.tier.metrics.tampered >= 1
    reader.tier.close()
