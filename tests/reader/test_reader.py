"""``KVReader``: stored KV back as tensors, equal to the model's own KV, for any reader rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hicache_store import sync
from hicache_store.backends import open_backend
from hicache_store.backends.memory import MemoryBackend
from hicache_store.demo.engine.source import MiniEngineSource
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.plans import plan_writes
from hicache_store.layout.topology import Topology
from hicache_store.objects import DEFAULT_IO_TIMEOUT_S, IOStats, L3Link
from hicache_store.ops.prepopulate import namespace_for, prepopulate
from hicache_store.reader import KVReader

PAGE = 4
TOKENS = list(range(3, 33))  # 30 tokens: 7 full pages and 2 tokens that are never stored


@pytest.fixture(scope="module")
def source() -> MiniEngineSource:
    return MiniEngineSource("tiny")  # 4 layers, 2 KV heads of 16, float32


def stored(source: MiniEngineSource, url: str, grid: Grid) -> Namespace:
    namespace = namespace_for(source, page_size=PAGE, grid=grid)
    backend = open_backend(url)
    sync.run(prepopulate(backend, source, [TOKENS], namespace, Topology(1, 1)))
    sync.close(backend)
    return namespace


@pytest.mark.parametrize(("tp", "pp", "rank"), [(1, 1, 0), (2, 1, 1), (1, 2, 1), (2, 2, 2)])
def test_read_equals_the_models_kv_for_any_rank(
    source: MiniEngineSource, tmp_path: Path, tp: int, pp: int, rank: int
) -> None:
    url = f"file://{tmp_path / 'kv'}"
    namespace = stored(source, url, Grid(1, 1))
    with KVReader(url, namespace, Topology(tp, pp), rank) as reader:
        assert reader.stored_pages(TOKENS) == 7
        kv = reader.read(TOKENS)
    assert kv.tokens == 28 and kv.corruptions == 0
    assert kv.latent is None and kv.keys is not None and kv.values is not None
    full = source.kv(TOKENS[:28])  # per layer (K, V), each [heads, tokens, dim]
    layers = range(kv.layer_start, kv.layer_stop)
    heads = slice(kv.head_start, kv.head_stop)
    expected_k = torch.stack([full[i][0][heads].transpose(0, 1) for i in layers])
    expected_v = torch.stack([full[i][1][heads].transpose(0, 1) for i in layers])
    assert kv.keys.shape == (len(layers), 28, kv.head_stop - kv.head_start, 16)
    assert torch.equal(kv.keys, expected_k)
    assert torch.equal(kv.values, expected_v)


async def test_async_reader_by_manifest_digest_on_an_open_backend(
    source: MiniEngineSource, tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'kv'}"
    namespace = namespace_for(source, page_size=PAGE, grid=Grid(2, 2))
    backend = open_backend(url)
    await prepopulate(backend, source, [TOKENS], namespace, Topology(1, 1))
    async with KVReader(backend, namespace.digest) as reader:  # namespace from the manifest
        assert await reader.anamespace() == namespace
        kv = await reader.aread([*TOKENS[:13], 999])  # a prompt sharing 3 pages
        assert kv.tokens == 12
        missing = await reader.aread([999, *TOKENS])
        assert missing.tokens == 0 and missing.keys is not None and missing.keys.shape[1] == 0
    assert not backend.closed  # the caller's backend stays open
    with pytest.raises(LookupError, match="no manifest"):
        await KVReader(backend, "0123456789abcdef").aread(TOKENS)
    await backend.close()


def test_a_corrupt_object_ends_the_prefix(source: MiniEngineSource) -> None:
    backend = MemoryBackend()
    namespace = namespace_for(source, page_size=PAGE, grid=Grid(4, 2))  # one object per page
    sync.run(prepopulate(backend, source, [TOKENS], namespace, Topology(1, 1)))
    hashes = page_hashes(TOKENS, PAGE)
    (key,) = plan_writes(namespace, Topology(1, 1), 0).object_keys(hashes[3])
    damaged = bytearray(backend.raw_get(key) or b"")
    damaged[-5] ^= 0xFF
    backend.raw_set(key, bytes(damaged))
    reader = KVReader(backend, namespace)
    kv = reader.read(TOKENS)
    assert kv.tokens == 12 and kv.corruptions == 1
    reader.close()
    assert not backend.closed


def test_mla_latent_round_trip() -> None:
    # MLA pages written as the tier writes them ((layer, token, dim) per page), read back.
    shape = ModelShape.mla(num_layers=3, kv_dim=8)
    namespace = Namespace.create("mla-model", shape, "bfloat16", PAGE, Grid(3, 1))
    backend = MemoryBackend()
    tokens = list(range(100, 112))  # 3 pages
    hashes = page_hashes(tokens, PAGE)
    gen = torch.Generator().manual_seed(1)
    latent = torch.randn(3, len(tokens), 8, generator=gen).to(torch.bfloat16)
    writer = L3Link(backend, namespace, Topology(2, 1), 0, max_inflight_bytes=1 << 20,
                    io_timeout_s=DEFAULT_IO_TIMEOUT_S)
    layout = UnifiedPageLayout.full_page(namespace)
    for page, page_hash in enumerate(hashes):
        block = latent[:, page * PAGE : (page + 1) * PAGE].contiguous()
        row = np.frombuffer(block.view(torch.uint8).numpy().tobytes(), dtype=np.uint8)
        assert row.nbytes == layout.page_bytes
        assert sync.run(writer.write_page(page_hash, row, IOStats()))
    kv = KVReader(backend, namespace, Topology(2, 1), 1).read(tokens)  # TP rank 1 reads too
    assert kv.keys is None and kv.latent is not None
    assert torch.equal(kv.latent.view(torch.int16), latent.view(torch.int16))


def test_sync_close_of_a_backend(tmp_path: Path) -> None:
    backend = open_backend(f"file://{tmp_path / 'kv'}")
    sync.close(backend)
    sync.close(backend)  # idempotent
    assert backend.closed
