"""The index of a store: what it knows about its objects beyond their bytes.

A bounded store keeps, beside the bytes, which objects it holds and their sizes, the capacity
bound and its eviction order, pins and retention, the writes in flight and the recovery of
writers that died, and a feed of every change. ``ObjectIndex`` is that one contract; its
implementations are interchangeable behind a backend:

| index | module | who shares it |
|---|---|---|
| SQLite in the root's ``index/`` | ``_file_index`` (``FileIndex``) | the processes of one host |
| Valkey or Redis (``valkey://``, ``redis://``) | ``_valkey_index`` (``ValkeyIndex``) | any number of hosts |
| none: the file system answers | ``_file_noindex`` (``NoIndex``) | any number of hosts; sampled |

**The bytes stay the truth.** The index never stores or serves an object; it is told what the
store holds by an ``ObjectSite`` (the backend's view of its own objects: sizes as the store
charges them, removal, a walk, the temp files of a writer). Every read is verified by the
backend, so a stale index can cost a miss, never wrong bytes, and an index lost or emptied is
rebuilt from a walk (``rebuilt``).

**Promises**, whichever implementation declares them (``features``):

1. *Presence and sizes.* ``exists`` answers from the index (other processes' and hosts'
   changes included); ``totals`` are the bytes and objects indexed.
2. *The bound.* A put is announced (``reserve``), room is made (``make_room``: an
   implementation may already have made it inside ``reserve``), the bytes are written, and the
   put is settled (``settle_put``) from what the store then holds. The indexed bytes plus the
   bytes of the puts in flight never pass the capacity once the puts have made their room; a
   put that cannot fit raises ``CapacityError``.
3. *The eviction order.* Least recently written or read first; within one call, whose keys
   are a chain in order, the deepest first (``_lru.chain_ranks``), so a chain loses its tail
   before its head; and **all the objects of one page go together** (``page_of``): no
   eviction leaves part of a page, the partial page no reader can use. A write or read of any
   object of a page makes the whole page recent.
4. *Never evicted:* a pinned object (``retain``), an object with a change in flight, a page
   holding either. A pin past the budget is refused whole (``PinBudgetError``); a delete or an
   eviction drops a key's holds; an empty hold table (a new or rebuilt index) holds nothing,
   it never means "evict everything".
5. *Writers that die.* A writer killed (or cut off past its lease) leaves its reservations
   behind; ``recover`` (run by any other process of the store) finishes its deletes,
   reconciles its puts' keys with the store and removes its temp files. A writer reclaimed this
   way cannot settle any more (``WriterFencedError``): its put is reported failed, and what it
   published unaccounted is removed by ``delete_unindexed``: at once by the writer
   (``settle_or_unpublish``), or by gc's reconcile where the index could not be reached.
6. *The change feed* (``features.change_feed``): every change of presence, by any process
   (put, eviction, delete, gc, repair), appears once, in order, numbered; ``changes_after``
   names them and ``listing`` gives every key as of one change number, for readers that start
   over (``backends.feed.FeedFollower``).

**Calls block** (a database or a network round trip) and are thread-safe: a backend runs them
on its bounded executor, as it runs any blocking SDK call. ``exists_if_current`` and
``exists_recent`` never block: an implementation that keeps nothing in memory answers None.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from hicache_store.layout.keys import object_key_parts

from .errors import BackendUnavailableError
from .retention import Retention


@dataclass(frozen=True)
class IndexFeatures:
    """What an index offers, as positive flags (as ``Capabilities`` are for backends).

    - ``exact``: presence, totals and the bound are exact, and eviction follows the order of
      the module docstring (without it they are estimated, in the style of sampled LRU).
    - ``retention``: pins and retention are kept here and every process's eviction honours them.
    - ``change_feed``: ``changes_after`` and ``listing`` work (otherwise ``NotSupportedError``).
    - ``hosts``: processes on several hosts may share one store through it.
    - ``in_memory``: ``exists_if_current`` / ``exists_recent`` can answer without I/O.
    - ``leases``: a writer holds a lease it renews; one whose lease lapsed (stopped, cut off)
      is reclaimed by others while it may still run, and is fenced: its ``settle_put``
      raises ``WriterFencedError``. (Without leases a writer is dead only once its process
      is gone, and a dead process never wakes.)
    """

    exact: bool = False
    retention: bool = False
    change_feed: bool = False
    hosts: bool = False
    in_memory: bool = False
    leases: bool = False


@dataclass(frozen=True)
class Measured:
    """An object as the store holds it: ``size`` its length in bytes, ``charged`` the bytes the
    store charges for it (what the bound counts: the file's allocated blocks, or ``size``),
    ``mtime`` its last write (unix seconds)."""

    size: int
    charged: int
    mtime: float


@dataclass
class Reservation:
    """The announced puts of one call, released by ``settle_put``.

    ``keys`` in the call's (chain) order; ``batch`` numbers it among its writer's calls;
    ``incoming`` the bytes it adds; ``started`` wall-clock seconds. ``victims``: keys an
    implementation that makes room inside ``reserve`` took out of the index for this put,
    whose objects ``make_room`` removes. ``writer``: the incarnation that made it.
    ``stored``: what the put itself stored, by key, when it knows (a store whose every write
    is one atomic request: S3); ``settle_put`` may take it instead of measuring those keys.
    ``fits``: the index found, when it reserved, that this put and the puts before it fit
    the capacity, so ``make_room`` has nothing to do for it (puts after it count its bytes
    when they make their room, and settles and deletes never make it need room); the
    caller may skip that call."""

    keys: list[str]
    batch: int
    incoming: int
    started: float = 0.0
    victims: list[str] = field(default_factory=list)
    writer: str = ""
    stored: dict[str, Measured] = field(default_factory=dict)
    fits: bool = False


@dataclass
class EvictionCount:
    evicted: int = 0
    failed: int = 0


@dataclass(frozen=True)
class FeedChanges:
    """What ``ObjectIndex.changes_after`` read: ``changes`` (key, present) in order, through
    change number ``upto``; ``last``: the last change recorded; ``complete``: False when the
    changes cannot all be named (start again from ``listing``)."""

    last: int
    upto: int
    changes: list[tuple[str, bool]]
    complete: bool


class ObjectSite(Protocol):
    """What an index asks of the store that holds the bytes. Blocking, thread-safe."""

    def measure(self, keys: Sequence[str]) -> list[Measured | None]:
        """Each key's object as stored now, or None where there is none."""

    def remove(self, keys: Sequence[str]) -> list[bool | OSError]:
        """Remove each key's object: True removed, False there was none, or the error that
        kept it (the object stays)."""

    def walk(self) -> Iterable[tuple[str, Measured]]:
        """Every object of the store (what an index is built or checked from)."""

    def remove_temps(self, writer: str) -> int:
        """Remove what writer ``writer`` left unpublished (temp files); return how many."""

    def charge_of(self, size: int) -> int:
        """The bytes an object of ``size`` bytes will be charged, at most (a reservation)."""


#: the URL schemes of a fleet's index server (the ``index`` option of a backend).
FLEET_SCHEMES: tuple[str, ...] = ("valkey", "valkeys", "redis", "rediss")


def fleet_index_url(index: str | None) -> str | None:
    """The server URL when an ``index`` option names a fleet's index (``valkey://host:port/N``,
    ``redis://...``; TLS as ``valkeys://`` / ``rediss://``), else None."""
    if not isinstance(index, str) or "://" not in index:
        return None
    return index if index.split("://", 1)[0].lower() in FLEET_SCHEMES else None


@dataclass
class IndexCheck:
    """What a store's index holds against a listing of the store (``Backend.check_index``).

    ``indexed_*``: the index's own totals; ``listed_*``: what a walk of the store found
    (bytes as the bound charges them). ``unindexed``: objects the store holds that the index
    does not (published by a writer that lost its lease, or behind the index's back);
    ``missing``: keys the index holds whose object is gone; ``examples``: a few of both.
    ``usage``: bytes per namespace digest. ``details``: the implementation's own facts
    (``rebuilt_at``: when a fleet's index was last built from a walk, ms; ``writers``).
    With a repair: ``removed`` unindexed objects removed, ``repaired`` missing keys unindexed;
    ``rebuilt``: the index was built anew from the walk."""

    kind: str
    indexed_bytes: int
    indexed_objects: int
    listed_bytes: int
    listed_objects: int
    unindexed: int = 0
    missing: int = 0
    examples: list[str] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    details: dict[str, int] = field(default_factory=dict)
    removed: int = 0
    repaired: int = 0
    rebuilt: bool = False

    @property
    def consistent(self) -> bool:
        """The index and the listing agree, object for object."""
        return (self.unindexed, self.missing) == (0, 0) and (
            self.indexed_bytes, self.indexed_objects) == (self.listed_bytes, self.listed_objects)


def page_of(key: str) -> str:
    """The page an object belongs to, for eviction (all objects of one page go together): the
    common prefix ``{page_hash}_{namespace}_`` of an object key, or the key itself for any other
    (a manifest, a foreign key: a page of its own)."""
    parts = object_key_parts(key)
    return key if parts is None else f"{parts[0]}_{parts[1]}_"


def is_page_prefix(page: str) -> bool:
    """Whether ``page`` (a ``page_of`` result) is the common prefix of a page's object keys,
    not a key that is a page of its own."""
    parts = object_key_parts(page + "L0-0")
    return parts is not None and page == f"{parts[0]}_{parts[1]}_"


def page_depths(keys: Sequence[str]) -> list[int]:
    """The chain depth of each key's page among the pages of one call (keys in chain order):
    the objects of one page share it, so a call's pages rank as a chain and a page as one."""
    depth: dict[str, int] = {}
    return [depth.setdefault(page_of(key), len(depth)) for key in keys]


class ObjectIndex(abc.ABC):
    """The index contract (module docstring). Thread-safe; calls may block on I/O."""

    features: ClassVar[IndexFeatures]
    #: the index was built (or rebuilt) from a walk of the store when this process opened it.
    rebuilt: bool = False
    #: pending changes of dead writers this process reconciled when it opened.
    recovered: int = 0
    #: the name this process's unpublished work carries (its temp files); "" where the
    #: backend names it itself.
    writer: str = ""

    # -- presence and sizes -------------------------------------------------------------------

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is indexed, as of now (every process's changes included)."""

    def exists_if_current(self, keys: Sequence[str]) -> list[bool] | None:
        """``exists`` if it can answer at once, without I/O or waiting; otherwise None."""
        return None

    def exists_recent(self, keys: Sequence[str], max_age_s: float) -> list[bool] | None:
        """``exists`` from memory as of at most ``max_age_s`` ago (this process's own changes
        never missed), without I/O or waiting; otherwise None (``Backend.exists_now``)."""
        return None

    @abc.abstractmethod
    def totals(self) -> tuple[int, int]:
        """``(bytes, objects)`` indexed (bytes as the bound counts them)."""

    @abc.abstractmethod
    def reserved_bytes(self) -> int:
        """Bytes of the puts in flight, every process's."""

    def usage(self) -> dict[str, int]:
        """Bytes indexed per namespace digest (``""``: keys of no namespace)."""
        out: dict[str, int] = {}
        for page in self.entry_pages(""):
            for key, size, _ in page:
                parts = object_key_parts(key)
                name = "" if parts is None else parts[1]
                out[name] = out.get(name, 0) + size
        return out

    # -- the bound ------------------------------------------------------------------------------

    @abc.abstractmethod
    def reserve(self, keys: Sequence[str], sizes: Sequence[int], capacity: int,
                pin_budget: int | None = None) -> Reservation:
        """Announce a put of ``keys`` (their ``sizes``) under ``capacity`` bytes. Raises
        ``CapacityError`` when the put alone passes the capacity. With ``pin_budget``, a
        rewrite that grows a pinned object is charged as a pin: past the budget,
        ``PinBudgetError`` and nothing is reserved."""

    @abc.abstractmethod
    def make_room(self, capacity: int, reservation: Reservation | None = None) -> EvictionCount:
        """Evict, in the order of the module docstring, until the indexed and in-flight bytes
        fit ``capacity``; an object that cannot be removed stays indexed (counted ``failed``)
        and eviction goes on. ``CapacityError`` when nothing more can go."""

    @abc.abstractmethod
    def settle_put(self, reservation: Reservation) -> None:
        """Set each reserved key from what the store holds now (written, rewritten, or not
        written at all) and release the reservation. ``WriterFencedError`` when this writer's
        reservations were reclaimed meanwhile (nothing is recorded for it)."""

    # -- reads ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def touch(self, keys: Sequence[str]) -> bool:
        """Record that ``keys`` (one call's, in chain order) were read; True when buffered
        touches are due for ``flush_touches``."""

    @abc.abstractmethod
    def flush_touches(self) -> None:
        """Write buffered read recency."""

    @abc.abstractmethod
    def repair_missing(self, key: str) -> None:
        """A read found no object for ``key``: if indexed, with no change in flight, it goes,
        but only if the store, asked again now, has no object either and nothing stored it
        since (a miss that arrives late, after another process stored the key again and
        perhaps pinned it, removes nothing)."""

    @abc.abstractmethod
    def adopt(self, keys: Sequence[str]) -> int:
        """Set each key from the store (objects placed by other means); how many are indexed."""

    # -- deletes --------------------------------------------------------------------------------

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key from the index and the store; True where an object was removed.
        Waits for other writers' changes in flight on these keys. An object that cannot be
        removed stays indexed and the first such error is raised."""

    def delete_until_held(self, groups: Sequence[Sequence[str]]) -> tuple[int, list[bool]]:
        """``Backend.delete_until_held``: ``delete`` of the groups, in order, up to the first
        one with a key that a retention entry holds (checked in the same atomic step that
        takes the keys out of the index: no ``retain`` comes between); returns how many
        groups went and, for their keys, whether an object was removed."""
        raise self._unsupported("delete_until_held")

    @abc.abstractmethod
    def delete_unindexed(self, keys: Sequence[str]) -> int:
        """Remove the objects of ``keys`` that the store holds but the index does not, with no
        change in flight (published by a writer that lost its lease, or behind the index's
        back): gc's reconcile. Returns how many were removed."""

    # -- retention ------------------------------------------------------------------------------

    def retain(self, keys: Sequence[str], retention: Retention, pin_budget: int) -> None:
        """Set ``retention.owner``'s entry on each indexed key; a holding pin past
        ``pin_budget`` bytes raises ``PinBudgetError`` and sets nothing."""
        raise self._unsupported("retain")

    def release(self, keys: Sequence[str], owner: str) -> None:
        raise self._unsupported("release")

    def retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        raise self._unsupported("retention_of")

    def pinned_bytes(self) -> int:
        """Bytes of the indexed objects pinned now (0 without retention)."""
        return 0

    # -- recovery -------------------------------------------------------------------------------

    @abc.abstractmethod
    def recover(self) -> int:
        """Reconcile the changes in flight of writers that died (or lost their lease); return
        how many were settled."""

    # -- the change feed and listings ------------------------------------------------------------

    def changes_after(self, seq: int, limit: int = 64) -> FeedChanges:
        """The changes numbered after ``seq``, named (at most ``limit`` feed records, oldest
        first). ``complete`` False: some cannot be told; start again from ``listing``."""
        raise self._unsupported("changes_after")

    def listing(self) -> tuple[int, list[str]]:
        """Every indexed key as of change number ``last``: ``(last, keys)``."""
        raise self._unsupported("listing")

    @abc.abstractmethod
    def key_pages(self, prefix: str) -> Iterator[list[str]]:
        """The indexed keys starting with ``prefix``, a page at a time."""

    @abc.abstractmethod
    def entry_pages(self, prefix: str) -> Iterator[list[tuple[str, int, float]]]:
        """``key_pages`` with each key's size and last use: ``(key, size, unix seconds)``."""

    def check(self) -> None:  # noqa: B027 - nothing to check by default
        """Raise when this process may not use the index any more (another host took the
        store's index over); every call of the backend asks first."""

    def rebuild(self) -> None:
        """Drop the index and build it again from a walk of the store: what it held beyond the
        store (pins, retention, the feed's numbers) is gone."""
        raise self._unsupported("rebuild")

    def details(self) -> dict[str, int]:
        """The implementation's own facts for ``IndexCheck.details``."""
        return {}

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release connections and threads; the index's state stays for the next opener."""

    def _unsupported(self, operation: str) -> Exception:
        from .errors import NotSupportedError

        return NotSupportedError(f"{type(self).__name__} does not offer {operation}",
                                 backend="index", operation=operation)


__all__ = [
    "FLEET_SCHEMES", "EvictionCount", "FeedChanges", "IndexCheck", "IndexFeatures", "Measured", "ObjectIndex", "ObjectSite",
    "Reservation", "fleet_index_url", "is_page_prefix", "page_depths", "page_of",
]


def settle_or_unpublish(index: ObjectIndex, reservation: Reservation,
                        published: Sequence[str]) -> None:
    """A put's settle (``ObjectIndex.settle_put``). A settle the index refuses (this writer's
    lease lapsed and another process reclaimed the put, or the index was lost and built again
    meanwhile) leaves the objects the put ``published`` unaccounted where the reclaim or the
    rebuild looked before they were there: those are removed at once (``delete_unindexed``,
    which keeps any the index did count) rather than left for gc's reconcile. The refusal is
    raised either way."""
    try:
        index.settle_put(reservation)
    except BackendUnavailableError:
        if published:
            # (the server unreachable too: gc's reconcile finds them later)
            with contextlib.suppress(Exception):
                index.delete_unindexed(published)
        raise
