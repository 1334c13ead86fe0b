"""Cache components: what a model caches besides full-attention KV, and the one hit rule.

A hybrid model caches more than full-attention KV (sliding-window KV, recurrent state),
and speculative decoding adds the draft model's state. Each is a *component* of
the tier, with its own pools, its own objects (``_C{tag}`` keys) and its own hit rule:

* ``FULL``: per-token state every page of which a resume needs (full-attention KV, the tier's
  own component 0; a sidecar draft model's KV);
* ``WINDOW``: per-token KV of sliding-window layers; resuming needs only the pages holding the
  last ``window_tokens`` tokens before the prefix end;
* ``CHECKPOINT``: a recurrent-state snapshot (linear attention, Mamba) taken exactly at a page
  end; resuming at a prefix end needs the snapshot at *that* end.

``match_components`` is the one hit rule: given where each component's object of each page is
(L1, L2, L3 or nowhere), the longest prefix at which every component can resume.

A ``Component`` is an engine pool plugged into the tier (a pool adapter): the tier allocates
its L1 slots, moves its objects through L2 and L3 and tracks them on the page tree beside the
page's KV; the engine reads and writes the slots the tier hands out (``Prepared.components``).
Every component is a paged pool in the unified layout of its own namespace (``layout``):

* KV-grid components (``Placement.GRID``: window KV, draft KV) are sharded across ranks exactly
  like KV, by their namespace's grid;
* replicated components (``Placement.REPLICATED``: recurrent state) are held whole by every
  rank and written by rank 0 only;

so, as for KV, the objects carry no rank and any topology reads what any other wrote.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.dtypes import is_float8
from hicache_store.layout.namespace import Grid, ModelShape, Namespace, check_kv_scales


class Tier(enum.IntEnum):
    L1 = 1  # device pool
    L2 = 2  # host pool
    L3 = 3  # external storage (for the tree: the record of pages only L3 is known to hold)


#: The component tags this library uses, by role: the one table of them. A tag names a
#: component's objects in L3 (``_C{tag}``; the KV's objects carry none) and its pools on the
#: page tree, so a tag, once its objects are stored, keeps its meaning. Engines plugging in a
#: component of their own take a tag not in this table.
TAGS: Mapping[str, int] = MappingProxyType({"kv": 0, "window": 1, "recurrent": 2, "draft": 3})
KV_TAG = TAGS["kv"]  # full-attention KV: the tier's own component
WINDOW_TAG = TAGS["window"]  # sliding-window KV (a hybrid model's local-attention layers)
RECURRENT_TAG = TAGS["recurrent"]  # recurrent-state checkpoints (linear attention, Mamba)
DRAFT_TAG = TAGS["draft"]  # a sidecar draft model's KV (speculative decoding)


class HitRule(enum.Enum):
    FULL = "full"
    WINDOW = "window"
    CHECKPOINT = "checkpoint"


class Placement(enum.Enum):
    """How a component's objects are split across the ranks of a deployment."""

    GRID = "grid"  # sharded by its namespace's grid, like KV (one writer per object)
    REPLICATED = "replicated"  # every rank holds all of it; rank 0 writes


@dataclass(frozen=True)
class ComponentSpec:
    """One cache component: its name, its tag in keys (``_C{tag}``; 0 is full-attention KV),
    its hit rule, and for ``WINDOW`` the sliding window in tokens."""

    name: str
    tag: int
    rule: HitRule
    window_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("component name must not be empty")
        if not 0 <= self.tag <= 999:
            raise ValueError(f"component tag {self.tag} outside [0, 999]")
        if self.rule is HitRule.WINDOW:
            if self.window_tokens <= 0:
                raise ValueError(f"{self.name}: a window component needs window_tokens > 0")
        elif self.window_tokens:
            raise ValueError(f"{self.name}: window_tokens only applies to window components")

    def pages_needed(self, prefix_pages: int, page_size: int) -> range:
        """Page indices whose object must be available to resume after ``prefix_pages`` pages.

        For ``CHECKPOINT`` that is the snapshot at the prefix end (keyed by its last page); an
        empty prefix needs nothing from any component.
        """
        if prefix_pages <= 0:
            return range(0)
        if self.rule is HitRule.FULL:
            return range(prefix_pages)
        if self.rule is HitRule.WINDOW:
            first_token = max(0, prefix_pages * page_size - self.window_tokens)
            return range(first_token // page_size, prefix_pages)
        return range(prefix_pages - 1, prefix_pages)


#: the tier's own component: full-attention KV.
KV = ComponentSpec("kv", KV_TAG, HitRule.FULL)


class SpecHolder:
    """``name`` and ``tag`` of what holds one component's ``spec`` (the engine's
    ``Component``, the tier's ``Pools``, an integration's part of a component). A mixin: it
    declares no dataclass field."""

    spec: ComponentSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def tag(self) -> int:
        return self.spec.tag


@dataclass(frozen=True, eq=False)
class Component(SpecHolder):
    """An engine pool of one component, plugged into the tier.

    ``namespace`` names and shapes its objects: its own layers, heads and dims and dtype, the
    KV's page-hash algorithm (objects are keyed by the KV's page hashes); one object per page
    (``page_size`` = the KV's) or, for a checkpoint, one per snapshot (``page_size`` = 1: a
    "page" of one state vector per layer). ``device`` is its L1 pool as the kernels see it:
    slot ``s`` is page ``s`` of ``device``. ``slots``: its own L1 slots, or None when it follows
    the KV pool's pages (a sidecar draft writes its KV at the target's slots). ``l2_slots``:
    rows of its own host pool (0: no L2, hence no L3 either). ``checkpoint_every``: for a
    checkpoint component, also take one every that many pages of a computed range (0: only at
    request ends and branch points).
    """

    spec: ComponentSpec
    namespace: Namespace
    device: DevicePool
    slots: int | None
    l2_slots: int = 0
    placement: Placement = Placement.GRID
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        if self.spec.tag == KV.tag:
            raise ValueError(f"component tag {KV.tag} is the tier's own KV")
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"{self.spec.name}: slots must be positive (or None)")
        if self.l2_slots < 0 or self.checkpoint_every < 0:
            raise ValueError(f"{self.spec.name}: l2_slots / checkpoint_every must be >= 0")
        if self.checkpoint_every and self.spec.rule is not HitRule.CHECKPOINT:
            raise ValueError(f"{self.spec.name}: checkpoint_every is for checkpoint components")
        if self.slots is None and self.spec.rule is not HitRule.FULL:
            raise ValueError(f"{self.spec.name}: only a full-rule component follows the KV pages")

    @property
    def follows_kv(self) -> bool:
        return self.slots is None


