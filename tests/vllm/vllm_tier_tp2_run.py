"""Two passes of the tiny Llama through vLLM's ``OffloadingConnector`` with the CPU shim and
``HiCacheStoreTier``; as a script, at TP2, printing the token ids and the tier's counters.

``python vllm_tier_tp2_run.py MODEL_DIR STORE_URL PROMPTS_JSON [canonical]``: a separate
process because vLLM's TP workers are spawned processes, which need a ``__main__`` guard.
``two_passes``: each prompt is run alone and in order (``first``: computed, or promoted from
the store where it holds the blocks, and stored into the primary tier and written through to
the store); the tier's jobs are waited for and vLLM's prefix cache and the primary tier
emptied (a reset that keeps the tier's revision: ``keep_revision_on_reset``);
then each prompt extended by a few of its own tokens is run (``second``: every reused block
can only come from the store). Used by ``test_secondary_tier_tp2.py``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

EXTEND = 7  # tokens of its own each prompt is extended by in the second pass


def tier_engine(model_dir: Path, url: str, *, canonical: bool, **engine_args: Any) -> Any:
    """An engine with the tier on ``url``, in vLLM's canonical primary layout if asked."""
    from test_secondary_tier import tier_config
    from vllm.distributed.kv_transfer.kv_transfer_state import has_kv_transfer_group
    from vllm_support import make_llm

    assert not has_kv_transfer_group(), "another engine with a KV connector is still open"
    # the reset between the passes only empties vLLM's caches: the tier keeps its revision
    config = tier_config(url, keep_revision_on_reset=True)
    if canonical:
        config.kv_connector_extra_config["canonical_layout"] = True
    return make_llm(model_dir, kv_transfer_config=config, **engine_args)


def two_passes(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    from test_secondary_tier import generate, tier_of, tier_read_bytes

    tier = tier_of(llm)
    result: dict[str, Any] = {"first": generate(llm, prompts)}
    tier.wait_jobs()
    result["after_first"] = dataclasses.asdict(tier.stats)
    assert llm.reset_prefix_cache(reset_connector=True)
    result["second"] = generate(llm, [p + p[:EXTEND] for p in prompts])
    tier.wait_jobs()
    result["stats"] = dataclasses.asdict(tier.stats)
    result["read_bytes"] = tier_read_bytes(llm)
    result["row_bytes"] = tier.row_bytes
    result["namespace"] = tier.namespace.digest
    return result


def main() -> None:
    model, url, prompts_file, *flags = sys.argv[1:]
    prompts = json.loads(Path(prompts_file).read_text())
    llm = tier_engine(Path(model), url, canonical="canonical" in flags,
                      tensor_parallel_size=2, distributed_executor_backend="mp")
    result = two_passes(llm, prompts)
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
