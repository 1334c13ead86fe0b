"""HiCacheStoreTier at TP2 in a real vLLM: two CPU worker processes, each copying its half of
the KV heads into its slot of the primary tier's chunk rows (the CPU shim), and the tier in the
scheduler storing and promoting whole rows (both ranks' slots: the model's full KV of a block).

A TP2 engine (``vllm_tier_tp2_run.py``, its own process: vLLM's TP workers are spawned) runs
each prompt once (stored through the primary tier into the store), empties vLLM's prefix cache
and the primary tier, and runs each prompt again, extended: every reused block is promoted from
hicache-store. Both passes' greedy tokens equal a TP1 engine without any offloading, and vLLM's
own tier read counter equals the rows the tier loaded. vLLM's CPU TP needs one core per worker
(``VLLM_CPU_OMP_THREADS_BIND``); skipped on a machine with fewer than two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_secondary_tier import generate, tokenize
from vllm_support import KV_CACHE_BYTES, close_llm, make_llm, sentence

#: real engines, two minutes or more on 2 cores
pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
BLOCK = 128
#: bytes of one token's KV in the whole model: 4 layers x K/V x 2 heads x 64 x float32
TOKEN_BYTES = KV_CACHE_BYTES // 2048
EXTEND = 7  # tokens of its own each prompt is extended by in the second pass


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="vLLM CPU TP2 needs two cores")
def test_tp2_rows_are_stored_and_promoted_with_equal_tokens(
    tiny_llama: Path, tmp_path: Path
) -> None:
    prompts = [tokenize(tiny_llama, sentence(7 * i + 2, 330)) for i in range(3)]
    extended = [p + p[:EXTEND] for p in prompts]
    llm = make_llm(tiny_llama)  # TP1, no offloading: the reference
    try:
        reference = generate(llm, prompts), generate(llm, extended)
    finally:
        close_llm(llm)

    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    url = f"file://{tmp_path / 'store'}"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(HERE / "vllm_tier_tp2_run.py"), str(tiny_llama), url,
         str(prompts_file)],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    tp2 = json.loads(lines[-1].removeprefix("RESULT "))

    assert (tp2["first"], tp2["second"]) == reference
    # A row is one block of both ranks' slots: the whole model's KV of 128 tokens.
    assert tp2["row_bytes"] == BLOCK * TOKEN_BYTES
    first, stats = tp2["after_first"], tp2["stats"]
    assert first["stored"] >= sum(len(p) // BLOCK for p in prompts)
    assert first["store_failures"] == 0 and first["loaded"] == 0
    # Second pass: every full block before each prompt's last token came from the store.
    promoted = sum((len(p) - 1) // BLOCK for p in extended)
    assert stats["loaded"] == promoted > 0
    assert tp2["read_bytes"] == stats["bytes_loaded"] == promoted * tp2["row_bytes"]
    assert stats["corruptions"] == stats["load_failures"] == stats["load_misses"] == 0
