"""Changes in flight in a file root's index: waiting for other writers, and recovering dead ones.

The file system and the index cannot change in one transaction, so every change is announced
(a ``pending`` row per key, with its owner: pid, pid namespace, token), done, then settled. A
process killed between the two leaves pending rows. Whoever finds them (every open, and every
eviction that runs short) with their owner dead *reconciles* each key (``Recovery.recover``):
a dead delete is finished (its object removed: the room it freed may be taken), then every
key's row is set from the store (present with its size, or absent). Nothing is invented, and
the bound holds.

An owner is alive while its pid exists in this pid namespace (one we cannot tell about, in
another namespace, until its rows are ``STALE_PENDING_SECONDS`` old).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator

from ._file_index_db import IndexDB
from ._file_index_rows import SQL_CHUNK, Rows, marks
from .errors import BackendUnavailableError

#: pending changes older than this are stale whoever owns them (no put lasts an hour).
STALE_PENDING_SECONDS = 3600.0


class Recovery:
    """Waiting for, and recovering, the changes in flight of one index."""

    def __init__(self, db: IndexDB, rows: Rows) -> None:
        self._db = db
        self._rows = rows

    def recover(self) -> int:
        """Reconcile the keys of pending changes whose owner is gone (or stale); return how
        many pending rows were settled."""
        with self._db.read() as con:
            if not con.execute("SELECT 1 FROM pending LIMIT 1").fetchone():
                return 0  # the common case, without taking the write lock
        with self._db.write() as con:
            rows = con.execute(
                "SELECT rowid, key, pid, pidns, token, since, op FROM pending"
            ).fetchall()
            dead = [r for r in rows if not self.alive(r[2], r[3], r[4], r[5])]
            if not dead:
                return 0
            # A dead delete (or eviction) is finished, not undone: its rows went at T1 and the
            # room they freed may already be another put's, so giving an object that stayed
            # its row back would put the store over its bound. No live put can be writing such
            # a key (a put waits for pending deletes). An object that cannot be removed keeps
            # its row, as in a live delete.
            self._rows.site.remove(sorted({r[1] for r in dead if r[6] == "del"}))
            for start in range(0, len(dead), SQL_CHUNK):
                chunk = [r[0] for r in dead[start : start + SQL_CHUNK]]
                con.execute(  # only "?" placeholders are formatted in
                    f"DELETE FROM pending WHERE rowid IN ({marks(len(chunk))})", chunk  # noqa: S608
                )
            self._rows.set_from_site(con, sorted({r[1] for r in dead}), None)
        return len(dead)

    def alive(self, pid: int, pidns: int, token: str, since: float) -> bool:
        owner = self._rows.owner
        if token == owner.token:
            return True
        if time.time() - since > STALE_PENDING_SECONDS:
            return False
        if pidns != owner.pidns:
            return True  # another pid namespace: cannot tell, trust it until it is stale
        return pid_alive(pid)

    def until_unblocked(
        self, keys: set[str], *, only_deletes: bool, operation: str
    ) -> Iterator[sqlite3.Connection]:
        """Yield a write transaction once no live call (of this process or another) has a
        change in flight on ``keys`` (only deletes, when ``only_deletes``); dead owners'
        changes are reconciled first. The caller's body runs exactly once, inside it."""
        deadline = time.monotonic() + self._db.lock_timeout
        pause = 0.001
        while True:
            stale = False
            with self._db.write() as con:
                blocking = [
                    r for r in pending_on(con, keys)
                    if r[1] == "del" or not only_deletes
                ]
                if not blocking:
                    yield con
                    return
                stale = any(not self.alive(r[2], r[3], r[4], r[5]) for r in blocking)
            if stale:
                self.recover()
                continue
            if time.monotonic() > deadline:
                raise BackendUnavailableError(
                    f"{len(blocking)} of the keys stayed busy in another process for "
                    f"{self._db.lock_timeout} s", backend="file", operation=operation,
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def pending_on(
    con: sqlite3.Connection, keys: Iterable[str]
) -> list[tuple[str, str, int, int, str, float]]:
    """The pending rows (key, op, pid, pidns, token, since) of ``keys``, selected inside
    SQLite: with thousands of puts in flight, handing every pending row to Python in each
    put's transaction was most of the time the write lock was held."""
    found: list[tuple[str, str, int, int, str, float]] = []
    unique = list(keys)
    for start in range(0, len(unique), SQL_CHUNK):
        chunk = unique[start : start + SQL_CHUNK]
        found += con.execute(
            "SELECT key, op, pid, pidns, token, since FROM pending "  # noqa: S608
            f"WHERE key IN ({marks(len(chunk))})", chunk,
        ).fetchall()
    return found


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


__all__ = ["STALE_PENDING_SECONDS", "Recovery", "pid_alive", "pid_namespace"]
