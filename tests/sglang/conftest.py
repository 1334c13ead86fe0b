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
    with sglang_cpu.imported() as mod:
        yield mod


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'kv'}"
