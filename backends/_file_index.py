"""A file root's index: which objects it holds, their sizes and their eviction order, in SQLite.

The ``ObjectIndex`` (``backends.index``) of the processes of one host: shared by every process
that opens the root, persistent, crash-safe, opened in constant time, and with no per-object
state in process memory.

**Why an embedded database** (SQLite, from the standard library), chosen over the other ways
to avoid rebuilding an index at every open (an in-memory index costs every process that opens
the root a walk of the store and memory per object):

- an append-only log replayed at open keeps open time proportional to the store;
- sampled eviction in the style of Redis' approximated LRU (list a few random directories,
  evict the oldest) needs no index at all, but gives no shared capacity accounting and no
  chain order: a sampled chain head can go while its tail stays, the hole this store avoids;
- per-directory summaries still need a global order to evict from.

SQLite gives multi-statement transactions, one write lock shared by processes, recovery from
a killed writer (write-ahead log), and ordered on-disk indexes: the eviction order is the
index on ``rank``, read a page at a time, never held in memory.

**Split by job**, each module with its part of the design:

| module | job |
|---|---|
| ``_file_index_db`` | connections, transactions (the write lock, first come first served), schema and upgrades, the first build, a replaced database |
| ``_file_index_rows`` | the tables and every row change, recorded in the feed |
| ``_file_index_membership`` | ``exists`` from a mapped fingerprint set, compaction |
| ``_file_index_writes`` | puts, deletes, eviction, read recency: the protocol |
| ``_file_index_recovery`` | changes in flight: waiting for them, recovering dead writers |
| ``_file_retention`` | pins and retention |
| this module | the contract assembled; the feed and listings |

**What the index trusts.** Objects are added and removed through the backend. A file that
vanishes behind its back (an operator's ``rm``) is reported present until a read misses it
and fixes the row; files placed behind its back are found by ``adopt`` (or a rebuild, below).
A root without an index (a store written before it existed, or whose ``index/`` was
removed) gets one built at open from one walk of ``objects/``, once, under a file lock that
other openers wait on (``_file_index_db``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence

from . import _file_retention as holds
from ._file_index_db import DB_NAME, IndexDB
from ._file_index_membership import Membership
from ._file_index_recovery import Recovery, pid_alive, pid_namespace
from ._file_index_rows import (
    SQL_CHUNK,
    Owner,
    Rows,
    feed_seq,
    growth_in_flight,
    meta,
    reserved,
    signed,
)
from ._file_index_writes import Writes
from ._file_site import HostClaim
from ._fingerprints import decode_changes, fingerprint, lookup
from ._lru import rank_at, rank_seconds
from .errors import BackendError, OutOfSpaceError
from .index import (
    EvictionCount,
    FeedChanges,
    IndexFeatures,
    ObjectIndex,
    ObjectSite,
    Reservation,
)
from .retention import Retention


class FileIndex(ObjectIndex):
    """The index of one root. Thread-safe: each thread gets its own SQLite connection.

    ``site`` is the store of the bytes (the index measures and removes objects only while
    settling, evicting or reconciling). ``durable`` makes every commit wait for the device
    (SQLite ``synchronous=FULL``); otherwise commits reach the device at checkpoints, and a
    power loss may forget the last ones (the files they describe are then found by ``adopt``).
    """

    features = IndexFeatures(exact=True, retention=True, change_feed=True, in_memory=True)

    def __init__(
        self,
        root: str,
        site: ObjectSite,
        *,
        token: str,
        durable: bool = False,
        lock_timeout: float = 30.0,
        index_hosts: str = "name",
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
    ) -> None:
        self.dir = os.path.join(root, "index")
        self.db_path = os.path.join(self.dir, DB_NAME)
        self.read_only = read_only
        self._site = site
        self._clock = clock
        self.rebuilt = False
        self.recovered = 0
        self.writer = token
        if not read_only:
            os.makedirs(self.dir, exist_ok=True)
        owner = Owner(os.getpid(), pid_namespace(), token)
        #: the host that uses this index (``_file_site``; ``index_hosts``: what a host is):
        #: claimed before SQLite opens it (read-only: checked, never written).
        self.host = HostClaim(self.dir, os.path.join(root, "tmp"), token,
                              index_hosts=index_hosts, read_only=read_only)
        self.host.claim()
        self._db = IndexDB(self.dir, self.host, durable=durable, lock_timeout=lock_timeout,
                           read_only=read_only)
        self._rows = Rows(self._db, site, owner)
        self._membership = Membership(self._db, f"{owner.pid}-{owner.token}")
        self._recovery = Recovery(self._db, self._rows)
        self._writes = Writes(self._db, self._rows, self._recovery, clock,
                              self._membership.maybe_compact)
        self._db.open(self._build)
        if read_only:
            return
        # (on a full filesystem: left to the next recovery, at any eviction or open)
        with contextlib.suppress(OutOfSpaceError):
            self.recovered = self.recover()

    @property
    def lock_timeout(self) -> float:
        """Seconds a call waits for the write lock or for a key busy in another process."""
        return self._db.lock_timeout

    @lock_timeout.setter
    def lock_timeout(self, seconds: float) -> None:
        self._db.lock_timeout = seconds

    def _build(self) -> None:
        """Index every object of a walk of the store (the oldest first in line), then write the
        first snapshot so that no process replays the build as changes."""
        batch: list[tuple[str, int, int, int]] = []
        for key, found in self._site.walk():
            batch.append((key, signed(fingerprint(key)), found.charged, rank_at(found.mtime)))
            if len(batch) >= SQL_CHUNK:
                with self._db.write() as con:
                    con.executemany("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?)", batch)
                batch = []
        with self._db.write() as con:
            con.executemany("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?)", batch)
            total, count = con.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM objects"
                                       ).fetchone()
            con.execute("UPDATE meta SET value = ? WHERE name = 'total_bytes'", (total,))
            con.execute("UPDATE meta SET value = ? WHERE name = 'count'", (count,))
        self.rebuilt = True
        self._membership.compact_now()

    # -- presence ------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        return self._membership.exists(keys)

    def exists_if_current(self, keys: Sequence[str]) -> list[bool] | None:
        # docstring inherited
        return self._membership.exists_if_current(keys)

    def exists_recent(self, keys: Sequence[str], max_age_s: float) -> list[bool] | None:
        # docstring inherited
        return self._membership.exists_recent(keys, max_age_s)

    def check(self) -> None:
        # docstring inherited. Another host took the root's index over (``_file_site``).
        self.host.raise_if_taken_over()

    def compact(self) -> bool:
        """Write a snapshot of every fingerprint and prune the feed; False if another process
        holds the compaction lease."""
        return self._membership.compact()

    # -- the bound, deletes, reads ------------------------------------------------------------------

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], capacity: int,
                pin_budget: int | None = None) -> Reservation:
        # docstring inherited
        return self._writes.reserve(keys, sizes, capacity, pin_budget)

    def make_room(self, capacity: int, reservation: Reservation | None = None) -> EvictionCount:
        # docstring inherited
        return self._writes.make_room(capacity, reservation)

    def settle_put(self, reservation: Reservation) -> None:
        # docstring inherited
        self._writes.settle_put(reservation)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        return self._writes.delete(keys)

    def delete_until_held(self, groups: Sequence[Sequence[str]]) -> tuple[int, list[bool]]:
        # docstring inherited
        return self._writes.delete_until_held(groups)

    def delete_unindexed(self, keys: Sequence[str]) -> int:
        # docstring inherited
        return self._writes.delete_unindexed(keys)

    def touch(self, keys: Sequence[str]) -> bool:
        # docstring inherited
        return self._writes.touch(keys)

    def flush_touches(self) -> None:
        # docstring inherited
        self._writes.flush_touches()

    def repair_missing(self, key: str) -> None:
        # docstring inherited. Not when open read-only.
        if not self.read_only:
            self._writes.repair_missing(key, self.exists([key])[0])

    def adopt(self, keys: Sequence[str]) -> int:
        # docstring inherited
        return self._writes.adopt(keys)

    def recover(self) -> int:
        # docstring inherited
        return self._recovery.recover()

    # -- retention (``_file_retention``) ----------------------------------------------------------

    def retain(self, keys: Sequence[str], retention: Retention, pin_budget: int) -> None:
        # docstring inherited
        with self._db.write() as con:
            holds.retain(con, keys, retention, now=self._clock(), budget=pin_budget,
                         in_flight=growth_in_flight(con))

    def release(self, keys: Sequence[str], owner: str) -> None:
        # docstring inherited
        with self._db.write() as con:
            holds.release(con, keys, owner)

    def retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        # docstring inherited
        with self._db.read() as con:
            return holds.entries_of(con, keys, self._clock())

    def pinned_bytes(self) -> int:
        # docstring inherited
        with self._db.read() as con:
            return holds.pinned_bytes(con, self._clock())

    # -- the named change feed (store-wide events) ------------------------------------------

    def changes_after(self, seq: int, limit: int = 64) -> FeedChanges:
        """The changes numbered after ``seq``, named (at most ``limit`` feed rows, oldest
        first), and the number of the last change. ``complete`` is False when some of them
        cannot be told: pruned by a compaction, recorded by a version that did not name them,
        or numbered anew by a rebuilt index (the last number is below ``seq``); the reader
        then starts again from ``listing``."""
        with self._db.read() as con:
            last = feed_seq(con)
            rows = con.execute("SELECT seq, recs, keys FROM feed WHERE seq > ? ORDER BY seq "
                               "LIMIT ?", (seq, limit)).fetchall()
        changes: list[tuple[str, bool]] = []
        at = seq
        for row_seq, recs, keys in rows:
            records = decode_changes(recs)
            if keys is None or row_seq - len(records) != at:
                return FeedChanges(last, seq, [], complete=False)
            names = keys.split("\n")
            if len(names) != len(records):
                return FeedChanges(last, seq, [], complete=False)
            changes.extend(zip(names, (bool(p) for p in records["present"]), strict=True))
            at = row_seq
        if not rows and last != seq:
            return FeedChanges(last, seq, [], complete=False)
        return FeedChanges(last, at, changes, complete=True)

    def listing(self) -> tuple[int, list[str]]:
        """Every indexed key and the number of the last change, as of one moment."""
        with self._db.read() as con:
            last = feed_seq(con)
            keys = [key for (key,) in con.execute("SELECT key FROM objects")]
        return last, keys

    # -- listing and totals --------------------------------------------------------------------------

    def key_pages(self, prefix: str, page: int = 4096) -> Iterator[list[str]]:
        """The indexed keys starting with ``prefix`` in key order, ``page`` at a time (each page
        its own short read, so a slow consumer holds nothing open)."""
        after: str | None = None
        while True:
            keys = self.keys_after(prefix, after, page)
            if keys:
                yield keys
            if len(keys) < page:
                return
            after = keys[-1]

    def keys_after(self, prefix: str, after: str | None, limit: int) -> list[str]:
        """Up to ``limit`` indexed keys starting with ``prefix``, in key order, after ``after``."""
        low = prefix if after is None or after < prefix else after
        op = ">=" if after is None or after < prefix else ">"
        sql = f"SELECT key FROM objects WHERE key {op} ?"  # noqa: S608 - op is ">=" or ">"
        params: list[object] = [low]
        if prefix:
            sql += " AND key < ?"
            params.append(prefix[:-1] + chr(ord(prefix[-1]) + 1))
        with self._db.read() as con:
            return [k for (k,) in con.execute(f"{sql} ORDER BY key LIMIT ?", (*params, limit))]

    def entry_pages(self, prefix: str, page: int = 4096
                    ) -> Iterator[list[tuple[str, int, float]]]:
        """``key_pages`` with each key's size and last-use time: ``(key, size, seconds)``
        (the time of its rank: its last write or read, ms resolution)."""
        after: str | None = None
        while True:
            rows = self.entries_after(prefix, after, page)
            if rows:
                yield [(key, size, rank_seconds(rank)) for key, size, rank in rows]
            if len(rows) < page:
                return
            after = rows[-1][0]

    def entries_after(self, prefix: str, after: str | None, limit: int
                      ) -> list[tuple[str, int, int]]:
        """``keys_after`` with each key's size and rank: ``(key, size, rank)``."""
        low = prefix if after is None or after < prefix else after
        op = ">=" if after is None or after < prefix else ">"
        sql = f"SELECT key, size, rank FROM objects WHERE key {op} ?"  # noqa: S608 - op fixed
        params: list[object] = [low]
        if prefix:
            sql += " AND key < ?"
            params.append(prefix[:-1] + chr(ord(prefix[-1]) + 1))
        with self._db.read() as con:
            return list(con.execute(f"{sql} ORDER BY key LIMIT ?", (*params, limit)))

    def totals(self) -> tuple[int, int]:
        """``(bytes, objects)`` indexed."""
        with self._db.read() as con:
            return meta(con, "total_bytes"), meta(con, "count")

    def reserved_bytes(self) -> int:
        with self._db.read() as con:
            return reserved(con)

    # -- close -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush read recency, stop a compaction, close every connection."""
        with contextlib.suppress(BackendError):
            self.flush_touches()
        self._membership.stop()
        self._db.close()


__all__ = ["DB_NAME", "FileIndex", "fingerprint", "lookup", "pid_alive"]
