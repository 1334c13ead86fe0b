"""Component objects on the request path: restoring the objects a resume needs into L1,
choosing the slots the engine fills with new ones, and keeping them on their pages.

One ``Restorer`` per tier, built with its residency (``tier.residency``); the request protocol
(``tier.cache``) calls ``restore`` and ``produce`` from ``prepare``, ``keep_produced`` and
``release`` from ``complete``, ``release`` from ``abort``. A component that follows the KV
pages (a sidecar draft) has no slots of its own: it restores into, and writes at, the
request's KV pages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .components import Component, HitRule, Tier
from .pools import Pools
from .radix import PageNode, l1_of
from .request import Request
from .residency import Residency


class Restorer:
    """The component objects of one tier's requests over ``residency``; ``components`` by name
    (their checkpoint intervals), pages of ``page_size`` tokens."""

    def __init__(
        self, residency: Residency, components: Mapping[str, Component], page_size: int
    ) -> None:
        self.residency = residency
        self.components = components
        self.page_size = page_size

    def restore(
        self, req: Request, release_plan: Callable[[Request], None]
    ) -> dict[int, tuple[tuple[int, int], ...]]:
        """Bring the component objects the resume at ``req.prefix_pages`` needs into L1 and
        lock them; per component tag, their (page index, slot). Then ``release_plan(req)``
        (the prefetch plan's holds on L2 copies: ``Prefetcher.unpin``), whatever happened.

        Every object the resume needs is locked in L1 and its L2 copy held *before* any slot
        is taken: making room for one object (evicting an L1 copy, which write-back first
        backs up to L2, which may evict an L2 copy) must not evict another object of the same
        resume (it would be restored again, or, without an L2 copy, be lost)."""
        res, tree = self.residency, self.residency.tree
        needed = [
            (res.parts[tag], i, req.nodes[i])
            for tag in req.need
            for i in res.parts[tag].spec.pages_needed(req.prefix_pages, self.page_size)
        ]
        held_host: list[tuple[PageNode, int]] = []
        for part, i, node in needed:
            held = node.held(part.tag)
            assert held is not None, f"{part.name}: page {i} has no object to restore"
            assert held.in_memory, f"{part.name}: page {i}'s object is not in L1 or L2"
            tree.lock(node, part.tag)
            req.held.append((node, part.tag))
            if held.l2 is not None:
                tree.hold_host(node, part.tag)
                held_host.append((node, part.tag))
        out: dict[int, list[tuple[int, int]]] = {tag: [] for tag in req.need}
        from_l2: list[tuple[PageNode, Pools]] = []
        try:
            for part, i, node in needed:
                held = node.held(part.tag)
                assert held is not None
                if held.l1 is None:
                    slot = (
                        res.alloc(part) if part.slots is not None
                        else l1_of(node, part.follows)  # type: ignore[arg-type]
                    )
                    assert slot is not None
                    assert held.l2 is not None
                    part.unpack(part.host_runs([held.l2]), [slot])
                    tree.set_copy(node, part.tag, Tier.L1, slot)
                    res.metrics.count(part.name, "restored_l2")
                    from_l2.append((node, part))
                out[part.tag].append((i, held.l1))  # type: ignore[arg-type]
        finally:
            for node, tag in held_host:
                tree.release_host(node, tag)
            release_plan(req)
        if res.config.host_mode == "buffer_only":
            for node, part in from_l2:
                res.drop(node, part)
        return {tag: tuple(slots) for tag, slots in out.items()}

    def produce(self, req: Request, part: Pools) -> tuple[tuple[int, int], ...]:
        """The (page index, slot) the engine fills with ``part``'s new objects: slots taken
        now, kept by the request until ``complete``. A slot that cannot be had (every one
        locked) drops that object (counted). A component following the KV pages writes at
        the request's own new pages."""
        prefix, full = req.prefix_pages, len(req.tokens) // self.page_size
        spec = part.spec
        if spec.rule is HitRule.CHECKPOINT:
            indices = [e - 1 for e in self.checkpoint_ends(req, part)]
        elif spec.rule is HitRule.WINDOW and (ends := self.all_checkpoint_ends(req)):
            # A resume happens only at a checkpoint: keep the window pages before new ones.
            indices = sorted(
                {i for e in ends for i in spec.pages_needed(e, self.page_size) if i >= prefix}
            )
        else:
            indices = list(range(prefix, full))
        out: list[tuple[int, int]] = []
        for i in indices:
            if part.slots is None:
                out.append((i, req.new_device_pages[i - prefix]))
                continue
            slot = self.residency.alloc(part, required=False)
            if slot is None:
                self.residency.metrics.count(part.name, "produce_dropped")
                continue
            out.append((i, slot))
        return tuple(out)

    def checkpoint_ends(self, req: Request, part: Pools) -> list[int]:
        """Page counts after which the request takes a checkpoint: its last full page, the
        branch points it computes past (``radix.branch_points``) and every
        ``checkpoint_every`` pages of the computed range."""
        prefix, full = req.prefix_pages, len(req.tokens) // self.page_size
        ends = {full}
        ends.update(b for b in req.branches if prefix < b <= full)
        step = self.components[part.name].checkpoint_every
        if step:
            ends.update(range(step * (prefix // step + 1), full, step))
        return sorted(e for e in ends if e > prefix)

    def all_checkpoint_ends(self, req: Request) -> list[int]:
        ends: set[int] = set()
        for tag in req.need:
            part = self.residency.parts[tag]
            if part.spec.rule is HitRule.CHECKPOINT:
                ends.update(self.checkpoint_ends(req, part))
        return sorted(ends)

    def keep_produced(
        self, req: Request, path: Sequence[PageNode]
    ) -> list[tuple[PageNode, int]]:
        """Record the objects the engine wrote into its produce slots on their pages; an object
        the page already has keeps its copy (the new slot is freed)."""
        res = self.residency
        kept: list[tuple[PageNode, int]] = []
        for name, slots in req.components.items():
            part = res.parts[self.components[name].tag]
            for i, slot in slots.produce:
                node = path[i] if i < len(path) else None
                held = None if node is None else node.held(part.tag)
                if part.slots is None:
                    assert node is not None
                    assert part.follows is not None
                    if held is not None and held.l1 is not None:
                        continue  # the page's copy is there already
                    page = l1_of(node, part.follows)
                    if page != slot:
                        # The page was cached by another request meanwhile: the tier keeps
                        # that copy and frees ``slot``; the rows are still in ``slot``
                        # (nothing ran since): copy them beside the kept page.
                        part.copy_slot(slot, page)  # type: ignore[arg-type]
                    res.tree.set_copy(node, part.tag, Tier.L1, page)
                elif node is None or (held is not None and held.l1 is not None):
                    part.slots.free([slot])
                    continue
                else:
                    res.tree.set_copy(node, part.tag, Tier.L1, slot)
                kept.append((node, part.tag))
                res.metrics.count(part.name, "produced")
        return kept

    def release(self, req: Request) -> None:
        """Unlock the objects ``restore`` locked for ``req``."""
        for node, tag in req.held:
            self.residency.tree.unlock(node, tag)
        req.held.clear()
