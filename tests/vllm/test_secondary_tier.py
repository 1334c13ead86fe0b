"""HiCacheStoreTier under vLLM 0.32's own OffloadingConnector, in a real engine of the tiny Llama.

The route: ``OffloadingConnector`` with ``spec_name="CPUTieringOffloadingSpec"`` (this
project's CPU-platform shim of ``TieringOffloadingSpec``), a CPU primary tier of 4 MiB (8
chunks of one 128-token block: less than the workload's history), and ``HiCacheStoreTier`` as
its only secondary tier on a file store. Engines, started one after another:

* ``reference``: no offloading at all; the greedy token ids every other run must reproduce.
* ``first_run``: the tier on a fresh store. Three conversations, turns interleaved, whose
  history outgrows vLLM's 8 MiB of KV *and* the primary tier, so earlier conversations' next
  turns are promoted from hicache-store.
* a **fresh engine process** (this file run as a script) on the same store: served from it.
* ``bounded``: a store whose capacity holds a fraction of what the workload writes.
* ``second_engine`` in this process on the same store: the test-only switch that zeroes
  loaded rows (tokens change: the check can fail), then every object corrupted on disk
  (misses, equal tokens).

One engine with a connector at a time (``start`` checks): vLLM keeps one worker-side
connector per process.

"Served from the tier" is read from vLLM's own tier counter
(``vllm:kv_offload_tiering_read_bytes{tier="1:HiCacheStoreTier"}``) and the tier's counters.
Token ids are compared exactly: float32, greedy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from vllm_support import close_llm, make_llm, sentence

#: every test here starts or drives a real engine (the module takes ~3-4 minutes on 2 cores).
pytestmark = pytest.mark.slow

TIER = "HiCacheStoreTier"
TIER_LABEL = f"1:{TIER}"
PRIMARY_BYTES = 4 << 20  # 8 chunks of 512 KiB (128 tokens x 4 KiB)
TURNS = 4
CONVERSATIONS = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tier_config(url: str, **tier: Any) -> KVTransferConfig:
    """vLLM's OffloadingConnector with the CPU shim and HiCacheStoreTier on ``url``."""
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "CPUTieringOffloadingSpec",
            "spec_module_path": "hicache_store.integrations.vllm.cpu_spec",
            "cpu_bytes_to_use": PRIMARY_BYTES,
            "secondary_tiers": [{
                "type": TIER,
                "module_path": "hicache_store.integrations.vllm.secondary_tier",
                "url": url,
                **tier,
            }],
        },
    )


def start(model_dir: Path, url: str, **tier: Any) -> Any:
    """An engine with the tier on ``url``. vLLM keeps one worker-side connector per process
    (``ensure_kv_transfer_initialized`` reuses one that exists): an engine started while
    another connector engine is alive would copy into the other engine's KV and primary
    region. So one at a time, checked."""
    from vllm.distributed.kv_transfer.kv_transfer_state import has_kv_transfer_group

    assert not has_kv_transfer_group(), "another engine with a KV connector is still open"
    return make_llm(model_dir, kv_transfer_config=tier_config(url, **tier))


def tokenize(model_dir: Path, text: str) -> list[int]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return list(tok(text, add_special_tokens=False)["input_ids"])


def workload(model_dir: Path) -> tuple[list[list[int]], list[list[list[int]]]]:
    systems = [tokenize(model_dir, sentence(11 * c, 300)) for c in range(CONVERSATIONS)]
    users = [[tokenize(model_dir, sentence(5 * c + 3 * t, 110)) for t in range(TURNS)]
             for c in range(CONVERSATIONS)]
    return systems, users


def generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, in order (so each is scheduled after the previous one finished)."""
    out = []
    for prompt in prompts:
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], GREEDY, use_tqdm=False)
        out.append(list(result.outputs[0].token_ids))
    return out


def run_workload(llm: Any, model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Turns interleaved across conversations; a turn's prompt is the conversation so far."""
    systems, users = workload(model_dir)
    history = [list(s) for s in systems]
    prompts, outputs = [], []
    for t in range(TURNS):
        for c in range(CONVERSATIONS):
            prompt = history[c] + users[c][t]
            (out,) = generate(llm, [prompt])
            prompts.append(prompt)
            outputs.append(out)
            history[c] = prompt + out
    return prompts, outputs


def final_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Each conversation's last prompt plus a few tokens: its whole history was stored."""
    return [p + p[:7] for p in prompts[-CONVERSATIONS:]]


def tier_of(llm: Any) -> Any:
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    (tier,) = manager.secondary_tiers
    return tier


def tier_read_bytes(llm: Any) -> float:
    return sum(m.value for m in llm.get_metrics()
               if m.name == "vllm:kv_offload_tiering_read_bytes"
               and m.labels.get("tier") == TIER_LABEL)


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "objects").rglob("*") if p.is_file())


@dataclasses.dataclass
class Reference:
    prompts: list[list[int]]
    outputs: list[list[int]]
    final: dict[tuple[int, ...], list[int]]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> Reference:
    llm = make_llm(tiny_llama)
    try:
        prompts, outputs = run_workload(llm, tiny_llama)
        final = final_prompts(prompts)
        by_prompt = dict(zip(map(tuple, final), generate(llm, final), strict=True))
    finally:
        close_llm(llm)
    return Reference(prompts, outputs, by_prompt)


@dataclasses.dataclass
class FirstRun:
    root: Path
    outputs: list[list[int]]
    read_bytes: float
    stats: Any


@pytest.fixture(scope="module")
def first_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    root = tmp_path_factory.mktemp("tier-store")
    llm = start(tiny_llama, f"file://{root}")
    try:
        _, outputs = run_workload(llm, tiny_llama)
        tier = tier_of(llm)
        tier.wait_jobs()
        run = FirstRun(root, outputs, tier_read_bytes(llm), dataclasses.replace(tier.stats))
    finally:
        close_llm(llm)
    return run


def test_history_beyond_vllm_and_primary_is_served_from_the_tier_with_equal_tokens(
    first_run: FirstRun, reference: Reference
) -> None:
    assert first_run.outputs == reference.outputs
    stats = first_run.stats
    assert stats.stored > 0 and stats.store_failures == 0
    assert stats.loaded > 0, "no turn was promoted from hicache-store"
    assert first_run.read_bytes == stats.bytes_loaded  # vLLM's own counter agrees
    assert stats.corruptions == 0 and stats.load_failures == 0


def test_lookups_count_chunks_asked_and_found(first_run: FirstRun) -> None:
    # The tier's hit rate for an operator: every promoted chunk was first a lookup that found
    # it (vLLM may ask again for a chunk it already knows).
    from prometheus_client import REGISTRY

    stats = first_run.stats
    assert stats.lookup_pages_asked_l3 >= stats.lookup_pages_found_l3 >= stats.loaded > 0
    labels = {"integration": "vllm_secondary_tier", "tier": "l3", "tp_rank": "", "pp_rank": ""}
    exported = REGISTRY.get_sample_value("hicache_store_lookup_pages_found_total", labels)
    assert exported is not None and exported >= stats.lookup_pages_found_l3


# -- a fresh engine process -------------------------------------------------------------------


def _serve_in_this_process(model_dir: str, url: str, prompts_file: str) -> None:
    """Script mode: one engine on ``url``; prints its outputs and the tier's counters."""
    prompts = json.loads(Path(prompts_file).read_text())
    llm = start(Path(model_dir), url)
    outputs = generate(llm, prompts)
    tier = tier_of(llm)
    print("RESULT " + json.dumps({"outputs": outputs, "read_bytes": tier_read_bytes(llm),
                                  "stats": dataclasses.asdict(tier.stats)}))
    close_llm(llm)


