"""One store across writers: KV that ``hicache-store prepopulate`` computed offline from the same
Hugging Face model (transformers, not vLLM) is found and served by vLLM through the connector.

* vLLM with the connector on an empty store computes every prompt itself (nothing to load:
  vLLM's own recompute) and stores its pages.
* ``prepopulate`` (``HFSource``: the model run by transformers) writes the same prompts' pages
  into a second store. Same model path, dtype, block size and topology: the same namespace, so
  the very same object keys. Their payloads agree with vLLM's to float32 rounding (a check of
  ``VllmCpuLayout``: K/V, token and head order all line up with what transformers
  computes), and are not bitwise equal (two different implementations did compute them).
* A fresh vLLM engine on the prepopulated store takes every offered page from it (vLLM's
  ``external_prefix_cache_hits``) and its greedy tokens equal vLLM's own recompute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_support import close_llm, connector_config, make_llm, sentence

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import ModelShape, Namespace
from hicache_store.layout.plans import plan_reads, suggest_grid
from hicache_store.layout.topology import Topology
from hicache_store.objects import ObjectIO
from hicache_store.ops.prepopulate import prepopulate
from hicache_store.ops.sources import HFSource
from hicache_store.weights import weights_identity

#: real engines, a minute or more on 2 cores
pytestmark = pytest.mark.slow

BLOCK = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def run(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], GREEDY,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def counter(llm: Any, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def namespace(model_dir: Path) -> Namespace:
    """The engines' namespace: the model path, the identity of its weights (what vLLM's
    connector derives from the same files), the KV shape, dtype, block size and grid."""
    shape = ModelShape.mha(num_layers=4, num_kv_heads=2, head_dim=64)
    grid = suggest_grid(shape, [Topology(1, 1)], "head_sharded")
    identity = weights_identity(model_dir)
    assert identity is not None
    return Namespace.create(str(model_dir), shape, "float32", BLOCK, grid,
                            model_revision=identity.value)


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path) -> list[list[int]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_llama))
    texts = [sentence(3, 420), sentence(17, 300), sentence(29, 520)]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def payloads(root: Path, ns: Namespace, hashes: list[str]) -> list[np.ndarray[Any, Any]]:
    """Every object's verified payload for ``hashes`` (float32), in plan order."""
    backend = open_backend(f"file://{root}")
    io = ObjectIO(backend, ns)
    plan = plan_reads(ns, Topology(1, 1), 0)
    out = []
    try:
        for h in hashes:
            for key in plan.object_keys(h):
                found = run_sync(io.read_object(key))
                assert found is not None, f"{key} is not stored"
                out.append(np.frombuffer(found[1], dtype=np.float32).copy())
    finally:
        run_sync(backend.close())
    return out


def test_prepopulated_kv_is_served_to_vllm(
    tiny_llama: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    vllm_store, hf_store = tmp_path / "vllm", tmp_path / "hf"
    llm = make_llm(tiny_llama, kv_transfer_config=connector_config({"url": f"file://{vllm_store}"}))
    try:
        recomputed = run(llm, prompts)
        assert counter(llm, "vllm:external_prefix_cache_hits") == 0  # nothing to load
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().flush()
    finally:
        close_llm(llm)

    ns = namespace(tiny_llama)
    source = HFSource(tiny_llama, dtype="float32", progress=False)
    backend = open_backend(f"file://{hf_store}")
    try:
        report = run_sync(prepopulate(backend, source, prompts, ns, Topology(1, 1)))
    finally:
        run_sync(backend.close())
    pages = sum(len(p) // BLOCK for p in prompts)
    assert report.pages_written == pages
    assert report.write_failures == 0

    # The same keys in both stores, the same KV to float32 rounding, computed independently.
    hashes = [h for p in prompts for h in page_hashes(p, BLOCK)][:4]
    ours, theirs = payloads(vllm_store, ns, hashes), payloads(hf_store, ns, hashes)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert any(not np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))

    llm = make_llm(tiny_llama, kv_transfer_config=connector_config({"url": f"file://{hf_store}"}))
    try:
        served = run(llm, prompts)
        hits = counter(llm, "vllm:external_prefix_cache_hits")
    finally:
        close_llm(llm)
    assert served == recomputed
    assert hits == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
