"""A component's own pools in L1 and L2 and its objects in L3, keyed by page hash.

One ``ComponentStore`` per non-KV component (a recurrent snapshot, a sliding-window page, ...):
every object is one fixed-size state tensor (``shape``/``dtype``) identified by a page hash (the
last page of the prefix it was taken at, for a checkpoint; the page itself, for a window page).

* L1: ``l1_slots`` rows of a device tensor; L2: ``l2_slots`` rows of a host tensor; L3: a
  ``StateL3`` (framed, namespaced objects), optional.
* Eviction: least recently used unlocked entry of the tier that needs room; an entry with no copy
  left anywhere is forgotten.
* ``backup(page_hash)``: copies what is missing below L1 (L1 -> L2, then L2 -> L3), and nothing
  that is already there. This is the rule of seed 002 "Backing up new recurrent snapshots": a
  snapshot taken later on a prefix whose KV is already backed up gets a backup of its own (the
  KV tier is not involved), so after L1 eviction it can be restored instead of recomputed.
* ``load(page_hash)``: the state as a tensor in L1, restored from L2 or L3 when needed (None on a
  miss; a corrupt L3 object is a counted miss).

Single-threaded bookkeeping (the engine's thread); L3 I/O goes through the sync bridge and is
bounded by the ``StateL3`` timeout. L3 backups are synchronous by default; with
``async_l3=True`` they are queued on the bridge loop (at most ``max_pending_l3`` in flight; more
are dropped and counted, as the KV tier drops backups past its queue) and take effect when the
engine thread calls ``poll`` (or ``flush``), which returns one ``BackupEvent`` per finished put:
the component's completion events. An object whose put is pending is not queued again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from hicache_store._sync import run_sync, submit

from .components import ComponentSpec, Location
from .state_l3 import StateL3


@dataclass
class _Entry:
    l1_slot: int | None = None
    l2_slot: int | None = None
    in_l3: bool = False
    last_access: int = 0
    lock: int = 0
    parent_hash: str | None = None


@dataclass
class StoreMetrics:
    """Counters of one component store."""

    saved: int = 0
    backups_l2: int = 0
    backups_l3: int = 0
    backups_skipped: int = 0
    loads_l1: int = 0
    loads_l2: int = 0
    loads_l3: int = 0
    misses: int = 0
    evictions_l1: int = 0
    evictions_l2: int = 0
    backups_l3_queued: int = 0
    backups_l3_failed: int = 0
    backups_l3_dropped: int = 0


@dataclass(frozen=True)
class BackupEvent:
    """One finished L3 backup of a component object (``ok``: stored)."""

    component: str
    page_hash: str
    ok: bool


class EventLog:
    """Completion events kept until drained; bounded, so an engine that never drains them
    cannot grow it (the oldest are dropped first)."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._events: collections.deque[BackupEvent] = collections.deque(maxlen=limit)

    def extend(self, events: Iterable[BackupEvent]) -> None:
        self._events.extend(events)

    def drain(self) -> list[BackupEvent]:
        """The events since the last call, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events


class StoreFullError(RuntimeError):
    """Every slot of a tier is locked."""


class ComponentStore:
    def __init__(
        self,
        spec: ComponentSpec,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        l1_slots: int,
        l2_slots: int,
        l3: StateL3 | None = None,
        device: torch.device | str = "cpu",
        async_l3: bool = False,
        max_pending_l3: int = 256,
    ) -> None:
        if l1_slots <= 0:
            raise ValueError("l1_slots must be positive")
        if l2_slots < 0:
            raise ValueError("l2_slots must be >= 0")
        self.spec = spec
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        numel = 1
        for dim in self.shape:
            numel *= dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.payload_bytes = numel * itemsize
        if self.payload_bytes % spec.num_layers:
            raise ValueError(f"{spec.name}: {self.payload_bytes} bytes do not split into layers")
        if l3 is not None and l3.payload_bytes not in (None, self.payload_bytes):
            raise ValueError(f"{spec.name}: the L3 link expects another payload size")
        self.l1 = torch.zeros(l1_slots, self.payload_bytes, dtype=torch.uint8, device=self.device)
        self.l2 = torch.zeros(max(l2_slots, 1), self.payload_bytes, dtype=torch.uint8)
        self.l2_slots = l2_slots
        self.l3 = l3
        self._free_l1 = list(range(l1_slots - 1, -1, -1))
        self._free_l2 = list(range(l2_slots - 1, -1, -1))
        self._entries: dict[str, _Entry] = {}
        self._clock = itertools.count(1)
        self.metrics = StoreMetrics()
        self.async_l3 = async_l3
        self.max_pending_l3 = max_pending_l3
        #: queued L3 puts by page hash, in submission order
        self._pending: dict[str, concurrent.futures.Future[bool]] = {}

    # -- queries --------------------------------------------------------------------------

    def location(self, page_hash: str, *, check_l3: bool = False) -> Location | None:
        """The closest tier holding the object (L3 only when known, or checked if asked)."""
        entry = self._entries.get(page_hash)
        if entry is not None:
            if entry.l1_slot is not None:
                return Location.L1
            if entry.l2_slot is not None:
                return Location.L2
            if entry.in_l3:
                return Location.L3
        if check_l3 and self.l3 is not None:
            (found,) = run_sync(self.l3.exists([page_hash]))
            if found:
                self._entry(page_hash).in_l3 = True
                return Location.L3
        return None

    def availability(
        self, page_hashes: Sequence[str], *, check_l3: bool = False
    ) -> list[Location | None]:
        """``location`` of every hash, L3 existence checked in one batch when asked."""
        out = [self.location(h) for h in page_hashes]
        if check_l3 and self.l3 is not None:
            unknown = [i for i, loc in enumerate(out) if loc is None]
            if unknown:
                found = run_sync(self.l3.exists([page_hashes[i] for i in unknown]))
                for i, ok in zip(unknown, found, strict=True):
                    if ok:
                        self._entry(page_hashes[i]).in_l3 = True
                        out[i] = Location.L3
        return out

    def __contains__(self, page_hash: str) -> bool:
        return self.location(page_hash) is not None

    @property
    def l1_used(self) -> int:
        return self.l1.shape[0] - len(self._free_l1)

    @property
    def l2_used(self) -> int:
        return self.l2_slots - len(self._free_l2)

    # -- writes ---------------------------------------------------------------------------

    def save(self, page_hash: str, state: torch.Tensor, *, parent_hash: str | None = None) -> None:
        """Put ``state`` (this component's shape and dtype) into L1 under ``page_hash``."""
        if tuple(state.shape) != self.shape or state.dtype != self.dtype:
            raise ValueError(
                f"{self.spec.name}: state {tuple(state.shape)} {state.dtype}, "
                f"expected {self.shape} {self.dtype}"
            )
        entry = self._entries.get(page_hash)
        slot = entry.l1_slot if entry is not None else None
        if slot is None:
            slot = self._alloc(Location.L1, keep=entry)  # may raise: nothing changed yet
        entry = self._entry(page_hash)
        entry.l1_slot = slot
        entry.parent_hash = parent_hash or entry.parent_hash
        self.l1[entry.l1_slot].copy_(self._as_bytes(state))
        self._touch(entry)
        self.metrics.saved += 1

    def backup(self, page_hash: str) -> bool:
        """Copy the object to the lower tiers that miss it; True when it ends below L1.

        Only what is missing moves: an L2 copy is not rewritten, an object known in L3 is not
        re-put. Returns False when there is nothing to back up from or nowhere to put it.
        """
        entry = self._entries.get(page_hash)
        if entry is None:
            return False
        moved = False
        if entry.l2_slot is None and entry.l1_slot is not None and self.l2_slots:
            slot = self._try_alloc(Location.L2)
            if slot is not None:
                self.l2[slot].copy_(self.l1[entry.l1_slot].cpu())
                entry.l2_slot = slot
                self.metrics.backups_l2 += 1
                moved = True
        if self.l3 is not None and not entry.in_l3 and page_hash not in self._pending:
            source = (
                self.l2[entry.l2_slot]
                if entry.l2_slot is not None
                else self.l1[entry.l1_slot].cpu()
                if entry.l1_slot is not None
                else None
            )
            if source is not None:
                # A copy of the bytes: the slot may be evicted and reused before the put ends.
                data = source.numpy().tobytes()
                put = self.l3.put(page_hash, data, parent_hash=entry.parent_hash)
                if not self.async_l3:
                    if run_sync(put):
                        entry.in_l3 = True
                        self.metrics.backups_l3 += 1
                        moved = True
                elif len(self._pending) >= self.max_pending_l3:
                    put.close()  # never awaited
                    self.metrics.backups_l3_dropped += 1
                else:
                    self._pending[page_hash] = submit(put)
                    self.metrics.backups_l3_queued += 1
                    moved = True
        if not moved:
            self.metrics.backups_skipped += 1
        return entry.l2_slot is not None or entry.in_l3 or page_hash in self._pending

    # -- asynchronous L3 backups ------------------------------------------------------------

    def in_l3(self, page_hash: str) -> bool:
        """Known to be stored in L3 (a put applied, or found by a check)."""
        entry = self._entries.get(page_hash)
        return entry is not None and entry.in_l3

    def l3_pending(self, page_hash: str) -> bool:
        """An L3 put of the object is queued and not yet applied."""
        return page_hash in self._pending

    @property
    def pending_l3(self) -> int:
        """L3 puts queued and not yet applied by ``poll``."""
        return len(self._pending)

    def poll(self) -> list[BackupEvent]:
        """Apply the L3 puts that finished (engine thread); their completion events, in
        submission order among those that finished."""
        events: list[BackupEvent] = []
        for page_hash, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[page_hash]
            ok = future.exception() is None and bool(future.result())
            if ok:
                self._entry(page_hash).in_l3 = True
                self.metrics.backups_l3 += 1
            else:
                self.metrics.backups_l3_failed += 1
            events.append(BackupEvent(self.spec.name, page_hash, ok))
        return events

    def flush(self, timeout: float = 60.0) -> list[BackupEvent]:
        """Wait for every queued L3 put (``TimeoutError`` after ``timeout``), then ``poll``."""
        deadline = time.monotonic() + timeout
        for future in list(self._pending.values()):
            remaining = deadline - time.monotonic()
            try:
                future.exception(timeout=max(remaining, 0.0))
            except concurrent.futures.TimeoutError:
                raise TimeoutError(
                    f"{self.spec.name}: L3 backups did not finish in {timeout} s"
                ) from None
        return self.poll()

    # -- reads ----------------------------------------------------------------------------

    def load(self, page_hash: str) -> torch.Tensor | None:
        """The object as a state tensor (a copy) after bringing it to L1; None on a miss."""
        entry = self._entries.get(page_hash)
        if entry is None and self.l3 is not None:
            entry = self._entry(page_hash)
            entry.in_l3 = True  # probe: a miss below forgets it again
        if entry is None:
            self.metrics.misses += 1
            return None
        if entry.l1_slot is not None:
            self.metrics.loads_l1 += 1
        elif entry.l2_slot is not None:
            slot = self._alloc(Location.L1, keep=entry)
            self.l1[slot].copy_(self.l2[entry.l2_slot].to(self.device))
            entry.l1_slot = slot
            self.metrics.loads_l2 += 1
        elif entry.in_l3 and self.l3 is not None:
            data = run_sync(self.l3.get(page_hash))
            if data is None:
                entry.in_l3 = False
                self._forget_if_empty(page_hash, entry)
                self.metrics.misses += 1
                return None
            slot = self._alloc(Location.L1, keep=entry)
            self.l1[slot].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            entry.l1_slot = slot
            self.metrics.loads_l3 += 1
        else:
            self.metrics.misses += 1
            return None
        self._touch(entry)
        assert entry.l1_slot is not None
        return self.l1[entry.l1_slot].clone().view(self.dtype).reshape(self.shape)

    # -- eviction -------------------------------------------------------------------------

    def evict(self, page_hash: str, tier: Location) -> bool:
        """Drop one copy (L1 or L2); True if it was there."""
        entry = self._entries.get(page_hash)
        if entry is None:
            return False
        if tier is Location.L1 and entry.l1_slot is not None:
            self._free_l1.append(entry.l1_slot)
            entry.l1_slot = None
            self.metrics.evictions_l1 += 1
        elif tier is Location.L2 and entry.l2_slot is not None:
            self._free_l2.append(entry.l2_slot)
            entry.l2_slot = None
            self.metrics.evictions_l2 += 1
        else:
            return False
        self._forget_if_empty(page_hash, entry)
        return True

    def evict_all(self, tier: Location) -> int:
        """Drop every unlocked copy in ``tier`` (tests; an engine clearing its device cache)."""
        return sum(self.evict(h, tier) for h, e in list(self._entries.items()) if e.lock == 0)

    def lock(self, page_hash: str) -> None:
        self._entry(page_hash).lock += 1

    def unlock(self, page_hash: str) -> None:
        entry = self._entries[page_hash]
        if entry.lock <= 0:
            raise RuntimeError(f"{self.spec.name}: unlock without lock")
        entry.lock -= 1

    def check_invariants(self) -> None:
        """Slots are owned by exactly one entry each and free lists are disjoint from them."""
        l1 = [e.l1_slot for e in self._entries.values() if e.l1_slot is not None]
        l2 = [e.l2_slot for e in self._entries.values() if e.l2_slot is not None]
        assert len(set(l1)) == len(l1)
        assert not set(l1) & set(self._free_l1)
        assert len(set(l2)) == len(l2)
        assert not set(l2) & set(self._free_l2)
        assert len(l1) + len(self._free_l1) == self.l1.shape[0]
        assert len(l2) + len(self._free_l2) == self.l2_slots

    # -- internals ------------------------------------------------------------------------

    def _entry(self, page_hash: str) -> _Entry:
        entry = self._entries.get(page_hash)
        if entry is None:
            entry = self._entries[page_hash] = _Entry()
        return entry

    def _touch(self, entry: _Entry) -> None:
        entry.last_access = next(self._clock)

    def _as_bytes(self, state: torch.Tensor) -> torch.Tensor:
        return state.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device)

    def _forget_if_empty(self, page_hash: str, entry: _Entry) -> None:
        if entry.l1_slot is None and entry.l2_slot is None and not entry.in_l3 and not entry.lock:
            del self._entries[page_hash]

    def _alloc(self, tier: Location, keep: _Entry | None = None) -> int:
        slot = self._try_alloc(tier, keep)
        if slot is None:
            raise StoreFullError(f"{self.spec.name}: every {tier.name} slot is locked")
        return slot

    def _try_alloc(self, tier: Location, keep: _Entry | None = None) -> int | None:
        free = self._free_l1 if tier is Location.L1 else self._free_l2
        if not free:
            victims = [
                (e.last_access, h)
                for h, e in self._entries.items()
                if e is not keep
                and e.lock == 0
                and (e.l1_slot if tier is Location.L1 else e.l2_slot) is not None
            ]
            if not victims:
                return None
            _, victim = min(victims)
            self.evict(victim, tier)
        return free.pop()
