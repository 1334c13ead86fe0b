"""The prefix a request resumes at, over every component it needs, and across ranks.

``Prefixes.best`` applies the one hit rule (``match_components``) to what the tree holds (and,
given a probe, what L3 holds); ``Prefixes.agree`` fixes the prefix every rank can resume at:
the minimum over ranks, lowered with components until no rank needs to go lower (the same
rounds on every rank), counting each component's own hit rate and what shortened the prefix.
It reads the residency (``tier.residency``) and changes nothing there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .components import KV, ComponentMatch, Tier, match_components
from .group import RankGroup
from .request import Request
from .residency import Residency

#: ``metrics.extra`` counters of requests with components that resumed before the prefix every
#: component allowed (``limited_by_<component>`` count the components that shortened it):
#: because what L3 holds was not in L2 at ``prepare`` (not fetched: the prefetch threshold, its
#: policy's wait, no free row; or a memory copy went meanwhile) ...
LIMITED_BY_PREFETCH = "limited_by_prefetch"
#: ... or because another rank could resume less.
LIMITED_BY_RANKS = "limited_by_ranks"


class Prefixes:
    """The prefix arithmetic of one tier over ``residency`` (pages of ``page_size`` tokens),
    agreed in ``group``."""

    def __init__(self, residency: Residency, page_size: int, group: RankGroup) -> None:
        self.residency = residency
        self.page_size = page_size
        self.group = group

    def best(
        self,
        req: Request,
        cap: int,
        kv_pages: int,
        l3: Mapping[int, Sequence[bool]] | None = None,
        *,
        known_l3: bool = True,
    ) -> ComponentMatch:
        """The longest prefix ``<= cap`` at which the KV (present for its first ``kv_pages``
        pages) and every component ``req`` needs can resume: objects in L1/L2 count, and with
        ``l3`` (tag -> per page, from a probe) those L3 holds (and, with ``known_l3``, those
        the tree knows it holds)."""
        parts = self.residency.parts
        avail: dict[str, list[Tier | None]] = {
            KV.name: [Tier.L1 if i < kv_pages else None for i in range(cap)]
        }
        nodes = self.residency.tree.match(req.hashes[:cap])
        for tag in req.need:
            part = parts[tag]
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
        specs = [KV, *(parts[t].spec for t in req.need)]
        return match_components(specs, avail, self.page_size, max_pages=cap)

    def local(self, req: Request, cap: int) -> int:
        """The longest prefix ``<= cap`` (KV pages held) this rank can resume at from L1/L2."""
        return self.best(req, cap, cap).prefix_pages if req.need else cap

    def agree(self, req: Request, usable: int) -> tuple[int, int]:
        """The prefix every rank can resume at: the minimum over ranks, lowered with
        components until no rank needs to go lower (the same rounds on every rank); and the
        number of values the agreement went through."""
        metrics, group = self.residency.metrics, self.group
        most = usable
        if req.need:
            most = self.local(req, usable)
            # Per-component hit rates on what is there (L3 included, failed reads not).
            limit = min(
                max(len(req.nodes), req.l3_kv_pages), (len(req.tokens) - 1) // self.page_size
            )
            found = self.best(req, limit, limit, req.l3_found)
            for name, pages in found.alone.items():
                metrics.note(f"component_hit_tokens_{name}", pages * self.page_size)
            for name in found.limited_by:
                metrics.note(f"limited_by_{name}")
            if most < found.prefix_pages:  # short of what every component allowed
                metrics.note(LIMITED_BY_PREFETCH)
        agreed = group.agree_min(most, "prefix_pages")
        rounds = 1
        if req.need and group.size > 1:
            while True:
                lowered = group.agree_min(self.local(req, agreed), "prefix_pages:components")
                if lowered == agreed:
                    break
                agreed = lowered
                rounds += 1
        if req.need and agreed < most:
            metrics.note(LIMITED_BY_RANKS)
        return agreed, rounds
