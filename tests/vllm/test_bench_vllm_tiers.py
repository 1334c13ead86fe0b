"""``bench/bench_vllm_tiers.py``'s connector figures, in a real vLLM 0.32.

Per model, through the bench's own ``run`` and its multi-turn workload (six conversations,
turns interleaved, history beyond vLLM's 8 MiB of KV): recompute, then the connector without L2
(every load from the store). The tiny Llama (one full-attention group) loads in steps
(``start_load_kv``); the tiny Gemma-2 (``vllm_support.FAMILIES``: a sliding-window group beside
a full-attention group) per request (``_start_part_loads``, ended in ``get_transfer_results``).
The bench's meter must count both, and its byte totals must be the connector's own counters.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_support import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_vllm_tiers  # (after the bench's folder is on the path)

#: real engines, minutes on 2 cores
pytestmark = pytest.mark.slow

CONVERSATIONS, TURNS, ANSWER = 6, 2, 4


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def runs(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    model = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    work = bench_vllm_tiers.workload(model, CONVERSATIONS, TURNS)
    store = tmp_path_factory.mktemp("store")
    reference = bench_vllm_tiers.run(model, "recompute", None, work, TURNS, None,
                                     answer_tokens=ANSWER)
    connector = bench_vllm_tiers.run(
        model, "hicache-connector", {"type": "connector", "url": f"file://{store}", "l2_mib": 0},
        work, TURNS, store, answer_tokens=ANSWER)
    return {"recompute": reference, "connector": connector}


def test_reused_turns_are_served_from_the_store_with_the_tokens_of_recompute(
    runs: dict[str, dict[str, Any]],
) -> None:
    got, reference = runs["connector"], runs["recompute"]
    assert got["outputs"] == reference["outputs"]
    counters = got["counters"]
    # vLLM's own counter: the tokens its connector served, all restored from the store
    assert got["external_tokens"] == counters["tokens_loaded"] > 0
    assert counters.get("load_failures", 0) == 0
    assert reference["external_tokens"] == 0


def test_the_bench_counts_the_loads_and_saves_of_several_groups(
    runs: dict[str, dict[str, Any]],
) -> None:
    got = runs["connector"]
    meter, counters = got["meter"], got["counters"]
    assert meter.bytes == {"load": counters["bytes_loaded"], "store": counters["bytes_saved"]}
    assert meter.bytes["load"] > 0 and meter.bytes["store"] > 0
    # every load job timed: the rate is over the loads' time
    assert meter.jobs["load"] > 0 and meter.seconds["load"] > 0
    assert meter.rate("load") > 0
