"""HiCacheStoreTier under vLLM's OffloadingConnector for every model family vLLM serves here.

The tier stores vLLM's chunk rows as opaque objects: a row's key carries its KV cache group and
its namespace names the groups (their layers and token spans), the KV dtype and the row size
(``secondary_tier.row_descriptor``). Per family (tiny random models built offline), one engine:
three prompts computed, vLLM's prefix cache and CPU primary tier emptied
(``reset_prefix_cache(reset_connector=True)``; secondary tiers keep their rows), the prompts
again: every reused chunk is promoted from hicache-store (vLLM's own tier counters), the greedy
tokens equal the first pass's; then the test-only switch that zeroes loaded rows changes them.
MLA (block 16) runs here too: both passes restore through vLLM's own path, whose CPU MLA
prefill over a restored context differs from a full one, so its second pass is compared with
the rows' own reproducibility (a third pass gives the same tokens). Last, a new OS process on the
same store gives the second pass's tokens from the tier's rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from vllm_support import FAMILIES, close_llm, make_llm, make_tiny_model, sentence

from hicache_store.integrations.vllm.secondary_tier import row_descriptor

#: real engines, minutes on 2 cores
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TIER_LABEL = "1:HiCacheStoreTier"


def tier_engine(model: Path, family: str, root: Path, *, chunk_tokens: int | None = None,
                **engine: Any) -> Any:
    """An engine with the tier under vLLM's offloading; ``chunk_tokens``: tokens per offloaded
    chunk (vLLM's ``block_size`` key; default one engine block)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import has_kv_transfer_group

    assert not has_kv_transfer_group(), "another engine with a KV connector is still open"
    chunk = {} if chunk_tokens is None else {"block_size": chunk_tokens}
    dtype = FAMILIES[family][2] if family in FAMILIES else "float32"
    return make_llm(model, dtype=dtype, max_model_len=768, **engine,
                    kv_transfer_config=KVTransferConfig(
                        kv_connector="OffloadingConnector", kv_role="kv_both",
                        kv_connector_extra_config={
                            **chunk,
                            "spec_name": "CPUTieringOffloadingSpec",
                            "spec_module_path": "hicache_store.integrations.vllm.cpu_spec",
                            "cpu_bytes_to_use": 32 << 20,
                            "secondary_tiers": [{
                                "type": "HiCacheStoreTier",
                                "module_path": "hicache_store.integrations.vllm.secondary_tier",
                                "url": f"file://{root}",
                                # the resets below only empty vLLM's caches (same weights)
                                "keep_revision_on_reset": True}]}))


def tier_of(llm: Any) -> Any:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    (tier,) = scheduler.connector.connector_scheduler.manager.secondary_tiers
    return tier


def read_bytes(llm: Any) -> float:
    return sum(m.value for m in llm.get_metrics()
               if m.name == "vllm:kv_offload_tiering_read_bytes"
               and m.labels.get("tier") == TIER_LABEL)


def run(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [list(llm.generate([TokensPrompt(prompt_token_ids=p)], GREEDY,
                              use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]


@pytest.mark.parametrize("family", ["gemma2", "mistral", "deepseek_v2", "qwen3_next"])
def test_every_family_is_promoted_from_the_tier(family: str, tmp_path: Path) -> None:
    import transformers

    model = make_tiny_model(tmp_path / "model", family)
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    prompts = [list(tok(sentence(3 + 7 * c, 420), add_special_tokens=False)["input_ids"])
               [:391 + 13 * c] for c in range(3)]
    llm = tier_engine(model, family, tmp_path / "store")
    try:
        tier = tier_of(llm)
        # The namespace names the groups: one token span per KV cache group.
        groups = len(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
                     .kv_cache_groups)
        assert row_descriptor.__name__ and tier.namespace.model.count("#vllm-row-") == 1
        first = run(llm, prompts)
        tier.drain_jobs()
        assert tier.stats.stored > 0 and tier.stats.store_failures == 0
        assert llm.reset_prefix_cache(reset_connector=True)
        second = run(llm, prompts)
        tier.wait_jobs()
        # vLLM offers chunks it recomputed again (a hybrid's groups past the hit the others
        # allowed): the rows the store holds are not rewritten, every write is a row kept.
        kept = [p for p in (tmp_path / "store" / "objects").rglob("*") if p.is_file()]
        assert tier.backend.stats.writes == tier.stats.stored == len(kept)
        loaded = tier.stats.loaded
        assert loaded > 0 and read_bytes(llm) == tier.stats.bytes_loaded
        if family == "deepseek_v2":
            # vLLM's CPU MLA over a restored context is not a full prefill: the rows must
            # reproduce themselves instead.
            assert llm.reset_prefix_cache(reset_connector=True)
            assert run(llm, prompts) == second
        else:
            assert second == first
        tier.test_alter_loaded_kv = True
        assert llm.reset_prefix_cache(reset_connector=True)
        assert run(llm, prompts) != second
        assert tier.stats.loaded > loaded
        print(f"\n{family}: {groups} KV cache groups, {loaded} rows promoted")
    finally:
        close_llm(llm)
    result = in_a_new_process(family, model, tmp_path / "store", prompts)
    assert result["outputs"] == second
    assert result["loaded"] > 0
    assert result["read_bytes"] == result["bytes_loaded"] > 0
    assert result["corruptions"] == 0


def in_a_new_process(family: str, model: Path, root: Path, prompts: list[list[int]]) -> Any:
    """``prompts`` through a tier engine on ``root`` in a new OS process: nothing of this
    process's caches can serve them."""
    prompts_file = root.parent / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, __file__, family, str(model), str(root), str(prompts_file)],
        check=False, capture_output=True, text=True, env=env, timeout=1800,  # a hang detector
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0, done.stderr[-3000:]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _serve_in_this_process(family: str, model: str, root: str, prompts_file: str) -> None:
    prompts = json.loads(Path(prompts_file).read_text())
    llm = tier_engine(Path(model), family, Path(root))
    try:
        outputs = run(llm, prompts)
        tier = tier_of(llm)
        result = {"outputs": outputs, "loaded": tier.stats.loaded,
                  "bytes_loaded": tier.stats.bytes_loaded, "read_bytes": read_bytes(llm),
                  "corruptions": tier.stats.corruptions}
    finally:
        close_llm(llm)
    print("RESULT " + json.dumps(result), flush=True)


def test_chunks_of_several_engine_blocks_are_promoted_with_equal_tokens(tmp_path: Path) -> None:
    """A stored chunk other than vLLM's block: engine blocks of 32 tokens, chunks of 128 (four
    blocks a row); the tokens equal the first pass's and those of a block-128 engine."""
    import transformers

    model = make_tiny_model(tmp_path / "model", "llama")
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    prompts = [list(tok(sentence(3 + 7 * c, 420), add_special_tokens=False)["input_ids"])
               [:391 + 13 * c] for c in range(3)]
    llm = tier_engine(model, "llama", tmp_path / "store", chunk_tokens=128, block_size=32)
    try:
        tier = tier_of(llm)
        first = run(llm, prompts)
        tier.drain_jobs()
        assert llm.reset_prefix_cache(reset_connector=True)
        second = run(llm, prompts)
        # every whole chunk of each prompt but the one holding its last token
        assert tier.stats.loaded == sum((len(p) - 1) // 128 for p in prompts)
        assert second == first
    finally:
        close_llm(llm)
    llm = make_llm(model, max_model_len=768)
    try:
        assert run(llm, prompts) == first
    finally:
        close_llm(llm)


if __name__ == "__main__":
    _serve_in_this_process(*sys.argv[1:5])
