"""A radix tree over token pages that records where each page lives (L1, L2, L3).

Pages are identified by their chained page hash (``hicache_store.layout.hashing``), so a path
from the root is a token prefix and the tree needs no token comparison: matching a request is a
walk over its page hashes. Each node is one full page.

Invariant kept by the tier (and checked by the tests): for L1 and L2, the set of nodes
resident in it is *prefix-closed* — if a node is resident, so is its parent. (L3 is written
parent-first, so what one instance writes there is a prefix too; but ``in_l3`` only records
what this instance *knows*, and a page fetched from L3 may have a parent whose L3 copy it
never checked, so the known set is not checked for closure.) Eviction therefore
only takes a tier's *leaves* (resident nodes with no resident child), least recently used first,
so a cached chain loses its tail, never a page in its middle.

The tree only does bookkeeping; it moves no bytes and is used from one thread (the engine's).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


class Tier(enum.IntEnum):
    L1 = 1  # device pool
    L2 = 2  # host pool


@dataclass(eq=False)
class PageNode:
    """One cached page.

    ``device_page`` / ``host_page``: its page index in the L1 / L2 pool, or None.
    ``in_l3``: an L3 copy is known to exist (acknowledged write or confirmed read).
    ``lock``: requests using its L1 copy (not evictable from L1 while > 0).
    ``host_lock``: transfers reading or writing its L2 copy (not evictable from L2 while > 0).
    ``hits``: how many requests matched it (write-through-selective counts these).
    ``l3_pending``: an L3 backup of it is queued or in flight.
    ``l3_write_ok``: outcome of this instance's last L3 write of it (the backup worker's).
    """

    page_hash: str
    parent: PageNode | None
    depth: int
    children: dict[str, PageNode] = field(default_factory=dict)
    device_page: int | None = None
    host_page: int | None = None
    in_l3: bool = False
    l3_pending: bool = False
    l3_write_ok: bool = False
    lock: int = 0
    host_lock: int = 0
    hits: int = 0
    last_access: int = 0

    def resident(self, tier: Tier) -> bool:
        return (self.device_page if tier is Tier.L1 else self.host_page) is not None

    def path(self) -> list[PageNode]:
        """Nodes from the first page down to this one."""
        nodes: list[PageNode] = []
        node: PageNode | None = self
        while node is not None and node.depth >= 0:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def __repr__(self) -> str:
        return (
            f"PageNode({self.page_hash[:8]}.., depth={self.depth}, L1={self.device_page}, "
            f"L2={self.host_page}, L3={self.in_l3})"
        )


class PageTree:
    """The page radix tree. See the module docstring for the invariant it serves."""

    def __init__(self) -> None:
        self.root = PageNode(page_hash="", parent=None, depth=-1)
        self._clock = itertools.count(1)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def tick(self) -> int:
        return next(self._clock)

    def match(self, page_hashes: Sequence[str]) -> list[PageNode]:
        """The nodes of the longest known prefix of ``page_hashes`` (any residency)."""
        nodes = []
        node = self.root
        for page_hash in page_hashes:
            child = node.children.get(page_hash)
            if child is None:
                break
            nodes.append(child)
            node = child
        return nodes

    def insert(self, page_hashes: Sequence[str]) -> list[PageNode]:
        """The nodes of ``page_hashes``, creating the missing ones (with no residency)."""
        nodes = []
        node = self.root
        for page_hash in page_hashes:
            child = node.children.get(page_hash)
            if child is None:
                child = PageNode(page_hash, node, node.depth + 1)
                node.children[page_hash] = child
                self._size += 1
            nodes.append(child)
            node = child
        return nodes

    def touch(self, nodes: Sequence[PageNode]) -> None:
        """Mark ``nodes`` as used now (deeper nodes last, so tails are older than heads never)."""
        now = self.tick()
        for node in nodes:
            node.last_access = now

    @staticmethod
    def resident_prefix(nodes: Sequence[PageNode], tier: Tier) -> int:
        """How many leading ``nodes`` are resident in ``tier``."""
        for i, node in enumerate(nodes):
            if not node.resident(tier):
                return i
        return len(nodes)

    def nodes(self) -> Iterator[PageNode]:
        """Every node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def eviction_order(self, tier: Tier) -> Iterator[PageNode]:
        """Evictable nodes of ``tier``, least recently used first, leaves before parents.

        A node is offered only once none of its children is resident in ``tier``; the caller
        evicts it (or not) before asking for the next one, and parents that become leaves
        join the queue. Locked nodes are never offered.
        """
        heap: list[tuple[int, int, PageNode]] = []
        order = itertools.count()

        def evictable(node: PageNode) -> bool:
            if not node.resident(tier):
                return False
            if (node.lock if tier is Tier.L1 else node.host_lock) > 0:
                return False
            return not any(child.resident(tier) for child in node.children.values())

        for node in self.nodes():
            if evictable(node):
                heapq.heappush(heap, (node.last_access, next(order), node))
        while heap:
            _, _, node = heapq.heappop(heap)
            if not evictable(node):
                continue
            yield node
            parent = node.parent
            if not node.resident(tier) and parent is not None and evictable(parent):
                heapq.heappush(heap, (parent.last_access, next(order), parent))

    def prune(self, node: PageNode) -> None:
        """Remove ``node`` and its now-empty ancestors once they hold no copy anywhere."""
        current: PageNode | None = node
        while (
            current is not None
            and current.depth >= 0
            and not current.children
            and current.device_page is None
            and current.host_page is None
            and not current.in_l3
            and not current.l3_pending
            and current.lock == 0
            and current.host_lock == 0
        ):
            parent = current.parent
            assert parent is not None
            del parent.children[current.page_hash]
            self._size -= 1
            current = parent

    def check_prefix_closed(self, tiers: tuple[Tier, ...] = (Tier.L1, Tier.L2)) -> None:
        """Raise ``AssertionError`` if one of ``tiers`` holds a page without its parent."""
        for node in self.nodes():
            parent = node.parent
            if parent is None or parent.depth < 0:
                continue
            for tier in tiers:
                if node.resident(tier) and not parent.resident(tier):
                    raise AssertionError(f"{node} is in {tier.name} without its parent {parent}")
