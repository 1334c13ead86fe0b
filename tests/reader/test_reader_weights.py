"""``KVReader(model=...)``: the KV of the weights of a model directory, never of other weights.

A deployment that served checkpoint ``a`` stored KV under ``a``'s weights identity (written
here through ``prepopulate`` with that revision). A reader given ``a``'s files at another path
finds it; a reader given ``b`` (same name and config, other weights) finds nothing; a namespace
that carries an explicit revision wins over the directory; a digest whose stored namespace
holds other weights is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _weights import checkpoint

from hicache_store import sync
from hicache_store.backends import open_backend
from hicache_store.demo.engine.source import MiniEngineSource
from hicache_store.layout.namespace import Grid, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.ops.prepopulate import namespace_for, prepopulate
from hicache_store.reader import KVReader
from hicache_store.weights import weights_identity

PAGE = 4
TOKENS = list(range(3, 33))  # 7 full pages


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    a = checkpoint(tmp_path / "a" / "llama", seed=0)
    return {"a": a, "b": checkpoint(tmp_path / "b" / "llama", seed=1),
            "a_copy": Path(shutil.copytree(a, tmp_path / "other" / "place"))}


def test_the_reader_reads_the_kv_of_the_weights_it_is_given(
    models: dict[str, Path], tmp_path: Path
) -> None:
    source = MiniEngineSource("tiny", model_name="llama")
    identity = weights_identity(models["a"])
    assert identity is not None
    url = f"file://{tmp_path / 'kv'}"
    served = namespace_for(source, page_size=PAGE, grid=Grid(1, 1),
                           model_revision=identity.value)
    backend = open_backend(url)
    sync.run(prepopulate(backend, source, [TOKENS], served, Topology(1, 1)))
    sync.close(backend)
    # what a user knows: the model's name and shape, not its revision
    asked = Namespace.create("llama", source.shape, source.dtype, PAGE, Grid(1, 1))

    with KVReader(url, asked, model=models["a_copy"]) as reader:
        kv = reader.read(TOKENS)
        assert reader.namespace() == served
    assert kv.tokens == 28 and kv.keys is not None
    expected = torch.stack([k.transpose(0, 1) for k, _ in source.kv(TOKENS[:28])])
    assert torch.equal(kv.keys, expected)
    with KVReader(url, asked, model=models["b"]) as reader:
        assert reader.stored_pages(TOKENS) == 0
        assert reader.read(TOKENS).tokens == 0
    # an explicit revision in the namespace wins over the directory
    with KVReader(url, served, model=models["b"]) as reader:
        assert reader.read(TOKENS).tokens == 28
    # by digest: the stored namespace must hold the weights given
    with KVReader(url, served.digest, model=models["a_copy"]) as reader:
        assert reader.stored_pages(TOKENS) == 7
    with KVReader(url, served.digest, model=models["b"]) as reader, pytest.raises(
            ValueError, match="holds the KV of weights"):
        reader.stored_pages(TOKENS)
    with pytest.raises(ValueError, match="no weights files"):
        KVReader(url, asked, model=tmp_path / "nothing")
