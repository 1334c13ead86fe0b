"""Fixtures for tests that drive SGLang 0.5.23's own classes (see ``sglang_cpu``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import sglang_cpu


@pytest.fixture
def sglang() -> Iterator[ModuleType]:
    """``sglang_cpu`` with SGLang imported; skipped (with the reason) where it cannot import.

    After the test, no stub may have been touched: the code that ran is SGLang's own.
    """
    error = sglang_cpu.load()
    if error is not None:
        pytest.skip(f"SGLang 0.5.23 does not import here ({error}); see `make setup`")
    before = len(sglang_cpu.stub_uses_since_import())
    yield sglang_cpu
    assert sglang_cpu.stub_uses_since_import()[before:] == []


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'kv'}"
