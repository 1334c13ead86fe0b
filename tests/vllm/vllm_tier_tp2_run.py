"""Run the tiny Llama in vLLM with TP2 under ``OffloadingConnector`` with the CPU shim and
``HiCacheStoreTier``; print the token ids and the tier's counters.

``python vllm_tier_tp2_run.py MODEL_DIR STORE_URL PROMPTS_JSON``: a separate process because
vLLM's TP workers are spawned processes, which need a ``__main__`` guard. Each prompt is run
alone and in order (``first``: computed, stored into the primary tier and written through to
the store); the tier's jobs are drained and vLLM's prefix cache and the primary tier emptied;
then each prompt extended by a few of its own tokens is run (``second``: every reused chunk can
only come from the store). Used by ``test_secondary_tier_tp2.py``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    from test_secondary_tier import generate, tier_config, tier_of, tier_read_bytes
    from vllm_support import make_llm

    model, url, prompts_file = sys.argv[1:4]
    prompts = json.loads(Path(prompts_file).read_text())
    llm = make_llm(Path(model), kv_transfer_config=tier_config(url),
                   tensor_parallel_size=2, distributed_executor_backend="mp")
    tier = tier_of(llm)
    result: dict[str, Any] = {"first": generate(llm, prompts)}
    tier.drain_jobs()
    result["after_first"] = dataclasses.asdict(tier.stats)
    assert llm.reset_prefix_cache(reset_connector=True)
    result["second"] = generate(llm, [p + p[:7] for p in prompts])
    tier.drain_jobs()
    result["stats"] = dataclasses.asdict(tier.stats)
    result["read_bytes"] = tier_read_bytes(llm)
    result["row_bytes"] = tier.row_bytes
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
