"""Prepopulation from a real (tiny, random-weight) Llama loaded through transformers.

Oracles bypass the code under test: stored pages are read back through the layout's plans and
framing (``L3Link.read_page``) and reshaped by the SPEC's definition of a unified host page,
then compared with the model's own ``past_key_values``; the restored KV then drives the HF model
itself through a ``DynamicCache``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache_store.backends import open_backend
from hicache_store.backends.base import Backend
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import Grid, Namespace
from hicache_store.layout.topology import Topology
from hicache_store.objects import IOStats, L3Link
from hicache_store.ops.manifest import list_manifests, read_manifest
from hicache_store.ops.prepopulate import Progress, namespace_for, prepopulate
from hicache_store.ops.sources import HFSource, Prompt, cache_layers, output_cache

from .conftest import sentence

transformers = pytest.importorskip("transformers")

PAGE = 4


@pytest.fixture(scope="module")
def hf32(tiny_llama: Path) -> HFSource:
    return HFSource(tiny_llama, dtype="float32")


def model_kv(source: HFSource, tokens: list[int]) -> torch.Tensor:
    """The model's own cache after one forward pass: ``[layers, 2, heads, tokens, dim]``."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = source.model(input_ids=ids, use_cache=True)
    return torch.stack([torch.stack((k, v)) for k, v in cache_layers(output_cache(out))])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_stored_kv_is_the_models_own_cache_bit_for_bit(
    tiny_llama: Path, tmp_path: Path, dtype: str
) -> None:
    source = HFSource(tiny_llama, dtype=dtype)
    tokens = source.tokenize(Prompt("t", text=sentence(0, 42)))
    ns = namespace_for(source, page_size=PAGE, grid=Grid(1, 1))
    writer = Topology(2, 2)
    backend = open_backend(f"file://{tmp_path / 'store'}")
    report = await prepopulate(backend, source, [tokens], ns, writer)
    full = len(tokens) // PAGE * PAGE
    assert report.pages_written == full // PAGE and report.write_failures == 0
    assert report.objects_written == report.pages_written * 4  # 2 layers x 2 head groups
    # The manifest names the namespace.
    (key,) = await list_manifests(backend)
    assert await read_manifest(backend, key) == ns
    expected = model_kv(source, tokens[:full])
    hashes = page_hashes(tokens, PAGE)
    # Read back by a different topology than the writer's: whole model, then TP=2 halves.
    stored = await _to_thread_read(backend, ns, Topology(1, 1), 0, hashes)
    assert stored.dtype == expected.dtype and torch.equal(stored, expected)
    for rank in range(2):
        half = await _to_thread_read(backend, ns, Topology(2, 1), rank, hashes)
        assert torch.equal(half, expected[:, :, rank:rank + 1])
    await backend.close()


async def _to_thread_read(backend: Backend, ns: Namespace, topology: Topology, rank: int,
                          hashes: list[str]) -> torch.Tensor:
    link = L3Link(backend, ns, topology, rank, max_inflight_bytes=1 << 26, io_timeout_s=30)
    layout = link.read_plan.page
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[ns.dtype]
    pages = []
    for h in hashes:
        row = np.zeros(layout.page_bytes, dtype=np.uint8)
        assert await link.read_page(h, row, IOStats())
        blocks = []
        for block in layout.blocks:
            raw = torch.from_numpy(row[block.offset:block.offset + block.nbytes].copy())
            shape = (layout.num_layers, 2, ns.page_size, block.num_heads, ns.head_dim)
            blocks.append(raw.view(dtype).reshape(shape).permute(0, 1, 3, 2, 4))
        pages.append(torch.cat(blocks, dim=2))
    return torch.cat(pages, dim=3)


async def test_restored_prefix_gives_the_full_forward_logits(
    hf32: HFSource, tmp_path: Path
) -> None:
    prefix = hf32.tokenize(Prompt("a", text=sentence(5, 40)))
    ns = namespace_for(hf32, page_size=PAGE, grid=Grid(1, 1))
    backend = open_backend(f"file://{tmp_path / 'store'}")
    await prepopulate(backend, hf32, [prefix], ns, Topology(2, 2))
    # A request that extends the prepopulated prompt.
    request = prefix + hf32.tokenize(Prompt("b", text=sentence(11, 9)))
    hashes = page_hashes(request, PAGE)
    reader = L3Link(backend, ns, Topology(1, 1), 0, max_inflight_bytes=1 << 26, io_timeout_s=30)
    hit = await reader.exists_prefix(hashes)
    assert hit == len(prefix) // PAGE  # every full page of the prefix, nothing beyond
    kv = await _to_thread_read(backend, ns, Topology(1, 1), 0, hashes[:hit])
    cache = transformers.DynamicCache()
    for layer in range(ns.num_layers):
        cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
    cached = hf32.logits(request[hit * PAGE:], cache)
    full = hf32.logits(request)
    assert hit * PAGE < len(request)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
    assert int(cached.argmax()) == int(full.argmax())
    await backend.close()


async def test_interrupted_run_then_rerun_writes_only_missing_pages(
    hf32: HFSource, tmp_path: Path
) -> None:
    prompts = [hf32.tokenize(Prompt(str(i), text=sentence(7 * i, 24))) for i in range(4)]
    ns = namespace_for(hf32, page_size=PAGE, grid=Grid(1, 1))
    url = f"file://{tmp_path / 'store'}"

    class Interrupted(Exception):
        pass

    def stop_after_two(state: Progress) -> None:
        if state.pages_done >= 2 * (24 // PAGE) - 1:
            raise Interrupted

    backend = open_backend(url)
    with pytest.raises(Interrupted):
        await prepopulate(backend, hf32, prompts, ns, Topology(1, 2), batch_size=1,
                          progress=stop_after_two)
    before = {k async for k in backend.list_prefix("") if not k.startswith("M_")}
    await backend.close()
    assert before  # something was written before the interruption

    backend = open_backend(url)
    written: list[str] = []
    real_put = backend.put

    async def recording_put(keys: Any, buffers: Any) -> None:
        written.extend(keys)
        await real_put(keys, buffers)

    backend.put = recording_put  # type: ignore[method-assign]
    dry = await prepopulate(backend, hf32, prompts, ns, Topology(1, 2), dry_run=True)
    assert written == [] and dry.pages_present == len(before) // 4 == 12
    report = await prepopulate(backend, hf32, prompts, ns, Topology(1, 2))
    after = {k async for k in backend.list_prefix("") if not k.startswith("M_")}
    assert set(written) == after - before and len(written) == len(after - before)
    assert report.objects_written == dry.objects_written == len(written)
    assert report.pages_present == dry.pages_present
    # A third run has nothing to do.
    written.clear()
    again = await prepopulate(backend, hf32, prompts, ns, Topology(1, 2))
    assert written == [] and again.pages_written == 0 and again.prompts_computed == 0
    await backend.close()
