"""The fleet's index on a Valkey Cluster (three masters started here, the slots split between
them): every key of one store carries one hash tag, so each store lives in one slot and its
atomic steps run on one node; the whole index contract holds there, and stores land on
different nodes."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache_store.backends._valkey_index import ValkeyIndex
from hicache_store.backends.index import ObjectIndex, ObjectSite
from hicache_store.testing.index import IndexTests, MemorySite, put

from .valkey_server import ValkeyCluster, server_or_skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    nodes = ValkeyCluster(server_or_skip()).start()
    yield nodes
    nodes.remove()


class TestValkeyClusterIndexContract(IndexTests):
    @pytest.fixture(autouse=True)
    def _cluster(self, cluster: ValkeyCluster) -> None:
        self.cluster = cluster
        self.roots: dict[Path, str] = {}

    def open_index(self, store: Path, site: ObjectSite, clock: Callable[[], float]) -> ObjectIndex:
        root = self.roots.setdefault(store, secrets.token_hex(8))
        return ValkeyIndex(self.cluster.url, root, site, writer=secrets.token_hex(8),
                           clock=clock, lease_s=5.0)

    def kill(self, index: ObjectIndex) -> None:
        assert isinstance(index, ValkeyIndex)
        index._stop.set()
        index._heart.join()
        index._link.call("kill", index._link.client.delete, index._link.key(f"H:{index.writer}"))


def test_stores_spread_over_the_nodes_each_whole_on_one(cluster: ValkeyCluster) -> None:
    nodes: set[bytes] = set()
    for n in range(8):
        site = MemorySite()
        index = ValkeyIndex(cluster.url, f"root{n}", site, writer=secrets.token_hex(8))
        try:
            assert index._link.cluster
            for i in range(5):
                put(index, site, [f"a{i}"], capacity=400)  # the fifth evicts one
            assert index.totals() == (400, 4)
            slot = index._link.client.keyslot(index._link.meta)
            assert all(index._link.client.keyslot(index._link.key(n)) == slot
                       for n in ("RB", "R:0000", "R:ffff", "F", "P:0000", "P:ffff",
                                 f"Q:{index.writer}"))
            nodes.add(index._link.client.get_node_from_key(index._link.meta).name.encode())
        finally:
            index.close()
    assert len(nodes) >= 2  # eight stores are not all on one node (one in 3^7 by chance)
