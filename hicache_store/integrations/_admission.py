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

Memory: one entry per row written here, the ``memory`` most recent ones. Calls may come from
any thread (one lock).

The routes share the option and the rule: ``write_admission`` (``WRITE_ADMISSIONS``) names it
(``admission_for``), and a write is refused only while the admission holds and no hint of the
request pins or retains any of its rows (``refuses``: a held row is always written).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from hicache_store.layout.errors import ConfigError

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


class ReuseAdmission:
    """Admit or refuse writes to a store that evicts least recently used first (module
    docstring). ``evictions``: the backend's eviction count (``BackendStats.evictions``)."""

    def __init__(
        self, evictions: Callable[[], int], *, window: int = DEFAULT_WINDOW,
        min_evidence: int = DEFAULT_MIN_EVIDENCE, idle: int = DEFAULT_IDLE,
        hold: int = DEFAULT_HOLD, memory: int = DEFAULT_MEMORY,
    ) -> None:
        if not 0 < min_evidence <= window or idle < 1 or hold < 1 or memory < 1:
            raise ValueError(f"ReuseAdmission: window {window}, min_evidence {min_evidence}, "
                             f"idle {idle}, hold {hold}, memory {memory}")
        self._evictions = evictions
        self._min_evidence = min_evidence
        self._idle_limit = idle
        self._hold_limit = hold
        self._memory = memory
        #: rows written here -> the eviction count when written or last found
        self._written: OrderedDict[Hashable, int] = OrderedDict()
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

    def admit(self) -> bool:
        """Whether a write may go now (False: it is refused, counted)."""
        with self._lock:
            if self._holding:
                self.counts.refused += 1
            return not self._holding

    def written(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were handed to the store (their lookups are evidence from now on)."""
        with self._lock:
            now = self._evictions()
            for key in keys:
                self._written[key] = now
                self._written.move_to_end(key)
            while len(self._written) > self._memory:
                self._written.popitem(last=False)

    def answered(self, key: Hashable, found: bool, request: Hashable = None) -> None:
        """A lookup of ``key`` for ``request`` was answered. Evidence counts per request (at
        most one hit and one premature eviction each): a prompt's chunks are looked up in
        order up to the first miss, so a request served is many hits and one that lost its
        history to eviction one miss, and it is requests the store serves or fails."""
        with self._lock:
            seen = self._requests.setdefault(request, set())
            self._requests.move_to_end(request)
            while len(self._requests) > self._request_memory:
                self._requests.popitem(last=False)
            if found:
                if key in self._written:
                    self._written[key] = self._evictions()
                    self._written.move_to_end(key)
                    self.counts.hits += 1
                    if True not in seen or request is None:
                        seen.add(True)
                        self._evidence.append(True)
                self._idle = 0
            else:
                since = self._written.get(key)
                if since is not None and self._evictions() > since:
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


def admission_for(mode: str, evicts: bool, evictions: Callable[[], int]) -> ReuseAdmission | None:
    """The admission a route's ``write_admission`` names, for a store that ``evicts`` under
    capacity pressure (``BackendCapabilities.eviction``) and counts its ``evictions``; None:
    every write goes (``all``, or a store that never evicts: nothing to protect)."""
    return ReuseAdmission(evictions) if check_write_admission(mode) == "reuse" and evicts else None


def refuses(admission: ReuseAdmission | None, held: Callable[[], bool]) -> bool:
    """Whether a write is refused (counted in ``admission.counts.refused``): the admission
    holds and ``held()`` (whether a hint pins or retains any of the write's rows) is false."""
    if admission is None or not admission.holding or held():
        return False
    return not admission.admit()
