"""vLLM's ``kv_hints`` through both vLLM routes, in a real engine of the tiny Llama.

Three engines, one after another in this process (module fixtures): ``reference`` (no
offloading: the greedy token ids every other run must reproduce), the secondary tier
(``HiCacheStoreTier`` under vLLM's ``OffloadingConnector``; hints in vLLM's own
``ReqContext.kv_hints``, passed with ``LLMEngine.add_request(..., kv_hints=envelope)``) and the
connector (``HiCacheStoreConnector``; hints in the request's ``kv_transfer_params["kv_hints"]``
as JSON, and once in vLLM's ``Request.kv_hints``). Each route runs on a file store bounded to
16 objects (5 whole pages / chunks per prompt), pins limited to 40% of it (6 objects), and
serves, one request at a time:

1. ``A``: pinned for session ``sess-a`` (its whole request); ``B``: no hints;
2. three other prompts, enough to evict 9 objects: ``B``'s go, ``A``'s pinned ones stay;
3. ``A`` again, no hints (served from the store);
4. ``C``: pinned too: past the budget with ``A``'s pins held, refused, counted and logged;
5. ``E``: a malformed envelope (an unknown payload key): logged, counted, served.

Every request's token ids equal the reference: hints decide what stays, never what a hit holds.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_secondary_tier import PRIMARY_BYTES, TIER, tier_of, tokenize
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm_support import close_llm, connector_config, make_llm, sentence

from hicache_store._sync import run_sync
from hicache_store.layout.hashing import page_hashes

#: real engines, minutes on 2 cores
pytestmark = pytest.mark.slow

BLOCK = 128  # tokens per vLLM block, per connector page, per tier chunk (one block)
OBJECT = (BLOCK << 12) + 8192  # a row / page object: 512 KiB and a header, rounded up
CAPACITY = 16 * OBJECT
PIN_FRACTION = 0.4  # 6 objects
WORDS = 5 * BLOCK + 10  # tokens per prompt: 5 whole pages
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}


def pin(session: str) -> KvHintsEnvelope:
    return KvHintsEnvelope("1", f"pin-{session}", [
        KvHintAction("p", "pin", "1", {"session": session, "duration_s": 3600})])


MALFORMED = KvHintsEnvelope("1", "bad", [
    KvHintAction("p", "pin", "1", {"session": "sess-e", "until": 5})])


@dataclasses.dataclass
class Prompts:
    a: list[int]
    b: list[int]
    flood: list[list[int]]
    c: list[int]
    e: list[int]

    def all(self) -> list[list[int]]:
        return [self.a, self.b, *self.flood, self.c, self.e]


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path) -> Prompts:
    made = [tokenize(tiny_llama, sentence(7 * i + 1, WORDS)) for i in range(7)]
    assert all(len(p) == WORDS for p in made)
    return Prompts(made[0], made[1], made[2:5], made[5], made[6])


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompts: Prompts) -> dict[tuple[int, ...], list[int]]:
    llm = make_llm(tiny_llama)
    try:
        return {tuple(p): serve(llm, p) for p in prompts.all()}
    finally:
        close_llm(llm)


def serve(llm: Any, prompt: list[int], *, kv_hints: Any = None,
          params: dict[str, Any] | None = None) -> list[int]:
    """One request alone, through ``LLMEngine.add_request`` (where ``kv_hints`` goes)."""
    engine = llm.llm_engine
    sampling = SamplingParams(**GREEDY, extra_args=params)
    engine.add_request("req", TokensPrompt(prompt_token_ids=prompt), sampling, kv_hints=kv_hints)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(out for out in engine.step() if out.finished)
    (out,) = finished
    return list(out.outputs[0].token_ids)


class Records(logging.Handler):
    """The route's log lines (the module fixtures cannot use ``caplog``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def __enter__(self) -> Records:
        logging.getLogger("hicache_store.integrations.vllm").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("hicache_store.integrations.vllm").removeHandler(self)


@dataclasses.dataclass
class Run:
    """What one route did: tokens per step, the objects of A, B and C, their state."""

    tokens: dict[str, list[int]]
    keys: dict[str, list[str]]  # the objects of each prompt's whole pages
    alive: dict[str, list[bool]]  # after the flood (C: after its request)
    pinned: dict[str, list[bool]]  # pinned by any owner, after the flood / after C
    counts: dict[str, int]
    log: list[str]


def drive(llm: Any, prompts: Prompts, backend: Any, keys_of: Any, settle: Any,
          counts: Any, *, hinted: Any) -> Run:
    """The scenario of the module docstring. ``keys_of(prompt)``: the objects of the last
    request's whole pages; ``settle()``: wait for the route's writes and hints;
    ``hinted(envelope)``: the ``serve`` arguments that pass it."""
    tokens: dict[str, list[int]] = {}
    keys: dict[str, list[str]] = {}

    def state(name: str) -> tuple[list[bool], list[bool]]:
        alive = [bool(x) for x in run_sync(backend.exists(keys[name]))]
        held = run_sync(backend.retention_of(keys[name]))
        return alive, [any(r.pinned for r in h) for h in held]

    alive: dict[str, list[bool]] = {}
    pinned: dict[str, list[bool]] = {}

    def step(name: str, prompt: list[int], env: KvHintsEnvelope | None = None) -> None:
        tokens[name] = serve(llm, prompt, **(hinted(env) if env is not None else {}))
        settle()
        keys[name] = keys_of(prompt)

    with Records() as records:
        step("a", prompts.a, pin("sess-a"))
        step("b", prompts.b)
        for i, p in enumerate(prompts.flood):
            step(f"f{i}", p)
        for name in ("a", "b"):
            alive[name], pinned[name] = state(name)
        step("a2", prompts.a)
        step("c", prompts.c, pin("sess-c"))
        alive["c"], pinned["c"] = state("c")
        step("e", prompts.e, MALFORMED)
    return Run(tokens, keys, alive, pinned, dict(counts()), records.lines)


