"""Write admission for a bounded store that evicts its least recently used objects first.

Under capacity pressure each write evicts what was used longest ago. Where the workload comes
back to its sessions in turn (multi-turn chat, agents) and their history outgrows the store,
what was used longest ago is what is read next: every row is evicted before its next read,
nothing is served, every recompute is written again (more bytes than the store keeps), and
the writes cost what the reads would have saved. ``ReuseAdmission`` refuses writes while
they only evict what is about to be read, from what an integration sees of its own rows:

* **Evidence.** The lookup answers for rows this process wrote: a *hit*, or a *premature
  eviction* (a miss of such a row after the backend has evicted since it was written or last
  found: the store gave it up before its next read). Misses of rows never written here, or
  gone without an eviction (a failed write, a delete), are no evidence.
* **Hold.** Once, among the last ``window`` answers of evidence (``min_evidence`` at least),
  premature evictions outnumber hits, writes are refused: what the store holds stays and is
  served, instead of being replaced by rows that would be evicted in turn. A run of premature
  evictions starts a hold at once (``RUN`` answers of evidence in a row; one before the
  store has served any row written here): conversations that come back in turn lose their
  history one after the other, each rewrite evicting the next one's, and each write while
  more evidence gathered would be a history written again and evicted in its turn (writes
  beyond what the store keeps).
* **Release.** The hold ends when what the store holds is no longer read (``idle`` answers
  in a row without a hit: the workload moved on) or after ``hold`` answers in all, so a store
  whose held rows stay hot is still tried with new rows now and then; if the store thrashes
  again, the evidence puts it back on hold, and the evidence window starts empty each time.

**With the room known** (``room``: the store's ``(capacity, used)``, from a backend that
declares ``capabilities.capacity_usage``), each write is judged before it goes, by its bytes:

* **Free room.** A write that fits in the room left (the capacity less the bytes held, the
  bytes reserved by puts in flight and the bytes admitted here not yet counted by the store)
  goes, hold or not: it evicts nothing.
* **Room made by evicting.** Otherwise the write would evict the store's least recently used
  rows; this process's rows, in the order of their writes and hits (its view of that order),
  stand for them. It goes only while there is no hold and every row it would evict is
  *stale*: neither written nor found here while other rows of ``stale`` times the capacity
  in bytes were looked up or offered (each counted once, however often it is asked: a
  refused row offered again, or a lookup repeated while a request waits, is no new demand).
  Under LRU alone a row is kept while less than one capacity of other rows is touched before
  its next read; a row within four is one the workload may still read, so the write is
  refused and the row kept; a workload that moves on looks
  up and offers other rows until the old ones are stale, and the store turns over to them.
  Rows another writer (or an earlier process) wrote are seen only where they are found here
  (then kept as this process's, at its row size): where the rows seen do not cover the room
  needed, the write goes.

**Rows offered that the store already holds** (``held``: an integration that can tell writes
only the others) are no write: neither admitted nor refused, no evidence. They are offered
rows for the staleness clock, and in demand: fresh from then on where they stand in the
store's order (an existence check moves nothing in the store's LRU).

Memory: one entry per row written or found here, the ``memory`` most recent ones. Calls may
come from any thread (one lock).

The routes share the option and the rule: ``write_admission`` (``WRITE_ADMISSIONS``) names it
(``admission_for``), and a write is refused only while the admission refuses it and no hint of
the request pins or retains any of its rows (``refuses``: a held row is always written).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache_store.backends import BackendError
from hicache_store.layout.errors import ConfigError

if TYPE_CHECKING:
    from hicache_store.backends import Backend

#: answers of evidence (hits, premature evictions) that decide a hold.
DEFAULT_WINDOW = 6
#: the fewest answers of evidence that may start a hold.
DEFAULT_MIN_EVIDENCE = 4
#: premature evictions in a row (answers of evidence) that start a hold at once (one before
#: the store has served any row written here).
RUN = 2
#: answers in a row without a hit that end a hold (what the store holds is not read).
DEFAULT_IDLE = 256
#: answers that end a hold in any case (a new trial of the writes).
DEFAULT_HOLD = 4096
#: rows written here that are remembered (the oldest are forgotten: no evidence).
DEFAULT_MEMORY = 1 << 16
#: with the room known: a row neither written nor found while other rows of this many
#: capacities were looked up or offered (each once) is stale (a write may evict it). LRU
#: alone keeps a row whose reuse distance is under one capacity; four keeps what a workload
#: comes back to a little later, and lets one that moved on turn the store over.
DEFAULT_STALE = 4
#: seconds after which bytes admitted into free room and not yet counted by the store are
#: no longer expected (a put that failed, or that rewrote an object: no growth to see).
AHEAD_S = 30.0

#: ``(capacity, used)`` of the store (``backends.protocols.CapacityUsage.usage``).
Room = Callable[[], tuple[int, int]]

#: ``write_admission`` values: ``reuse`` refuses writes while the store evicts rows before
#: their next read (``ReuseAdmission``), ``all`` writes every one (the backend's LRU alone).
WRITE_ADMISSIONS = ("reuse", "all")


@dataclass
class AdmissionCounts:
    """What ``ReuseAdmission`` saw and did since it started."""

    hits: int = 0
    premature_evictions: int = 0
    holds: int = 0
    refused: int = 0
    #: with the room known: writes that went into free room, and writes refused because a
    #: row they would evict was not stale (also in ``refused``)
    fitted: int = 0
    refused_fresh: int = 0


class ReuseAdmission:
    """Admit or refuse writes to a store that evicts least recently used first (module
    docstring). ``evictions``: the backend's eviction count (``BackendStats.evictions``)."""

    def __init__(
        self, evictions: Callable[[], int], *, window: int = DEFAULT_WINDOW,
        min_evidence: int = DEFAULT_MIN_EVIDENCE, idle: int = DEFAULT_IDLE,
        hold: int = DEFAULT_HOLD, memory: int = DEFAULT_MEMORY, room: Room | None = None,
        stale: float = DEFAULT_STALE, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < min_evidence <= window or idle < 1 or hold < 1 or memory < 1 or stale <= 0:
            raise ValueError(f"ReuseAdmission: window {window}, min_evidence {min_evidence}, "
                             f"idle {idle}, hold {hold}, memory {memory}, stale {stale}")
        self._evictions = evictions
        self._room = room
        self._stale = stale
        self._clock = clock
        #: (room known) the rows written here believed held, least recently written or
        #: found first -> (bytes, the bytes offered when last written or found)
        self._present: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        self._present_bytes = 0
        #: the staleness clock: bytes of distinct rows looked up or offered (``_new_bytes``)
        self._offered = 0
        self._row_bytes = 0  # the last row size written (for lookups of rows of no size known)
        self._seen: OrderedDict[Hashable, None] = OrderedDict()  # rows looked up or offered
        #: bytes admitted into free room the store may not count yet: [expires, bytes]
        self._ahead: deque[list[float]] = deque()
        self._ahead_bytes = 0.0
        self._last_used = 0
        self._min_evidence = min_evidence
        self._idle_limit = idle
        self._hold_limit = hold
        self._memory = memory
        #: rows written here -> (the eviction count when written or last found, bytes)
        self._written: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        self._evidence: deque[bool] = deque(maxlen=window)  # True: a hit
        #: the evidence each recent request gave (True: a hit, False: a premature eviction)
        self._requests: OrderedDict[Hashable, set[bool]] = OrderedDict()
        self._request_memory = window
        self._holding = False
        self._answers = 0  # answers since the hold began
        self._idle = 0  # answers in a row without a hit, during a hold
        self._lock = threading.Lock()
        self.counts = AdmissionCounts()

    @property
    def holding(self) -> bool:
        return self._holding

    @property
    def knows_room(self) -> bool:
        """Whether writes are judged by the store's room (module docstring)."""
        return self._room is not None

    def admit(self, nbytes: int = 0, held: Callable[[], bool] | None = None,
              keys: Iterable[Hashable] = ()) -> bool:
        """Whether a write of ``nbytes`` may go now (False: it is refused, counted). Without
        the room known, or of unknown size (0): whether there is no hold. ``held()``: whether
        a hint pins or retains one of the write's rows (asked only for a write that would be
        refused, outside the lock: then it goes). ``keys``: the write's rows, where known;
        only rows not offered before move the staleness clock (a refused row offered again,
        as an engine does each time it computes it anew, is no new demand)."""
        with self._lock:
            why = self._judge(nbytes, keys)
        if why is None or (held is not None and held()):
            return True
        with self._lock:
            self.counts.refused += 1
            self.counts.refused_fresh += why == "fresh"
        return False

    def _judge(self, nbytes: int, keys: Iterable[Hashable]) -> str | None:
        """None: the write goes; else why not (``hold``, ``fresh``: a row it would evict)."""
        if self._room is None or nbytes <= 0:
            return "hold" if self._holding else None
        try:
            capacity, used = self._room()
        except BackendError:  # (counters out of reach: the evidence alone decides)
            return "hold" if self._holding else None
        now = self._clock()
        self._offered += self._new_bytes(nbytes, keys)
        ahead = self._expected(used, now)
        free = capacity - used - ahead
        if nbytes <= free:
            self._ahead.append([now + AHEAD_S, float(nbytes)])
            self._ahead_bytes += nbytes
            self.counts.fitted += 1
            return None
        if self._holding:
            return "hold"
        self._forget_gone(used + ahead)
        need, fresh = nbytes - free, self._offered - self._stale * capacity
        for size, touched in self._present.values():
            if need <= 0:
                break
            if touched > fresh:
                return "fresh"
            need -= size
        return None

    def _expected(self, used: int, now: float) -> float:
        """Bytes admitted into free room not yet counted in ``used``: each admission's bytes
        are consumed by the growth of ``used`` since the last reading, oldest first, or given
        up after ``AHEAD_S``."""
        growth: float = used - self._last_used
        self._last_used = used
        while self._ahead and (self._ahead[0][0] <= now or growth > 0):
            entry = self._ahead[0]
            if entry[0] > now:
                taken = min(growth, entry[1])
                entry[1] -= taken
                self._ahead_bytes -= taken
                growth -= taken
                if entry[1] > 0:
                    break
            else:
                self._ahead_bytes -= entry[1]
            self._ahead.popleft()
        return self._ahead_bytes

    def _new_bytes(self, nbytes: int, keys: Iterable[Hashable]) -> int:
        """The bytes of rows (``nbytes`` for ``keys``) not looked up or offered lately (all
        of them: ``keys`` unknown): the staleness clock counts distinct rows, so a row's age
        is how much other data the workload touched since (its reuse distance, as LRU
        counts it), not how often it asked."""
        keys = list(keys)
        if not keys:
            return nbytes
        new = 0
        for key in keys:
            if key in self._seen:
                self._seen.move_to_end(key)
            else:
                self._seen[key] = None
                new += 1
        while len(self._seen) > self._memory:
            self._seen.popitem(last=False)
        return nbytes * new // len(keys)

    def _forget_gone(self, held: float) -> None:
        """Rows written here beyond what the store holds were evicted (the least recent)."""
        while self._present and self._present_bytes > held:
            _, (size, _) = self._present.popitem(last=False)
            self._present_bytes -= size

    def _touch(self, key: Hashable, size: int) -> None:
        old = self._present.pop(key, None)
        if old is not None:
            self._present_bytes -= old[0]
        self._present[key] = (size, self._offered)
        self._present_bytes += size

    def written(self, keys: Iterable[Hashable], nbytes: int = 0) -> None:
        """``keys`` were handed to the store, ``nbytes`` in all (their lookups are evidence
        from now on; with the room known, the rows a later write may evict)."""
        with self._lock:
            now = self._evictions()
            keys = list(keys)
            size = nbytes // len(keys) if keys else 0
            self._row_bytes = size or self._row_bytes
            for key in keys:
                self._written[key] = (now, size)
                self._written.move_to_end(key)
                if self._room is not None:
                    self._touch(key, size)
            while len(self._written) > self._memory:
                self._written.popitem(last=False)
            while len(self._present) > self._memory:
                self._present_bytes -= self._present.popitem(last=False)[1][0]

    def held(self, keys: Iterable[Hashable], nbytes: int = 0) -> None:
        """``keys`` (``nbytes`` in all) were offered for a write and are already in the store
        (not written again: no write to admit, none refused). An offer like any other for
        the staleness clock (each row counted once, as ``admit`` counts it), and a row in
        demand: with the room known, a row this process holds is fresh from now on, where
        it stands in the store's order (an existence check is no use for the store's LRU:
        the row goes no later than before); one it did not know is kept as found. Its
        eviction count is reset, as a hit's: a later miss is premature only after an
        eviction from now on. No evidence."""
        with self._lock:
            keys = list(keys)
            size = nbytes // len(keys) if keys else 0
            now = self._evictions()
            if self._room is not None:
                self._offered += self._new_bytes(nbytes, keys)
            for key in keys:
                entry = self._written.get(key)
                if entry is not None:
                    self._written[key] = (now, entry[1])
                if self._room is None:
                    continue
                there = self._present.get(key)
                if there is not None:
                    self._present[key] = (there[0], self._offered)  # (its place unchanged)
                elif size:
                    self._touch(key, size)

    def answered(self, key: Hashable, found: bool, request: Hashable = None) -> None:
        """A lookup of ``key`` for ``request`` was answered. Evidence counts per request (at
        most one hit and one premature eviction each): a prompt's chunks are looked up in
        order up to the first miss, so a request served is many hits and one that lost its
        history to eviction one miss, and it is requests the store serves or fails."""
        with self._lock:
            if self._room is not None:
                entry = self._written.get(key)
                size = entry[1] if entry is not None and entry[1] else self._row_bytes
                self._offered += self._new_bytes(size, (key,))
            seen = self._requests.setdefault(request, set())
            self._requests.move_to_end(request)
            while len(self._requests) > self._request_memory:
                self._requests.popitem(last=False)
            if found:
                if key in self._written:
                    size = self._written[key][1]
                    self._written[key] = (self._evictions(), size)
                    self._written.move_to_end(key)
                    if self._room is not None:
                        self._touch(key, size)
                    self.counts.hits += 1
                    if True not in seen or request is None:
                        seen.add(True)
                        self._evidence.append(True)
                elif self._room is not None and self._row_bytes:
                    # a row another process (or an earlier one) wrote, read here: kept as
                    # this process's own (no evidence: the counts stay of rows written here)
                    self._touch(key, self._row_bytes)
                self._idle = 0
            else:
                entry = self._written.get(key)
                if entry is not None and self._evictions() > entry[0]:
                    del self._written[key]  # reported once: it is gone
                    self.counts.premature_evictions += 1
                    if False not in seen or request is None:
                        seen.add(False)
                        self._evidence.append(False)
                self._idle += 1
            self._decide()

    def _decide(self) -> None:
        if self._holding:
            self._answers += 1
            if self._idle >= self._idle_limit or self._answers >= self._hold_limit:
                self._holding = False
                self._evidence.clear()  # the trial is judged on what happens from now
            return
        hits = sum(self._evidence)
        premature = len(self._evidence) - hits
        run = RUN if self.counts.hits else 1  # (module docstring: Hold)
        in_a_row = len(self._evidence) >= run and not any(list(self._evidence)[-run:])
        if in_a_row or (len(self._evidence) >= self._min_evidence and premature > hits):
            self._holding = True
            self._answers = self._idle = 0
            self.counts.holds += 1


def check_write_admission(value: object) -> str:
    """``value`` as a ``write_admission`` option; ``ConfigError`` naming the values otherwise."""
    if value not in WRITE_ADMISSIONS:
        raise ConfigError(f"write_admission must be one of {', '.join(WRITE_ADMISSIONS)}, "
                          f"not {value!r}")
    return str(value)


def admission_for(mode: str, evicts: bool, evictions: Callable[[], int],
                  room: Room | None = None) -> ReuseAdmission | None:
    """The admission a route's ``write_admission`` names, for a store that ``evicts`` under
    capacity pressure (``Capabilities.eviction``) and counts its ``evictions``, judging writes
    by the store's ``room`` where it is known (``Capabilities.capacity_usage``); None: every
    write goes (``all``, or a store that never evicts: nothing to protect)."""
    if check_write_admission(mode) != "reuse" or not evicts:
        return None
    return ReuseAdmission(evictions, room=room)


def room_of(backend: Backend) -> Room | None:
    """The store's ``(capacity, used)`` where the backend declares it
    (``Capabilities.capacity_usage``), else None (the rule goes by evidence alone)."""
    if not backend.capabilities.capacity_usage:
        return None
    return backend.capacity_usage().usage


def refuses(admission: ReuseAdmission | None, held: Callable[[], bool], nbytes: int = 0,
            keys: Iterable[Hashable] = ()) -> bool:
    """Whether a write of ``nbytes`` (0: not known) of the rows ``keys`` is refused (counted
    in ``admission.counts.refused``): the admission refuses it (``ReuseAdmission.admit``) and
    ``held()`` (whether a hint pins or retains any of the write's rows) is false."""
    return admission is not None and not admission.admit(nbytes, held, keys)
