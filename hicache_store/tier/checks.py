"""The tier's bookkeeping checked against a full scan (``HiCache.check_invariants``: tests,
debugging, the leak check)."""

from __future__ import annotations

from collections.abc import Mapping

from .components import KV, Tier
from .pins import PinTable
from .pools import LayerLoad, SlotList
from .prefetch import Prefetcher
from .radix import PageNode
from .residency import Residency


def check_tier(
    residency: Residency,
    filling: Mapping[int, LayerLoad],
    pins: PinTable[PageNode],
    prefetcher: Prefetcher,
) -> None:
    """Raise ``AssertionError`` if the tier's bookkeeping is inconsistent (see
    ``HiCache.check_invariants``): ``filling`` its L2 -> L1 loads by ``id`` of the page they
    fill, ``pins`` its hints' pin table, ``prefetcher`` its prefetches."""
    tree = residency.tree
    buffer_only = residency.config.host_mode == "buffer_only"
    tiers = (Tier.L1,) if buffer_only else (Tier.L1, Tier.L2)
    filled = {id(n): n for n in tree.nodes()}
    for key in filling:
        node = filled.get(key)
        assert node is not None, "a load is recorded for a page not in the tree"
        held = node.held(KV.tag)
        assert held is not None, "a load is recorded for a page without KV"
        assert held.l1 is not None, "a load is recorded for a page not in L1"
        assert held.lock, "a load is recorded for a page no request holds"
    pinned = [n for n in filled.values() if (h := n.held(KV.tag)) is not None and h.pins]
    assert all(n.copy(KV.tag).pins == 1 for n in pinned), "a page pinned twice in the tree"
    assert all(pins.is_pinned(n) for n in pinned), "a page pinned in the tree, not in the table"
    assert len(pinned) == pins.pinned, (
        f"{len(pinned)} pages pinned in the tree, {pins.pinned} in the table"
    )
    tree.check_prefix_closed(tiers)
    tree.check_queues()
    for part in residency.parts.values():
        used, referenced = part.host.used, rows_referenced(residency, prefetcher, part.tag)
        if used != referenced:
            raise AssertionError(f"{part.name}: {used} host rows in use, {referenced} held")
        if isinstance(part.slots, SlotList):
            slots = [h.l1 for n in tree.nodes() if (h := n.held(part.tag)) and h.l1 is not None]
            assert len(set(slots)) == len(slots), f"{part.name}: a slot held twice"
            assert not set(slots) & set(part.slots.free_slots), f"{part.name}: a held slot is free"


def rows_referenced(residency: Residency, prefetcher: Prefetcher, tag: int) -> int:
    """Host rows of component ``tag`` the tree or a prefetch holds."""
    in_tree = sum(1 for n in residency.tree.nodes() if (h := n.held(tag)) and h.l2 is not None)
    return in_tree + prefetcher.rows_held(tag)
