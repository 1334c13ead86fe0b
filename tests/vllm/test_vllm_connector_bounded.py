"""HiCacheStoreConnector on a store smaller than the workload, inside a real vLLM 0.32.

Six conversations served in turn (each turn's prompt the conversation so far) outgrow both
vLLM's 8 MiB of KV and an 8 MiB store. Under the backend's LRU alone
(``write_admission="all"``) each conversation's pages are evicted just before it comes back:
nothing is served and every history is written again. With the connector's write admission
(the default) the store keeps what it holds and serves it; the file backend declares its
capacity and used bytes, so no save evicts a page saved or served lately: what is written is
what the store keeps. Both reproduce the greedy tokens of a run without the connector. Served tokens are the connector's Prometheus counter of
tokens restored (``vllm:hicache_store_loaded_tokens``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_support import close_llm, connector_config, make_llm, sentence

#: real engines, minutes on 2 cores
pytestmark = pytest.mark.slow

CONVERSATIONS = 6
TURNS = 3
CAPACITY = 8 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@dataclasses.dataclass
class Run:
    outputs: list[list[int]]
    loaded_tokens: float
    bytes_written: int
    refused_pages: int
    disk_bytes: int
    kept_bytes: int  # the objects' bytes in the store at the end (its index's count)
    evictions: int


def serve(model_dir: Path, store: Path | None, **extra: Any) -> Run:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    transfer = None
    if store is not None:
        transfer = connector_config({
            "url": f"file://{store}?capacity_bytes={CAPACITY}&durability=none", "l2_mib": 0,
            **extra})
    llm = make_llm(model_dir, kv_transfer_config=transfer)
    history = [ids(sentence(11 * c, 300)) for c in range(CONVERSATIONS)]
    outputs = []
    try:
        for t in range(TURNS):
            for c in range(CONVERSATIONS):
                prompt = history[c] + ids(sentence(5 * c + 3 * t, 110))
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], GREEDY,
                                      use_tqdm=False)
                outputs.append(list(out.outputs[0].token_ids))
                history[c] = prompt + outputs[-1]
        loaded = sum(m.value for m in llm.get_metrics()
                     if m.name == "vllm:hicache_store_loaded_tokens")
        written = refused = kept = evictions = 0
        if store is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = get_kv_transfer_group()
            worker.flush()
            written = worker.backend.stats.bytes_written
            evictions = worker.backend.stats.evictions
            kept = worker.backend.capacity_usage().usage()[1]
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
            refused = scheduler.metrics["saves_refused_pages"]
    finally:
        close_llm(llm)
    disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) if store else 0
    return Run(outputs, loaded, written, refused, disk, kept, evictions)


def test_a_capped_store_serves_reused_turns_where_lru_alone_serves_none(
        tiny_llama: Path, tmp_path: Path) -> None:
    reference = serve(tiny_llama, None)
    lru = serve(tiny_llama, tmp_path / "lru", write_admission="all")
    admitted = serve(tiny_llama, tmp_path / "reuse")
    assert lru.outputs == reference.outputs
    assert admitted.outputs == reference.outputs
    # LRU alone: every history evicted before it came back, written again, none served
    assert lru.loaded_tokens == 0 and lru.refused_pages == 0
    assert lru.bytes_written > 2 * CAPACITY
    # the admission: reused turns served from what the store kept, fewer bytes written
    assert admitted.loaded_tokens > 0 and admitted.refused_pages > 0
    assert admitted.bytes_written < lru.bytes_written / 2
    assert admitted.disk_bytes <= CAPACITY and lru.disk_bytes <= CAPACITY
    # knowing the room: nothing written was evicted, so it wrote exactly what it keeps
    assert admitted.evictions == 0 and lru.evictions > 0
    assert admitted.bytes_written == admitted.kept_bytes <= CAPACITY
