"""The tree's incremental heaps against a full scan: any sequence of residency, lock, use and
eviction changes leaves them holding exactly the evictable nodes, and every victim is the
policy's first choice among them."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache_store.tier.components import KV_TAG
from hicache_store.tier.eviction import LRUEviction
from hicache_store.tier.radix import PageNode, PageTree, Tier

OWN, FOLLOWS = 5, 6  # a component with its own L1 slots, one that follows the KV pages

# Chains over a small alphabet of pages so that branches share prefixes often.
chains = st.lists(st.sampled_from("abc"), min_size=1, max_size=5).map(
    lambda path: ["".join(path[: i + 1]) for i in range(len(path))]
)


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = PageTree(l3_record_limit=6)
        self.tree.add_component(OWN, LRUEviction(_depth), LRUEviction(_depth))
        self.tree.add_component(FOLLOWS, LRUEviction(_depth), None)
        self.pages = 0
        self.clock = 0
        # The LRU model: the request clock at which each resident KV copy was last used.
        self.stamps: dict[tuple[int, Tier], int] = {}

    def _nodes(self) -> list[PageNode]:
        return sorted(self.tree.nodes(), key=lambda n: (n.depth, n.page_hash))

    def _pick(self, index: int) -> PageNode | None:
        nodes = self._nodes()
        return nodes[index % len(nodes)] if nodes else None

    @rule(path=chains)
    def insert(self, path: list[str]) -> None:
        self.tree.insert(path)

    @rule(index=st.integers(0, 99), tier=st.sampled_from([Tier.L1, Tier.L2]))
    def add_copy(self, index: int, tier: Tier) -> None:
        node = self._pick(index)
        if node is None:
            return
        self.pages += 1
        if not node.resident(tier, KV_TAG):
            self.stamps[(id(node), tier)] = self.clock
        self.tree.set_copy(node, KV_TAG, tier, self.pages)

    @rule(index=st.integers(0, 99), tier=st.sampled_from([Tier.L1, Tier.L2]))
    def drop_copy(self, index: int, tier: Tier) -> None:
        node = self._pick(index)
        if node is not None:
            self.tree.set_copy(node, KV_TAG, tier, None)
            self.tree.prune(node)

    @rule(
        index=st.integers(0, 99),
        tag=st.sampled_from([OWN, FOLLOWS]),
        tier=st.sampled_from([Tier.L1, Tier.L2, Tier.L3]),
        keep=st.booleans(),
    )
    def component_copy(self, index: int, tag: int, tier: Tier, keep: bool) -> None:
        node = self._pick(index)
        if node is None:
            return
        if tier is Tier.L1 and tag == FOLLOWS:
            value: int | bool | None = node.copy(KV_TAG).l1 if keep else None
            if value is None and keep:
                return  # no KV page to follow
        elif tier is Tier.L3:
            value = keep
        else:
            self.pages += 1
            value = self.pages if keep else None
        self.tree.set_copy(node, tag, tier, value)
        self.tree.prune(node)

    @rule(index=st.integers(0, 99), tag=st.sampled_from([OWN, FOLLOWS]), host=st.booleans())
    def component_lock(self, index: int, tag: int, host: bool) -> None:
        node = self._pick(index)
        if node is not None:
            (self.tree.hold_host if host else self.tree.lock)(node, tag)

    @rule(tag=st.sampled_from([OWN, FOLLOWS]), tier=st.sampled_from([Tier.L1, Tier.L2]))
    def component_evict(self, tag: int, tier: Tier) -> None:
        if (tag, tier) not in self.tree.policies:
            return
        victim = self.tree.pop_victim(tier, tag)
        if victim is None:
            assert not any(self.tree.is_evictable(n, tier, tag) for n in self._nodes())
            return
        assert self.tree.is_evictable(victim, tier, tag)
        self.tree.set_copy(victim, tag, tier, None)
        self.tree.prune(victim)

    @rule(index=st.integers(0, 99), known=st.booleans(), pending=st.booleans())
    def l3(self, index: int, known: bool, pending: bool) -> None:
        node = self._pick(index)
        if node is not None:
            self.tree.set_copy(node, KV_TAG, Tier.L3, known)
            self.tree.set_pending(node, KV_TAG, pending)
            self.tree.prune(node)

    @rule(index=st.integers(0, 99), host=st.booleans())
    def lock_and_maybe_unlock(self, index: int, host: bool) -> None:
        node = self._pick(index)
        if node is None:
            return
        if host:
            self.tree.hold_host(node, KV_TAG)
        else:
            self.tree.lock(node, KV_TAG)

    @rule()
    def unlock_all(self) -> None:
        for node in self._nodes():
            for held in list(node.records()):
                while held.lock:
                    self.tree.unlock(node, held.tag)
                while held.host_lock:
                    self.tree.release_host(node, held.tag)

    @rule(index=st.integers(0, 99))
    def use(self, index: int) -> None:
        node = self._pick(index)
        if node is not None:
            self.tree.begin_request()
            self.clock += 1
            self.tree.touch(node.path())
            for used in node.path():
                for tier in (Tier.L1, Tier.L2):
                    if used.resident(tier, KV_TAG):
                        self.stamps[(id(used), tier)] = self.clock

    @rule(tier=st.sampled_from([Tier.L1, Tier.L2]))
    def evict(self, tier: Tier) -> None:
        candidates = [n for n in self._nodes() if self.tree.is_evictable(n, tier, KV_TAG)]
        victim = self.tree.pop_victim(tier, KV_TAG)
        if not candidates:
            assert victim is None
            return
        assert victim is not None
        # LRU: nothing evictable was used before the victim (ties: the deeper page first).
        def age(n: PageNode) -> tuple[int, int]:
            return self.stamps[(id(n), tier)], -n.depth

        assert all(age(victim) <= age(n) for n in candidates), (
            "the victim is not the least recently used evictable leaf"
        )
        if tier is Tier.L1:
            self.tree.set_copy(victim, KV_TAG, Tier.L1, None)
        else:
            self.tree.set_copy(victim, KV_TAG, Tier.L2, None)
        self.tree.prune(victim)

    @rule()
    def trim(self) -> None:
        self.tree.trim_l3_record()
        evictable = sum(self.tree.record_leaf(n) for n in self._nodes())
        assert self.tree.l3_record <= 6 or evictable == 0

    @invariant()
    def heaps_match_a_full_scan(self) -> None:
        self.tree.check_queues()


def _depth(node: PageNode) -> int:
    return node.depth


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
