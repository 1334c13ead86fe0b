"""A radix tree over token pages that records where each page lives (L1, L2, L3), with
incremental eviction.

Pages are identified by their chained page hash (``hicache_store.layout.hashing``): a page's
hash covers every token before it, so it names a whole prefix, and the tree is one dict from
hash to node plus parent links (no per-node child tables). Matching a request is a walk over
its page hashes; each node is one full page.

Invariant kept by the tier (and checked by the tests): for L1 and L2, the set of nodes whose KV
is resident is *prefix-closed* — if a node is resident, so is its parent. Eviction therefore
only takes a pool's *evictable leaves* (resident, unlocked, no resident child), so a cached
chain loses its tail, never a page in its middle. (``in_l3`` only records what this instance
*knows*: a page fetched from L3 may have a parent whose L3 copy it never checked, so it is not
checked for closure.)

**Components.** Besides its KV (the node's own fields), a page may hold an object of each cache
component (``tier.components``: sliding-window KV, a recurrent checkpoint, a draft's KV), with
its own residency and locks in a ``Held`` (``node.comps[tag]``). Component copies are not
prefix-closed (a resume needs only some of them; ``match_components`` says which), so any
unlocked copy may go; a component that follows the KV pages (``follows_kv``) keeps its L1 copy
in the KV's device page and loses it with that page.

**Bounded.** The tree holds the pages L1 and L2 hold, pages in use or in transit, and a bounded
*record* of pages only L3 holds (``l3_record_limit`` nodes without an L1/L2 copy). Past the
bound the least recently used record leaves are forgotten (``trim_l3_record``): L3 is probed
again when a request needs them, so forgetting costs at most a probe or a redundant backup.

**Incremental.** Every residency or lock change goes through the tree (``set_device``,
``set_host``, ``set_in_l3``, ``set_l3_pending``, ``lock`` / ``unlock``, ``hold_host`` /
``release_host``; ``set_held``, ``lock_held`` ... for components). Each pool (the KV's L1 and
L2, and each component's) has an eviction policy (``tier.eviction``: it owns the order, the
tree tells it which nodes are evictable as that changes and asks it for ``victim()``), so a
victim costs O(log n) and every change O(log n) for the node and its parent. The record keeps
its own heap, least recently used first.

**One eviction order across components.** Every pool orders its copies with the same policy
(``TierConfig.eviction_policy``; one instance per pool), and the tree gives every pool the same
history of each page: one request clock (``begin_request``), and each use of a page touches
every copy it holds, in path order (``touch``). A policy's order is a function of that history
(``lru``: last use, then deeper first; ``arc``: used by one request or again, then last use), so
pools holding copies of the same pages keep and give up the same pages
(``tests/hybrid/test_eviction_order.py``). Pools differ only in what they may give up (a KV pool
its evictable leaves, so a chain loses its tail; a component copy any time it is unlocked) and,
with ``arc``, in the adaptive target and ghost lists, which are evidence about that pool's own
capacity. Ordering component copies by their page's KV policy state instead was not chosen: a
component copy outlives its page's KV copy in a pool (a window page or a checkpoint stays after
the page's KV went), and the KV's policy has no state for a page it does not hold. (Component
pools once evicted LRU under an ARC KV, c250cb4, working around bugs that cost the hybrid
benchmark its reuse under ARC; with those fixed, ARC components reuse as much as LRU ones:
BENCHMARKS.md, "The hybrid model".)

Per node the tree keeps the fields of ``PageNode`` (slotted) plus the policies' state per
resident copy; ``bench/bench_tier_scale.py`` measures the bytes per page (BENCHMARKS.md).

The tree only does bookkeeping; it moves no bytes and is used from one thread (the engine's).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .eviction import EvictionPolicy, LRUEviction


class Tier(enum.IntEnum):
    L1 = 1  # device pool
    L2 = 2  # host pool
    L3 = 3  # external storage (for the tree: the record of pages only L3 is known to hold)


#: the record's heap is compacted when its stale entries exceed the live ones by this many.
_COMPACT_SLACK = 1024


@dataclass(eq=False, slots=True)
class Held:
    """A component's object of one page: ``l1`` its L1 slot (for a component that follows the
    KV pages: the KV's device page), ``l2`` its host row, ``in_l3`` / ``l3_pending`` as for KV,
    ``lock`` requests using its L1 copy, ``host_lock`` transfers using its L2 copy."""

    l1: int | None = None
    l2: int | None = None
    in_l3: bool = False
    l3_pending: bool = False
    lock: int = 0
    host_lock: int = 0

    @property
    def in_memory(self) -> bool:
        return self.l1 is not None or self.l2 is not None

    @property
    def empty(self) -> bool:
        return not (self.in_memory or self.in_l3 or self.l3_pending or self.lock or self.host_lock)

    def where(self) -> Tier | None:
        """The closest tier holding this object (L3: one is known), or None."""
        if self.l1 is not None:
            return Tier.L1
        if self.l2 is not None:
            return Tier.L2
        return Tier.L3 if self.in_l3 else None


@dataclass(eq=False, slots=True)
class PageNode:
    """One cached page. Change residency and locks only through ``PageTree``'s methods.

    ``device_page`` / ``host_page``: its KV's page index in the L1 / L2 pool, or None.
    ``in_l3``: an L3 copy of its KV is known to exist (acknowledged write or confirmed read).
    ``lock``: requests using its L1 copy (not evictable from L1 while > 0).
    ``host_lock``: transfers reading or writing its L2 copy (not evictable from L2 while > 0).
    ``hits``: how many requests matched it (write-through-selective counts these).
    ``l3_pending``: an L3 backup of its KV is queued or in flight.
    ``l3_write_ok``: outcome of this instance's last L3 write of it (the backup worker's).
    ``children``: how many nodes have this one as parent; ``l1_children`` / ``l2_children``:
    how many of them have an L1 / L2 copy (leaf tests in O(1)). ``comps``: the objects of other
    components this page holds, by tag (None: none). ``last_access``: the request clock at its
    last use (the record's order).
    """

    page_hash: str
    parent: PageNode | None
    depth: int
    children: int = 0
    device_page: int | None = None
    host_page: int | None = None
    in_l3: bool = False
    l3_pending: bool = False
    l3_write_ok: bool = False
    lock: int = 0
    host_lock: int = 0
    hits: int = 0
    last_access: int = 0
    l1_children: int = 0
    l2_children: int = 0
    record_seq: int = 0
    comps: dict[int, Held] | None = None

    def held(self, tag: int) -> Held | None:
        """This page's object of component ``tag``, if it has one."""
        return None if self.comps is None else self.comps.get(tag)

    def resident(self, tier: Tier) -> bool:
        """Whether this node's KV has a copy in ``tier`` (L3: one is known)."""
        if tier is Tier.L1:
            return self.device_page is not None
        if tier is Tier.L2:
            return self.host_page is not None
        return self.in_l3

    @property
    def in_memory(self) -> bool:
        """Some copy of this page (KV or a component's) is in L1 or L2."""
        if self.device_page is not None or self.host_page is not None:
            return True
        return self.comps is not None and any(h.in_memory for h in self.comps.values())

    @property
    def busy(self) -> bool:
        """Something uses or writes this page's copies now (locks, pending backups)."""
        if self.lock or self.host_lock or self.l3_pending:
            return True
        return self.comps is not None and any(
            h.lock or h.host_lock or h.l3_pending for h in self.comps.values()
        )

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


def _lru() -> EvictionPolicy[PageNode]:
    return LRUEviction(lambda node: node.depth)


class PageTree:
    """The page radix tree. See the module docstring for its invariants and costs.

    ``l1_policy`` / ``l2_policy``: the eviction policies of the KV's pools (LRU by default;
    ``tier.eviction.make_eviction_policy``). ``l3_record_limit``: how many nodes without an
    L1/L2 copy the tree keeps (None: unbounded).
    """

    def __init__(
        self,
        l1_policy: EvictionPolicy[PageNode] | None = None,
        l2_policy: EvictionPolicy[PageNode] | None = None,
        *,
        l3_record_limit: int | None = None,
    ) -> None:
        if l3_record_limit is not None and l3_record_limit < 0:
            raise ValueError("l3_record_limit must not be negative")
        self.root = PageNode(page_hash="", parent=None, depth=-1)
        self._index: dict[str, PageNode] = {}
        #: eviction policies by (component tag, tier); tag 0 is the KV.
        self.policies: dict[tuple[int, Tier], EvictionPolicy[PageNode]] = {
            # ``is None``, not ``or``: a policy with no pages yet has len() 0, so it is falsy.
            (0, Tier.L1): _lru() if l1_policy is None else l1_policy,
            (0, Tier.L2): _lru() if l2_policy is None else l2_policy,
        }
        self._follows_kv: set[int] = set()
        self.l3_record_limit = l3_record_limit
        self._clock = 0
        self._seq = itertools.count(1)
        self._size = 0
        self._in_memory = 0
        self._record: list[tuple[int, int, int, PageNode]] = []
        self._record_queued = 0

    def add_component(
        self,
        tag: int,
        l2_policy: EvictionPolicy[PageNode],
        l1_policy: EvictionPolicy[PageNode] | None,
    ) -> None:
        """Track copies of component ``tag`` (before any is set); ``l1_policy`` None: the
        component follows the KV pages (its L1 copies go with theirs)."""
        if tag == 0 or (tag, Tier.L2) in self.policies:
            raise ValueError(f"component tag {tag} is taken")
        self.policies[(tag, Tier.L2)] = l2_policy
        if l1_policy is None:
            self._follows_kv.add(tag)
        else:
            self.policies[(tag, Tier.L1)] = l1_policy

    def __len__(self) -> int:
        return self._size

    @property
    def in_memory(self) -> int:
        """Nodes with an L1 or L2 copy (of KV or of a component)."""
        return self._in_memory

    @property
    def l3_record(self) -> int:
        """Nodes without an L1 or L2 copy (the L3 record, plus pages in transit)."""
        return self._size - self._in_memory

    def begin_request(self) -> None:
        """A request starts: every pool's policy and the tree's clock tick once."""
        self._clock += 1
        for policy in self.policies.values():
            policy.begin_request()

    # -- structure ------------------------------------------------------------------------

    def match(self, page_hashes: Sequence[str]) -> list[PageNode]:
        """The nodes of the longest known prefix of ``page_hashes`` (any residency)."""
        nodes = []
        index = self._index
        parent = self.root
        for page_hash in page_hashes:
            node = index.get(page_hash)
            if node is None or node.parent is not parent:
                break
            nodes.append(node)
            parent = node
        return nodes

    def insert(self, page_hashes: Sequence[str]) -> list[PageNode]:
        """The nodes of ``page_hashes``, creating the missing ones (with no residency).

        The hashes must be a chain from the first page (``layout.hashing``): a hash already
        known under another parent raises ``ValueError`` (it cannot come from a chain)."""
        nodes = []
        index = self._index
        parent = self.root
        for page_hash in page_hashes:
            node = index.get(page_hash)
            if node is None:
                node = index[page_hash] = PageNode(page_hash, parent, parent.depth + 1)
                node.last_access = self._clock
                parent.children += 1
                if parent.children == 1:
                    self._update_record(parent)  # no longer a leaf of the record
                self._size += 1
            elif node.parent is not parent:
                raise ValueError(f"page {page_hash[:16]} is known after another page")
            nodes.append(node)
            parent = node
        return nodes

    def get(self, page_hash: str) -> PageNode | None:
        """The node of ``page_hash``, if known."""
        return self._index.get(page_hash)

    def touch(self, nodes: Sequence[PageNode]) -> None:
        """The current request used ``nodes`` (path order): every pool holding a copy of one
        is told (``begin_request`` starts the request)."""
        now = self._clock
        for node in nodes:
            node.last_access = now
            if node.device_page is not None:
                self.policies[(0, Tier.L1)].touch(node)
            if node.host_page is not None:
                self.policies[(0, Tier.L2)].touch(node)
            if node.comps is not None:
                for tag, held in node.comps.items():
                    if held.l1 is not None and tag not in self._follows_kv:
                        self.policies[(tag, Tier.L1)].touch(node)
                    if held.l2 is not None:
                        self.policies[(tag, Tier.L2)].touch(node)
            if node.record_seq:
                self._update_record(node, reprioritize=True)

    def nodes(self) -> Iterator[PageNode]:
        """Every node (a snapshot: the tree may change while the caller iterates)."""
        yield from list(self._index.values())

    @staticmethod
    def resident_prefix(nodes: Sequence[PageNode], tier: Tier) -> int:
        """How many leading ``nodes`` have their KV resident in ``tier``."""
        for i, node in enumerate(nodes):
            if not node.resident(tier):
                return i
        return len(nodes)

    def prune(self, node: PageNode) -> None:
        """Remove ``node`` and its now-empty ancestors once they hold no copy anywhere (KV or
        component) and nothing uses them."""
        current: PageNode | None = node
        while current is not None and current.depth >= 0 and self._removable(current):
            parent = current.parent
            assert parent is not None
            del self._index[current.page_hash]
            parent.children -= 1
            if not parent.children:
                self._update_record(parent)  # may now be a record leaf
            if current.record_seq:
                current.record_seq = 0
                self._record_queued -= 1
            current.parent = None
            self._size -= 1
            current = parent

    @staticmethod
    def _removable(node: PageNode) -> bool:
        return (
            not node.children
            and node.device_page is None
            and node.host_page is None
            and not node.in_l3
            and not node.l3_pending
            and node.lock == 0
            and node.host_lock == 0
            and (node.comps is None or all(h.empty for h in node.comps.values()))
        )

    # -- KV residency and locks (each keeps the pools' policies exact) -------------------

    def set_device(self, node: PageNode, page: int | None) -> None:
        """Give ``node``'s KV an L1 copy at ``page``, or drop it (``None``; components that
        follow the KV pages lose their L1 copy with it)."""
        self._set_kv(node, Tier.L1, page)

    def set_host(self, node: PageNode, page: int | None) -> None:
        """Give ``node``'s KV an L2 copy at ``page``, or drop it (``None``)."""
        self._set_kv(node, Tier.L2, page)

    def _set_kv(self, node: PageNode, tier: Tier, page: int | None) -> None:
        was_in_memory = node.in_memory
        had = (node.device_page if tier is Tier.L1 else node.host_page) is not None
        if tier is Tier.L1:
            moved = page != node.device_page
            node.device_page = page
            if moved and node.comps is not None:  # rows at the old page are not at the new
                for tag in self._follows_kv:
                    held = node.comps.get(tag)
                    if held is not None:
                        held.l1 = None
        else:
            node.host_page = page
        now = page is not None
        if had != now:
            policy = self.policies[(0, tier)]
            if now:
                policy.admit(node)
                policy.touch(node)
            else:
                policy.evict(node)
            parent = node.parent
            if parent is not None and parent.depth >= 0:
                if tier is Tier.L1:
                    parent.l1_children += 1 if now else -1
                else:
                    parent.l2_children += 1 if now else -1
                self._update_kv(parent, tier)
            self._update_kv(node, tier)
        self._memory_changed(node, was_in_memory)

    def set_in_l3(self, node: PageNode, known: bool) -> None:
        node.in_l3 = known
        self._update_record(node)

    def set_l3_pending(self, node: PageNode, pending: bool) -> None:
        node.l3_pending = pending
        self._update_record(node)

    def lock(self, node: PageNode) -> None:
        """A request uses ``node``'s L1 copy (or will): not evictable from L1."""
        node.lock += 1
        if node.lock == 1:
            self._update_kv(node, Tier.L1)
            self._update_record(node)

    def unlock(self, node: PageNode) -> None:
        if node.lock <= 0:
            raise RuntimeError(f"{node}: unlock without lock")
        node.lock -= 1
        if node.lock == 0:
            self._update_kv(node, Tier.L1)
            self._update_record(node)

    def hold_host(self, node: PageNode) -> None:
        """A transfer reads or fills ``node``'s L2 copy: not evictable from L2."""
        node.host_lock += 1
        if node.host_lock == 1:
            self._update_kv(node, Tier.L2)
            self._update_record(node)

    def release_host(self, node: PageNode) -> None:
        if node.host_lock <= 0:
            raise RuntimeError(f"{node}: release_host without hold_host")
        node.host_lock -= 1
        if node.host_lock == 0:
            self._update_kv(node, Tier.L2)
            self._update_record(node)

    def _update_kv(self, node: PageNode, tier: Tier) -> None:
        if node.depth >= 0 and node.resident(tier):
            self.policies[(0, tier)].set_evictable(node, self.is_evictable(node, tier))

    def _memory_changed(self, node: PageNode, was_in_memory: bool) -> None:
        in_memory = node.in_memory
        if in_memory != was_in_memory:
            self._in_memory += 1 if in_memory else -1
        self._update_record(node)

    # -- component residency and locks ----------------------------------------------------

    def held(self, node: PageNode, tag: int) -> Held:
        """``node``'s object of component ``tag``, made (empty) if it has none."""
        if (tag, Tier.L2) not in self.policies:
            raise ValueError(f"component tag {tag} was not added to the tree")
        if node.comps is None:
            node.comps = {}
        held = node.comps.get(tag)
        if held is None:
            held = node.comps[tag] = Held()
        return held

    def set_held(self, node: PageNode, tag: int, tier: Tier, value: int | bool | None) -> None:
        """Set where ``node``'s object of component ``tag`` is: ``tier`` L1 / L2 take a slot or
        row (None drops the copy), L3 takes whether a copy is known."""
        held = self.held(node, tag)
        was_in_memory = node.in_memory
        if tier is Tier.L3:
            held.in_l3 = bool(value)
        else:
            slot = None if value is None else int(value)
            old = held.l1 if tier is Tier.L1 else held.l2
            if tier is Tier.L1:
                held.l1 = slot
            else:
                held.l2 = slot
            policy = self.policies.get((tag, tier))
            if policy is not None and (old is None) != (slot is None):
                if slot is not None:
                    policy.admit(node)
                    policy.touch(node)
                else:
                    policy.evict(node)
            self._update_held(node, tag, tier)
        self._memory_changed(node, was_in_memory)

    def set_held_pending(self, node: PageNode, tag: int, pending: bool) -> None:
        self.held(node, tag).l3_pending = pending
        self._update_record(node)

    def lock_held(self, node: PageNode, tag: int) -> None:
        self.held(node, tag).lock += 1
        self._update_held(node, tag, Tier.L1)
        self._update_record(node)

    def unlock_held(self, node: PageNode, tag: int) -> None:
        held = self.held(node, tag)
        if held.lock <= 0:
            raise RuntimeError(f"{node} component {tag}: unlock without lock")
        held.lock -= 1
        self._update_held(node, tag, Tier.L1)
        self._update_record(node)

    def hold_held_host(self, node: PageNode, tag: int) -> None:
        self.held(node, tag).host_lock += 1
        self._update_held(node, tag, Tier.L2)
        self._update_record(node)

    def release_held_host(self, node: PageNode, tag: int) -> None:
        held = self.held(node, tag)
        if held.host_lock <= 0:
            raise RuntimeError(f"{node} component {tag}: release without hold")
        held.host_lock -= 1
        self._update_held(node, tag, Tier.L2)
        self._update_record(node)

    def _update_held(self, node: PageNode, tag: int, tier: Tier) -> None:
        policy = self.policies.get((tag, tier))
        held = node.held(tag)
        if policy is None or held is None:
            return
        if (held.l1 if tier is Tier.L1 else held.l2) is not None:
            policy.set_evictable(node, self.is_evictable(node, tier, tag))

    # -- eviction -------------------------------------------------------------------------

    def is_evictable(self, node: PageNode, tier: Tier, tag: int = 0) -> bool:
        """Whether ``tier`` may give up ``node``'s copy of component ``tag`` now (for L3: forget
        the record node)."""
        if tag:
            held = node.held(tag)
            if held is None:
                return False
            if tier is Tier.L1:
                return held.l1 is not None and held.lock == 0 and tag not in self._follows_kv
            if tier is Tier.L2:
                return held.l2 is not None and held.host_lock == 0
            return False
        if tier is Tier.L1:
            return node.device_page is not None and node.lock == 0 and node.l1_children == 0
        if tier is Tier.L2:
            return node.host_page is not None and node.host_lock == 0 and node.l2_children == 0
        # The record: a leaf known in L3 (KV or a component), with nothing in memory or in use.
        return (
            node.depth >= 0
            and not node.children
            and not node.in_memory
            and not node.busy
            and (
                node.in_l3
                or (node.comps is not None and any(h.in_l3 for h in node.comps.values()))
            )
        )

    def pop_victim(self, tier: Tier, tag: int = 0) -> PageNode | None:
        """The node whose copy of component ``tag`` (0: KV) ``tier`` (L1 or L2) should give up
        next, as its pool's policy decides; None when nothing is evictable. The caller must
        drop that copy (``set_device(node, None)``, ``set_held(node, tag, tier, None)`` ...)
        before asking again."""
        if tier is Tier.L3:
            raise ValueError("the record is trimmed with trim_l3_record")
        return self.policies[(tag, tier)].victim()

    def trim_l3_record(self) -> int:
        """Forget least recently used record leaves until the record fits its bound; returns
        how many pages were forgotten."""
        limit = self.l3_record_limit
        dropped = 0
        heap = self._record
        while limit is not None and self.l3_record > limit and heap:
            _, _, seq, node = heapq.heappop(heap)
            if node.record_seq != seq:
                continue  # stale
            node.record_seq = 0
            self._record_queued -= 1
            node.in_l3 = False
            node.comps = None  # nothing in memory or in use: only L3 knowledge is lost
            self.prune(node)
            dropped += 1
        return dropped

    def _update_record(self, node: PageNode, *, reprioritize: bool = False) -> None:
        if node.depth < 0:
            return
        queued = node.record_seq != 0
        if not self.is_evictable(node, Tier.L3):
            if queued:
                node.record_seq = 0
                self._record_queued -= 1
            return
        if queued and not reprioritize:
            return
        seq = next(self._seq)
        node.record_seq = seq
        if not queued:
            self._record_queued += 1
        heapq.heappush(self._record, (node.last_access, -node.depth, seq, node))
        if len(self._record) > 2 * self._record_queued + _COMPACT_SLACK:
            live = [e for e in self._record if e[3].record_seq == e[2]]
            heapq.heapify(live)
            self._record = live

    # -- checks ---------------------------------------------------------------------------

    def check_prefix_closed(self, tiers: tuple[Tier, ...] = (Tier.L1, Tier.L2)) -> None:
        """Raise ``AssertionError`` if one of ``tiers`` holds a page's KV without its parent's."""
        for node in self.nodes():
            parent = node.parent
            if parent is None or parent.depth < 0:
                continue
            for tier in tiers:
                if node.resident(tier) and not parent.resident(tier):
                    raise AssertionError(f"{node} is in {tier.name} without its parent {parent}")

    def check_queues(self) -> None:
        """Raise ``AssertionError`` unless the counters, the record and each pool's policy say
        what a full scan says (tests: every change went through the tree)."""
        nodes = list(self.nodes())
        assert len(nodes) == self._size, f"{len(nodes)} nodes, size says {self._size}"
        assert sum(n.in_memory for n in nodes) == self._in_memory
        counts: dict[int, list[int]] = {id(n): [0, 0, 0] for n in nodes}
        for node in nodes:
            parent = node.parent
            assert parent is not None
            if parent.depth >= 0:
                c = counts[id(parent)]
                c[0] += 1
                c[1] += node.device_page is not None
                c[2] += node.host_page is not None
        for node in nodes:
            assert [node.children, node.l1_children, node.l2_children] == counts[id(node)], node
            for tag in self._follows_kv:
                held = node.held(tag)
                if held is not None and held.l1 is not None:
                    assert held.l1 == node.device_page, f"{node}: component {tag} off its page"
        record = {id(n) for n in nodes if self.is_evictable(n, Tier.L3)}
        assert {id(n) for n in nodes if n.record_seq} == record, "record out of step"
        assert self._record_queued == len(record)
        for (tag, tier), policy in self.policies.items():
            resident = [n for n in nodes if _copy_in(n, tag, tier)]
            assert len(policy) == len(resident), f"{tag}/{tier.name}: policy holds {len(policy)}"
            victim = policy.victim()
            evictable = [n for n in resident if self.is_evictable(n, tier, tag)]
            assert (victim is None) == (not evictable), f"{tag}/{tier.name}: victim {victim}"
            if victim is not None:
                assert self.is_evictable(victim, tier, tag), f"{tag}/{tier.name}: {victim}"


def _copy_in(node: PageNode, tag: int, tier: Tier) -> bool:
    if tag == 0:
        return node.resident(tier)
    held = node.held(tag)
    return held is not None and (held.l1 if tier is Tier.L1 else held.l2) is not None
