"""The page radix tree: matching, insertion, LRU leaf-first eviction, pruning."""

from __future__ import annotations

import pytest

from hicache_store.tier.config import TierConfig, prefetch_timeout
from hicache_store.tier.radix import PageTree, Tier


def chain(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_match_walks_the_longest_known_prefix() -> None:
    tree = PageTree()
    tree.insert(chain("a", 4))
    assert [n.page_hash for n in tree.match(chain("a", 6))] == chain("a", 4)
    assert tree.match(["b0"]) == []
    assert len(tree) == 4


def test_branches_share_their_prefix() -> None:
    tree = PageTree()
    first = tree.insert(["d0", "d1", "qa"])
    second = tree.insert(["d0", "d1", "qb"])
    assert first[:2] == second[:2]
    assert first[2] is not second[2]
    assert len(tree) == 4


def test_eviction_offers_lru_leaves_and_then_their_parents() -> None:
    tree = PageTree()
    old = tree.insert(chain("a", 3))
    new = tree.insert(chain("b", 2))
    for i, node in enumerate(old + new):
        node.device_page = i
    tree.touch(old)
    tree.touch(new)
    order = []
    for node in tree.eviction_order(Tier.L1):
        order.append(node.page_hash)
        node.device_page = None
    assert order == ["a2", "a1", "a0", "b1", "b0"]


def test_locked_nodes_and_their_ancestors_stay() -> None:
    tree = PageTree()
    nodes = tree.insert(chain("a", 3))
    for i, node in enumerate(nodes):
        node.device_page = i
    nodes[2].lock = 1
    assert list(tree.eviction_order(Tier.L1)) == []
    nodes[2].lock = 0
    nodes[2].host_page = 7
    nodes[2].host_lock = 1
    assert [n.page_hash for n in tree.eviction_order(Tier.L2)] == []
    assert [n.page_hash for n in tree.eviction_order(Tier.L1)] == ["a2"]


def test_prefix_closed_check_catches_a_hole() -> None:
    tree = PageTree()
    nodes = tree.insert(chain("a", 2))
    nodes[1].host_page = 0
    with pytest.raises(AssertionError, match="without its parent"):
        tree.check_prefix_closed()
    nodes[0].host_page = 1
    tree.check_prefix_closed()


def test_prune_removes_empty_tails_only() -> None:
    tree = PageTree()
    nodes = tree.insert(chain("a", 3))
    nodes[0].in_l3 = True
    tree.prune(nodes[2])
    assert len(tree) == 1
    assert tree.match(chain("a", 3)) == [nodes[0]]


def test_timeout_formula_matches_sglang() -> None:
    config = TierConfig(l1_pages=8)
    assert prefetch_timeout(config, 0) == 2.0
    assert prefetch_timeout(config, 10 * 1024) == pytest.approx(3.0)
    assert prefetch_timeout(config, 10**7) == 30.0


def test_backup_thresholds() -> None:
    assert TierConfig(l1_pages=1).backup_threshold == 1
    assert TierConfig(l1_pages=1, write_policy="write_through_selective").backup_threshold == 2
    assert TierConfig(l1_pages=1, write_policy="write_back").backup_threshold == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("write_policy", "lazy"),
        ("prefetch_policy", "never"),
        ("host_mode", "swap"),
        ("l1_pages", 0),
    ],
)
def test_bad_config(field: str, value: object) -> None:
    options: dict[str, object] = {"l1_pages": 4, field: value}
    with pytest.raises(ValueError, match=field):
        TierConfig(**options)  # type: ignore[arg-type]
