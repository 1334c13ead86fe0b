"""HiCacheStoreTier at TP2 in a real vLLM, in both of vLLM's primary-tier layouts.

Two CPU worker processes each copy their half of the KV heads into the primary tier (the CPU
shim); the tier in the scheduler stores and promotes whole rows. A TP2 engine
(``vllm_tier_tp2_run.py``, its own process: vLLM's TP workers are spawned) runs each prompt
once (stored through the primary tier into the store), empties vLLM's prefix cache and the
primary tier, and runs each prompt again, extended: every reused block is promoted from
hicache-store. Both passes' greedy tokens equal a TP1 engine without any offloading, and
vLLM's own tier read counter equals the rows the tier loaded.

* **Direct layout** (vLLM's default): a row is both ranks' slots of a block.
* **Canonical layout**: a row is vLLM's canonical page of each layer (the block's KV as if
  there were no parallelism; each rank scatters its bytes by the runs vLLM certified), the
  same bytes at every TP size, so the rows a TP2 engine stored serve a TP1 engine (in this
  process) with equal tokens.

vLLM's CPU TP needs one core per worker (``VLLM_CPU_OMP_THREADS_BIND``); skipped on a machine
with fewer than two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_secondary_tier import generate, tokenize
from vllm_support import KV_CACHE_BYTES, close_llm, make_llm, sentence
from vllm_tier_tp2_run import EXTEND, tier_engine, two_passes

#: real engines, two minutes or more each on 2 cores
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="vLLM CPU TP2 needs two cores"),
]

HERE = Path(__file__).parent
BLOCK = 128
#: bytes of one token's KV in the whole model: 4 layers x K/V x 2 heads x 64 x float32
TOKEN_BYTES = KV_CACHE_BYTES // 2048

Reference = tuple[list[list[int]], list[list[int]], list[list[int]]]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> Reference:
    """(prompts, TP1 tokens without offloading for them, and for them extended)."""
    prompts = [tokenize(tiny_llama, sentence(7 * i + 2, 330)) for i in range(3)]
    llm = make_llm(tiny_llama)
    try:
        return prompts, generate(llm, prompts), generate(
            llm, [p + p[:EXTEND] for p in prompts])
    finally:
        close_llm(llm)


def run_tp2(model_dir: Path, url: str, prompts: list[list[int]], folder: Path,
            *flags: str) -> dict[str, Any]:
    prompts_file = folder / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(HERE / "vllm_tier_tp2_run.py"), str(model_dir), url,
         str(prompts_file), *flags],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def check_two_passes(run: dict[str, Any], reference: Reference) -> None:
    """Equal tokens in both passes; the second pass promoted every block it could reuse."""
    prompts, first, second = reference
    assert (run["first"], run["second"]) == (first, second)
    # A row is one block of the whole model's KV (both ranks' halves): 128 tokens' worth.
    assert run["row_bytes"] == BLOCK * TOKEN_BYTES
    after_first, stats = run["after_first"], run["stats"]
    assert stats["store_failures"] == 0
    promoted = sum((len(p) + EXTEND - 1) // BLOCK for p in prompts)
    assert stats["loaded"] - after_first["loaded"] == promoted > 0
    assert run["read_bytes"] == stats["bytes_loaded"] == stats["loaded"] * run["row_bytes"]
    assert stats["corruptions"] == stats["load_failures"] == stats["load_misses"] == 0


def test_tp2_rows_are_stored_and_promoted_with_equal_tokens(
    tiny_llama: Path, reference: Reference, tmp_path: Path
) -> None:
    run = run_tp2(tiny_llama, f"file://{tmp_path / 'store'}", reference[0], tmp_path)
    # An empty store: nothing promoted at first, every full block stored.
    assert run["after_first"]["loaded"] == 0
    assert run["after_first"]["stored"] >= sum(len(p) // BLOCK for p in reference[0])
    check_two_passes(run, reference)


def test_canonical_rows_a_tp2_engine_stored_serve_a_tp1_engine(
    tiny_llama: Path, reference: Reference, tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    tp2 = run_tp2(tiny_llama, url, reference[0], tmp_path, "canonical")
    assert tp2["after_first"]["stored"] >= sum(len(p) // BLOCK for p in reference[0])
    check_two_passes(tp2, reference)

    llm = tier_engine(tiny_llama, url, canonical=True)
    try:
        tp1 = two_passes(llm, reference[0])
    finally:
        close_llm(llm)
    assert tp1["namespace"] == tp2["namespace"]  # one namespace for both TP sizes
    # A fresh engine: its first pass took every reusable block from the rows TP2 stored.
    prompts = reference[0]
    assert tp1["after_first"]["loaded"] == sum((len(p) - 1) // BLOCK for p in prompts)
    check_two_passes(tp1, reference)
