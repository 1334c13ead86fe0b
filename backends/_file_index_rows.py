"""The rows of a file root's index, inside one transaction: objects, pending changes, the feed.

``objects(key, fp, size, rank)`` (rank: ``_lru.chain_ranks``; smallest is evicted first),
``pending(key, op, size, owner...)`` (changes in flight), ``feed(seq, recs, keys)`` (the
changes, packed), ``meta(name, value)`` (total bytes, object count, snapshot change number,
compaction lease). Every function here runs inside a transaction its caller opened
(``IndexDB.read`` / ``write``); none commits.

Rows change only through ``Rows.set_from_site`` (a key's row made to match its object in the
store) and ``Rows.remove`` (rows taken out: deleted, evicted or found missing): each records
its changes in the feed and keeps ``total_bytes`` and ``count`` exact.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import _file_retention as holds
from ._file_index_db import IndexDB
from ._fingerprints import encode_changes, fingerprint
from ._lru import rank_at
from .index import ObjectSite, is_page_prefix, page_of

SQL_CHUNK = 10_000  # bound on the parameters of one statement (SQLite allows 32,766)
_VICTIM_PAGE = 256
_SIGN64 = 1 << 63
_MASK64 = (1 << 64) - 1


def signed(fp: int) -> int:
    """``fp`` as SQLite stores it (a signed 64-bit integer with the same bits)."""
    return fp - (1 << 64) if fp >= _SIGN64 else fp


def marks(n: int) -> str:
    return ",".join("?" * n)


@dataclass
class Owner:
    """Who makes a change in flight: this process (``pid`` in pid namespace ``pidns``) and its
    backend's ``token``."""

    pid: int
    pidns: int
    token: str


def feed_seq(con: sqlite3.Connection) -> int:
    """The number of the last change ever recorded (pruned ones included)."""
    row = con.execute("SELECT seq FROM sqlite_sequence WHERE name = 'feed'").fetchone()
    return int(row[0]) if row else 0


def meta(con: sqlite3.Connection, name: str) -> int:
    value: int = con.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0]
    return value


def add_meta(con: sqlite3.Connection, *, total: int = 0, count: int = 0) -> None:
    if total:
        con.execute("UPDATE meta SET value = value + ? WHERE name = 'total_bytes'", (total,))
    if count:
        con.execute("UPDATE meta SET value = value + ? WHERE name = 'count'", (count,))


def rows_of(con: sqlite3.Connection, keys: Sequence[str]) -> dict[str, int]:
    """``{key: size}`` of the indexed keys among ``keys``."""
    found: dict[str, int] = {}
    unique = list(dict.fromkeys(keys))
    for start in range(0, len(unique), SQL_CHUNK):
        chunk = unique[start : start + SQL_CHUNK]
        found.update(con.execute(
            f"SELECT key, size FROM objects WHERE key IN ({marks(len(chunk))})",  # noqa: S608
            chunk,
        ).fetchall())
    return found


def reserved(
    con: sqlite3.Connection, first: int | None = None, mine: tuple[str, int] | None = None
) -> int:
    """Bytes of the puts in flight: all of them, or (``first``: the first pending rowid of
    the put ``mine`` = owner token, batch) those of that put and the puts before it."""
    query = "SELECT COALESCE(SUM(size), 0) FROM pending WHERE op = 'put'"
    if first is None or mine is None:
        value: int = con.execute(query).fetchone()[0]
    else:
        value = con.execute(
            f"{query} AND (rowid < ? OR (token = ? AND batch = ?))", (first, *mine)
        ).fetchone()[0]
    return value


def committed(con: sqlite3.Connection) -> int:
    """Bytes of the indexed objects and of every put in flight, in one statement (a put that
    has just announced its keys, in the same transaction, is the last of those puts)."""
    value: int = con.execute(
        "SELECT (SELECT value FROM meta WHERE name = 'total_bytes')"
        " + (SELECT COALESCE(SUM(size), 0) FROM pending WHERE op = 'put')"
    ).fetchone()[0]
    return value


def first_row(con: sqlite3.Connection, mine: tuple[str, int] | None) -> int | None:
    """The first pending rowid of the put ``mine`` (owner token, batch), if it is pending."""
    if mine is None:
        return None
    row = con.execute(
        "SELECT MIN(rowid) FROM pending WHERE token = ? AND batch = ?", mine
    ).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def growth_in_flight(con: sqlite3.Connection) -> dict[str, int]:
    """key -> the bytes the puts in flight reserved for it (a rewrite: its growth)."""
    return dict(con.execute(
        "SELECT key, SUM(size) FROM pending WHERE op = 'put' AND size > 0 GROUP BY key"))


