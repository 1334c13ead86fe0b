"""The connector's L2 (``l2_mib``) inside a real vLLM 0.32 serving the tiny Llama.

The workload of ``test_vllm_connector`` (three conversations, turns interleaved, history beyond
vLLM's 8 MiB of KV), three engines one after another in this process:

* ``reference``: no connector; the greedy token ids every other run must reproduce.
* ``roomy``: an L2 larger than the workload, on a file store behind a transparent ``faulty://``
  wrapper. Reused turns are served from L2; then the store is **emptied** (every object
  deleted) and, in a second test, **stopped** (every backend call fails): vLLM's prefix
  cache emptied, the whole history is still served (L2 alone) with the right tokens. The
  test-only altered-bytes switch changes the tokens of L2-served pages (the check can fail).
* ``small``: an L2 of 2 MiB (4 pages of 512 KiB): pages are evicted (counted), the bytes held
  never exceed the bound, pages L2 lost are read from the store, tokens stay right.

An L2 entry cannot be corrupt by construction (``_l2``: private copies in, copies out; the
pages put are verified reads or vLLM's own KV), so there is no corrupt-L2 test; the altered-
bytes test shows that a wrong page served from L2 would be caught by the token comparison.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_connector import (
    BLOCK,
    Workload,
    counter,
    extra_prompts,
    generate,
    make_workload,
    run_workload,
    scheduler_connector,
    worker_connector,
)
from vllm_support import close_llm, connector_config, make_llm

from hicache_store.backends.faulty import FaultConfig

#: real engines, minutes on 2 cores
pytestmark = pytest.mark.slow

PAGE_BYTES = 4 * 2 * 2 * 64 * BLOCK * 4  # layers x K/V x heads x dim x tokens x float32
SMALL_MIB = 2


@pytest.fixture(scope="module")
def work(tiny_llama: Path) -> Workload:
    return make_workload(tiny_llama)


@dataclasses.dataclass
class Reference:
    outputs: list[list[int]]
    extra: list[list[int]]
    extra_outputs: list[list[int]]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, work: Workload) -> Reference:
    llm = make_llm(tiny_llama)
    try:
        prompts, outputs = run_workload(llm, work)
        extra = extra_prompts(prompts)
        return Reference(outputs, extra, [generate(llm, p) for p in extra])
    finally:
        close_llm(llm)


@dataclasses.dataclass
class Run:
    llm: Any
    root: Path
    outputs: list[list[int]]
    worker: dict[str, int]
    scheduler: dict[str, int]
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            close_llm(self.llm)


def serve(tiny_llama: Path, work: Workload, root: Path, l2_mib: float) -> Run:
    """An engine with an L2 of ``l2_mib`` on a file store at ``root`` (behind ``faulty://``),
    after the workload ran and its saves ended."""
    extra = {"url": f"faulty://?inner=file://{root}", "l2_mib": l2_mib,
             "io_timeout_s": 1.0, "lookup_timeout_s": 1.0, "retry_after_s": 60.0}
    run = Run(make_llm(tiny_llama, kv_transfer_config=connector_config(extra)), root, [], {}, {})
    try:
        _, run.outputs = run_workload(run.llm, work)
        worker_connector().flush()
    except BaseException:
        run.close()
        raise
    run.worker = dict(worker_connector().metrics)
    run.scheduler = dict(scheduler_connector(run.llm).metrics)
    return run


@pytest.fixture(scope="module")
def roomy(tiny_llama: Path, work: Workload, reference: Reference,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    run = serve(tiny_llama, work, tmp_path_factory.mktemp("roomy"), 64)
    yield run
    run.close()


def test_reused_turns_are_served_from_l2(reference: Reference, roomy: Run) -> None:
    assert roomy.outputs == reference.outputs
    w, s = roomy.worker, roomy.scheduler
    assert w["pages_loaded"] > 0 and w.get("load_failures", 0) == 0
    # Every page the workload reuses was saved or loaded by this worker before: all from L2,
    # none read from the store, and the scheduler found them without asking the store.
    assert w["l2_hit_pages"] == w["pages_loaded"]
    assert w.get("bytes_loaded", 0) == 0
    assert s["lookup_l2_pages"] >= w["pages_loaded"]  # a request may be looked up twice
    assert w["l2_hit_bytes"] == w["l2_hit_pages"] * PAGE_BYTES
    assert w["l2_put_pages"] == w["pages_saved"]  # each computed page, once
    assert w.get("l2_evicted_pages", 0) == 0
    assert w["l2_held_bytes"] == w["l2_put_pages"] * PAGE_BYTES


def _served_from_l2_alone(reference: Reference, roomy: Run) -> None:
    llm, worker = roomy.llm, worker_connector()
    assert llm.reset_prefix_cache()
    before = counter(llm, "vllm:external_prefix_cache_hits")
    hits, read = worker.metrics["l2_hit_pages"], worker.metrics["bytes_loaded"]
    for prompt, expected in zip(reference.extra, reference.extra_outputs, strict=True):
        assert generate(llm, prompt) == expected
    served = counter(llm, "vllm:external_prefix_cache_hits") - before
    pages = sum((len(p) - 1) // BLOCK for p in reference.extra)
    # Every full page of each history but the one holding the last token, from L2 alone.
    assert served == pages * BLOCK
    assert worker.metrics["l2_hit_pages"] - hits == pages
    assert worker.metrics["bytes_loaded"] == read
    assert worker.metrics.get("load_failures", 0) == 0


def test_l2_alone_serves_after_the_store_is_emptied(reference: Reference, roomy: Run) -> None:
    objects = [p for p in roomy.root.rglob("*") if p.is_file() and "_L" in p.name]
    assert objects
    for child in roomy.root.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
    _served_from_l2_alone(reference, roomy)


def test_l2_alone_serves_while_the_store_is_stopped(reference: Reference, roomy: Run) -> None:
    down = FaultConfig(error_rate=1.0)
    worker, sched = worker_connector(), scheduler_connector(roomy.llm)
    worker.backend.faults = down
    sched.backend.faults = down
    try:
        _served_from_l2_alone(reference, roomy)
    finally:
        worker.backend.faults = FaultConfig()
        sched.backend.faults = FaultConfig()


def test_altered_l2_pages_do_change_the_tokens(reference: Reference, roomy: Run) -> None:
    """The comparisons above can fail: the test-only switch alters every page after L2 served
    it (and before vLLM gets it), and the tokens differ."""
    llm, worker = roomy.llm, worker_connector()
    assert llm.reset_prefix_cache()
    worker.config = dataclasses.replace(worker.config, test_alter_loaded_kv=True)
    hits = worker.metrics["l2_hit_pages"]
    try:
        out = generate(llm, reference.extra[0])
    finally:
        worker.config = dataclasses.replace(worker.config, test_alter_loaded_kv=False)
    assert worker.metrics["l2_hit_pages"] > hits
    assert out != reference.extra_outputs[0]
    # What L2 holds was not altered: served again without the switch, the tokens are right.
    assert llm.reset_prefix_cache()
    assert generate(llm, reference.extra[0]) == reference.extra_outputs[0]


@pytest.fixture(scope="module")
def small(tiny_llama: Path, work: Workload, reference: Reference, roomy: Run,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    # vLLM keeps one worker-side connector per process: an engine started while another is
    # open would get the open one's. ``roomy``'s tests have run: close it first.
    roomy.close()
    run = serve(tiny_llama, work, tmp_path_factory.mktemp("small"), SMALL_MIB)
    yield run
    run.close()


def test_small_l2_is_bounded_and_the_store_serves_what_it_lost(
    reference: Reference, small: Run
) -> None:
    assert small.outputs == reference.outputs
    w = small.worker
    capacity = SMALL_MIB * (1 << 20) // PAGE_BYTES
    assert capacity == 4
    assert w["l2_evicted_pages"] > 0
    assert w["l2_evicted_bytes"] == w["l2_evicted_pages"] * PAGE_BYTES
    assert w["l2_put_pages"] - w["l2_evicted_pages"] == capacity
    assert w["l2_held_bytes"] == capacity * PAGE_BYTES <= SMALL_MIB << 20
    # Pages L2 no longer held came from the store; every page was served one way or the other.
    assert w["bytes_loaded"] > 0
    assert w.get("load_failures", 0) == 0
    l2 = worker_connector()._l2
    assert l2 is not None and len(l2) == capacity
    # The scheduler's list of L2 pages is what the worker holds.
    assert set(scheduler_connector(small.llm)._l2_pages) == set(l2._rows)
