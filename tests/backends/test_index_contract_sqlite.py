"""The index contract (``hicache_store.testing.IndexTests``) on the SQLite index of a file root."""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Callable
from pathlib import Path

from hicache_store.backends._file_index import FileIndex
from hicache_store.backends.index import ObjectIndex, ObjectSite
from hicache_store.testing.index import IndexTests


class TestFileIndexContract(IndexTests):
    def open_index(self, store: Path, site: ObjectSite, clock: Callable[[], float]) -> ObjectIndex:
        (store / "tmp").mkdir(exist_ok=True)  # (where the host record is written)
        return FileIndex(str(store), site, token=secrets.token_hex(4), clock=clock)

    def kill(self, index: ObjectIndex) -> None:
        # a process that is gone: its pending rows name a pid that no longer exists
        assert isinstance(index, FileIndex)
        db = sqlite3.connect(index.db_path)
        db.execute("UPDATE pending SET pid = 0 WHERE token = ?", (index._rows.owner.token,))
        db.commit()
        db.close()