# Both routes write every row (``write_admission="all"``): the flood must reach the store and
# make its LRU evict, which is what the pin is tested against. (With the default admission a
# store that knows its room refuses writes that would evict rows not yet stale: B would stay.)
def store_url(root: Path) -> str:
    return f"file://{root}?capacity_bytes={CAPACITY}&pin_fraction={PIN_FRACTION}"


@pytest.fixture(scope="module")
def tier_run(tiny_llama: Path, prompts: Prompts, reference: Any,
             tmp_path_factory: pytest.TempPathFactory) -> Run:
    from vllm.distributed.kv_transfer.kv_transfer_state import has_kv_transfer_group

    assert not has_kv_transfer_group(), "another engine with a KV connector is still open"
    root = tmp_path_factory.mktemp("hints-tier")
    llm = make_llm(tiny_llama, kv_transfer_config=KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "CPUTieringOffloadingSpec",
            "spec_module_path": "hicache_store.integrations.vllm.cpu_spec",
            "cpu_bytes_to_use": PRIMARY_BYTES,
            "secondary_tiers": [{
                "type": TIER, "module_path": "hicache_store.integrations.vllm.secondary_tier",
                "url": store_url(root), "write_admission": "all"}]}))
    try:
        tier = tier_of(llm)
        stored: list[list[str]] = []  # the storage keys of each store job, in order
        submit_store = tier.submit_store

        def recording(job: Any) -> None:
            stored.append([tier.storage_key(k) for k in job.keys])
            submit_store(job)

        tier.submit_store = recording
        seen = 0

        def keys_of(prompt: list[int]) -> list[str]:
            """The objects of the chunks stored since the last call (the last request)."""
            nonlocal seen
            mine = [k for job in stored[seen:] for k in job]
            seen = len(stored)
            return list(dict.fromkeys(mine))[: len(prompt) // BLOCK]

        def settle() -> None:
            tier.wait_jobs()
            list(tier.get_finished_jobs())  # what vLLM would poll; the jobs are done
            tier.hints.drain(60)

        return drive(llm, prompts, tier.backend, keys_of, settle, lambda: tier.hints.counts,
                     hinted=lambda env: {"kv_hints": env})
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def connector_run(tiny_llama: Path, prompts: Prompts, reference: Any, tier_run: Run,
                  tmp_path_factory: pytest.TempPathFactory) -> Run:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    root = tmp_path_factory.mktemp("hints-connector")
    llm = make_llm(tiny_llama, kv_transfer_config=connector_config({"url": store_url(root), "write_admission": "all"}))
    try:
        worker = get_kv_transfer_group()
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        assert worker.block_size == BLOCK

        def keys_of(prompt: list[int]) -> list[str]:
            whole = len(prompt) // BLOCK * BLOCK
            return [k for h in page_hashes(prompt[:whole], BLOCK)
                    for k in worker._link.write_names(h)]

        def counts() -> dict[str, int]:
            return dict(sched.metrics + worker.metrics)

        def hinted(env: KvHintsEnvelope) -> dict[str, Any]:
            if env.message_id == "pin-sess-c":  # vLLM's own Request.kv_hints, read first
                return {"kv_hints": env}
            return {"params": {"kv_transfer_params": {"kv_hints": msgspec.to_builtins(env)}}}

        return drive(llm, prompts, worker.backend, keys_of, lambda: worker.flush(60), counts,
                     hinted=hinted)
    finally:
        close_llm(llm)


@pytest.fixture(params=["tier", "connector"])
def run(request: pytest.FixtureRequest) -> Run:
    result: Run = request.getfixturevalue(f"{request.param}_run")
    return result


def test_hints_never_change_tokens(run: Run, prompts: Prompts, reference: Any) -> None:
    want = {"a": prompts.a, "a2": prompts.a, "b": prompts.b, "c": prompts.c, "e": prompts.e,
            **{f"f{i}": p for i, p in enumerate(prompts.flood)}}
    assert set(run.tokens) == set(want)
    for name, prompt in want.items():
        assert run.tokens[name] == reference[tuple(prompt)], name


def test_a_pinned_prefix_survives_the_eviction_that_takes_the_unpinned_one(run: Run) -> None:
    objects = len(run.keys["a"])  # 5 pages: an object per page and head group
    assert objects >= 5 and len(run.keys["b"]) == objects
    assert run.pinned["a"] == [True] * objects
    assert run.alive["a"] == [True] * objects
    assert run.alive["b"] == [False] * objects, "B, written after A, went first: A is pinned"
    assert run.counts["hint_pinned_objects"] >= objects


def test_a_pin_past_the_budget_is_refused_logged_and_the_request_served(run: Run) -> None:
    assert run.counts["hint_pins_refused"] >= 1
    assert not all(run.pinned["c"]), "C's pages were never pinned together with A's"
    assert any("refused" in line and "pin budget" in line for line in run.log)


def test_a_malformed_envelope_is_logged_and_ignored(run: Run) -> None:
    assert run.counts["hints_malformed"] == 1
    assert any(line.startswith("ERROR") and "'until'" in line for line in run.log)
