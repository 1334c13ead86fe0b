"""Fixtures shared by the object-layer tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hicache_store.backends import open_backend
from hicache_store.backends.file import FileBackend


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FileBackend]:
    """A file backend under the test's own folder, closed after the test."""
    backend = open_backend(f"file://{tmp_path}/s")
    assert isinstance(backend, FileBackend)
    yield backend
    await backend.close()
