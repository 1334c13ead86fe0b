"""Cache components and the hybrid match: the longest prefix every needed component can resume.

A hybrid model caches more than full-attention KV (SPEC §4, seed 002 "Hybrid-model state"):

* ``full``: per-token KV of full-attention layers; resuming at a prefix end needs every page of
  the prefix (component 0, the tier's unified pages).
* ``window``: per-token KV of sliding-window layers; resuming needs only the pages that hold the
  last ``window_tokens`` tokens before the prefix end (older pages may be gone).
* ``checkpoint``: a recurrent-state snapshot (linear attention, Mamba) taken exactly at a prefix
  end. It is keyed by the page hash of the prefix's last page; resuming at a prefix end needs the
  snapshot at *that* end (a snapshot at any other end is useless there).

Each component has its own objects (``ObjectCoords.component``, ``_C{n}`` in keys) and its own
hit rule. ``match_components`` takes, for every component, where (if anywhere) each page's object
lives and returns the longest prefix at which all of them are available, which of their objects
must be restored from which tier, and where computation resumes.

Availability is given per page index ``i`` of the request's page hashes: for ``full`` and
``window`` it is page ``i``'s object; for ``checkpoint`` it is the snapshot at the end of page
``i`` (prefix of ``i + 1`` pages). ``None`` means absent everywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class HitRule(enum.Enum):
    FULL = "full"
    WINDOW = "window"
    CHECKPOINT = "checkpoint"


class Location(enum.IntEnum):
    """Where a component object lives; lower is closer to compute."""

    L1 = 1
    L2 = 2
    L3 = 3


@dataclass(frozen=True)
class ComponentSpec:
    """One cache component of a model.

    ``component``: the tag in object keys and headers (0 = full-attention KV, the tier's own
    pages; other components use 1..999). ``num_layers``: layers its objects hold (one checksummed
    block each). ``window_tokens``: the sliding window, for ``HitRule.WINDOW`` only.
    """

    name: str
    component: int
    rule: HitRule
    num_layers: int = 1
    window_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("component name must not be empty")
        if not 0 <= self.component <= 999:
            raise ValueError(f"component {self.component} outside [0, 999]")
        if self.num_layers <= 0:
            raise ValueError(f"{self.name}: num_layers must be positive")
        if self.rule is HitRule.WINDOW:
            if self.window_tokens <= 0:
                raise ValueError(f"{self.name}: a window component needs window_tokens > 0")
        elif self.window_tokens:
            raise ValueError(f"{self.name}: window_tokens only applies to window components")

    def pages_needed(self, prefix_pages: int, page_size: int) -> range:
        """Page indices whose object must be available to resume after ``prefix_pages`` pages.

        For ``checkpoint``, the index is that of the snapshot at the prefix end (keyed by the
        last page); an empty prefix needs nothing from any component.
        """
        if prefix_pages <= 0:
            return range(0)
        if self.rule is HitRule.FULL:
            return range(prefix_pages)
        if self.rule is HitRule.WINDOW:
            first_token = max(0, prefix_pages * page_size - self.window_tokens)
            return range(first_token // page_size, prefix_pages)
        return range(prefix_pages - 1, prefix_pages)


def validate_components(specs: Sequence[ComponentSpec]) -> None:
    """Names and component tags must be unique (``ValueError`` otherwise)."""
    names = [s.name for s in specs]
    tags = [s.component for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate component names in {names}")
    if len(set(tags)) != len(tags):
        raise ValueError(f"duplicate component tags in {tags}")


@dataclass(frozen=True)
class HybridMatch:
    """The outcome of ``match_components``.

    ``prefix_pages``: pages every component can resume after; computation resumes at token
    ``resume_token`` (= ``prefix_pages * page_size``). ``restore[name]``: (page index, location)
    of each object of that component the engine needs, in page order (objects already in L1
    included, so the engine knows every slot it uses). ``alone[name]``: the longest prefix that
    component alone would allow (for per-component hit rates and diagnostics). ``limited_by``:
    the binding components, those without which the match would be longer (empty when no single
    component shortens it, e.g. when every component ends where the request does).
    """

    prefix_pages: int
    resume_token: int
    restore: Mapping[str, tuple[tuple[int, Location], ...]]
    alone: Mapping[str, int]
    limited_by: tuple[str, ...] = field(default=())


def match_components(
    specs: Sequence[ComponentSpec],
    availability: Mapping[str, Sequence[Location | None]],
    page_size: int,
    *,
    max_pages: int | None = None,
) -> HybridMatch:
    """The longest prefix at which every component in ``specs`` is available.

    ``availability[spec.name]`` gives, per page index, where that component's object lives
    (see the module docstring); all sequences cover the same pages (the request's full pages).
    ``max_pages`` caps the result (a prompt must keep one token to compute). Cost: linear in the
    number of pages times the square of the number of components (one descending scan per subset
    asked: all, each alone, all but each).
    """
    validate_components(specs)
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    lengths = {len(availability[s.name]) for s in specs}
    if len(lengths) > 1:
        raise ValueError(f"availability sequences differ in length: {sorted(lengths)}")
    num_pages = lengths.pop() if lengths else 0
    cap = num_pages if max_pages is None else max(0, min(num_pages, max_pages))

    # last_missing[name][p] = largest index < p whose object is absent (-1 if none): a window
    # [lo, p) is complete iff last_missing[p] < lo.
    last_missing: dict[str, list[int]] = {}
    for spec in specs:
        avail = availability[spec.name]
        marks = [-1] * (num_pages + 1)
        for i in range(num_pages):
            marks[i + 1] = i if avail[i] is None else marks[i]
        last_missing[spec.name] = marks

    def ok(spec: ComponentSpec, p: int) -> bool:
        needed = spec.pages_needed(p, page_size)
        if not needed:
            return True
        if spec.rule is HitRule.CHECKPOINT:
            return availability[spec.name][p - 1] is not None
        return last_missing[spec.name][p] < needed.start

    def longest(among: Sequence[ComponentSpec]) -> int:
        return next((p for p in range(cap, 0, -1) if all(ok(s, p) for s in among)), 0)

    best = longest(specs)
    alone = {s.name: longest([s]) for s in specs}
    restore = {
        s.name: tuple(
            (i, loc)
            for i in s.pages_needed(best, page_size)
            if (loc := availability[s.name][i]) is not None
        )
        for s in specs
    }
    limited_by = tuple(
        s.name for s in specs if best < cap and longest([o for o in specs if o is not s]) > best
    )
    return HybridMatch(best, best * page_size, restore, alone, limited_by)
