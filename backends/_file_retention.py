"""Retention in the file backend's index: one table, the SQL every process of a root shares.

``retention(key, owner, until_s, pinned, priority)``, keyed by ``(key, owner)``: the entries
of ``backends.retention``, one per owner per key, in the same SQLite database as ``objects``
(``_file_index``). So holds are seen by every process of the root at once, survive the
process that made them (a SIGKILLed pinner's pins stay until released or expired), and
change in the same transactions as the rows they describe: a delete or an eviction drops a
key's entries with its row, so no entry outlives its object and none is left behind by a
crash. An index rebuilt from ``objects/`` (``index/`` removed) starts with no holds.

Every function here runs inside a transaction its caller opened (``IndexDB.read`` or
``write``, ``_file_index_db``); none commits.

**Eviction order** (``UNHELD``, ``retained_victims``), the one of
``backends.retention``: rows with no holding entry in the index's usual rank order, then
retained rows by ascending effective priority (the highest of their entries), by rank within
one priority, never a row with a holding pin. Entries past their deadline are deleted first
(``expire``), so "holds" is "has a row here" for the rest of the transaction. While the table
is empty (``any_entries``: one indexed probe) eviction costs what it did without retention.

**Pin budget**: pinned bytes are the stored sizes of the pinned objects plus what puts in
flight will add to them (``in_flight``: the growth each pending rewrite reserved, passed in
by the index, which owns the pending table). ``retain`` with a holding pin refuses the whole
call with ``PinBudgetError`` when the new keys would pass the budget; ``charge_rewrite``
refuses a put whose rewrites of pinned objects would (a rewrite of a pinned object keeps its
pins, so it is charged as one). The caller's transaction then rolls back: nothing is applied.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence

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


def held_among(con: sqlite3.Connection, keys: Sequence[str], now: float, *,
               pins_only: bool = False) -> set[str]:
    """The keys of ``keys`` with an entry (a pin or a retention; ``pins_only``: a pin) that
    holds at ``now``."""
    pinned = "pinned = 1 AND " if pins_only else ""
    held: set[str] = set()
    for chunk in _chunks(keys):
        held.update(k for (k,) in con.execute(
            f"SELECT DISTINCT key FROM retention WHERE {pinned}(until_s IS NULL OR until_s > ?) "  # noqa: S608
            f"AND key IN ({_marks(len(chunk))})", (now, *chunk),
        ))
    return held


def _pinned_in_flight(con: sqlite3.Connection, in_flight: Mapping[str, int], now: float) -> int:
    """Bytes the puts in flight (``in_flight``: key -> growth) will add to pinned objects."""
    if not in_flight:
        return 0
    return sum(in_flight[key] for key in held_among(con, list(in_flight), now, pins_only=True))


def retain(
    con: sqlite3.Connection, keys: Sequence[str], retention: Retention, *,
    now: float, budget: int, in_flight: Mapping[str, int],
) -> None:
    """Set ``retention.owner``'s entry on each stored key of ``keys`` (absent keys: nothing).
    A holding pin is first checked against ``budget`` (``PinBudgetError``, nothing set),
    each key counted at its stored size plus its growth in flight (``in_flight``)."""
    stored: dict[str, int] = {}
    for chunk in _chunks(keys):
        stored.update(con.execute(
            f"SELECT key, size FROM objects WHERE key IN ({_marks(len(chunk))})",  # noqa: S608
            chunk,
        ).fetchall())
    if not stored:
        return
    if retention.pinned and retention.holds(now):
        pinned = held_among(con, list(stored), now, pins_only=True)
        asked = sum(size + in_flight.get(key, 0) for key, size in stored.items()
                    if key not in pinned)
        used = pinned_bytes(con, now) + _pinned_in_flight(con, in_flight, now)
        check_pin_budget(budget=budget, used=used, asked=asked, backend="file")
    con.executemany(
        "INSERT INTO retention VALUES (?, ?, ?, ?, ?) ON CONFLICT(key, owner) DO UPDATE SET "
        "until_s = excluded.until_s, pinned = excluded.pinned, priority = excluded.priority",
        [(key, retention.owner, retention.until_s, int(retention.pinned), retention.priority)
         for key in stored],
    )


def charge_rewrite(
    con: sqlite3.Connection, growth: Mapping[str, int], *, now: float, budget: int,
    in_flight: Mapping[str, int],
) -> None:
    """A put that rewrites stored objects larger (``growth``: key -> bytes added) is charged,
    for the pinned ones, against ``budget``: ``PinBudgetError`` (operation ``put``) when the
    pinned bytes, with the puts already in flight (``in_flight``) and this growth, would pass
    it. Objects without a holding pin, and rewrites that do not grow, are not charged."""
    if not growth:
        return
    pinned = held_among(con, list(growth), now, pins_only=True)
    if not pinned:
        return
    used = pinned_bytes(con, now) + _pinned_in_flight(con, in_flight, now)
    check_pin_budget(budget=budget, used=used, asked=sum(growth[key] for key in pinned),
                     backend="file", operation="put")


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
