"""Run the tiny Llama in vLLM with TP2 and the hicache-store connector; print the token ids.

``python vllm_tp2_run.py MODEL_DIR STORE_URL PROMPTS_JSON``: a separate process because vLLM's
TP workers are spawned processes, which need a ``__main__`` guard. Used by
``test_vllm_topologies.py``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hicache_store.layout.hashing import page_hashes


def main() -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_support import connector_config, make_llm

    model, url, prompts_file = sys.argv[1:4]
    prompts = json.loads(Path(prompts_file).read_text())
    llm = make_llm(
        Path(model),
        kv_transfer_config=connector_config({"url": url, "grid": "4x1"}),
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy,
                        use_tqdm=False)
    hits = sum(m.value for m in llm.get_metrics()
               if m.name == "vllm:external_prefix_cache_hits")
    result = {"ids": [list(o.outputs[0].token_ids) for o in outs], "external_hits": hits}
    # The workers write in the background: wait (bounded) until every page's two objects (one
    # per head group of the 4x1 grid, one per TP rank) are in the file store.
    pages = {h for p in prompts for h in page_hashes(p, 128)}
    root = Path(url.removeprefix("file://"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stored = [f for f in root.rglob("*_L0-3_H*") if f.name.split("_")[0] in pages]
        if len(stored) >= 2 * len(pages):
            break
        time.sleep(0.2)
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
