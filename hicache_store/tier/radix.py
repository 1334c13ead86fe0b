"""A radix tree over token pages that records where each page lives (L1, L2, L3), with
incremental eviction.

Pages are identified by their chained page hash (``hicache_store.layout.hashing``): a page's
hash covers every token before it, so it names a whole prefix, and the tree is one dict from
hash to node plus parent links (no per-node child tables). Matching a request is a walk over
its page hashes; each node is one full page.

**One residency record.** A node is only its place in the tree (hash, parent, depth, child
count, last use). What a page holds is one ``Held`` per component (``node.held(tag)``; the
full-attention KV is the component ``KV_TAG``): its L1 copy, its L2 copy, whether L3 holds one,
whether a backup is pending, and the locks on its L1 and L2 copies. Every component's copies
change through one set of mutators (``set_copy``, ``set_pending``, ``lock`` / ``unlock``,
``hold_host`` / ``release_host``), and the tree removes a node itself once it holds no copy
anywhere and nothing uses it (``prune`` remains for nodes ``insert`` made and nobody filled).

What differs between components is a property of their pools, given when they are added
(``add_component``), never a test of the tag:

* *prefix-closed* pools (the KV's): a page's L1 or L2 copy needs its parent's, so eviction
  takes only *evictable leaves* (resident, unlocked, no child resident there) and a cached
  chain loses its tail, never a page in its middle. (``in_l3`` records only what this instance
  *knows*: a page fetched from L3 may have a parent whose L3 copy it never checked, so L3 is not
  checked for closure.) Other components' copies are not prefix-closed (a resume needs only
  some of them; ``match_components`` says which), so any unlocked copy may go;
* a component that *follows* another's pages (a sidecar draft's KV, written at the KV's device
  pages) has no L1 pool of its own: its L1 copy is the leader's page and goes with it.

**Bounded.** The tree holds the pages L1 and L2 hold, pages in use or in transit, and a bounded
*record* of pages only L3 holds (``l3_record_limit`` nodes without an L1/L2 copy). Past the
bound the least recently used record leaves are forgotten (``trim_l3_record``): L3 is probed
again when a request needs them, so forgetting costs at most a probe or a redundant backup.

**Incremental.** Each pool (every component's L1 and L2) has an eviction policy
(``tier.eviction``: it owns the order, the tree tells it which nodes are evictable as that
changes and asks it for ``victim()``), so a victim costs O(log n) and every change O(log n) for
the node and its parent. The record keeps its own heap, least recently used first.

**One eviction order across components.** Every pool orders its copies with the same policy
(``TierConfig.eviction_policy``; one instance per pool), and the tree gives every pool the same
history of each page: one request clock (``begin_request``), and each use of a page touches
every copy it holds, in path order (``touch``). A policy's order is a function of that history
(``lru``: last use, then deeper first; ``arc``: used by one request or again, then last use), so
pools holding copies of the same pages keep and give up the same pages
(``tests/tier/test_components_eviction_order.py``). Pools differ only in what they may give up (a KV pool
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

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .components import KV_TAG, Tier
from .eviction import EvictionPolicy, LRUEviction

__all__ = ["Held", "PageNode", "PageTree", "Tier"]

#: the record's heap is compacted when its stale entries exceed the live ones by this many.
_COMPACT_SLACK = 1024

#: the holds on a copy (``Held`` counters) and the tiers whose copy each keeps from eviction:
#: a request's lock its L1 copy, a transfer's host lock its L2 copy, a hint's pin both.
_HOLDS: dict[str, tuple[Tier, ...]] = {
    "lock": (Tier.L1,),
    "host_lock": (Tier.L2,),
    "pins": (Tier.L1, Tier.L2),
}


@dataclass(eq=False, slots=True)
class Held:
    """One component's copies of one page (the KV's included): ``l1`` its L1 page or slot (for
    a component that follows another's pages: that component's page), ``l2`` its host row,
    ``in_l3`` an L3 copy is known (an acknowledged write or a confirmed read), ``l3_pending``
    an L3 backup of it is queued or in flight, ``lock`` requests using its L1 copy (not
    evictable from L1 while > 0), ``host_lock`` transfers reading or filling its L2 copy (not
    evictable from L2 while > 0), ``pins`` hint pins holding the page (``tier.pins``: neither
    copy evictable while > 0; unlike a lock it keeps no transfer waiting). For a prefix-closed pool, ``l1_children`` / ``l2_children``
    count the page's children whose copy of the same component is in L1 / L2 (leaf tests in
    O(1)), and ``write_ok`` is the outcome of this instance's last L3 write of it (the backup
    worker's: a chain's write waits for its parent's).

    A page's records form a chain (``tag``, ``next``) in the order they were made, so a page
    costs one slotted record per component it holds and no table (a few components at most:
    a lookup walks at most that many links)."""

    tag: int = KV_TAG
    next: Held | None = None
    l1: int | None = None
    l2: int | None = None
    in_l3: bool = False
    l3_pending: bool = False
    lock: int = 0
    host_lock: int = 0
    pins: int = 0
    l1_children: int = 0
    l2_children: int = 0
    write_ok: bool = False

    @property
    def in_memory(self) -> bool:
        return self.l1 is not None or self.l2 is not None

    @property
    def empty(self) -> bool:
        """No copy, none known, none pending and none in use."""
        return not (
            self.in_memory or self.in_l3 or self.l3_pending or self.lock or self.host_lock
            or self.pins
        )

    def resident(self, tier: Tier) -> bool:
        """Whether ``tier`` holds this copy (L3: one is known)."""
        if tier is Tier.L1:
            return self.l1 is not None
        if tier is Tier.L2:
            return self.l2 is not None
        return self.in_l3

    def where(self) -> Tier | None:
        """The closest tier holding this object (L3: one is known), or None."""
        if self.l1 is not None:
            return Tier.L1
        if self.l2 is not None:
            return Tier.L2
        return Tier.L3 if self.in_l3 else None


@dataclass(eq=False, slots=True)
class PageNode:
    """One cached page: its place in the tree. Its copies are ``held(tag)`` (a ``Held`` per
    component it holds anything of, the KV's under ``KV_TAG``; ``records()`` lists them,
    chained from ``first``); change them and the locks only through ``PageTree``'s methods.

    ``children``: how many nodes have this one as parent. ``hits``: how many requests matched
    it (write-through-selective counts these). ``last_access``: the request clock at its last
    use (the record's order). ``record_seq``: its entry in the record's heap (0: none).
    """

    page_hash: str
    parent: PageNode | None
    depth: int
    children: int = 0
    hits: int = 0
    last_access: int = 0
    record_seq: int = 0
    first: Held | None = None

    def held(self, tag: int) -> Held | None:
        """This page's copies of component ``tag``, if it has a record of them."""
        h = self.first
        while h is not None and h.tag != tag:
            h = h.next
        return h

    def records(self) -> Iterator[Held]:
        """This page's records, one per component (each names its ``tag``), in the order
        they were made."""
        h = self.first
        while h is not None:
            yield h
            h = h.next

    def copy(self, tag: int) -> Held:
        """This page's copies of component ``tag``, an empty record if it has none (to read:
        a record made here is not the page's)."""
        held = self.held(tag)
        return Held() if held is None else held

    def resident(self, tier: Tier, tag: int) -> bool:
        """Whether ``tier`` holds this page's copy of component ``tag`` (L3: one is known)."""
        held = self.held(tag)
        return held is not None and held.resident(tier)

    @property
    def in_memory(self) -> bool:
        """Some copy of this page (of any component) is in L1 or L2."""
        h = self.first
        while h is not None:
            if h.l1 is not None or h.l2 is not None:
                return True
            h = h.next
        return False

    @property
    def busy(self) -> bool:
        """Something uses or writes this page's copies now (locks, pending backups)."""
        h = self.first
        while h is not None:
            if h.lock or h.host_lock or h.l3_pending:
                return True
            h = h.next
        return False

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
        where = {
            h.tag: "".join(f"{t.name}" for t in Tier if h.resident(t)) for h in self.records()
        }
        return f"PageNode({self.page_hash[:8]}.., depth={self.depth}, copies={where})"


@dataclass(slots=True)
class _Pool:
    """One component's pools as the tree sees them: their eviction policies (``l1`` None: its
    L1 copies live in the pages of component ``follows`` and go with them), whether they are
    prefix-closed, and the components that follow its L1 pages."""

    l1: EvictionPolicy[PageNode] | None
    l2: EvictionPolicy[PageNode]
    prefix_closed: bool
    follows: int | None = None
    followers: tuple[int, ...] = ()


def _lru() -> EvictionPolicy[PageNode]:
    return LRUEviction(lambda node: node.depth)


class PageTree:
    """The page radix tree. See the module docstring for its invariants and costs.

    Built with the KV's pools (``KV_TAG``, prefix-closed): ``l1_policy`` / ``l2_policy`` their
    eviction policies (LRU by default; ``tier.eviction.make_eviction_policy``); every other
    component's pools are added with ``add_component``. ``l3_record_limit``: how many nodes
    without an L1/L2 copy the tree keeps (None: unbounded).
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
        self._pools: dict[int, _Pool] = {}
        self.l3_record_limit = l3_record_limit
        self._clock = 0
        self._seq = itertools.count(1)
        self._size = 0
        self._in_memory = 0
        self._record: list[tuple[int, int, int, PageNode]] = []
        self._record_queued = 0
        #: called as ``observer(node, tag, tier, present)`` when a copy in L2 or L3 appears
        #: or goes (``set_copy``); L1 changes are not reported. None: nobody listens.
        self.observer: Callable[[PageNode, int, Tier, bool], None] | None = None
        # ``is None``, not ``or``: a policy with no pages yet has len() 0, so it is falsy.
        self.add_component(
            KV_TAG,
            _lru() if l2_policy is None else l2_policy,
            _lru() if l1_policy is None else l1_policy,
            prefix_closed=True,
        )

    def add_component(
        self,
        tag: int,
        l2_policy: EvictionPolicy[PageNode],
        l1_policy: EvictionPolicy[PageNode] | None,
        *,
        prefix_closed: bool = False,
        follows: int = KV_TAG,
    ) -> None:
        """Track copies of component ``tag`` (before any is set). ``l1_policy`` None: its L1
        copies live in component ``follows``'s pages and go with them. ``prefix_closed``: its
        L1 and L2 copies of a page need its parent's (eviction takes leaves only)."""
        if tag in self._pools:
            raise ValueError(f"component tag {tag} is taken")
        if l1_policy is None:
            leader = self._pools.get(follows)
            if leader is None or leader.l1 is None:
                raise ValueError(f"component {tag} cannot follow the pages of {follows}")
            leader.followers = (*leader.followers, tag)
        self._pools[tag] = _Pool(
            l1_policy, l2_policy, prefix_closed, None if l1_policy is not None else follows
        )

    @property
    def policies(self) -> dict[tuple[int, Tier], EvictionPolicy[PageNode]]:
        """Every pool's eviction policy, by (component tag, tier)."""
        out: dict[tuple[int, Tier], EvictionPolicy[PageNode]] = {}
        for tag, pool in self._pools.items():
            if pool.l1 is not None:
                out[(tag, Tier.L1)] = pool.l1
            out[(tag, Tier.L2)] = pool.l2
        return out

    def prefix_closed(self, tag: int) -> bool:
        """Whether component ``tag``'s L1 and L2 copies are prefix-closed."""
        return self._pools[tag].prefix_closed

    def __len__(self) -> int:
        return self._size

    @property
    def in_memory(self) -> int:
        """Nodes with an L1 or L2 copy (of any component)."""
        return self._in_memory

    @property
    def l3_record(self) -> int:
        """Nodes without an L1 or L2 copy (the L3 record, plus pages in transit)."""
        return self._size - self._in_memory

    def begin_request(self) -> None:
        """A request starts: every pool's policy and the tree's clock tick once."""
        self._clock += 1
        for pool in self._pools.values():
            if pool.l1 is not None:
                pool.l1.begin_request()
            pool.l2.begin_request()

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
        """The nodes of ``page_hashes``, creating the missing ones (with no copies: the caller
        gives them one, or ``prune``s them).

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
        pools = self._pools
        for node in nodes:
            node.last_access = now
            held = node.first
            while held is not None:
                pool = pools[held.tag]
                if held.l1 is not None and pool.l1 is not None:
                    pool.l1.touch(node)
                if held.l2 is not None:
                    pool.l2.touch(node)
                held = held.next
            if node.record_seq:
                self._update_record(node, reprioritize=True)

    def nodes(self) -> Iterator[PageNode]:
        """Every node (a snapshot: the tree may change while the caller iterates)."""
        yield from list(self._index.values())

    @staticmethod
    def resident_prefix(nodes: Sequence[PageNode], tier: Tier, tag: int) -> int:
        """How many leading ``nodes`` have their copy of component ``tag`` in ``tier``."""
        for i, node in enumerate(nodes):
            if not node.resident(tier, tag):
                return i
        return len(nodes)

    def prune(self, node: PageNode) -> None:
        """Remove ``node`` and its ancestors while they hold no copy anywhere and nothing uses
        them. Every mutator below does this itself; this is for nodes ``insert`` made that
        were given no copy (a no-op on a node no longer in the tree)."""
        current: PageNode | None = node
        while current is not None and self._removable(current):
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
        if node.children or node.depth < 0 or node.parent is None:
            return False
        h = node.first
        while h is not None:
            if not h.empty:
                return False
            h = h.next
        return True

    # -- residency and locks: one set for every component (each keeps the pools exact) ----

    def held(self, node: PageNode, tag: int) -> Held:
        """``node``'s copies of component ``tag``, their record made (empty) if it has none."""
        held = node.held(tag)
        if held is not None:
            return held
        if tag not in self._pools:
            raise ValueError(f"component tag {tag} was not added to the tree")
        held = Held(tag)
        last = node.first
        if last is None:
            node.first = held
        else:
            while last.next is not None:
                last = last.next
            last.next = held
        return held

    def set_copy(
        self, node: PageNode, tag: int, tier: Tier, value: int | bool | None, *,
        report: bool = True,
    ) -> None:
        """Set where ``node``'s copy of component ``tag`` is: ``tier`` L1 / L2 take a page,
        slot or row (None drops the copy; an L1 copy that moves or goes takes the L1 copies of
        the components following its pages with it), L3 takes whether a copy is known.
        ``report=False``: the ``observer`` is not told (a copy admitted only to be ranked,
        whose appearance the caller reports with ``report`` once it stays)."""
        held = self.held(node, tag)
        was_in_memory = node.in_memory
        observer = self.observer if report else None
        if tier is Tier.L3:
            if observer is not None and held.in_l3 != bool(value):
                observer(node, tag, tier, bool(value))
            held.in_l3 = bool(value)
        else:
            pool = self._pools[tag]
            slot = None if value is None else int(value)
            if tier is Tier.L1:
                old = held.l1
                held.l1 = slot
                if slot != old and pool.followers:
                    for follower in pool.followers:  # rows at the old page are not at the new
                        other = node.held(follower)
                        if other is not None:
                            other.l1 = None
                policy = pool.l1
            else:
                old = held.l2
                held.l2 = slot
                policy = pool.l2
            if (old is None) != (slot is None):
                if observer is not None and tier is Tier.L2:
                    observer(node, tag, tier, slot is not None)
                if policy is not None:
                    if slot is not None:
                        policy.admit(node)
                        policy.touch(node)
                    else:
                        policy.evict(node)
                parent = node.parent
                if pool.prefix_closed and parent is not None and parent.depth >= 0:
                    above = self.held(parent, tag)
                    step = 1 if slot is not None else -1
                    if tier is Tier.L1:
                        above.l1_children += step
                    else:
                        above.l2_children += step
                    self._update(parent, tag, tier)
            self._update(node, tag, tier)
        in_memory = node.in_memory
        if in_memory != was_in_memory:
            self._in_memory += 1 if in_memory else -1
        self._changed(node)

    def report(self, node: PageNode, tag: int, tier: Tier) -> None:
        """Tell the ``observer`` that ``node``'s copy of ``tag`` in ``tier`` appeared (one set
        with ``report=False``)."""
        if self.observer is not None:
            self.observer(node, tag, tier, True)

    def set_pending(self, node: PageNode, tag: int, pending: bool) -> None:
        """Whether an L3 backup of ``node``'s copy of component ``tag`` is queued or running."""
        self.held(node, tag).l3_pending = pending
        self._changed(node)

    def lock(self, node: PageNode, tag: int) -> None:
        """A request uses ``node``'s L1 copy of component ``tag`` (or will): not evictable."""
        self._hold(node, tag, "lock")

    def unlock(self, node: PageNode, tag: int) -> None:
        self._release(node, tag, "lock", "unlock without lock")

    def pin(self, node: PageNode, tag: int) -> None:
        """A hint pins ``node``'s copies of component ``tag``: whatever L1 or L2 copy it has or
        gets stays until ``unpin`` (the tier bounds how many pages are pinned, ``tier.pins``)."""
        self._hold(node, tag, "pins")

    def unpin(self, node: PageNode, tag: int) -> None:
        self._release(node, tag, "pins", "unpin without pin")

    def hold_host(self, node: PageNode, tag: int) -> None:
        """A transfer reads or fills ``node``'s L2 copy of component ``tag``: not evictable."""
        self._hold(node, tag, "host_lock")

    def release_host(self, node: PageNode, tag: int) -> None:
        self._release(node, tag, "host_lock", "release_host without hold_host")

    def _hold(self, node: PageNode, tag: int, counter: str) -> None:
        """Count one more ``counter`` hold (a ``_HOLDS`` key) on ``node``'s copy of ``tag``;
        the first one takes the copies of its tiers off their evictable sets."""
        held = self.held(node, tag)
        count: int = getattr(held, counter) + 1
        setattr(held, counter, count)
        if count == 1:
            for tier in _HOLDS[counter]:
                self._update(node, tag, tier)
            self._update_record(node)

    def _release(self, node: PageNode, tag: int, counter: str, unmatched: str) -> None:
        """Count one ``counter`` hold less; ``RuntimeError`` (``unmatched``) when there is none.
        The last one lets the copies of its tiers go again (and the node, if it holds none)."""
        held = self.held(node, tag)
        count: int = getattr(held, counter)
        if count <= 0:
            raise RuntimeError(f"{node} component {tag}: {unmatched}")
        setattr(held, counter, count - 1)
        if count == 1:
            for tier in _HOLDS[counter]:
                self._update(node, tag, tier)
            self._changed(node)

    def _update(self, node: PageNode, tag: int, tier: Tier) -> None:
        """Tell ``tag``'s ``tier`` policy whether ``node``'s copy there may go now (the test of
        ``is_evictable``, inlined: this runs for every change)."""
        if node.depth < 0:
            return
        held = node.held(tag)
        if held is None:
            return
        pool = self._pools[tag]
        if tier is Tier.L1:
            if pool.l1 is not None and held.l1 is not None:
                pool.l1.set_evictable(
                    node,
                    held.lock == 0
                    and held.pins == 0
                    and not (pool.prefix_closed and held.l1_children),
                )
        elif held.l2 is not None:
            pool.l2.set_evictable(
                node,
                held.host_lock == 0
                and held.pins == 0
                and not (pool.prefix_closed and held.l2_children),
            )

    def _changed(self, node: PageNode) -> None:
        """After a change to ``node``'s copies or locks: requeue it in the record, and remove
        it (and its ancestors) once it holds nothing and nothing uses it."""
        self._update_record(node)
        if self._removable(node):
            self.prune(node)

    # -- eviction -------------------------------------------------------------------------

    def is_evictable(self, node: PageNode, tier: Tier, tag: int) -> bool:
        """Whether ``tier`` (L1 or L2) may give up ``node``'s copy of component ``tag`` now: it
        is there, unlocked and unpinned, its L1 copy is its own (not in another component's page), and
        for a prefix-closed pool no child has one there."""
        held = node.held(tag)
        if held is None:
            return False
        pool = self._pools[tag]
        if tier is Tier.L1:
            return (
                held.l1 is not None
                and held.lock == 0
                and held.pins == 0
                and pool.l1 is not None
                and not (pool.prefix_closed and held.l1_children)
            )
        if tier is Tier.L2:
            return (
                held.l2 is not None
                and held.host_lock == 0
                and held.pins == 0
                and not (pool.prefix_closed and held.l2_children)
            )
        raise ValueError("the record is tested with record_leaf")

    @staticmethod
    def record_leaf(node: PageNode) -> bool:
        """Whether the record may forget ``node``: a leaf known in L3 (for some component),
        with nothing in memory or in use."""
        if node.children or node.depth < 0:
            return False
        known = False
        h = node.first
        while h is not None:
            if (
                h.l1 is not None or h.l2 is not None or h.lock or h.host_lock or h.l3_pending
                or h.pins
            ):
                return False
            known = known or h.in_l3
            h = h.next
        return known

    def pop_victim(self, tier: Tier, tag: int) -> PageNode | None:
        """The node whose copy of component ``tag`` ``tier`` (L1 or L2) should give up next, as
        its pool's policy decides; None when nothing is evictable. The caller must drop that
        copy (``set_copy(node, tag, tier, None)``) before asking again."""
        if tier is Tier.L3:
            raise ValueError("the record is trimmed with trim_l3_record")
        policy = self.policy(tier, tag)
        return None if policy is None else policy.victim()

    def policy(self, tier: Tier, tag: int) -> EvictionPolicy[PageNode] | None:
        """The eviction policy of component ``tag``'s pool at ``tier`` (L1 or L2; None: the
        component has no L1 pool of its own)."""
        pool = self._pools[tag]
        return pool.l1 if tier is Tier.L1 else pool.l2

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
            node.first = None  # nothing in memory or in use: only L3 knowledge is lost
            self.prune(node)
            dropped += 1
        return dropped

    def _update_record(self, node: PageNode, *, reprioritize: bool = False) -> None:
        if node.depth < 0:
            return
        queued = node.record_seq != 0
        if not self.record_leaf(node):
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
        """Raise ``AssertionError`` if one of ``tiers`` holds a page's copy of a prefix-closed
        component without its parent's."""
        closed = [tag for tag, pool in self._pools.items() if pool.prefix_closed]
        for node in self.nodes():
            parent = node.parent
            if parent is None or parent.depth < 0:
                continue
            for tag in closed:
                for tier in tiers:
                    if node.resident(tier, tag) and not parent.resident(tier, tag):
                        raise AssertionError(
                            f"{node} is in {tier.name} without its parent {parent}"
                        )

    def check_queues(self) -> None:
        """Raise ``AssertionError`` unless the counters, the record and each pool's policy say
        what a full scan says (tests: every change went through the tree)."""
        nodes = list(self.nodes())
        assert len(nodes) == self._size, f"{len(nodes)} nodes, size says {self._size}"
        assert sum(n.in_memory for n in nodes) == self._in_memory
        children: dict[int, int] = {id(n): 0 for n in nodes}
        resident: dict[tuple[int, int], list[int]] = {}
        for node in nodes:
            parent = node.parent
            assert parent is not None
            if parent.depth < 0:
                continue
            children[id(parent)] += 1
            for copy in node.records():
                if self._pools[copy.tag].prefix_closed:
                    c = resident.setdefault((id(parent), copy.tag), [0, 0])
                    c[0] += copy.l1 is not None
                    c[1] += copy.l2 is not None
        for node in nodes:
            assert node.children == children[id(node)], node
            for tag, pool in self._pools.items():
                held = node.held(tag)
                if pool.prefix_closed:
                    counts = [0, 0] if held is None else [held.l1_children, held.l2_children]
                    assert counts == resident.get((id(node), tag), [0, 0]), (node, tag)
                if pool.follows is not None and held is not None and held.l1 is not None:
                    leader = node.held(pool.follows)
                    assert leader is not None, f"{node}: component {tag} follows nothing"
                    assert held.l1 == leader.l1, f"{node}: component {tag} off its page"
        record = {id(n) for n in nodes if self.record_leaf(n)}
        assert {id(n) for n in nodes if n.record_seq} == record, "record out of step"
        assert self._record_queued == len(record)
        for (tag, tier), policy in self.policies.items():
            holding = [n for n in nodes if n.resident(tier, tag)]
            assert len(policy) == len(holding), f"{tag}/{tier.name}: policy holds {len(policy)}"
            victim = policy.victim()
            evictable = [n for n in holding if self.is_evictable(n, tier, tag)]
            assert (victim is None) == (not evictable), f"{tag}/{tier.name}: victim {victim}"
            if victim is not None:
                assert self.is_evictable(victim, tier, tag), f"{tag}/{tier.name}: {victim}"


def branch_points(nodes: Sequence[PageNode]) -> tuple[int, ...]:
    """Page counts at which a request's known path ``nodes`` branches: after each node with
    a child off the path (other requests went on from there), and the path's end.

    A request that computes past one takes a checkpoint there, so requests sharing the prefix
    up to it can resume. Every node with a child off the path counts, not only the path's end:
    a component object (a window page, a later checkpoint) keeps a node in the tree after its
    KV and its checkpoint were evicted, so the end of the known path can lie past the point
    where the requests sharing a prefix (a system prompt) part; taking the checkpoint only
    there, a shared prefix whose checkpoint was evicted would never get one again.
    """
    ends = [i + 1 for i, node in enumerate(nodes[:-1]) if node.children > 1]
    if nodes:
        ends.append(len(nodes))
    return tuple(ends)


def parent_hash(node: PageNode) -> str | None:
    """The page hash of ``node``'s parent; None for a first page (its parent is the root)."""
    parent = node.parent
    return parent.page_hash if parent is not None and parent.depth >= 0 else None


def l1_of(node: PageNode, tag: int) -> int | None:
    """``node``'s L1 page or slot of component ``tag``, if any."""
    held = node.held(tag)
    return None if held is None else held.l1


def l2_of(node: PageNode, tag: int) -> int | None:
    """``node``'s host row of component ``tag``, if any."""
    held = node.held(tag)
    return None if held is None else held.l2
