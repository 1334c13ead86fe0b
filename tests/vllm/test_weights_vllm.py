"""The weights in the vLLM connector's and tier's namespaces, in real vLLM 0.32 engines.

Two tiny Llamas built offline with one config and one tokenizer but other weights (``a``: the
session's, ``b``: another seed), served under one model name, and ``a``'s files copied to
another path. For the connector and for the tier, one after another on one store:

* ``a`` stores a prompt's pages;
* ``b`` finds none of them (vLLM's own counters: nothing loaded) and computes its own tokens;
* ``a``'s copy is served from the store, with ``a``'s tokens;
* that engine then reloads ``b``'s weights in place (vLLM's ``reload_weights``) and resets
  its connector (``reset_prefix_cache(reset_connector=True)``, what vLLM's pause for a
  weight update does): nothing stored before is served, and its tokens are ``b``'s.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from test_secondary_tier import start, tier_of
from test_vllm_connector import (
    counter,
    generate,
    scheduler_connector,
    tokenize,
    worker_connector,
)
from vllm_support import close_llm, connector_config, make_llm, make_tiny_llama, sentence

#: real engines, about a minute each on 2 cores
pytestmark = pytest.mark.slow

NAME = "tiny-llama"  # one served name for every engine: only the weights differ


@pytest.fixture(scope="module")
def models(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    b = make_tiny_llama(tmp_path_factory.mktemp("other-weights") / "tiny", seed=1)
    copy = tmp_path_factory.mktemp("elsewhere") / "tiny-copy"
    shutil.copytree(tiny_llama, copy)
    return {"a": tiny_llama, "b": b, "a_copy": copy}


@pytest.fixture(scope="module")
def prompt(tiny_llama: Path) -> list[int]:
    tokens = tokenize(tiny_llama, sentence(2, 450))
    assert len(tokens) > 3 * 128  # three whole blocks to store
    return tokens


def reload(llm: Any, model: Path) -> None:
    """vLLM's in-place weight reload, then the connector reset its weight-update pause does."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model)})
    assert llm.reset_prefix_cache(reset_connector=True)


def test_the_connector_never_serves_other_weights(
    models: dict[str, Path], prompt: list[int], tmp_path: Path
) -> None:
    config = connector_config({"url": f"file://{tmp_path / 'kv'}", "model": NAME, "l2_mib": 0})

    def engine(model: Path) -> Any:
        return make_llm(model, kv_transfer_config=config)

    llm = engine(models["a"])
    try:
        out_a = generate(llm, prompt)
        worker_connector().flush()
        assert worker_connector().metrics["pages_saved"] >= 3
        revision_a = scheduler_connector(llm).namespace.model_revision
    finally:
        close_llm(llm)

    llm = engine(models["b"])
    try:
        out_b = generate(llm, prompt)
        assert counter(llm, "vllm:external_prefix_cache_hits") == 0  # none of a's pages
        assert worker_connector().metrics["pages_loaded"] == 0
        assert scheduler_connector(llm).namespace.model_revision != revision_a
    finally:
        close_llm(llm)
    assert out_b != out_a  # the weights do differ: a's KV would have changed the tokens
    assert revision_a.startswith("fp-")

    llm = engine(models["a_copy"])
    try:
        assert scheduler_connector(llm).namespace.model_revision == revision_a
        assert generate(llm, prompt) == out_a
        served = counter(llm, "vllm:external_prefix_cache_hits")
        assert served >= 3 * 128  # a's pages, from the store
        reload(llm, models["b"])
        assert generate(llm, prompt) == out_b
        assert counter(llm, "vllm:external_prefix_cache_hits") == served  # nothing more
        scheduler, worker = scheduler_connector(llm), worker_connector()
        assert scheduler.namespace.model_revision.startswith(revision_a + "+reset-")
        assert worker.namespace == scheduler.namespace  # the worker followed the scheduler
    finally:
        close_llm(llm)


def test_the_tier_never_serves_other_weights(
    models: dict[str, Path], prompt: list[int], tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'tier'}"

    llm = start(models["a"], url, model=NAME)
    try:
        out_a = generate(llm, prompt)
        tier = tier_of(llm)
        tier.wait_jobs()
        assert tier.stats.stored >= 3
        revision_a = tier.namespace.model_revision
    finally:
        close_llm(llm)

    llm = start(models["b"], url, model=NAME)
    try:
        out_b = generate(llm, prompt)
        assert tier_of(llm).stats.loaded == 0  # none of a's rows promoted
        assert tier_of(llm).namespace.model_revision != revision_a
    finally:
        close_llm(llm)
    assert out_b != out_a
    assert revision_a.startswith("fp-")

    llm = start(models["a_copy"], url, model=NAME)
    try:
        tier = tier_of(llm)
        assert generate(llm, prompt) == out_a
        loaded = tier.stats.loaded
        assert loaded >= 3  # a's rows, from the store
        reload(llm, models["b"])
        assert generate(llm, prompt) == out_b
        assert tier.stats.loaded == loaded
        assert tier.namespace.model_revision.startswith(revision_a + "+reset-")
    finally:
        close_llm(llm)
