"""Puts, deletes and read recency in a file root's index: the capacity bound and its eviction.

**Protocol.** The file system and the index cannot change in one transaction, so every change
is announced, done, then settled (``_file_index_recovery`` recovers the ones a killed process
left):

- *put*: T1 records a pending put per key (``reserve``, which also finds whether the put
  and the puts before it fit: ``Reservation.fits``) and, where they do not, evicts
  (``make_room``, transactions of its own); the files are written and renamed; T2 sets each key's row from a ``stat``
  of its file and drops the pending rows (``settle_put``). Row sizes are therefore the sizes
  of the files, whoever renamed last.
- *delete / evict*: T1 removes the rows and records pending deletes; the files are unlinked;
  T2 drops the pending rows and gives back the row of any file that could not be deleted (at
  the back of the eviction line, counted as an eviction failure).
- A key with a pending change by another owner is never chosen for eviction, a delete waits
  for it, and a put waits for a pending delete: an unlink never races a rename of one key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from . import _file_retention as holds
from ._file_index_db import IndexDB
from ._file_index_recovery import Recovery
from ._file_index_rows import (
    Rows,
    committed,
    earlier_puts,
    first_row,
    growth_in_flight,
    meta,
    reserved,
    rows_of,
)
from ._lru import chain_ranks
from .errors import CapacityError, OutOfSpaceError
from .index import EvictionCount, Reservation, page_depths, page_of


class Writes:
    """The changes of one index that go through the store: puts, deletes, eviction, read
    recency and repairs."""

    def __init__(self, db: IndexDB, rows: Rows, recovery: Recovery,
                 clock: Callable[[], float], after_write: Callable[[], None]) -> None:
        self._db = db
        self._rows = rows
        self._recovery = recovery
        self._clock = clock
        self._after_write = after_write  # (a compaction when the feed outgrew its bound)
        self._batches = iter(range(1, 1 << 62))
        self._touches: dict[str, int] = {}
        self._touch_lock = threading.Lock()
        self._touched_at = time.monotonic()

    # -- puts --------------------------------------------------------------------------------------

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], capacity: int,
                pin_budget: int | None = None) -> Reservation:
        """T1 of a put: announce the keys, counting the bytes they will add as in flight (a
        rewrite counts only its growth: the row it replaces can neither be evicted nor deleted
        while the put is pending). Waits (up to ``lock_timeout``) while another call is
        deleting one of the keys. With ``pin_budget``, a rewrite that grows a pinned object is
        charged as a pin (``_file_retention.charge_rewrite``): past the budget,
        ``PinBudgetError`` and nothing is reserved."""
        incoming = sum(sizes)
        if incoming > capacity:
            raise CapacityError(
                f"{incoming} bytes cannot fit a capacity of {capacity} bytes",
                backend="file", operation="put", key=keys[0] if len(keys) == 1 else None,
            )
        batch = next(self._batches)
        since = time.time()
        for con in self._recovery.until_unblocked(set(keys), only_deletes=True, operation="put"):
            stored = rows_of(con, keys)
            if pin_budget is not None and stored and holds.any_entries(con):
                growth: dict[str, int] = {}
                for key, size in zip(keys, sizes, strict=True):
                    if key in stored:  # a key repeated in the call: its largest write counts
                        growth[key] = max(growth.get(key, 0), size - stored[key])
                holds.charge_rewrite(
                    con, {key: grown for key, grown in growth.items() if grown > 0},
                    now=self._clock(), budget=pin_budget, in_flight=growth_in_flight(con))
            self._rows.announce(con, keys, "put", batch, [
                max(0, size - stored.get(key, 0)) for key, size in zip(keys, sizes, strict=True)])
            # make_room's test, in this transaction (where every put in flight is this one
            # or an earlier one): where it passes now it passes then, so the put spares that
            # call its transaction (and its caller a thread hop)
            fits = committed(con) <= capacity
        return Reservation(list(keys), batch, incoming, since, fits=fits)

    def make_room(self, capacity: int, reservation: Reservation | None = None) -> EvictionCount:
        """Evict, in rank order, until the indexed and in-flight bytes fit ``capacity``.

        Keys with a change in flight are skipped. A file that cannot be deleted keeps its row
        (moved to the back of the line) and eviction goes on with the next. Raises
        ``CapacityError`` when nothing more can go.

        ``reservation``: the put this room is for. Puts are ordered by when their pending rows
        were inserted (rowid order: one write transaction inserts a put's rows, so they are
        contiguous, and a new row's rowid exceeds every pending row's; wall-clock times
        could disagree with that order across processes); a put counts only its own bytes
        and those of earlier puts, and when
        nothing is left to evict while an earlier put of a live call is still in flight
        (its bytes, and the rows it rewrites, cannot go yet) it waits up to ``lock_timeout``
        for that put to settle instead of failing. The earliest put never waits, so two
        calls never wait for each other; a later put counted the earlier ones' bytes when it
        made its room, so the store still fits ``capacity`` once both have settled."""
        counts = EvictionCount()
        if reservation is not None and reservation.fits:
            return counts  # (``reserve`` found the room, and nothing since can take it)
        skip: set[str] = set()
        recovered = False
        deadline = time.monotonic() + self._db.lock_timeout
        pause = 0.001
        mine = (self._rows.owner.token, reservation.batch) if reservation is not None else None
        while True:
            batch = next(self._batches)
            earlier = 0
            with self._db.write() as con:
                first = first_row(con, mine)
                need = meta(con, "total_bytes") + reserved(con, first, mine) - capacity
                if need <= 0:
                    return counts
                victims = self._rows.pick_victims(con, need, skip, self._clock())
                if victims:
                    self._rows.remove(con, victims)
                    self._rows.announce(con, [key for key, _ in victims], "del", batch)
                elif first is not None:
                    earlier = earlier_puts(con, first)
            if not victims:
                if not recovered and self._recovery.recover():
                    recovered = True  # a dead writer's reservation was holding the room
                    continue
                if earlier and time.monotonic() < deadline:
                    self._recovery.recover()  # an earlier put whose owner died must not hold us
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
                    continue
                raise CapacityError(
                    f"no room: {need} bytes over a capacity of {capacity} bytes and nothing "
                    f"more can be evicted ({counts.failed} eviction failures; what remains is "
                    "pinned, or busy in a call in flight)",
                    backend="file", operation="put",
                )
            failed = self._remove_objects([key for key, _ in victims])
            self._settle(batch, failed, ranks=chain_ranks(len(failed)))
            counts.evicted += len(victims) - len(failed)
            counts.failed += len(failed)
            skip.update(failed)

    def settle_put(self, reservation: Reservation) -> None:
        """T2 of a put: every key's row from its file (written, rewritten, or not written at
        all when the write failed), in chain order; the reservation is released."""
        ranks = page_ranks(reservation.keys)
        with self._db.write() as con:
            self._rows.set_from_site(con, reservation.keys, ranks)
            self._rows.rank_pages(con, dict(zip(map(page_of, reservation.keys), ranks,
                                                strict=True)))
            self._rows.release(con, reservation.batch)
        self._after_write()

    # -- deletes -----------------------------------------------------------------------------------

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key's row and file; True when a file was removed. Waits (up to
        ``lock_timeout``) for other owners' changes in flight on these keys. A file that
        cannot be deleted keeps its row, and the first such error is raised."""
        return self._delete_groups([keys], until_held=False)[1]

    def delete_until_held(self, groups: Sequence[Sequence[str]]) -> tuple[int, list[bool]]:
        """``Backend.delete_until_held``: ``delete`` of the groups, in order, up to the first
        one with a key that a retention entry holds; returns how many groups went and, for
        their keys, whether a file was removed. The holds are read in the write transaction
        that removes the rows (T1), so no ``retain`` commits between the check and the
        removal, and one after it finds no row to hold."""
        return self._delete_groups(groups, until_held=True)

    def _delete_groups(
        self, groups: Sequence[Sequence[str]], *, until_held: bool
    ) -> tuple[int, list[bool]]:
        batch = next(self._batches)
        wanted = {key for group in groups for key in group}
        try:
            for con in self._recovery.until_unblocked(wanted, only_deletes=False,
                                                      operation="delete"):
                done = len(groups)
                if until_held and holds.any_entries(con):
                    held = holds.held_among(con, list(wanted), self._clock())
                    done = next((i for i, group in enumerate(groups)
                                 if held.intersection(group)), done)
                keys = [key for group in groups[:done] for key in group]
                self._rows.remove(con, list(rows_of(con, keys).items()))
                self._rows.announce(con, keys, "del", batch)
        except OutOfSpaceError:
            return self._delete_groups_freeing_space(groups, until_held=until_held)
        outcomes = self._rows.site.remove(keys)
        removed = [outcome is True for outcome in outcomes]
        failed = [key for key, outcome in zip(keys, outcomes, strict=True)
                  if isinstance(outcome, OSError)]
        self._settle(batch, failed, ranks=None)
        self._after_write()
        error = next((outcome for outcome in outcomes if isinstance(outcome, OSError)), None)
        if error is not None:
            raise error
        return done, removed

    def _delete_groups_freeing_space(
        self, groups: Sequence[Sequence[str]], *, until_held: bool
    ) -> tuple[int, list[bool]]:
        """``_delete_groups`` on a full filesystem, where its T1 cannot commit (every commit
        appends to the write-ahead log). One write transaction instead: taking the write lock
        writes nothing, and holding it, no ``retain`` and no put can commit; it reads the holds
        and the changes in flight, removes the files of the groups up to the first held or
        busy one (a group with a change in flight is kept, as a held one; a plain ``delete``
        of a busy key gives up), and only then removes their rows, in the room the files
        freed. A crash between the removals and the commit, or a commit that still finds no
        room (``OutOfSpaceError``), leaves rows whose files are gone: present until a read
        misses them, as after an ``rm`` behind the index's back."""
        wanted = {key for group in groups for key in group}
        with self._db.write() as con:
            stop = {key for (key,) in con.execute("SELECT key FROM pending") if key in wanted}
            if stop and not until_held:
                raise self._db.out_of_space(f"{len(stop)} of the keys are busy in another call")
            if until_held and holds.any_entries(con):
                stop |= holds.held_among(con, list(wanted), self._clock())
            done = next((i for i, group in enumerate(groups) if stop.intersection(group)),
                        len(groups))
            keys = [key for group in groups[:done] for key in group]
            rows = rows_of(con, keys)
            outcomes = self._rows.site.remove(keys)
            gone = [(key, rows.pop(key)) for key, outcome in zip(keys, outcomes, strict=True)
                    if not isinstance(outcome, OSError) and key in rows]
            self._rows.remove(con, gone)
        error = next((outcome for outcome in outcomes if isinstance(outcome, OSError)), None)
        if error is not None:
            raise error
        return done, [outcome is True for outcome in outcomes]

    def delete_unindexed(self, keys: Sequence[str]) -> int:
        """Remove the files of ``keys`` that no row and no change in flight accounts for
        (announced as deletes first, in the transaction that finds them, so that a put of
        one of them waits for the removal)."""
        batch = next(self._batches)
        with self._db.write() as con:
            indexed = rows_of(con, keys)
            busy = {key for (key,) in con.execute("SELECT key FROM pending")}
            strays = [key for key in dict.fromkeys(keys) if key not in indexed and key not in busy]
            self._rows.announce(con, strays, "del", batch)
        outcomes = self._rows.site.remove(strays)
        with self._db.write() as con:
            self._rows.release(con, batch)
        return sum(outcome is True for outcome in outcomes)

    def _settle(self, batch: int, failed: Sequence[str], ranks: Sequence[int] | None) -> None:
        """T2 of a delete: drop the pending rows; the files that stayed get their rows back
        (``ranks``: at the back of the eviction line; None: as the files' mtimes say)."""
        with self._db.write() as con:
            if failed:
                self._rows.set_from_site(con, failed, ranks)
            self._rows.release(con, batch)

    def _remove_objects(self, keys: Sequence[str]) -> list[str]:
        """Remove each key's object; return the keys whose object could not be removed (one
        that is already gone was removed by someone else: the room is ours anyway)."""
        outcomes = self._rows.site.remove(keys)
        return [key for key, outcome in zip(keys, outcomes, strict=True)
                if isinstance(outcome, OSError)]

    # -- reads: recency and repairs ----------------------------------------------------------------

    def touch(self, keys: Sequence[str]) -> bool:
        """Record that ``keys`` (one call's, in chain order) were read; True when the buffered
        touches are due for ``flush_touches`` (a second old, or 4 Ki keys)."""
        ranks = page_ranks(keys)
        with self._touch_lock:
            self._touches.update(zip(map(page_of, keys), ranks, strict=True))
            return len(self._touches) >= 4096 or time.monotonic() - self._touched_at >= 1.0

    def flush_touches(self) -> None:
        """Write buffered read recency to the index (one transaction): each page read, all
        its objects."""
        with self._touch_lock:
            touches, self._touches = self._touches, {}
            self._touched_at = time.monotonic()
        if not touches:
            return
        with self._db.write() as con:
            self._rows.rank_pages(con, touches)

    def repair_missing(self, key: str, indexed: bool) -> None:
        """A read found no file for ``key`` (``indexed``: the index still lists it): its row
        goes unless a change of it is in flight (someone removed the file behind the index's
        back)."""
        if not indexed:
            return
        with self._db.write() as con:
            busy = {k for (k,) in con.execute("SELECT key FROM pending WHERE key = ?", (key,))}
            if not busy:
                self._rows.set_from_site(con, [key], None)

    def adopt(self, keys: Sequence[str]) -> int:
        """Set the rows of ``keys`` from their files (for files placed under ``objects/`` by
        other means: a restore, a copy, a test oracle); return how many are now indexed."""
        with self._db.write() as con:
            self._rows.set_from_site(con, keys, None)
            return len(rows_of(con, keys))


def page_ranks(keys: Sequence[str]) -> list[int]:
    """``chain_ranks`` of one call's keys by page: the objects of one page rank together,
    the call's pages as a chain (``index.page_depths``)."""
    depths = page_depths(keys)
    ranks = chain_ranks(max(depths, default=-1) + 1)
    return [ranks[depth] for depth in depths]


__all__ = ["Writes", "page_ranks"]
