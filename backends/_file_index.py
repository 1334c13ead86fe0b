"""The file backend's index: which objects a root holds, their sizes and their eviction order.

Shared by every process that opens the root on one host, persistent, crash-safe, opened in
constant time, and with no per-object state in process memory.

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
index on ``rank``, read a page at a time, never held in memory. The threads of one process
take the write lock one at a time in the order they asked (``TicketLock``); SQLite's own wait
(polls with sleeps growing to 100 ms) is left to arbitrate between processes, since among
many threads it let one lose the lock to the others for as long as they kept taking it.

**What SQLite is too slow for: existence.** A point lookup costs microseconds of CPU per key
even in one ``IN`` query (BENCHMARKS.md, "Design figures behind the file backend's index and
read policy"), so ``exists`` reads a *fingerprint set* instead:
a sorted array of the 64-bit xxh3 fingerprints of every key as of change ``S`` (a file in
``index/``, mapped read-only and shared through the page cache: 8 bytes per object, none of
it process-private), plus the changes after ``S``, which every process reads from the
database's change feed before it answers (one query when another connection has committed
since the last look, none otherwise; the feed packs the changes of each write into one row,
read and kept as numpy arrays: ``_fingerprints``). So a key written by another process a
moment ago is found at numpy speed. When the changes since ``S`` outgrow a bound (an eighth
of the store, at least 8 Ki and at most 1 Mi changes), the writer that notices, holding a
lease, writes a new snapshot and prunes the feed; the others map it at their next look.
A fingerprint can collide: an absent key is reported present with probability n / 2^64 (one
in 10^11 lookups at 100 M objects); reads are exact (a miss).

**Tables.** ``objects(key, fp, size, rank)`` (rank: ``_lru.chain_ranks``; smallest is
evicted first), ``pending(key, op, size, owner...)`` (changes in flight), ``feed(seq, recs)``
(the changes, packed), ``meta(name, value)`` (total bytes, object count, snapshot change
number, compaction lease), ``retention(key, owner, ...)`` (pins and retained objects, which
eviction honours: ``_file_retention``).

**Protocol.** The file system and the index cannot change in one transaction, so every change
is announced, done, then settled:

- *put*: T1 records a pending put per key (and evicts if the bound needs room); the files are
  written and renamed; T2 sets each key's row from a ``stat`` of its file and drops the pending
  rows. Row sizes are therefore the sizes of the files, whoever renamed last.
- *delete / evict*: T1 removes the rows and records pending deletes; the files are unlinked;
  T2 drops the pending rows and gives back the row of any file that could not be deleted (at
  the back of the eviction line, counted as an eviction failure). A delete that spares held
  objects (``delete_until_held``) reads the holds in T1, so no pin commits between its check
  and the removal of the rows.
- A key with a pending change by another owner is never chosen for eviction, a delete waits
  for it, and a put waits for a pending delete: an unlink never races a rename of one key.
- A process killed between T1 and T2 leaves pending rows. Whoever finds them (every open, and
  every eviction that runs short) with their owner dead *reconciles* each key: a dead delete is
  finished (its file unlinked: the room it freed may be taken), then every key's row is set
  from its file (present with the file's size, or absent). Nothing is invented, and the bound
  holds.

**What the index trusts.** Objects are added and removed through the backend. A file that
vanishes behind its back (an operator's ``rm``) is reported present until a read misses it
and fixes the row; files placed behind its back are found by ``adopt`` (or a rebuild, below).
A root without an index (a store written before it existed, or whose ``index/`` was
removed) gets one built at open from one walk of ``objects/``, once, under a file lock that
other openers wait on. A process that has the index open when ``index/`` is removed notices
within ``REPLACED_CHECK_SECONDS`` (its database file is not the one at the path any more) and
moves every connection to the rebuilt database, or builds it itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from . import _file_retention as holds
from ._file_site import HostClaim
from ._fingerprints import (
    FEED_RECORD,
    Delta,
    Snapshot,
    decode_changes,
    encode_changes,
    fingerprint,
    fingerprints,
    lookup,
)
from ._lru import chain_ranks, now_ms, rank_at, rank_seconds
from .errors import (
    BackendError,
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    NotSupportedError,
    OutOfSpaceError,
)
from .retention import Retention

DB_NAME = "index.sqlite3"
LOCK_NAME = "build.lock"
#: pending changes older than this are stale whoever owns them (no put lasts an hour).
STALE_PENDING_SECONDS = 3600.0
#: how long a compaction lease lasts without renewal.
COMPACT_LEASE_MS = 10 * 60 * 1000
MIN_DELTA = 8 * 1024
MAX_DELTA = 1 << 20
#: how often (at most, in seconds) a process checks that the database it has open is still
#: the one at ``index/``: removed (by an operator, as the message of an unreadable index says)
#: and rebuilt by another opener, a process that went on with the removed file would never see
#: the others' writes again, nor they its own.
REPLACED_CHECK_SECONDS = 1.0
_SQLITE_FULL = 13  # the result code of "database or disk is full" (sqlite3.SQLITE_FULL, 3.11+)
#: what opening a WAL database's shared memory fails with on a full filesystem: SQLITE_FULL,
#: SQLITE_CANTOPEN, SQLITE_IOERR_SHMOPEN / _SHMSIZE / _SHMMAP.
_NO_SHARED_MEMORY = frozenset({13, 14, 4618, 4874, 5386})
_SQL_CHUNK = 10_000  # bound on the parameters of one statement (SQLite allows 32,766)
_VICTIM_PAGE = 256
_SIGN64 = 1 << 63
_MASK64 = (1 << 64) - 1

#: The change feed: each row packs the changes of one index write (``_fingerprints``); its
#: ``seq`` is the number of the last change it holds (changes are counted, not rows).
#: ``keys``: the keys of those changes, in order, joined by newlines (keys never hold one),
#: for readers that must name each change (``changes_after``: the store-wide KV events);
#: NULL in rows written before the column existed. The membership readers never read it.
_FEED_TABLE = """CREATE TABLE IF NOT EXISTS feed (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    recs BLOB NOT NULL,
    keys TEXT
)"""

_SCHEMA = _FEED_TABLE + """;
CREATE TABLE IF NOT EXISTS objects (
    key TEXT PRIMARY KEY,
    fp INTEGER NOT NULL,
    size INTEGER NOT NULL,
    rank INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS objects_by_rank ON objects(rank);
CREATE TABLE IF NOT EXISTS pending (
    key TEXT NOT NULL,
    op TEXT NOT NULL,
    size INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    pidns INTEGER NOT NULL,
    token TEXT NOT NULL,
    batch INTEGER NOT NULL,
    since REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS pending_by_owner ON pending(token, batch);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
INSERT OR IGNORE INTO meta VALUES ('total_bytes', 0), ('count', 0), ('snapshot_seq', -1),
    ('compact_lease', 0);
"""


def _signed(fp: int) -> int:
    """``fp`` as SQLite stores it (a signed 64-bit integer with the same bits)."""
    return fp - (1 << 64) if fp >= _SIGN64 else fp


def snapshot_name(seq: int) -> str:
    return f"fp-{seq:016x}.u64"


@dataclass
class Reservation:
    """The pending puts of one call (released by ``settle_put``)."""

    keys: list[str]
    batch: int
    incoming: int
    started: float = 0.0  # wall-clock seconds when it was made


@dataclass
class EvictionCount:
    evicted: int = 0
    failed: int = 0


@dataclass(frozen=True)
class FeedChanges:
    """What ``FileIndex.changes_after`` read: ``changes`` (key, present) in order, through
    change number ``upto``; ``last``: the last change recorded; ``complete``: False when the
    changes cannot all be named (start again from ``FileIndex.listing``)."""

    last: int
    upto: int
    changes: list[tuple[str, bool]]
    complete: bool


class ObjectIndex(Protocol):
    """What the file backend asks of its index: ``FileIndex`` (shared, on disk) or
    ``_file_noindex.NoIndex`` (the file system answers). Every method may block on I/O."""

    rebuilt: bool
    recovered: int

    def exists(self, keys: Sequence[str]) -> list[bool]: ...
    def exists_if_current(self, keys: Sequence[str]) -> list[bool] | None: ...
    def exists_recent(self, keys: Sequence[str], max_age_s: float) -> list[bool] | None: ...
    def key_pages(self, prefix: str) -> Iterator[list[str]]: ...
    def entry_pages(self, prefix: str) -> Iterator[list[tuple[str, int, float]]]: ...
    def reserve(self, keys: Sequence[str], sizes: Sequence[int], capacity: int,
                pin_budget: int | None = None) -> Reservation: ...
    def make_room(self, capacity: int, reservation: Reservation | None = None) -> EvictionCount: ...
    def settle_put(self, reservation: Reservation) -> None: ...
    def delete(self, keys: Sequence[str]) -> list[bool]: ...
    def touch(self, keys: Sequence[str]) -> bool: ...
    def flush_touches(self) -> None: ...
    def repair_missing(self, key: str) -> None: ...
    def adopt(self, keys: Sequence[str]) -> int: ...
    def totals(self) -> tuple[int, int]: ...
    def reserved_bytes(self) -> int: ...
    def close(self) -> None: ...


@dataclass
class _Owner:
    pid: int
    pidns: int
    token: str


@dataclass
class _Membership:
    """The fingerprint set one process answers ``exists`` from (see the module docstring)."""

    snapshot_seq: int = -2  # none mapped yet (-1: the store has no snapshot)
    seen_seq: int = 0
    snapshot: Snapshot = field(default_factory=lambda: Snapshot(np.zeros(0, dtype=np.uint64)))
    delta: Delta = field(default_factory=Delta)
    data_version: int = -1
    refreshed_at: float = float("-inf")  # (monotonic) when its last refresh began


class FileIndex:
    """The index of one root. Thread-safe: each thread gets its own SQLite connection.

    ``path_of(key)`` gives the final path of a key (the index stats and unlinks files only
    while settling or reconciling). ``durable`` makes every commit wait for the device
    (SQLite ``synchronous=FULL``); otherwise commits reach the device at checkpoints, and a
    power loss may forget the last ones (the files they describe are then found by ``adopt``).
    """

    def __init__(
        self,
        root: str,
        objects_dir: str,
        path_of: Callable[[str], str],
        *,
        token: str,
        durable: bool = False,
        lock_timeout: float = 30.0,
        walk: Callable[[], Iterable[tuple[str, int, float]]] | None = None,
        index_hosts: str = "name",
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
    ) -> None:
        self.dir = os.path.join(root, "index")
        self.read_only = read_only
        self.db_path = os.path.join(self.dir, DB_NAME)
        self._objects_dir = objects_dir
        self._path_of = path_of
        self._durable = durable
        self._clock = clock
        self.lock_timeout = lock_timeout
        self._owner = _Owner(os.getpid(), _pid_namespace(), token)
        self._batches = iter(range(1, 1 << 62))
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._conn_lock = threading.Lock()
        #: this process's write transactions, one at a time in the order they asked
        self._writers = TicketLock()
        self._view = _Membership()
        self._view_lock = threading.Lock()  # guards _view and _feed
        self._local = threading.local()  # per thread: whether its write transaction changed the set
        self._changed_at = float("-inf")  # (monotonic) this process's last commit that did
        self._feed: sqlite3.Connection | None = None
        self._walk = walk
        #: which database file the connections are for (``_check_replaced``); a connection
        #: opened for an earlier generation is replaced at its thread's next use.
        self._generation = 0
        self._feed_generation = 0
        self._db_id: tuple[int, int] | None = None
        self._checked_at = time.monotonic()
        self._replace_lock = threading.RLock()
        self._replacing = False  # set while this process moves to a new database
        self._touches: dict[str, int] = {}
        self._touch_lock = threading.Lock()
        self._touched_at = time.monotonic()
        self._compactor: threading.Thread | None = None
        self._compact_tried = -1.0
        self._stopping = threading.Event()
        self.rebuilt = False
        self.recovered = 0
        if not read_only:
            os.makedirs(self.dir, exist_ok=True)
        #: the host that uses this index (``_file_site``; ``index_hosts``: what a host is):
        #: claimed before SQLite opens it (read-only: checked, never written).
        self.host = HostClaim(self.dir, os.path.join(root, "tmp"), token,
                              index_hosts=index_hosts, read_only=read_only)
        self.host.claim()
        self._open(walk)
        self._db_id = _file_id(self.db_path)
        if read_only:
            return
        self._upgrade_feed()
        self._add_retention()
        # (on a full filesystem: left to the next recovery, at any eviction or open)
        with contextlib.suppress(OutOfSpaceError):
            self.recovered = self.recover()

    # -- connections and transactions -----------------------------------------------------------

    def _con(self) -> sqlite3.Connection:
        """This thread's connection (to the database now at ``db_path``)."""
        self._check_replaced()
        con: sqlite3.Connection | None = getattr(self._local, "con", None)
        if con is not None and self._local.generation != self._generation:
            self._close_thread_connection()  # of a removed database
            con = None
        if con is None:
            con = self._connect()
            self._local.con = con
            self._local.generation = self._generation
        return con

    def _check_replaced(self) -> None:
        """At most every ``REPLACED_CHECK_SECONDS``: if the database at ``db_path`` is not
        the file this process opened (``index/`` was removed, and rebuilt by another opener
        or not yet), move every connection to the one there, building it first if there is
        none (other openers wait on the build lock)."""
        self.host.raise_if_taken_over()
        if time.monotonic() - self._checked_at < REPLACED_CHECK_SECONDS or self._db_id is None:
            return
        with self._replace_lock:
            if self._replacing or time.monotonic() - self._checked_at < REPLACED_CHECK_SECONDS:
                return  # the calls of the move below, or another thread checked meanwhile
            self._checked_at = time.monotonic()
            current = _file_id(self.db_path)
            if current == self._db_id:
                self.host.check()  # the host record is still this kernel's (one stat)
                return
            self._replacing = True
            try:
                self._generation += 1  # first: _open's reads must not use the removed file
                if not self.read_only:
                    os.makedirs(self.dir, exist_ok=True)
                self.host.check()  # removed with index/: claimed again before the rebuild
                self._open(self._walk)  # ready already, or wait for its builder, or build it
                self._db_id = _file_id(self.db_path)
            finally:
                self._replacing = False

    def _connect(self) -> sqlite3.Connection:
        with self._translated():
            if self.read_only:
                con = self._connect_read_only()
            else:
                con = sqlite3.connect(
                    self.db_path, timeout=self.lock_timeout, isolation_level=None,
                    check_same_thread=False,  # one thread at a time uses it; close() runs on another
                )
                con.execute(f"PRAGMA synchronous={'FULL' if self._durable else 'NORMAL'}")
        with self._conn_lock:
            self._connections.append(con)
        return con

    def _connect_read_only(self) -> sqlite3.Connection:
        """A connection that never writes the database (``mode=ro``). Reading a database in
        WAL mode takes its shared-memory file (``-shm``), which a reader creates when no
        process has the database open; on a full filesystem it cannot. Then, when the log
        holds nothing (``-wal`` absent or empty: the last writer checkpointed it), the
        database file alone is the whole index and is read as such (``immutable=1``: no lock,
        no ``-shm``); otherwise the index cannot be read until some space is freed."""
        path = urllib.parse.quote(self.db_path)

        def connect(flags: str) -> sqlite3.Connection:
            con = sqlite3.connect(f"file:{path}?{flags}", uri=True, timeout=self.lock_timeout,
                                  isolation_level=None, check_same_thread=False)
            try:
                con.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()  # opens the log
            except BaseException:
                con.close()
                raise
            return con

        try:
            return connect("mode=ro")
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) not in _NO_SHARED_MEMORY:
                raise
            wal = self.db_path + "-wal"
            if os.path.exists(wal) and os.path.getsize(wal) > 0:
                root = os.path.dirname(self.dir)
                raise OutOfSpaceError(
                    f"the index of {root} cannot be read: its filesystem is full, a reader "
                    f"needs {self.db_path}-shm, which cannot be made ({exc}), and the "
                    "write-ahead log holds changes not in the database file. Free a little "
                    "space on that filesystem (remove other files: a few hundred KiB), then "
                    f"run this again, or hicache-store gc file://{root} --max-bytes SIZE",
                    backend="file", operation="open") from exc
            return connect("immutable=1")

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``: takes the write lock up front, so two
        writers never deadlock upgrading; waits up to ``lock_timeout`` for it). Nothing is
        committed once another host has taken the root's index over (``HostClaim.check``
        before each commit: one ``stat``). ``NotSupportedError`` when opened read-only."""
        if self.read_only:
            raise NotSupportedError(f"the index at {self.db_path} is open read-only",
                                    backend="file", operation="index")
        con = self._con()
        self._local.changed = False
        with self._writers, self._translated():
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
                self.host.check(reclaim=False)
                con.execute("COMMIT")
                if self._local.changed:  # (``exists_recent``: the view is older than this)
                    self._changed_at = time.monotonic()
            except BaseException:
                if con.in_transaction:  # SQLite may have rolled back already (e.g. disk full)
                    con.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def _read(self, con: sqlite3.Connection | None = None) -> Iterator[sqlite3.Connection]:
        """One read transaction: a consistent view of every table."""
        con = con or self._con()
        with self._translated():
            con.execute("BEGIN")
            try:
                yield con
            finally:
                con.execute("COMMIT")

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            text = str(exc)
            if "locked" in text or "busy" in text:
                raise BackendUnavailableError(
                    f"the index at {self.db_path} stayed locked for {self.lock_timeout} s",
                    backend="file", operation="index",
                ) from exc
            code = getattr(exc, "sqlite_errorcode", None)
            if code == _SQLITE_FULL or "disk is full" in text or (
                    code in _NO_SHARED_MEMORY and _filesystem_full(self.dir)):
                raise self.out_of_space(text) from exc
            raise BackendIOError(f"index at {self.db_path}: {text}", backend="file",
                                 operation="index") from exc
        except sqlite3.DatabaseError as exc:
            raise self._unreadable(exc) from exc

    def out_of_space(self, cause: str) -> OutOfSpaceError:
        """The error of an index write that found the filesystem full: it names the root and
        what frees space."""
        root = os.path.dirname(self.dir)
        return OutOfSpaceError(
            f"the filesystem of {root} is full: the index at {self.db_path} cannot commit "
            f"({cause}). Free space: hicache-store gc file://{root} --max-bytes SIZE (it "
            "deletes objects even while the index cannot commit), or remove other files on "
            "that filesystem; a smaller capacity_bytes leaves the index room to grow",
            backend="file", operation="index",
        )

    def _unreadable(self, exc: Exception) -> BackendError:
        return BackendError(
            f"the index at {self.db_path} is unreadable ({exc}); remove {self.dir} and it "
            "is rebuilt from objects/ at the next open",
            backend="file", operation="index",
        )

    # -- open, build -----------------------------------------------------------------------------

    def _open(self, walk: Callable[[], Iterable[tuple[str, int, float]]] | None) -> None:
        if self.read_only:
            if not self._ready():
                raise BackendError(
                    f"the index at {self.db_path} is not built yet (being built, or removed); "
                    "open the root read-write once, or again in a moment",
                    backend="file", operation="open")
            return
        try:
            if self._ready():
                return
        except BackendError:
            pass  # being created by another opener right now: wait for it below
        # No index yet (a new root, or one written before the index existed): one opener
        # builds it while the others wait on the lock, then find it ready.
        with open(os.path.join(self.dir, LOCK_NAME), "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            if self._ready():
                return
            with self._translated():
                con = self._con()
                con.execute("PRAGMA journal_mode=WAL")
                con.executescript(_SCHEMA)
                holds.create(con)
            if walk is not None:
                self._build(walk())
            with self._write() as con:
                con.execute("INSERT OR REPLACE INTO meta VALUES ('ready', 1)")

    def _upgrade_feed(self) -> None:
        """Convert the change feed of an index written before the feed was packed (a table
        ``changes`` of one row per change) to ``feed``: once, in one transaction, by whichever
        opener comes first. Change numbers are kept, so the current snapshot stays valid. A
        process of the older code still open on this root fails its next index call (no such
        table) instead of reading a feed that nobody writes any more."""
        self._add_feed_keys()
        find = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'changes'"
        with self._read() as con:
            if not con.execute(find).fetchone():
                return
        with self._write() as con:
            if not con.execute(find).fetchone():
                return  # another opener converted it meanwhile
            con.execute(_FEED_TABLE)
            row = con.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
            last = int(row[0]) if row else 0
            rows = con.execute("SELECT fp, present FROM changes WHERE seq > ? ORDER BY seq",
                               (self._meta(con, "snapshot_seq"),)).fetchall()
            added = [(fp & _MASK64, present == 1) for fp, present in rows]
            if added:
                records = np.empty(len(added), dtype=FEED_RECORD)
                records["fp"] = np.array([fp for fp, _ in added], dtype=np.uint64)
                records["present"] = [present for _, present in added]
                con.execute("INSERT INTO feed (seq, recs) VALUES (?, ?)", (last, records.tobytes()))
            elif last:
                con.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('feed', ?)", (last,))
            con.execute("DROP TABLE changes")

    def _add_retention(self) -> None:
        """Create the retention table (``_file_retention``) if this index has none yet: a new
        one, or one written before retention existed."""
        with self._read() as con:
            if holds.has_table(con):
                return
        with self._write() as con:
            holds.create(con)

    def _add_feed_keys(self) -> None:
        """Give a feed written before it named its changes the ``keys`` column (once, by the
        first opener; older rows keep NULL, which ``changes_after`` reports as unnamed)."""
        def has_keys(con: sqlite3.Connection) -> bool:
            rows = con.execute("PRAGMA table_info(feed)").fetchall()
            return not rows or any(row[1] == "keys" for row in rows)

        with self._read() as con:
            if has_keys(con):
                return
        with self._write() as con:
            if not has_keys(con):
                con.execute("ALTER TABLE feed ADD COLUMN keys TEXT")

    def _ready(self) -> bool:
        if not os.path.exists(self.db_path):
            return False
        try:
            with self._read() as con:
                row = con.execute("SELECT value FROM meta WHERE name = 'ready'").fetchone()
        except BackendIOError as exc:
            if "no such table" in str(exc):
                return False
            raise
        return row is not None

    def _build(self, found: Iterable[tuple[str, int, float]]) -> None:
        """Index every ``(key, size, mtime)`` of a walk (the oldest first in line), then write
        the first snapshot so that no process replays the build as changes."""
        batch: list[tuple[str, int, int, int]] = []
        for key, size, mtime in found:
            batch.append((key, _signed(fingerprint(key)), size, rank_at(mtime)))
            if len(batch) >= _SQL_CHUNK:
                with self._write() as con:
                    con.executemany("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?)", batch)
                batch = []
        with self._write() as con:
            con.executemany("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?)", batch)
            total, count = con.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM objects"
                                       ).fetchone()
            con.execute("UPDATE meta SET value = ? WHERE name = 'total_bytes'", (total,))
            con.execute("UPDATE meta SET value = ? WHERE name = 'count'", (count,))
        self.rebuilt = True
        self._compact_now()

    # -- existence ---------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is indexed, as of now (other processes' commits included)."""
        fps = fingerprints(keys)
        with self._view_lock:
            self._refresh()
            return self._lookup(fps)

    def exists_if_current(self, keys: Sequence[str]) -> list[bool] | None:
        """``exists`` when it can answer at once: the fingerprint set is up to date and no
        other thread is using it; otherwise None (call ``exists``). Never waits on I/O or a
        lock, so an event loop may call it inline."""
        if self.host.taken_over is not None or not self._view_lock.acquire(blocking=False):
            return None  # (taken over: ``exists`` raises)
        try:
            if (self._feed is None or self._feed_generation != self._generation
                    or time.monotonic() - self._checked_at >= REPLACED_CHECK_SECONDS
                    or self._data_version() != self._view.data_version):
                return None  # (a check of the database file is due: ``exists`` makes it)
            return self._lookup(fingerprints(keys))
        finally:
            self._view_lock.release()

    def exists_recent(self, keys: Sequence[str], max_age_s: float) -> list[bool] | None:
        """``exists`` as of the last time the fingerprint set was brought up to date, if that
        began at most ``max_age_s`` ago and after this process's last change of what is
        stored, and no other thread is using the set; otherwise None. No I/O, no SQLite call,
        never waits: for a thread that must not release the GIL (a scheduler), which accepts
        an answer that may miss other processes' changes of the last ``max_age_s`` (see
        ``Backend.exists_now``); this process's own puts and deletes are never missed."""
        if self.host.taken_over is not None or not self._view_lock.acquire(blocking=False):
            return None
        try:
            refreshed = self._view.refreshed_at
            if (self._feed is None or self._feed_generation != self._generation
                    or refreshed <= self._changed_at
                    or time.monotonic() - refreshed > max_age_s):
                return None
            return self._lookup(fingerprints(keys))
        finally:
            self._view_lock.release()

    def _lookup(self, fps: np.ndarray) -> list[bool]:
        """(caller holds ``_view_lock``)"""
        return lookup(self._view.snapshot, self._view.delta, fps)

    def _data_version(self) -> int:
        """The feed connection's ``data_version`` (caller holds ``_view_lock``)."""
        assert self._feed is not None
        with self._translated():
            version: int = self._feed.execute("PRAGMA data_version").fetchone()[0]
        return version

    def _refresh(self) -> None:
        """Bring the fingerprint set up to date (caller holds ``_view_lock``).

        The feed connection never writes, so its ``data_version`` moves exactly when some
        other connection (this process's writers included) has committed."""
        started = time.monotonic()  # every commit before this is in the view after it
        self._check_replaced()
        if self._feed is not None and self._feed_generation != self._generation:
            with self._conn_lock:
                if self._feed in self._connections:
                    self._connections.remove(self._feed)
            self._feed.close()  # of a removed database: start over from the new one
            self._feed, self._view = None, _Membership()
        view = self._view
        if self._feed is None:
            self._feed = self._connect()
            self._feed_generation = self._generation
        feed = self._feed
        version = self._data_version()
        if version == view.data_version:
            view.refreshed_at = started
            return
        for attempt in range(3):
            with self._read(feed) as con:
                seq = con.execute(
                    "SELECT value FROM meta WHERE name = 'snapshot_seq'").fetchone()[0]
                if seq != view.snapshot_seq:
                    try:
                        snapshot = Snapshot(self._map_snapshot(seq))
                    except FileNotFoundError:
                        if attempt == 2:
                            raise
                        continue  # replaced by a newer one meanwhile: read meta again
                    view.snapshot, view.delta = snapshot, Delta()
                    view.snapshot_seq = view.seen_seq = seq
                rows = con.execute(
                    "SELECT seq, recs FROM feed WHERE seq > ? ORDER BY seq", (view.seen_seq,)
                ).fetchall()
            break
        if rows:
            try:
                changes = decode_changes(b"".join([recs for _, recs in rows]))
            except ValueError as exc:
                raise self._unreadable(exc) from exc
            view.delta.apply(changes)
            view.seen_seq = rows[-1][0]
        # No compaction from here: the writers start one once the feed outgrows its bound
        # (``_maybe_compact``), and a reader's delta costs 9 bytes and O(log) per change.
        # (Started here, a compaction's read of every row ran in the reading process, about
        # ten times the CPU of the ``exists`` call that noticed it, at 100 k objects.)
        view.data_version = version
        view.refreshed_at = started

    def _map_snapshot(self, seq: int) -> np.ndarray:
        """The snapshot after change ``seq`` (-1: none yet, the empty set), mapped read-only."""
        path = self._snapshot_path(seq)
        if seq < 0 or (seq == 0 and not os.path.exists(path)):
            return np.zeros(0, dtype=np.uint64)  # (0 without a file: an index's first layout)
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return np.zeros(0, dtype=np.uint64)
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(mapped, dtype="<u8")

    def _snapshot_path(self, seq: int) -> str:
        return os.path.join(self.dir, snapshot_name(seq))

    def _delta_bound(self) -> int:
        """How many changes may pile up after a snapshot before the next one is written."""
        with self._read() as con:
            count = self._meta(con, "count")
        return max(MIN_DELTA, min(count // 8, MAX_DELTA))

    # -- snapshots (compaction) ------------------------------------------------------------------

    def _compact_soon(self) -> None:
        """Start a compaction on a background thread, unless one is running here or one was
        tried in the last second (another process may hold the lease)."""
        if self._compactor is not None and self._compactor.is_alive():
            return
        if time.monotonic() - self._compact_tried < 1.0 or self._stopping.is_set():
            return
        self._compact_tried = time.monotonic()
        self._compactor = threading.Thread(
            target=self._compact_quietly, name="hicache-file-compact", daemon=True
        )
        self._compactor.start()

    def _compact_quietly(self) -> None:
        try:
            self.compact()
        except BackendError:
            pass  # the next refresh or put tries again; exists stays correct meanwhile
        finally:
            self._close_thread_connection()

    def compact(self) -> bool:
        """Write a snapshot of every fingerprint and prune the feed; False if another process
        holds the compaction lease."""
        now = now_ms()
        with self._write() as con:
            until = con.execute("SELECT value FROM meta WHERE name = 'compact_lease'").fetchone()[0]
            if until > now:
                return False
            con.execute("UPDATE meta SET value = ? WHERE name = 'compact_lease'",
                        (now + COMPACT_LEASE_MS,))
        try:
            self._compact_now()
        finally:
            with self._write() as con:
                con.execute("UPDATE meta SET value = 0 WHERE name = 'compact_lease'")
        return True

    def _compact_now(self) -> None:
        with self._read() as con:
            seq = self._feed_seq(con)
            fps = np.fromiter((fp for (fp,) in con.execute("SELECT fp FROM objects")),
                              dtype=np.int64)
        snap = fps.view(np.uint64)
        snap.sort()
        # A snapshot is named by the last change it holds (0: none, e.g. right after a build):
        # racing builders of one number write the same content.
        path = self._snapshot_path(seq)
        tmp = f"{path}.{self._owner.pid}-{self._owner.token}.tmp"
        try:
            snap.astype("<u8", copy=False).tofile(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with self._write() as con:
            current = con.execute("SELECT value FROM meta WHERE name = 'snapshot_seq'").fetchone()[0]
            if seq > current:
                con.execute("UPDATE meta SET value = ? WHERE name = 'snapshot_seq'", (seq,))
                con.execute("DELETE FROM feed WHERE seq <= ?", (seq,))
                current = seq
        self._remove_old_snapshots(keep=current)

    def _remove_old_snapshots(self, keep: int) -> None:
        """Delete snapshots older than the one before ``keep`` (a process that read the
        previous number a moment ago may still be about to map it)."""
        names = sorted(n for n in os.listdir(self.dir) if n.startswith("fp-"))
        older = [n for n in names if n.endswith(".u64") and n < snapshot_name(keep)]
        stale = [n for n in names if n.endswith(".tmp") and _older_than(
            os.path.join(self.dir, n), STALE_PENDING_SECONDS)]  # a killed compactor's
        for name in older[:-1] + stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, name))

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
        owner, since = self._owner, time.time()
        for con in self._until_unblocked(set(keys), only_deletes=True, operation="put"):
            stored = self._rows(con, keys)
            if pin_budget is not None and stored and holds.any_entries(con):
                growth: dict[str, int] = {}
                for key, size in zip(keys, sizes, strict=True):
                    if key in stored:  # a key repeated in the call: its largest write counts
                        growth[key] = max(growth.get(key, 0), size - stored[key])
                holds.charge_rewrite(
                    con, {key: grown for key, grown in growth.items() if grown > 0},
                    now=self._clock(), budget=pin_budget, in_flight=self._growth_in_flight(con))
            con.executemany("INSERT INTO pending VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [
                (key, "put", max(0, size - stored.get(key, 0)), owner.pid, owner.pidns,
                 owner.token, batch, since)
                for key, size in zip(keys, sizes, strict=True)
            ])
        return Reservation(list(keys), batch, incoming, since)

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
        skip: set[str] = set()
        recovered = False
        deadline = time.monotonic() + self.lock_timeout
        pause = 0.001
        mine = (self._owner.token, reservation.batch) if reservation is not None else None
        while True:
            batch = next(self._batches)
            earlier = 0
            with self._write() as con:
                first = self._first_row(con, mine)
                need = self._meta(con, "total_bytes") + self._reserved(con, first, mine) - capacity
                if need <= 0:
                    return counts
                victims = self._pick_victims(con, need, skip)
                if victims:
                    self._remove_rows(con, victims)
                    self._announce(con, [key for key, _ in victims], "del", batch)
                elif first is not None:
                    earlier = self._earlier_puts(con, first)
            if not victims:
                if not recovered and self.recover():
                    recovered = True  # a dead writer's reservation was holding the room
                    continue
                if earlier and time.monotonic() < deadline:
                    self.recover()  # an earlier put whose owner died must not hold us
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
                    continue
                raise CapacityError(
                    f"no room: {need} bytes over a capacity of {capacity} bytes and nothing "
                    f"more can be evicted ({counts.failed} eviction failures; what remains is "
                    "pinned, or busy in a call in flight)",
                    backend="file", operation="put",
                )
            failed = self._unlink_all([key for key, _ in victims])
            self._settle(batch, failed, ranks=chain_ranks(len(failed)))
            counts.evicted += len(victims) - len(failed)
            counts.failed += len(failed)
            skip.update(failed)

    def settle_put(self, reservation: Reservation) -> None:
        """T2 of a put: every key's row from its file (written, rewritten, or not written at
        all when the write failed), in chain order; the reservation is released."""
        ranks = chain_ranks(len(reservation.keys))
        with self._write() as con:
            self._set_from_files(con, reservation.keys, ranks)
            con.execute("DELETE FROM pending WHERE token = ? AND batch = ?",
                        (self._owner.token, reservation.batch))
        self._maybe_compact()

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
            for con in self._until_unblocked(wanted, only_deletes=False, operation="delete"):
                done = len(groups)
                if until_held and holds.any_entries(con):
                    held = holds.held_among(con, list(wanted), self._clock())
                    done = next((i for i, group in enumerate(groups)
                                 if held.intersection(group)), done)
                keys = [key for group in groups[:done] for key in group]
                rows = self._rows(con, keys)
                self._remove_rows(con, list(rows.items()))
                self._announce(con, keys, "del", batch)
        except OutOfSpaceError:
            return self._delete_groups_freeing_space(groups, until_held=until_held)
        removed: list[bool] = []
        failed: list[str] = []
        error: OSError | None = None
        for key in keys:
            try:
                os.unlink(self._path_of(key))
            except FileNotFoundError:
                removed.append(False)
            except OSError as exc:
                removed.append(False)
                failed.append(key)
                error = error or exc
            else:
                removed.append(True)
        self._settle(batch, failed, ranks=None)
        self._maybe_compact()
        if error is not None:
            raise error
        return done, removed

    def _delete_groups_freeing_space(
        self, groups: Sequence[Sequence[str]], *, until_held: bool
    ) -> tuple[int, list[bool]]:
        """``_delete_groups`` on a full filesystem, where its T1 cannot commit (every commit
        appends to the write-ahead log). One write transaction instead: taking the write lock
        writes nothing, and holding it, no ``retain`` and no put can commit; it reads the holds
        and the changes in flight, unlinks the files of the groups up to the first held or
        busy one (a group with a change in flight is kept, as a held one; a plain ``delete``
        of a busy key gives up), and only then removes their rows, in the room the files
        freed. A crash between the unlinks and the commit, or a commit that still finds no
        room (``OutOfSpaceError``), leaves rows whose files are gone: present until a read
        misses them, as after an ``rm`` behind the index's back."""
        wanted = {key for group in groups for key in group}
        error: OSError | None = None
        with self._write() as con:
            stop = {key for (key,) in con.execute("SELECT key FROM pending") if key in wanted}
            if stop and not until_held:
                raise self.out_of_space(f"{len(stop)} of the keys are busy in another call")
            if until_held and holds.any_entries(con):
                stop |= holds.held_among(con, list(wanted), self._clock())
            done = next((i for i, group in enumerate(groups) if stop.intersection(group)),
                        len(groups))
            keys = [key for group in groups[:done] for key in group]
            rows = self._rows(con, keys)
            removed: list[bool] = []
            gone: list[tuple[str, int]] = []
            for key in keys:
                try:
                    os.unlink(self._path_of(key))
                except FileNotFoundError:
                    removed.append(False)
                except OSError as exc:
                    removed.append(False)
                    error = error or exc
                    continue  # the file stayed: so does its row
                else:
                    removed.append(True)
                if key in rows:
                    gone.append((key, rows.pop(key)))
            self._remove_rows(con, gone)
        if error is not None:
            raise error
        return done, removed

    def _settle(self, batch: int, failed: Sequence[str], ranks: Sequence[int] | None) -> None:
        """T2 of a delete: drop the pending rows; the files that stayed get their rows back
        (``ranks``: at the back of the eviction line; None: as the files' mtimes say)."""
        with self._write() as con:
            if failed:
                self._set_from_files(con, failed, ranks)
            con.execute("DELETE FROM pending WHERE token = ? AND batch = ?",
                        (self._owner.token, batch))

    def _unlink_all(self, keys: Sequence[str]) -> list[str]:
        """Unlink each key's file; return the keys whose file could not be removed."""
        failed = []
        for key in keys:
            try:
                os.unlink(self._path_of(key))
            except FileNotFoundError:
                pass  # someone else removed it: the room is ours anyway
            except OSError:
                failed.append(key)
        return failed

    # -- retention (``_file_retention``) ----------------------------------------------------------

    def retain(self, keys: Sequence[str], retention: Retention, pin_budget: int) -> None:
        """Set ``retention.owner``'s entry on each indexed key (one transaction); a holding
        pin past ``pin_budget`` bytes raises ``PinBudgetError`` and sets nothing."""
        with self._write() as con:
            holds.retain(con, keys, retention, now=self._clock(), budget=pin_budget,
                         in_flight=self._growth_in_flight(con))

    @staticmethod
    def _growth_in_flight(con: sqlite3.Connection) -> dict[str, int]:
        """key -> the bytes the puts in flight reserved for it (a rewrite: its growth)."""
        return dict(con.execute(
            "SELECT key, SUM(size) FROM pending WHERE op = 'put' AND size > 0 GROUP BY key"))

    def release(self, keys: Sequence[str], owner: str) -> None:
        with self._write() as con:
            holds.release(con, keys, owner)

    def retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        with self._read() as con:
            return holds.entries_of(con, keys, self._clock())

    def pinned_bytes(self) -> int:
        """Bytes of the indexed objects pinned now."""
        with self._read() as con:
            return holds.pinned_bytes(con, self._clock())

    # -- reads: recency and repairs ----------------------------------------------------------------

    def touch(self, keys: Sequence[str]) -> bool:
        """Record that ``keys`` (one call's, in chain order) were read; True when the buffered
        touches are due for ``flush_touches`` (a second old, or 4 Ki keys)."""
        ranks = chain_ranks(len(keys))
        with self._touch_lock:
            self._touches.update(zip(keys, ranks, strict=True))
            return len(self._touches) >= 4096 or time.monotonic() - self._touched_at >= 1.0

    def flush_touches(self) -> None:
        """Write buffered read recency to the index (one transaction)."""
        with self._touch_lock:
            touches, self._touches = self._touches, {}
            self._touched_at = time.monotonic()
        if not touches:
            return
        with self._write() as con:
            con.executemany("UPDATE objects SET rank = ? WHERE key = ? AND rank < ?",
                            [(rank, key, rank) for key, rank in touches.items()])

    def repair_missing(self, key: str) -> None:
        """A read found no file for ``key``: if the index still lists it, and no change of it
        is in flight, its row goes (someone removed the file behind the index's back; not
        when open read-only)."""
        if self.read_only or not self.exists([key])[0]:
            return
        with self._write() as con:
            busy = {k for (k,) in con.execute("SELECT key FROM pending WHERE key = ?", (key,))}
            if not busy:
                self._set_from_files(con, [key], None)

    def adopt(self, keys: Sequence[str]) -> int:
        """Set the rows of ``keys`` from their files (for files placed under ``objects/`` by
        other means: a restore, a copy, a test oracle); return how many are now indexed."""
        with self._write() as con:
            self._set_from_files(con, keys, None)
            return len(self._rows(con, keys))

    # -- recovery ------------------------------------------------------------------------------------

    def recover(self) -> int:
        """Reconcile the keys of pending changes whose owner is gone (or stale); return how
        many pending rows were settled."""
        with self._read() as con:
            if not con.execute("SELECT 1 FROM pending LIMIT 1").fetchone():
                return 0  # the common case, without taking the write lock
        with self._write() as con:
            rows = con.execute(
                "SELECT rowid, key, pid, pidns, token, since, op FROM pending"
            ).fetchall()
            dead = [r for r in rows if not self._alive(r[2], r[3], r[4], r[5])]
            if not dead:
                return 0
            # A dead delete (or eviction) is finished, not undone: its rows went at T1 and the
            # room they freed may already be another put's, so giving a file that stayed its
            # row back would put the store over its bound. No live put can be writing such a
            # key (a put waits for pending deletes). A file that cannot be removed keeps its
            # row, as in a live delete.
            self._unlink_all(sorted({r[1] for r in dead if r[6] == "del"}))
            for start in range(0, len(dead), _SQL_CHUNK):
                chunk = [r[0] for r in dead[start : start + _SQL_CHUNK]]
                con.execute(  # only "?" placeholders are formatted in
                    f"DELETE FROM pending WHERE rowid IN ({_marks(len(chunk))})", chunk  # noqa: S608
                )
            self._set_from_files(con, sorted({r[1] for r in dead}), None)
        return len(dead)

    def _alive(self, pid: int, pidns: int, token: str, since: float) -> bool:
        if token == self._owner.token:
            return True
        if time.time() - since > STALE_PENDING_SECONDS:
            return False
        if pidns != self._owner.pidns:
            return True  # another pid namespace: cannot tell, trust it until it is stale
        return pid_alive(pid)

    def _until_unblocked(
        self, keys: set[str], *, only_deletes: bool, operation: str
    ) -> Iterator[sqlite3.Connection]:
        """Yield a write transaction once no live call (of this process or another) has a
        change in flight on ``keys`` (only deletes, when ``only_deletes``); dead owners'
        changes are reconciled first. The caller's body runs exactly once, inside it."""
        deadline = time.monotonic() + self.lock_timeout
        pause = 0.001
        while True:
            stale = False
            with self._write() as con:
                blocking = [
                    r for r in self._pending_on(con, keys)
                    if r[1] == "del" or not only_deletes
                ]
                if not blocking:
                    yield con
                    return
                stale = any(not self._alive(r[2], r[3], r[4], r[5]) for r in blocking)
            if stale:
                self.recover()
                continue
            if time.monotonic() > deadline:
                raise BackendUnavailableError(
                    f"{len(blocking)} of the keys stayed busy in another process for "
                    f"{self.lock_timeout} s", backend="file", operation=operation,
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    @staticmethod
    def _pending_on(
        con: sqlite3.Connection, keys: Iterable[str]
    ) -> list[tuple[str, str, int, int, str, float]]:
        """The pending rows (key, op, pid, pidns, token, since) of ``keys``, selected inside
        SQLite: with thousands of puts in flight, handing every pending row to Python in each
        put's transaction was most of the time the write lock was held."""
        found: list[tuple[str, str, int, int, str, float]] = []
        unique = list(keys)
        for start in range(0, len(unique), _SQL_CHUNK):
            chunk = unique[start : start + _SQL_CHUNK]
            found += con.execute(
                "SELECT key, op, pid, pidns, token, since FROM pending "  # noqa: S608
                f"WHERE key IN ({_marks(len(chunk))})", chunk,
            ).fetchall()
        return found

    # -- rows -------------------------------------------------------------------------------------------

    def _set_from_files(
        self, con: sqlite3.Connection, keys: Sequence[str], ranks: Sequence[int] | None
    ) -> None:
        """Make each key's row match its file: present with the file's size, or absent.

        A present key's rank comes from ``ranks`` (parallel to ``keys``; the first occurrence
        of a repeated key counts) when given; otherwise a row that exists keeps its rank and
        a new row ranks as its file's mtime."""
        rows = self._rows(con, keys)
        rank_of: dict[str, int] = {}
        if ranks is not None:
            for key, rank in zip(keys, ranks, strict=True):
                rank_of.setdefault(key, rank)
        upserts: list[tuple[str, int, int, int]] = []
        resized: list[tuple[int, str]] = []
        gone: list[tuple[str, int]] = []
        total = 0
        for key in dict.fromkeys(keys):
            old = rows.get(key)
            try:
                st = os.stat(self._path_of(key))
            except FileNotFoundError:
                if old is not None:
                    gone.append((key, old))
                continue
            total += st.st_size - (old or 0)
            if key in rank_of:
                upserts.append((key, _signed(fingerprint(key)), st.st_size, rank_of[key]))
            elif old is None:
                upserts.append((key, _signed(fingerprint(key)), st.st_size, rank_at(st.st_mtime)))
            elif old != st.st_size:
                resized.append((st.st_size, key))
        if upserts:
            con.executemany(
                "INSERT INTO objects VALUES (?, ?, ?, ?) ON CONFLICT(key) DO UPDATE "
                "SET size = excluded.size, rank = excluded.rank", upserts,
            )
        con.executemany("UPDATE objects SET size = ? WHERE key = ?", resized)
        added = [(key, fp & _MASK64) for key, fp, _, _ in upserts if key not in rows]
        self._append_feed(con, [fp for _, fp in added], [key for key, _ in added], present=True)
        self._add_meta(con, total=total, count=len(added))
        self._remove_rows(con, gone)

    def _remove_rows(self, con: sqlite3.Connection, rows: Sequence[tuple[str, int]]) -> None:
        if not rows:
            return
        con.executemany("DELETE FROM objects WHERE key = ?", [(key,) for key, _ in rows])
        keys = [key for key, _ in rows]
        if holds.any_entries(con):
            holds.drop(con, keys)
        self._append_feed(con, [fingerprint(key) for key in keys], keys, present=False)
        self._add_meta(con, total=-sum(size for _, size in rows), count=-len(rows))

    def _append_feed(
        self, con: sqlite3.Connection, fps: list[int], keys: list[str], *, present: bool
    ) -> None:
        """Record in the change feed that ``keys`` (their fingerprints ``fps``) became present
        (absent): one row for them all, numbered by its last change (changes are counted,
        rows are not)."""
        if fps:
            self._local.changed = True
            con.execute("INSERT INTO feed (seq, recs, keys) VALUES (?, ?, ?)",
                        (self._feed_seq(con) + len(fps), encode_changes(fps, present),
                         "\n".join(keys)))

    @staticmethod
    def _feed_seq(con: sqlite3.Connection) -> int:
        """The number of the last change ever recorded (pruned ones included)."""
        row = con.execute("SELECT seq FROM sqlite_sequence WHERE name = 'feed'").fetchone()
        return int(row[0]) if row else 0

    def _announce(self, con: sqlite3.Connection, keys: Sequence[str], op: str, batch: int) -> None:
        owner, since = self._owner, time.time()
        con.executemany(
            "INSERT INTO pending VALUES (?, ?, 0, ?, ?, ?, ?, ?)",
            [(key, op, owner.pid, owner.pidns, owner.token, batch, since) for key in keys],
        )

    def _rows(self, con: sqlite3.Connection, keys: Sequence[str]) -> dict[str, int]:
        """``{key: size}`` of the indexed keys among ``keys``."""
        found: dict[str, int] = {}
        unique = list(dict.fromkeys(keys))
        for start in range(0, len(unique), _SQL_CHUNK):
            chunk = unique[start : start + _SQL_CHUNK]
            found.update(con.execute(
                f"SELECT key, size FROM objects WHERE key IN ({_marks(len(chunk))})",  # noqa: S608
                chunk,
            ).fetchall())
        return found

    def _pick_victims(
        self, con: sqlite3.Connection, need: int, skip: set[str]
    ) -> list[tuple[str, int]]:
        """The rows worth at least ``need`` bytes (or all there are) first in eviction order,
        less keys with a change in flight and ``skip``: the lowest-ranked rows, and while any
        retention entry exists, the unretained ones by rank, then the retained ones
        (``_file_retention``), never a pinned one; while entries exist, nothing when even
        all of that is not enough."""
        busy = {key for (key,) in con.execute("SELECT key FROM pending")}
        retained = holds.any_entries(con)
        if retained:
            holds.expire(con, self._clock())
            retained = holds.any_entries(con)
        victims: list[tuple[str, int]] = []
        freed = 0

        def take(rows: Iterable[tuple[str, int]]) -> bool:
            """Add ``rows`` in order, less busy and skipped keys, until ``need`` bytes are
            freed; whether they are."""
            nonlocal freed
            for key, size in rows:
                if key in busy or key in skip:
                    continue
                victims.append((key, size))
                freed += size
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
            take((key, size) for key, size, _rank in page)
            after = (page[-1][2], page[-1][0])
        if retained and freed < need and not take(holds.retained_victims(con)):
            return []  # pins (or calls in flight) hold the rest: evict nothing for nothing
        return victims

    @staticmethod
    def _meta(con: sqlite3.Connection, name: str) -> int:
        value: int = con.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0]
        return value

    @staticmethod
    def _add_meta(con: sqlite3.Connection, *, total: int = 0, count: int = 0) -> None:
        if total:
            con.execute("UPDATE meta SET value = value + ? WHERE name = 'total_bytes'", (total,))
        if count:
            con.execute("UPDATE meta SET value = value + ? WHERE name = 'count'", (count,))

    @staticmethod
    def _reserved(
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

    @staticmethod
    def _first_row(con: sqlite3.Connection, mine: tuple[str, int] | None) -> int | None:
        """The first pending rowid of the put ``mine`` (owner token, batch), if it is pending."""
        if mine is None:
            return None
        row = con.execute(
            "SELECT MIN(rowid) FROM pending WHERE token = ? AND batch = ?", mine
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    @staticmethod
    def _earlier_puts(con: sqlite3.Connection, first: int) -> int:
        """How many pending put rows came before rowid ``first``."""
        value: int = con.execute(
            "SELECT COUNT(*) FROM pending WHERE op = 'put' AND rowid < ?", (first,)
        ).fetchone()[0]
        return value

    def _maybe_compact(self) -> None:
        with self._read() as con:
            seq = self._feed_seq(con)
            snap = self._meta(con, "snapshot_seq")
        if seq - snap > self._delta_bound():
            self._compact_soon()

    # -- the named change feed (store-wide events) ------------------------------------------

    def changes_after(self, seq: int, limit: int = 64) -> FeedChanges:
        """The changes numbered after ``seq``, named (at most ``limit`` feed rows, oldest
        first), and the number of the last change. ``complete`` is False when some of them
        cannot be told: pruned by a compaction, recorded by a version that did not name them,
        or numbered anew by a rebuilt index (the last number is below ``seq``); the reader
        then starts again from ``listing``."""
        with self._read() as con:
            last = self._feed_seq(con)
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
        with self._read() as con:
            last = self._feed_seq(con)
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
        with self._read() as con:
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
        with self._read() as con:
            return list(con.execute(f"{sql} ORDER BY key LIMIT ?", (*params, limit)))

    def totals(self) -> tuple[int, int]:
        """``(bytes, objects)`` indexed."""
        with self._read() as con:
            return self._meta(con, "total_bytes"), self._meta(con, "count")

    def reserved_bytes(self) -> int:
        with self._read() as con:
            return self._reserved(con)

    # -- close -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush read recency, stop a compaction, close every connection."""
        with contextlib.suppress(BackendError):
            self.flush_touches()
        self._stopping.set()
        if self._compactor is not None:
            self._compactor.join()
        with self._conn_lock:
            connections, self._connections = self._connections, []
        for con in connections:
            with contextlib.suppress(sqlite3.Error):
                con.close()

    def _close_thread_connection(self) -> None:
        con = getattr(self._local, "con", None)
        if con is None:
            return
        self._local.con = None
        with self._conn_lock:
            if con in self._connections:
                self._connections.remove(con)
        con.close()


class TicketLock:
    """A lock that threads get in the order they asked for it (FIFO)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the ticket the next thread to ask takes
        self._serving = 0  # the ticket that holds the lock

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


def _file_id(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of a file; None if there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _filesystem_full(path: str) -> bool:
    """Whether the filesystem of ``path`` has no block left for this process."""
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > seconds
    except FileNotFoundError:
        return False


def _marks(n: int) -> str:
    return ",".join("?" * n)


def _pid_namespace() -> int:
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


__all__ = [
    "EvictionCount", "FileIndex", "ObjectIndex", "Reservation", "fingerprint", "lookup",
    "pid_alive", "snapshot_name",
]