def test_a_fresh_engine_process_is_served_from_the_store(
    first_run: FirstRun, reference: Reference, tiny_llama: Path, tmp_path: Path
) -> None:
    prompts = [list(p) for p in reference.final]
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, __file__, str(tiny_llama), f"file://{first_run.root}", str(prompts_file)],
        check=False, capture_output=True, text=True, env=env, timeout=900,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["outputs"] == [reference.final[tuple(p)] for p in prompts]
    # Nothing in that process's own caches: every reused block came from the store.
    assert result["stats"]["loaded"] > 0
    assert result["read_bytes"] == result["stats"]["bytes_loaded"] > 0
    assert result["stats"]["corruptions"] == 0


# -- a bounded store ----------------------------------------------------------------------------


def test_the_store_stays_within_its_capacity(
    tiny_llama: Path, reference: Reference, first_run: FirstRun,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    capacity = 6 << 20  # under what the workload writes (first_run's stats below)
    # (its distinct rows: vLLM offers half of them again, and a row the store holds is not
    # written again)
    assert first_run.stats.bytes_stored > capacity
    root = tmp_path_factory.mktemp("bounded")
    # Every row written (write_admission="all"): the bound is tested against the backend's own
    # evictions (the default admission refuses writes that would evict fresh rows).
    llm = start(tiny_llama, f"file://{root}?capacity_bytes={capacity}", write_admission="all")
    try:
        _, outputs = run_workload(llm, tiny_llama)
        tier = tier_of(llm)
        tier.wait_jobs()
        assert outputs == reference.outputs
        assert tier.stats.stored > 0 and tier.backend.stats.evictions > 0
        assert store_bytes(root) <= capacity
        assert tier.backend.used_bytes <= capacity
    finally:
        close_llm(llm)


# -- a second engine in this process: wrong bytes must show, corrupt ones must not ---------------


@pytest.fixture(scope="module")
def second_engine(tiny_llama: Path, first_run: FirstRun) -> Iterator[Any]:
    # Its resets only empty vLLM's own caches and the primary tier (the weights stay): the
    # tier keeps its revision across them, so the store serves (test_weights_vllm tests the
    # default, a new revision per reset).
    llm = start(tiny_llama, f"file://{first_run.root}", keep_revision_on_reset=True)
    yield llm
    close_llm(llm)


@pytest.fixture
def engine(second_engine: Any) -> Iterator[Any]:
    """The second engine with vLLM's prefix cache and the primary tier emptied (the reset
    drains the tier's jobs first), so every reused block is promoted from the store."""
    assert second_engine.reset_prefix_cache(reset_connector=True)
    yield second_engine
    tier_of(second_engine).test_alter_loaded_kv = False


def test_zeroed_rows_do_change_the_tokens(engine: Any, reference: Reference) -> None:
    tier = tier_of(engine)
    tier.test_alter_loaded_kv = True
    before = tier.stats.loaded
    prompts = [list(p) for p in reference.final]
    outputs = generate(engine, prompts)
    assert tier.stats.loaded > before  # rows were served (zeroed after their check) ...
    assert outputs != [reference.final[tuple(p)] for p in prompts]  # ... and the tokens show it


def test_corrupt_objects_on_disk_are_misses_with_equal_tokens(
    engine: Any, reference: Reference, first_run: FirstRun
) -> None:
    tier = tier_of(engine)
    files = [p for p in (first_run.root / "objects").rglob("*") if p.is_file()]
    assert files
    for path in files:  # one bit of each payload, in place (size unchanged)
        with open(path, "r+b") as f:
            f.seek(-1000, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1000, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x10]))
    loaded, corrupt = tier.stats.loaded, tier.stats.corruptions
    prompts = [list(p) for p in reference.final]
    outputs = generate(engine, prompts)
    assert outputs == [reference.final[tuple(p)] for p in prompts]
    assert tier.stats.corruptions > corrupt  # found, counted ...
    assert tier.stats.loaded == loaded  # ... and never served


if __name__ == "__main__":
    _serve_in_this_process(*sys.argv[1:4])
