"""Retention and pins: how long, and how firmly, a backend keeps an object.

A key holds at most one ``Retention`` per owner. ``retain`` by an owner replaces that owner's
own entry (so only the owner can shorten or weaken it); another owner adds its own entry
beside it, so a caller that is not the owner can only extend what the key already has.
At time ``now`` an entry *holds* while ``until_s`` is None or later than ``now``; an entry
that no longer holds is ignored everywhere (the object is ordinary data again).

Eviction order of a backend declaring ``capabilities.retention``: unretained objects first
(in the backend's usual order), then retained objects by ascending effective priority (the
highest priority among the entries that hold), never a pinned one. When room cannot be made
without evicting a pin the write fails with ``CapacityError``.

Pin budget: the bytes of objects pinned at once may not pass ``pin_budget_bytes`` (a fixed
fraction of the capacity). A ``retain(pinned=True)`` that would pass it raises
``PinBudgetError`` and changes nothing. A rewrite (``put`` of a stored key) keeps the key's
entries, so a rewrite of a pinned object is charged as a pin: a ``put`` whose rewrites would
make the pinned bytes pass the budget raises ``PinBudgetError`` and stores nothing of the call
(the old objects and their pins stay). A rewrite at the same size or smaller is never refused,
nor is one of an object without a holding pin.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: default fraction of a backend's capacity that pins may hold.
DEFAULT_PIN_FRACTION = 0.25

#: what ``hold_owner`` appends to a holder's name for its (unpinned) retention entries.
RETAIN_SUFFIX = "#retain"


def hold_owner(holder: str, *, pinned: bool) -> str:
    """The owner id under which ``holder`` (a session) keeps its pins, or its retention.

    Kept apart because a key holds one entry per owner: were both the same owner, a later
    ``retain`` by the session would replace its own earlier pin on the same object (and the
    pinned object become evictable). ``hold_owners`` names both, for a release of everything.
    """
    return holder if pinned else holder + RETAIN_SUFFIX


def hold_owners(holder: str) -> tuple[str, str]:
    """Both owner ids of ``holder`` (``hold_owner``): its pins and its retention."""
    return hold_owner(holder, pinned=True), hold_owner(holder, pinned=False)


@dataclass(frozen=True)
class Retention:
    """One owner's hold on an object.

    ``owner``: who holds it (a pin or session id); only the owner may shorten or release it.
    ``until_s``: wall-clock unix seconds it holds until; None: until released.
    ``pinned``: never evicted while it holds (counts against the pin budget).
    ``priority``: for ``pinned=False``: higher is evicted later than lower; any retained object
    is evicted after unretained data.
    """

    owner: str
    until_s: float | None
    pinned: bool
    priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.owner, str) or not self.owner:
            raise ValueError("Retention.owner must be a non-empty string")
        if self.until_s is not None and not isinstance(self.until_s, (int, float)):
            raise ValueError("Retention.until_s must be unix seconds or None")

    def holds(self, now: float) -> bool:
        return self.until_s is None or self.until_s > now


def holding(entries: Iterable[Retention], now: float) -> tuple[Retention, ...]:
    """The entries that still hold at ``now``, ordered by owner (a stable report)."""
    return tuple(sorted((r for r in entries if r.holds(now)), key=lambda r: r.owner))


def is_pinned(entries: Iterable[Retention], now: float) -> bool:
    return any(r.pinned and r.holds(now) for r in entries)


def eviction_class(entries: Iterable[Retention], now: float) -> tuple[int, int] | None:
    """Sort key of an object among eviction candidates: lower goes first; None: pinned (never).

    ``(0, 0)`` for unretained data, ``(1, priority)`` for retained data.
    """
    live = [r for r in entries if r.holds(now)]
    if any(r.pinned for r in live):
        return None
    if not live:
        return (0, 0)
    return (1, max(r.priority for r in live))


def check_pin_budget(
    *, budget: int, used: int, asked: int, backend: str, operation: str = "retain"
) -> None:
    """Raise ``PinBudgetError`` when ``asked`` more pinned bytes would pass ``budget``
    (``operation``: ``retain`` for a pin, ``put`` for a rewrite that grows a pinned object)."""
    from .errors import PinBudgetError

    if used + asked > budget:
        why = (" by rewriting pinned objects larger (a rewrite keeps their pins; release them "
               "first, or rewrite them at their size)" if operation == "put" else "")
        raise PinBudgetError(
            f"pin budget exceeded{why}: budget {budget} bytes, used {used}, asked {asked}",
            backend=backend, operation=operation,
        )


def pin_budget_bytes(capacity_bytes: int, pin_fraction: float) -> int:
    """The pin budget of a backend of ``capacity_bytes``: ``pin_fraction`` of it, in bytes."""
    if not 0.0 <= pin_fraction <= 1.0:
        from hicache_store.layout.errors import ConfigError

        raise ConfigError(f"pin_fraction must be within [0, 1], got {pin_fraction!r}")
    return int(capacity_bytes * pin_fraction)


def pinned_bytes(
    table: Mapping[str, Iterable[Retention]], sizes: Mapping[str, int], now: float
) -> int:
    """Bytes of the objects of ``table`` pinned at ``now``."""
    return sum(sizes.get(k, 0) for k, entries in table.items() if is_pinned(entries, now))
