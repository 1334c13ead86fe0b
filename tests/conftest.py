"""Shared by every test folder: this directory is on ``sys.path`` (pytest's rootdir-relative
import of a ``conftest.py`` without ``__init__.py``), so tests import ``_serve`` by name.

The checkout's root is taken off ``sys.path`` (``python -m pytest`` puts the working directory
there): its source folders ``layout/``, ``kernels/`` and ``backends/`` are the package's
``hicache_store.layout`` / ``.kernels`` / ``.backends`` (mapped by the editable install) and must
never import as top-level packages. Left there, ``kernels/`` shadows Hugging Face's ``kernels``
distribution, which transformers (5.25 and later) imports when it is installed, and every test
that loads a model fails at ``from kernels import ...``.

Collection imports every test module and what they use (torch, transformers, SGLang, Hypothesis):
a heap of long-lived objects that every full garbage collection would walk again, in each
process, for the rest of the run. The cyclic collector is off while collection loads them, and
they are then frozen (``gc.freeze``); the tests' own objects are collected as usual.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The shared suites (``BackendTests``, ``IndexTests``) assert inside the package: rewritten like
# a test module's, a failure there shows the values it compared.
pytest.register_assert_rewrite("hicache_store.testing")

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    gc.disable()
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()
