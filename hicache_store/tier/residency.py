"""The tier's residency primitives: where every copy of every component lives, and the few
operations that change it, written once for the KV and every component.

One ``Residency`` per tier, on the engine's thread. It owns nothing of the request protocol
(``tier.cache``) and decides no prefix; the protocol and each collaborator (``tier.prefetch``,
``tier.restore``, ``tier.hinting``) are built with it. Its state: the page tree (``tier.radix``:
one ``Held`` per page and component), each component's ``Pools`` by tag, the metrics, and the
L2 -> L3 backup queue (``tier.transfers``). The primitives, by tier:

L1 (device pages or slots)
    ``make_room(part, n)``: evict ``part``'s L1 victims until ``n`` are free
    (``TierCapacityError`` when the rest is locked); ``alloc(part)``: one free slot, evicting
    if needed; ``evict(node, part)``: give up one L1 copy (write-back backs it up first).
L2 (host rows)
    ``alloc_rows(part, n)``: ``n`` rows, evicting L2 victims in ``cache`` mode;
    ``drop(node, part)``: give up one L2 copy unless a transfer holds it.
L3 (a backend, through each component's ``L3Link``)
    ``backup(node, part)``: copy what the tiers below lack (L1 -> L2 -> L3; for a
    prefix-closed pool the chain up to ``node``, ancestors first), admitting new L2 copies as
    the policy ranks them (below); ``apply_backup(done)``: apply a finished backup, returning
    the ``BackupEvent`` to report.
A request's KV pages
    ``hold(req, nodes)`` / ``release(req, nodes)``: lock the pages a request uses (and the L2
    copies it must load) until it completes.

**L2 admission.** A request's new pages take L2 rows by evicting the L2 policy's victims. The
tail of them L2 may do without (no L3 write needs their L2 copy: L3 has them, or the component
writes none) is admitted into the policy first and room is made after, so the policy may give
up the new pages themselves: the order the block-level simulator measures (it admits, then
evicts), so every policy hits in the tier exactly what the simulator reports
(``tests/bench/test_trace_format_weka.py``).

Past a request's KV page holds, what is special about the KV is two properties of its pools
(``Pools.prefix_closed``, ``Pools.ordered``), never a test of its tag.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_store.objects import L3Link

from .components import KV, Tier
from .config import TierConfig
from .metrics import TierMetrics
from .pools import Pools
from .radix import Held, PageNode, PageTree, l1_of, l2_of, parent_hash
from .request import Request, TierCapacityError
from .transfers import BackupDone, BackupEvent, BackupItem, Transfers

#: the L2 "row" of a copy admitted into its pool's policy before it has a row
#: (``Residency._admit_first``; never outside that call).
_UNPLACED = -1


class Residency:
    """The residency primitives of one tier (module docstring). ``parts``: each component's
    pools by tag (the tier adds components to this mapping as it plugs them in)."""

    def __init__(
        self,
        tree: PageTree,
        parts: dict[int, Pools],
        config: TierConfig,
        metrics: TierMetrics,
        transfers: Transfers,
    ) -> None:
        self.tree = tree
        self.parts = parts
        self.config = config
        self.metrics = metrics
        self.transfers = transfers
        #: backups of ordered pools (the KV's) queued and not yet applied
        self.ordered_in_flight = 0

    # == a request's KV pages ================================================================

    def hold(self, req: Request, nodes: Sequence[PageNode]) -> None:
        """Lock ``nodes`` for ``req``: their L1 copy, and their L2 copy when it must be loaded."""
        for node in nodes:
            self.tree.lock(node, KV.tag)
            node.hits += 1
            if l1_of(node, KV.tag) is None:
                self.tree.hold_host(node, KV.tag)
                req.host_locked.append(node)
        req.nodes.extend(nodes)

    def release(self, req: Request, nodes: Sequence[PageNode]) -> None:
        """Unlock ``nodes`` of ``req`` (and the L2 copies it held of them)."""
        released = set(map(id, nodes))
        for node in nodes:
            self.tree.unlock(node, KV.tag)
        for node in [n for n in req.host_locked if id(n) in released]:
            self.tree.release_host(node, KV.tag)
        req.host_locked = [n for n in req.host_locked if id(n) not in released]

    # == copies of every component ===========================================================

    def make_room(self, part: Pools, needed: int) -> None:
        """Evict ``part``'s L1 copies (its policy's victims) until ``needed`` pages or slots
        are free; ``TierCapacityError`` when every other copy is locked."""
        slots = part.slots
        assert slots is not None
        if slots.num_free_pages >= needed:
            return
        while (node := self.tree.pop_victim(Tier.L1, part.tag)) is not None:
            self.evict(node, part)
            if slots.num_free_pages >= needed:
                return
        raise TierCapacityError(
            f"{part.name}: L1 holds {slots.num_free_pages} free pages after eviction; the "
            f"request needs {needed}: give the device pool more pages than the longest request"
        )

    def alloc(self, part: Pools, *, required: bool = True) -> int | None:
        """A free L1 slot of ``part`` (evicting if needed); None when every copy is locked and
        the slot is not ``required``."""
        assert part.slots is not None
        try:
            self.make_room(part, 1)
        except TierCapacityError:
            if required:
                raise
            return None
        return part.slots.alloc(1)[0]

    def evict(self, node: PageNode, part: Pools) -> None:
        """Give up ``node``'s L1 copy of ``part`` (and of the components following its pages).
        Write-back backs it up first: a copy that L2 lacks, or that L3 lacks where this rank
        writes (an L2 copy alone is not a backup: its L3 write may have failed or been dropped,
        and L2 would then evict the only copy); a chain only from the copy that needs it."""
        held = node.held(part.tag)
        assert held is not None
        assert held.l1 is not None
        assert part.slots is not None
        if self.config.write_policy == "write_back" and self.config.l2_pages:
            dirty = part.writes and not (held.in_l3 or held.l3_pending)
            if not part.prefix_closed or held.l2 is None or dirty:
                self.backup(node, part)
            for other in node.records():
                if other.l1 is not None and self.parts[other.tag].follows == part.tag:
                    self.backup(node, self.parts[other.tag])  # it loses its L1 copy with the page
        part.slots.free([held.l1])
        self.tree.set_copy(node, part.tag, Tier.L1, None)
        self.metrics.count(part.name, "evictions_l1")

    def alloc_rows(self, part: Pools, count: int) -> list[int] | None:
        """``count`` host rows of ``part`` (in ``cache`` mode evicting its L2 victims)."""
        rows = part.host.alloc(count)
        if rows is not None or self.config.host_mode == "buffer_only":
            return rows
        self._free_rows(part, count)
        return part.host.alloc(count)

    def _free_rows(self, part: Pools, count: int) -> None:
        """Evict ``part``'s L2 victims until ``count`` rows are free, or none is left."""
        while part.host.free_pages < count:
            node = self.tree.pop_victim(Tier.L2, part.tag)
            if node is None:
                return
            self.drop(node, part)
            self.metrics.count(part.name, "evictions_l2")

    def _admit_rows(self, part: Pools, missing: list[PageNode]) -> int:
        """Give L2 rows to ``missing`` (a chain's pages L2 lacks, in chain order) as far as
        L2 takes them, making room in ``cache`` mode; returns how many of its first pages now
        have a row (their copies set; the caller fills the rows).

        The tail of pages L2 may do without (no L3 write needs their L2 copy: this component
        writes none, or L3 has them) is admitted into the policy first and only then is room
        made, so the policy ranks them with what L2 holds and may give them up at once
        (refused, counted ``l2_admissions_refused``): the order of the block-level simulator,
        which admits a request's pages and then evicts (``trace_sim.simulate``). The pages
        before that tail (an L3 write needs them) get their rows first, as before: an L2
        eviction costs a prefetch later, a refused page would cost a miss."""
        tag = part.tag
        rows = part.host.alloc(len(missing))
        if rows is None and self.config.host_mode == "cache":
            optional = 0
            for node in reversed(missing):
                held = node.held(tag)
                if part.writes and (held is None or not held.in_l3):
                    break
                optional += 1
            required = len(missing) - optional
            self._free_rows(part, required)
            if optional and part.host.free_pages >= required:
                return self._admit_first(part, missing, required)
            self._free_rows(part, len(missing))
            rows = part.host.alloc(len(missing))
        if rows is None:  # L2 cannot take them all: keep as long a prefix as fits
            fit = part.host.free_pages
            self.metrics.count(part.name, "backups_dropped", len(missing) - fit)
            rows = part.host.alloc(fit)
        assert rows is not None
        for node, row in zip(missing, rows, strict=False):
            self.tree.set_copy(node, tag, Tier.L2, row)
        return len(rows)

    def _admit_first(self, part: Pools, missing: list[PageNode], required: int) -> int:
        """``_admit_rows`` for a tail L2 may do without, past the ``required`` first pages
        (for which room was made): rows for those, the tail admitted as copies without a row
        (``_UNPLACED``, not reported to the tree's observer), then the policy's victims
        evicted until the tail that stays has rows (a victim in the tail is refused)."""
        tag, tree = part.tag, self.tree
        head, tail = missing[:required], missing[required:]
        rows = part.host.alloc(required)
        assert rows is not None
        for node, row in zip(head, rows, strict=True):
            tree.set_copy(node, tag, Tier.L2, row)
            tree.hold_host(node, tag)  # its row is not filled yet: not evictable meanwhile
        for node in tail:
            tree.set_copy(node, tag, Tier.L2, _UNPLACED, report=False)
        unplaced = {id(n) for n in tail}
        kept = len(tail)
        while part.host.free_pages < kept:
            victim = tree.pop_victim(Tier.L2, tag)
            if victim is not None and id(victim) not in unplaced:
                self.drop(victim, part)
                self.metrics.count(part.name, "evictions_l2")
                continue
            kept -= 1
            assert victim is None or victim is tail[kept]  # a leaf of the tail: its last page
            tree.set_copy(tail[kept], tag, Tier.L2, None, report=False)
            if victim is None:  # every other copy is held: no room for it
                self.metrics.count(part.name, "backups_dropped")
            else:
                self.metrics.note("l2_admissions_refused")
        rows = part.host.alloc(kept)
        assert rows is not None
        for node, row in zip(tail, rows, strict=False):
            tree.set_copy(node, tag, Tier.L2, row)
            tree.report(node, tag, Tier.L2)
        for node in head:
            tree.release_host(node, tag)
        return required + kept

    def drop(self, node: PageNode, part: Pools) -> None:
        """Give up ``node``'s L2 copy of ``part`` unless a transfer holds it."""
        held = node.held(part.tag)
        if held is None or held.l2 is None or held.host_lock:
            return
        part.host.free([held.l2])
        self.tree.set_copy(node, part.tag, Tier.L2, None)

    def backup(self, node: PageNode, part: Pools) -> None:
        """Copy ``node``'s object of ``part`` to the tiers below that miss it: L1 -> L2 if L2
        has none, then L2 -> L3 if L3 has none (only what is missing moves). For a
        prefix-closed pool the unit is the chain up to ``node``: ancestors first (L2 stays
        prefix-closed), as long a prefix as L2 can take (the rest counted), none past a hole."""
        if not part.host.num_pages:
            return
        tag, buffer_only = part.tag, self.config.host_mode == "buffer_only"
        chain = node.path() if part.prefix_closed else [node]
        missing: list[PageNode] = []
        for n in chain:
            held = n.held(tag)
            if held is None or not held.in_memory:
                return  # a hole: the chain cannot be backed up as a prefix
            # In buffer-only mode L2 is only a staging area on the way to L3.
            if held.l2 is None and not (buffer_only and (held.in_l3 or held.l3_pending)):
                missing.append(n)
        if missing:
            # Pin the chain's existing L2 copies: evicting one to make room would leave a hole.
            pinned = [n for n in chain if l2_of(n, tag) is not None]
            for n in pinned:
                self.tree.hold_host(n, tag)
            try:
                placed = self._admit_rows(part, missing)
            finally:
                for n in pinned:
                    self.tree.release_host(n, tag)
            if not placed:
                return
            del missing[placed:]
            part.pack([l1_of(n, tag) for n in missing], [l2_of(n, tag) for n in missing])  # type: ignore[misc]
            self.metrics.count(part.name, "backups_l2", len(missing))
            self.metrics.count(part.name, "bytes_l1_to_l2", len(missing) * part.layout.page_bytes)
        self._queue_l3(chain, part)

    def _queue_l3(self, chain: Sequence[PageNode], part: Pools) -> None:
        """Queue L3 backups of ``chain``'s L2 copies of ``part`` that L3 lacks (up to the first
        without an L2 copy, as many as the queue has room for); in ``buffer_only`` mode the
        L2 copies not queued are dropped."""
        tag, buffer_only = part.tag, self.config.host_mode == "buffer_only"
        if not part.writes:
            if buffer_only:
                for node in chain:
                    self.drop(node, part)
            return
        todo: list[tuple[PageNode, Held]] = []
        for node in chain:
            held = node.held(tag)
            assert held is not None
            if held.in_l3 or held.l3_pending:
                continue
            if held.l2 is None:
                break
            todo.append((node, held))
        room = max(0, self.config.max_queued_backup_pages - self.transfers.in_flight)
        if len(todo) > room:  # the queue is full: the tail waits for a later backup
            self.metrics.count(part.name, "backups_dropped", len(todo) - room)
            del todo[room:]
        if buffer_only:
            queued = {id(n) for n, _ in todo}
            for node in chain:
                if id(node) not in queued:
                    self.drop(node, part)
        if not todo:
            return
        items = []
        for node, held in todo:
            self.tree.set_pending(node, tag, True)
            self.tree.hold_host(node, tag)
            row = part.host.row(held.l2)  # type: ignore[arg-type]
            items.append(BackupItem(node, tag, held, row, parent_hash(node), part.prefix_closed))
        if part.ordered:
            self.ordered_in_flight += len(todo)
        self.transfers.queue_backups(items, self.links())

    def apply_backup(self, done: BackupDone) -> BackupEvent:
        """Apply a finished L3 backup (``poll``): the row it read is released, L3 holds the
        copy if it was stored; returns the event to report."""
        self.transfers.in_flight -= 1
        node, tag, ok = done.node, done.tag, done.ok
        part = self.parts[tag]
        if ok:
            self.metrics.bytes_l2_to_l3 += done.io.bytes_moved
        if part.ordered:
            self.ordered_in_flight -= 1
        self.tree.release_host(node, tag)
        if ok:
            self.tree.set_copy(node, tag, Tier.L3, True)
        self.metrics.count(part.name, "backups_l3" if ok else "backups_l3_failed")
        self.tree.set_pending(node, tag, False)
        if self.config.host_mode == "buffer_only":
            self.drop(node, part)
        return BackupEvent(node.page_hash, part.name, ok)

    def links(self) -> dict[int, L3Link]:
        """Every component's L3 link, by tag."""
        return {tag: part.link for tag, part in self.parts.items() if part.link is not None}