def earlier_puts(con: sqlite3.Connection, first: int) -> int:
    """How many pending put rows came before rowid ``first``."""
    value: int = con.execute(
        "SELECT COUNT(*) FROM pending WHERE op = 'put' AND rowid < ?", (first,)
    ).fetchone()[0]
    return value


class Rows:
    """Row changes of one index: each matches the store (``site``) and is recorded in the feed."""

    def __init__(self, db: IndexDB, site: ObjectSite, owner: Owner) -> None:
        self._db = db
        self.site = site
        self.owner = owner

    def set_from_site(
        self, con: sqlite3.Connection, keys: Sequence[str], ranks: Sequence[int] | None
    ) -> None:
        """Make each key's row match its object: present with the object's size, or absent.

        A present key's rank comes from ``ranks`` (parallel to ``keys``; the first occurrence
        of a repeated key counts) when given; otherwise a row that exists keeps its rank and
        a new row ranks as its object's mtime."""
        rows = rows_of(con, keys)
        rank_of: dict[str, int] = {}
        if ranks is not None:
            for key, rank in zip(keys, ranks, strict=True):
                rank_of.setdefault(key, rank)
        upserts: list[tuple[str, int, int, int]] = []
        resized: list[tuple[int, str]] = []
        gone: list[tuple[str, int]] = []
        total = 0
        unique = list(dict.fromkeys(keys))
        for key, found in zip(unique, self.site.measure(unique), strict=True):
            old = rows.get(key)
            if found is None:
                if old is not None:
                    gone.append((key, old))
                continue
            size = found.charged
            total += size - (old or 0)
            if key in rank_of:
                upserts.append((key, signed(fingerprint(key)), size, rank_of[key]))
            elif old is None:
                upserts.append((key, signed(fingerprint(key)), size, rank_at(found.mtime)))
            elif old != size:
                resized.append((size, key))
        if upserts:
            con.executemany(
                "INSERT INTO objects VALUES (?, ?, ?, ?) ON CONFLICT(key) DO UPDATE "
                "SET size = excluded.size, rank = excluded.rank", upserts,
            )
        con.executemany("UPDATE objects SET size = ? WHERE key = ?", resized)
        added = [(key, fp & _MASK64) for key, fp, _, _ in upserts if key not in rows]
        self._append_feed(con, [fp for _, fp in added], [key for key, _ in added], present=True)
        add_meta(con, total=total, count=len(added))
        self.remove(con, gone)

    def rank_pages(self, con: sqlite3.Connection, ranks: dict[str, int]) -> None:
        """Make each page of ``ranks`` (``index.page_of``) at least that recent: every indexed
        object of it, whichever call wrote it (its objects are one unit of eviction)."""
        pages = [(rank, page, page_end(page), rank) for page, rank in ranks.items()
                 if page_end(page) is not None]
        singles = [(rank, page, rank) for page, rank in ranks.items() if page_end(page) is None]
        if pages:
            con.executemany(
                "UPDATE objects SET rank = ? WHERE key >= ? AND key < ? AND rank < ?", pages)
        if singles:
            con.executemany("UPDATE objects SET rank = ? WHERE key = ? AND rank < ?", singles)

    def remove(self, con: sqlite3.Connection, rows: Sequence[tuple[str, int]]) -> None:
        """Take ``(key, size)`` rows out (with their retention entries)."""
        if not rows:
            return
        con.executemany("DELETE FROM objects WHERE key = ?", [(key,) for key, _ in rows])
        keys = [key for key, _ in rows]
        if holds.any_entries(con):
            holds.drop(con, keys)
        self._append_feed(con, [fingerprint(key) for key in keys], keys, present=False)
        add_meta(con, total=-sum(size for _, size in rows), count=-len(rows))

    def _append_feed(
        self, con: sqlite3.Connection, fps: list[int], keys: list[str], *, present: bool
    ) -> None:
        """Record in the change feed that ``keys`` (their fingerprints ``fps``) became present
        (absent): one row for them all, numbered by its last change (changes are counted,
        rows are not)."""
        if fps:
            self._db.mark_changed()
            con.execute("INSERT INTO feed (seq, recs, keys) VALUES (?, ?, ?)",
                        (feed_seq(con) + len(fps), encode_changes(fps, present),
                         "\n".join(keys)))

    def announce(self, con: sqlite3.Connection, keys: Sequence[str], op: str, batch: int,
                 sizes: Sequence[int] | None = None) -> None:
        """Record changes in flight on ``keys`` (``op`` put or del) by this owner's ``batch``;
        ``sizes``: the bytes each put adds (0 for deletes)."""
        owner, since = self.owner, time.time()
        counted = sizes if sizes is not None else [0] * len(keys)
        con.executemany(
            "INSERT INTO pending VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(key, op, size, owner.pid, owner.pidns, owner.token, batch, since)
             for key, size in zip(keys, counted, strict=True)],
        )

    def release(self, con: sqlite3.Connection, batch: int) -> None:
        """Drop this owner's pending rows of ``batch``."""
        con.execute("DELETE FROM pending WHERE token = ? AND batch = ?",
                    (self.owner.token, batch))

    def pick_victims(
        self, con: sqlite3.Connection, need: int, skip: set[str], now: float
    ) -> list[tuple[str, int]]:
        """The rows worth at least ``need`` bytes (or all there are) first in eviction order,
        a whole page at a time (``index.page_of``: a page whose object is chosen goes with
        every indexed object of it, or not at all), less pages with a key in flight or in
        ``skip``: the lowest-ranked rows, and while any retention entry exists, the pages of
        unretained ones by rank, then the retained ones (``_file_retention``), never a page
        with a pinned object; while entries exist, nothing when even all of that is not
        enough."""
        busy = {key for (key,) in con.execute("SELECT key FROM pending")}
        retained = holds.any_entries(con)
        if retained:
            holds.expire(con, now)
            retained = holds.any_entries(con)
        victims: list[tuple[str, int]] = []
        seen: set[str] = set()
        freed = 0

        def take(rows: Iterable[tuple[str, int]], *, retained_ok: bool) -> bool:
            """Add the pages of ``rows`` in order, less pages busy, skipped or held (held
            by a pin, or at all unless ``retained_ok``), until ``need`` bytes are freed;
            whether they are."""
            nonlocal freed
            for key, size in rows:
                page = page_of(key)
                if page in seen:
                    continue
                seen.add(page)
                members = [(key, size)] if page == key else self._page_rows(con, page)
                names = [name for name, _ in members]
                if any(name in busy or name in skip for name in names):
                    continue
                if retained and page != key and self._held(con, names, pinned_only=retained_ok):
                    continue
                victims.extend(members)
                freed += sum(nbytes for _, nbytes in members)
                if freed >= need:
                    return True
            return False

        after: tuple[int, str] | None = None
        # while entries exist, held rows are passed over inside SQLite (one primary-key probe
        # of ``retention`` per row), never handed to Python
        unheld = f" AND {holds.UNHELD}" if retained else ""
        while freed < need:
            if after is None:
                page = con.execute(
                    f"SELECT key, size, rank FROM objects WHERE 1{unheld} "  # noqa: S608
                    "ORDER BY rank, key LIMIT ?", (_VICTIM_PAGE,),
                ).fetchall()
            else:
                page = con.execute(
                    "SELECT key, size, rank FROM objects WHERE (rank, key) > (?, ?)"  # noqa: S608
                    f"{unheld} ORDER BY rank, key LIMIT ?", (*after, _VICTIM_PAGE),
                ).fetchall()
            if not page:
                break
            take(((key, size) for key, size, _rank in page), retained_ok=False)
            after = (page[-1][2], page[-1][0])
        if retained and freed < need and not take(holds.retained_victims(con), retained_ok=True):
            return []  # pins (or calls in flight) hold the rest: evict nothing for nothing
        return victims

    @staticmethod
    def _page_rows(con: sqlite3.Connection, page: str) -> list[tuple[str, int]]:
        """``(key, size)`` of every indexed object of ``page`` (a key prefix: one range of
        the primary key)."""
        return con.execute("SELECT key, size FROM objects WHERE key >= ? AND key < ?",
                           (page, page_end(page))).fetchall()

    @staticmethod
    def _held(con: sqlite3.Connection, keys: Sequence[str], *, pinned_only: bool) -> bool:
        """Whether a retention entry (a pin, with ``pinned_only``) is on one of ``keys``
        (after ``holds.expire``)."""
        pinned = " AND pinned = 1" if pinned_only else ""
        row = con.execute(
            f"SELECT 1 FROM retention WHERE key IN ({marks(len(keys))}){pinned} LIMIT 1",  # noqa: S608
            list(keys)).fetchone()
        return row is not None


def page_end(page: str) -> str | None:
    """The first key past every key of ``page``'s prefix, for a page of several objects
    (``index.page_of`` ends it with ``_``); None for a key that is a page of its own."""
    if not is_page_prefix(page):
        return None
    return page[:-1] + chr(ord("_") + 1)


__all__ = [
    "SQL_CHUNK", "Owner", "Rows", "add_meta", "earlier_puts", "feed_seq", "first_row",
    "growth_in_flight", "marks", "page_end",
    "meta", "reserved", "rows_of", "signed",
]
