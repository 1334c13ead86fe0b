"""Across topologies through real vLLM: KV written by a TP2 vLLM (two worker processes, each
writing its head group's objects) is read by a TP1 vLLM, with greedy tokens equal to what the
TP2 engine computed itself.

Both deployments set ``grid: "4x1"`` (one object per page and KV head): without it each picks
the coarsest grid it can write itself, TP2 ``4x1`` and TP1 ``4x2``, which are different
namespaces and never share (by design). vLLM's CPU TP needs one core per worker
(``VLLM_CPU_OMP_THREADS_BIND``); the test is skipped on a machine with fewer than two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_support import close_llm, connector_config, make_llm, sentence

#: real engines, a minute or more on 2 cores
pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="vLLM CPU TP2 needs two cores")
def test_tp2_writes_tp1_reads(tiny_llama: Path, tmp_path: Path) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_llama))
    prompts = [list(tok(sentence(5 * i, 400), add_special_tokens=False)["input_ids"])
               for i in range(3)]
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    url = f"file://{tmp_path / 'store'}"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(HERE / "vllm_tp2_run.py"), str(tiny_llama), url, str(prompts_file)],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    tp2 = json.loads(lines[-1].removeprefix("RESULT "))
    assert tp2["external_hits"] == 0  # an empty store: TP2 computed everything

    llm = make_llm(tiny_llama, kv_transfer_config=connector_config({"url": url, "grid": "4x1"}))
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy,
                            use_tqdm=False)
        hits = sum(m.value for m in llm.get_metrics()
                   if m.name == "vllm:external_prefix_cache_hits")
    finally:
        close_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == tp2["ids"]
    # Every offered page (all but the one holding each prompt's last token) from TP2's objects.
    assert hits == sum((len(p) - 1) // 128 * 128 for p in prompts)
