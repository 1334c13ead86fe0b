"""The index contract (``hicache_store.testing.IndexTests``) on the Valkey index of a fleet."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from hicache_store.backends import Retention
from hicache_store.backends._valkey_index import ValkeyIndex
from hicache_store.backends.index import Measured, ObjectIndex, ObjectSite
from hicache_store.testing.index import IndexTests, MemorySite, put

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


class _LookThenPut:
    """A site whose next look at one key is followed at once by another process's put of it:
    the put settles between a repair's look at the store and the repair's step."""

    def __init__(self, site: MemorySite, key: str, then: Callable[[], None]) -> None:
        self._site, self._key, self._then = site, key, then

    def __getattr__(self, name: str) -> Any:
        return getattr(self._site, name)

    def measure(self, keys: Sequence[str]) -> list[Measured | None]:
        found = self._site.measure(keys)
        if self._key in keys:
            self._key = ""
            self._then()
        return found


def test_a_repair_whose_look_a_put_overtook_removes_nothing(valkey: ValkeyServer) -> None:
    site = MemorySite()
    root = secrets.token_hex(8)
    other = ValkeyIndex(valkey.url, root, site, writer=secrets.token_hex(8))
    indexes = [other]
    try:
        put(other, site, ["b0"])  # (an index with something in it)
        reader = ValkeyIndex(valkey.url, root, _LookThenPut(site, "a0", lambda: (
            put(other, site, ["a0"]),
            other.retain(["a0"], Retention("pinner", None, pinned=True), pin_budget=200))),
            writer=secrets.token_hex(8))
        indexes.append(reader)
        reader.repair_missing("a0")  # looked: missing; then stored and pinned; then the step
        assert reader.exists(["a0"]) == [True]
        assert [r.owner for r in reader.retention_of(["a0"])[0]] == ["pinner"]
        assert reader.totals() == (200, 2)
    finally:
        for index in indexes:
            index.close()
