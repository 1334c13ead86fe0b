"""The page radix tree: matching, insertion, LRU leaf-first eviction, pruning."""

from __future__ import annotations

import pytest

from hicache_store.tier.components import KV_TAG
from hicache_store.tier.config import TierConfig, prefetch_timeout
from hicache_store.tier.eviction import ARCEviction
from hicache_store.tier.radix import PageNode, PageTree, Tier


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


def drain(tree: PageTree, tier: Tier) -> list[str]:
    """Evict everything ``tier`` offers, in order (dropping each copy as the tier would)."""
    order = []
    while (node := tree.pop_victim(tier, KV_TAG)) is not None:
        order.append(node.page_hash)
        if tier is Tier.L1:
            tree.set_copy(node, KV_TAG, Tier.L1, None)
        else:
            tree.set_copy(node, KV_TAG, Tier.L2, None)
    return order


def use(tree: PageTree, nodes: list[PageNode]) -> None:
    """One request uses ``nodes``."""
    tree.begin_request()
    tree.touch(nodes)


def test_eviction_offers_lru_leaves_and_then_their_parents() -> None:
    tree = PageTree()
    old = tree.insert(chain("a", 3))
    new = tree.insert(chain("b", 2))
    for i, node in enumerate(old + new):
        tree.set_copy(node, KV_TAG, Tier.L1, i)
    use(tree, old)
    use(tree, new)
    assert drain(tree, Tier.L1) == ["a2", "a1", "a0", "b1", "b0"]
    tree.check_queues()


def test_use_moves_a_chain_to_the_back() -> None:
    tree = PageTree()
    first, second = tree.insert(chain("a", 2)), tree.insert(chain("b", 2))
    for i, node in enumerate(first + second):
        tree.set_copy(node, KV_TAG, Tier.L1, i)
    use(tree, first)
    use(tree, second)
    use(tree, first)  # used again: now the most recent
    assert drain(tree, Tier.L1) == ["b1", "b0", "a1", "a0"]


def test_locked_nodes_and_their_ancestors_stay() -> None:
    tree = PageTree()
    nodes = tree.insert(chain("a", 3))
    for i, node in enumerate(nodes):
        tree.set_copy(node, KV_TAG, Tier.L1, i)
    tree.lock(nodes[2], KV_TAG)
    assert tree.pop_victim(Tier.L1, KV_TAG) is None
    tree.unlock(nodes[2], KV_TAG)
    tree.set_copy(nodes[0], KV_TAG, Tier.L2, 5)
    tree.set_copy(nodes[1], KV_TAG, Tier.L2, 6)
    tree.set_copy(nodes[2], KV_TAG, Tier.L2, 7)
    tree.hold_host(nodes[2], KV_TAG)
    assert tree.pop_victim(Tier.L2, KV_TAG) is None
    tree.check_queues()
    assert drain(tree, Tier.L1) == ["a2", "a1", "a0"]
    tree.release_host(nodes[2], KV_TAG)
    assert drain(tree, Tier.L2) == ["a2", "a1", "a0"]
    with pytest.raises(RuntimeError, match="without"):
        tree.unlock(nodes[0], KV_TAG)


def test_prefix_closed_check_catches_a_hole() -> None:
    tree = PageTree()
    nodes = tree.insert(chain("a", 2))
    tree.set_copy(nodes[1], KV_TAG, Tier.L2, 0)
    with pytest.raises(AssertionError, match="without its parent"):
        tree.check_prefix_closed()
    tree.set_copy(nodes[0], KV_TAG, Tier.L2, 1)
    tree.check_prefix_closed()


def test_prune_removes_empty_tails_only() -> None:
    tree = PageTree()
    nodes = tree.insert(chain("a", 3))
    tree.set_copy(nodes[0], KV_TAG, Tier.L3, True)
    tree.prune(nodes[2])
    assert len(tree) == 1
    assert tree.match(chain("a", 3)) == [nodes[0]]
    tree.check_queues()


def test_the_l3_record_is_bounded_and_forgets_the_oldest_tails() -> None:
    tree = PageTree(l3_record_limit=4)
    old, new = tree.insert(chain("a", 3)), tree.insert(chain("b", 3))
    for node in old + new:
        tree.set_copy(node, KV_TAG, Tier.L3, True)
    use(tree, old)
    use(tree, new)
    resident = tree.insert(chain("c", 2))
    for i, node in enumerate(resident):
        tree.set_copy(node, KV_TAG, Tier.L1, i)
    assert len(tree) == 8 and tree.l3_record == 6
    assert tree.trim_l3_record() == 2
    assert tree.l3_record == 4
    # the least recently used chain lost its tail first; resident pages are never forgotten
    assert [n.page_hash for n in tree.match(chain("a", 3))] == ["a0"]
    assert len(tree.match(chain("b", 3))) == 3
    assert len(tree.match(chain("c", 2))) == 2
    tree.check_queues()


def test_a_page_in_use_is_not_forgotten() -> None:
    tree = PageTree(l3_record_limit=0)
    nodes = tree.insert(chain("a", 2))
    for node in nodes:
        tree.set_copy(node, KV_TAG, Tier.L3, True)
    tree.lock(nodes[1], KV_TAG)
    assert tree.trim_l3_record() == 0
    tree.unlock(nodes[1], KV_TAG)
    assert tree.trim_l3_record() == 2
    assert len(tree) == 0


def test_a_policy_decides_the_order_among_evictable_leaves() -> None:
    # ARC (tier.eviction): a chain used by a second request outlives chains used once, even
    # ones used more recently; LRU would evict it first.
    def arc() -> ARCEviction[PageNode]:
        return ARCEviction(4, lambda n: n.depth, lambda n: n.page_hash)

    tree = PageTree(arc(), arc())
    pages = iter(range(4))

    def request(nodes: list[PageNode]) -> None:  # cached by the request that computed them
        tree.begin_request()
        for node in nodes:
            if node.copy(KV_TAG).l1 is None:
                tree.set_copy(node, KV_TAG, Tier.L1, next(pages))
        tree.touch(nodes)

    reused, once = tree.insert(chain("a", 2)), tree.insert(chain("b", 2))
    request(reused)
    request(reused)  # a later request: now in ARC's "used again" list
    request(once)
    assert drain(tree, Tier.L1) == ["b1", "b0", "a1", "a0"]


def test_policies_are_chosen_by_name() -> None:
    assert TierConfig(l1_pages=4, eviction_policy="arc").eviction_policy == "arc"
    with pytest.raises(ValueError, match="eviction_policy"):
        TierConfig(l1_pages=4, eviction_policy="fifo")


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
