"""Retention in the file backend's index: one table, the SQL every process of a root shares.

``retention(key, owner, until_s, pinned, priority)``, keyed by ``(key, owner)``: the entries
of ``backends.retention``, one per owner per key, in the same SQLite database as ``objects``
(``_file_index``). So holds are seen by every process of the root at once, survive the
process that made them (a SIGKILLed pinner's pins stay until released or expired), and
change in the same transactions as the rows they describe: a delete or an eviction drops a
key's entries with its row, so no entry outlives its object and none is left behind by a
crash. An index rebuilt from ``objects/`` (``index/`` removed) starts with no holds.

Every function here runs inside a transaction its caller opened (``FileIndex._read`` or
``_write``); none commits.

**Eviction order** (``UNHELD``, ``retained_victims``), the one of
``backends.retention``: rows with no holding entry in the index's usual rank order, then
retained rows by ascending effective priority (the highest of their entries), by rank within
one priority, never a row with a holding pin. Entries past their deadline are deleted first
(``expire``), so "holds" is "has a row here" for the rest of the transaction. While the table
is empty (``any_entries``: one indexed probe) eviction costs what it did without retention.

**Pin budget**: ``retain`` with a holding pin sums the bytes pinned now (one join) and
refuses the whole call with ``PinBudgetError`` when the new keys would pass the budget; the
caller's transaction then rolls back, so nothing is applied.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence

from .retention import Retention, check_pin_budget

#: created at every open (``IF NOT EXISTS``), so an index written before retention gets it.
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS retention (
        key TEXT NOT NULL,
        owner TEXT NOT NULL,
        until_s REAL,
        pinned INTEGER NOT NULL,
        priority INTEGER NOT NULL,
        PRIMARY KEY (key, owner)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS retention_by_until ON retention(until_s)",
)
_CHUNK = 10_000  # parameters per statement (SQLite allows 32,766)


def has_table(con: sqlite3.Connection) -> bool:
    return con.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'retention'"
    ).fetchone() is not None


def create(con: sqlite3.Connection) -> None:
    for statement in SCHEMA:
        con.execute(statement)


def any_entries(con: sqlite3.Connection) -> bool:
    """Whether any entry exists (held or expired): the eviction hot path's only question
    while nothing is retained."""
    return con.execute("SELECT 1 FROM retention LIMIT 1").fetchone() is not None


def expire(con: sqlite3.Connection, now: float) -> None:
    """Delete the entries that no longer hold at ``now`` (their objects are ordinary data)."""
    con.execute("DELETE FROM retention WHERE until_s IS NOT NULL AND until_s <= ?", (now,))


def _chunks(keys: Sequence[str]) -> Iterator[list[str]]:
    unique = list(dict.fromkeys(keys))
    for start in range(0, len(unique), _CHUNK):
        yield unique[start : start + _CHUNK]


def _marks(n: int) -> str:
    return ",".join("?" * n)


#: SQL condition on a row of ``objects``: no entry holds it (after ``expire``: no entry).
UNHELD = "NOT EXISTS (SELECT 1 FROM retention r WHERE r.key = objects.key)"


def retained_victims(con: sqlite3.Connection) -> Iterator[tuple[str, int]]:
    """``(key, size)`` of the stored keys that are retained but not pinned, in eviction order
    (ascending effective priority, then rank). Call after ``expire``."""
    yield from con.execute(
        "SELECT o.key, o.size FROM retention r JOIN objects o ON o.key = r.key "
        "GROUP BY o.key HAVING MAX(r.pinned) = 0 "
        "ORDER BY MAX(r.priority), o.rank, o.key"
    )


def pinned_bytes(con: sqlite3.Connection, now: float) -> int:
    """Bytes of the stored objects with a pin that holds at ``now``."""
    value: int = con.execute(
        "SELECT COALESCE(SUM(size), 0) FROM objects WHERE key IN (SELECT key FROM retention "
        "WHERE pinned = 1 AND (until_s IS NULL OR until_s > ?))",
        (now,),
    ).fetchone()[0]
    return value


def retain(
    con: sqlite3.Connection, keys: Sequence[str], retention: Retention, *,
    now: float, budget: int,
) -> None:
    """Set ``retention.owner``'s entry on each stored key of ``keys`` (absent keys: nothing).
    A holding pin is first checked against ``budget`` (``PinBudgetError``, nothing set)."""
    stored: dict[str, int] = {}
    for chunk in _chunks(keys):
        stored.update(con.execute(
            f"SELECT key, size FROM objects WHERE key IN ({_marks(len(chunk))})",  # noqa: S608
            chunk,
        ).fetchall())
    if not stored:
        return
    if retention.pinned and retention.holds(now):
        pinned: set[str] = set()
        for chunk in _chunks(list(stored)):
            pinned.update(k for (k,) in con.execute(
                "SELECT DISTINCT key FROM retention WHERE pinned = 1 AND (until_s IS NULL OR "  # noqa: S608
                f"until_s > ?) AND key IN ({_marks(len(chunk))})", (now, *chunk),
            ))
        asked = sum(size for key, size in stored.items() if key not in pinned)
        check_pin_budget(budget=budget, used=pinned_bytes(con, now), asked=asked, backend="file")
    con.executemany(
        "INSERT INTO retention VALUES (?, ?, ?, ?, ?) ON CONFLICT(key, owner) DO UPDATE SET "
        "until_s = excluded.until_s, pinned = excluded.pinned, priority = excluded.priority",
        [(key, retention.owner, retention.until_s, int(retention.pinned), retention.priority)
         for key in stored],
    )


def release(con: sqlite3.Connection, keys: Sequence[str], owner: str) -> None:
    """Drop ``owner``'s entry on each key."""
    con.executemany("DELETE FROM retention WHERE key = ? AND owner = ?",
                    [(key, owner) for key in dict.fromkeys(keys)])


def drop(con: sqlite3.Connection, keys: Sequence[str]) -> None:
    """Drop every entry of each key (its row is going: deleted, evicted or found missing)."""
    con.executemany("DELETE FROM retention WHERE key = ?", [(key,) for key in keys])


def entries_of(
    con: sqlite3.Connection, keys: Sequence[str], now: float
) -> list[tuple[Retention, ...]]:
    """The entries holding on each key at ``now``, ordered by owner."""
    found: dict[str, list[Retention]] = {}
    for chunk in _chunks(keys):
        for key, owner, until_s, pinned, priority in con.execute(
            "SELECT key, owner, until_s, pinned, priority FROM retention WHERE (until_s IS NULL "  # noqa: S608
            f"OR until_s > ?) AND key IN ({_marks(len(chunk))}) ORDER BY key, owner",
            (now, *chunk),
        ):
            found.setdefault(key, []).append(Retention(owner, until_s, bool(pinned), priority))
    return [tuple(found.get(key, ())) for key in keys]
