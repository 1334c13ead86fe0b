"""The index contract (``hicache_store.testing.IndexTests``) on the Valkey index of a fleet."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache_store.backends._valkey_index import ValkeyIndex
from hicache_store.backends.index import ObjectIndex, ObjectSite
from hicache_store.testing.index import IndexTests

from .valkey_server import ValkeyServer


class TestValkeyIndexContract(IndexTests):
    @pytest.fixture(autouse=True)
    def _server(self, valkey: ValkeyServer) -> None:
        self.server = valkey
        self.roots: dict[Path, str] = {}

    def open_index(self, store: Path, site: ObjectSite, clock: Callable[[], float]) -> ObjectIndex:
        root = self.roots.setdefault(store, secrets.token_hex(8))
        return ValkeyIndex(self.server.url, root, site, writer=secrets.token_hex(8),
                           clock=clock, lease_s=5.0)

    def kill(self, index: ObjectIndex) -> None:
        # its heartbeat stops and lapses at once: what other writers see of a dead process
        assert isinstance(index, ValkeyIndex)
        index._stop.set()
        index._heart.join()
        self.server.client().delete(index._link.key(f"H:{index.writer}"))