def component_namespace(
    model: Namespace,
    part: str,
    shape: ModelShape,
    dtype: str,
    grid: Grid,
    *,
    page_size: int | None = None,
) -> Namespace:
    """The namespace of one component of ``model``'s cache: named ``{model}#{part}`` with the
    model's revision, tenant salt and page-hash algorithm (so a tenant's or a revision's
    components never hit another's), its own ``shape``, ``dtype`` and ``grid``; ``page_size``
    the model's unless given (1 for a checkpoint: one state vector per layer). A sealed
    model's components are sealed too, with the same tenant key ring. A float8 component
    carries the model's ``kv_scales`` (the scales are the model's); one whose model has none
    raises ``InvalidNamespaceError`` (``check_kv_scales``)."""
    scales = model.kv_scales if is_float8(dtype) else ""
    check_kv_scales(dtype, scales, setting=f"the kv_scales of {model.model}'s namespace")
    return Namespace.create(
        f"{model.model}#{part}",
        shape,
        dtype,
        model.page_size if page_size is None else page_size,
        grid,
        model_revision=model.model_revision,
        tenant_salt=model.tenant_salt,
        hash_algo=model.hash_algo,
        sealed=model.sealed,
        kv_scales=scales,
    )


def validate_components(specs: Sequence[ComponentSpec]) -> None:
    """Names and tags must be unique (``ValueError`` otherwise)."""
    names = [s.name for s in specs]
    tags = [s.tag for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate component names in {names}")
    if len(set(tags)) != len(tags):
        raise ValueError(f"duplicate component tags in {tags}")


@dataclass(frozen=True)
class ComponentMatch:
    """The outcome of ``match_components``.

    ``prefix_pages``: pages every component can resume after. ``restore[name]``: (page index,
    where) of each object of that component the resume needs, in page order (objects already in
    L1 included). ``alone[name]``: the longest prefix that component alone would allow (its hit
    rate). ``limited_by``: the components without which the match would be longer.
    """

    prefix_pages: int
    restore: Mapping[str, tuple[tuple[int, Tier], ...]]
    alone: Mapping[str, int]
    limited_by: tuple[str, ...] = field(default=())


def match_components(
    specs: Sequence[ComponentSpec],
    availability: Mapping[str, Sequence[Tier | None]],
    page_size: int,
    *,
    max_pages: int | None = None,
) -> ComponentMatch:
    """The longest prefix at which every component of ``specs`` is available.

    ``availability[name][i]``: where that component's object of page ``i`` is (for a checkpoint:
    the snapshot at the end of page ``i``), or None; all sequences cover the same pages.
    ``max_pages`` caps the result (a prompt keeps one token to compute). Linear in the pages
    times the square of the components (one descending scan per subset asked).
    """
    validate_components(specs)
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    lengths = {len(availability[s.name]) for s in specs}
    if len(lengths) > 1:
        raise ValueError(f"availability sequences differ in length: {sorted(lengths)}")
    num_pages = lengths.pop() if lengths else 0
    cap = num_pages if max_pages is None else max(0, min(num_pages, max_pages))

    # last_missing[name][p]: the largest index < p whose object is absent (-1 if none), so a
    # window [lo, p) is complete iff last_missing[p] < lo.
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
            (i, where)
            for i in s.pages_needed(best, page_size)
            if (where := availability[s.name][i]) is not None
        )
        for s in specs
    }
    limited_by = tuple(
        s.name for s in specs if best < cap and longest([o for o in specs if o is not s]) > best
    )
    return ComponentMatch(best, restore, alone, limited_by)
