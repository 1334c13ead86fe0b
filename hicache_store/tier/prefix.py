"""The prefix a request resumes at, over every component it needs, and across ranks.

``best`` applies the one hit rule (``match_components``) to what the tree holds (and, given a
probe, what L3 holds); ``agree`` fixes the prefix every rank can resume at: the minimum over
ranks, lowered with components until no rank needs to go lower (the same rounds on every
rank), counting each component's own hit rate and what shortened the prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .components import KV, ComponentMatch, Tier, match_components

if TYPE_CHECKING:
    from .cache import HiCache
    from .request import Request

#: ``metrics.extra`` counters of requests with components that resumed before the prefix every
#: component allowed (``limited_by_<component>`` count the components that shortened it):
#: because what L3 holds was not in L2 at ``prepare`` (not fetched: the prefetch threshold, its
#: policy's wait, no free row; or a memory copy went meanwhile) ...
LIMITED_BY_PREFETCH = "limited_by_prefetch"
#: ... or because another rank could resume less.
LIMITED_BY_RANKS = "limited_by_ranks"



def best(
    tier: HiCache,
    req: Request,
    cap: int,
    kv_pages: int,
    l3: Mapping[int, Sequence[bool]] | None = None,
    *,
    known_l3: bool = True,
) -> ComponentMatch:
    """The longest prefix ``<= cap`` at which the KV (present for its first ``kv_pages``
    pages) and every component ``req`` needs can resume: objects in L1/L2 count, and with
    ``l3`` (tag -> per page, from a probe) those L3 holds (and, with ``known_l3``, those the
    tree knows it holds)."""
    avail: dict[str, list[Tier | None]] = {
        KV.name: [Tier.L1 if i < kv_pages else None for i in range(cap)]
    }
    nodes = tier.tree.match(req.hashes[:cap])
    for tag in req.need:
        part = tier.parts[tag]
        probed = () if l3 is None else l3.get(tag, ())
        where: list[Tier | None] = []
        for i in range(cap):
            held = nodes[i].held(tag) if i < len(nodes) else None
            here = None if held is None else held.where()
            if here is Tier.L3 and (l3 is None or not known_l3):
                here = None  # memory only, or the probe's word only
            if here is None and i < len(probed) and probed[i]:
                here = Tier.L3
            where.append(here)
        avail[part.name] = where
    specs = [KV, *(tier.parts[t].spec for t in req.need)]
    return match_components(specs, avail, tier.namespace.page_size, max_pages=cap)

def local_prefix(tier: HiCache, req: Request, cap: int) -> int:
    """The longest prefix ``<= cap`` (KV pages held) this rank can resume at from L1/L2."""
    return best(tier, req, cap, cap).prefix_pages if req.need else cap

def agree(tier: HiCache, req: Request, usable: int) -> int:
    """The prefix every rank can resume at: the minimum over ranks, lowered with
    components until no rank needs to go lower (the same rounds on every rank)."""
    most = usable
    if req.need:
        most = local_prefix(tier, req, usable)
        # Per-component hit rates on what is there (L3 included, failed reads not).
        limit = min(
            max(len(req.nodes), req.l3_kv_pages),
            (len(req.tokens) - 1) // tier.namespace.page_size,
        )
        found = best(tier, req, limit, limit, req.l3_found)
        count_components(tier, found)
        if most < found.prefix_pages:  # short of what every component allowed
            tier.metrics.note(LIMITED_BY_PREFETCH)
    agreed = tier.group.agree_min(most, "prefix_pages")
    rounds = 1
    if req.need and tier.group.size > 1:
        while True:
            lowered = tier.group.agree_min(
                local_prefix(tier, req, agreed), "prefix_pages:components"
            )
            if lowered == agreed:
                break
            agreed = lowered
            rounds += 1
    if req.need and agreed < most:
        tier.metrics.note(LIMITED_BY_RANKS)
    tier._last_rounds = rounds
    return agreed

def count_components(tier: HiCache, found: ComponentMatch) -> None:
    page = tier.namespace.page_size
    for name, pages in found.alone.items():
        tier.metrics.note(f"component_hit_tokens_{name}", pages * page)
    for name in found.limited_by:
        tier.metrics.note(f"limited_by_{name}")
