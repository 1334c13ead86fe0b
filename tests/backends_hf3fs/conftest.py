"""Fixtures for the hf3fs tests: the FAKE ``hf3fs_fuse.io`` installed for one test at a time.

The fake (``fakes/hf3fs_fuse/io.py``) is NOT 3FS: it runs the USRBIO call sequence with plain
file I/O and checks that the sequence is legal. Real-3FS tests live in ``test_real_mount.py``
and run only when ``HICACHE_STORE_HF3FS_MOUNT`` names a 3FS mount point.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from .fakes import hf3fs_fuse as fake_pkg
from .fakes.hf3fs_fuse import io as fake_io


@pytest.fixture
def fake_usrbio(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``hf3fs_fuse.io`` resolves to the FAKE for this test; its checker state is fresh."""
    fake_io.reset()
    monkeypatch.setitem(sys.modules, "hf3fs_fuse", fake_pkg)
    monkeypatch.setitem(sys.modules, "hf3fs_fuse.io", fake_io)
    return fake_io


@pytest.fixture
def fake_mount(tmp_path: Path) -> Path:
    """A directory the fake treats as a 3FS mount point."""
    mount = tmp_path / "3fs"
    fake_io.make_fake_mount(mount)
    return mount


@pytest.fixture
def no_usrbio(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hf3fs_fuse`` cannot be imported (as on every machine without a 3FS client)."""
    monkeypatch.setitem(sys.modules, "hf3fs_fuse", None)
    monkeypatch.setitem(sys.modules, "hf3fs_fuse.io", None)
