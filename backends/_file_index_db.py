"""The SQLite database of a file root's index: connections, transactions, the schema and its
upgrades, the first build, and following the database when ``index/`` is replaced.

One connection per thread (``con``); a write is one ``BEGIN IMMEDIATE`` transaction, a read
one ``BEGIN`` transaction (``write`` / ``read``). SQLite's errors are translated once, here:
a lock held past ``lock_timeout`` is ``BackendUnavailableError``, other operational errors
``BackendIOError``, a damaged file a ``BackendError`` that says to remove ``index/``.

**A replaced database.** A process that has the index open when ``index/`` is removed notices
within ``REPLACED_CHECK_SECONDS`` (its database file is not the one at the path any more,
``check_replaced``) and moves every connection to the rebuilt database, or builds it itself
(other openers wait on ``LOCK_NAME``). A connection opened for an earlier database is replaced
at its thread's next use (``generation``).

**The write lock.** The threads of one process take it one at a time in the order they asked
(``TicketLock``); SQLite's own wait (polls with sleeps growing to 100 ms) is left to arbitrate
between processes, since among many threads it let one lose the lock to the others for as long
as they kept taking it.

**Read-only** (``read_only``): connections that never write (``mode=ro``; on a full
filesystem, where a reader cannot make the shared-memory file, the database file alone when
its log holds nothing); every write transaction raises ``NotSupportedError``.

**Another host.** Nothing is committed once another host has taken the root's index over
(``HostClaim.check`` before each commit: one ``stat``), and every later call fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator

import numpy as np

from . import _file_retention as holds
from ._file_site import HostClaim
from ._fingerprints import FEED_RECORD
from .errors import (
    BackendError,
    BackendIOError,
    BackendUnavailableError,
    NotSupportedError,
    OutOfSpaceError,
)

DB_NAME = "index.sqlite3"
LOCK_NAME = "build.lock"
#: how often (at most, in seconds) a process checks that the database it has open is still
#: the one at ``index/``: removed (by an operator, as the message of an unreadable index says)
#: and rebuilt by another opener, a process that went on with the removed file would never see
#: the others' writes again, nor they its own.
REPLACED_CHECK_SECONDS = 1.0
_MASK64 = (1 << 64) - 1
_SQLITE_FULL = 13  # the result code of "database or disk is full" (sqlite3.SQLITE_FULL, 3.11+)
#: what opening a WAL database's shared memory fails with on a full filesystem: SQLITE_FULL,
#: SQLITE_CANTOPEN, SQLITE_IOERR_SHMOPEN / _SHMSIZE / _SHMMAP.
_NO_SHARED_MEMORY = frozenset({13, 14, 4618, 4874, 5386})

#: The change feed: each row packs the changes of one index write (``_fingerprints``); its
#: ``seq`` is the number of the last change it holds (changes are counted, not rows).
#: ``keys``: the keys of those changes, in order, joined by newlines (keys never hold one),
#: for readers that must name each change (``changes_after``: the store-wide KV events);
#: NULL in rows written before the column existed. The membership readers never read it.
FEED_TABLE = """CREATE TABLE IF NOT EXISTS feed (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    recs BLOB NOT NULL,
    keys TEXT
)"""

SCHEMA = FEED_TABLE + """;
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


class IndexDB:
    """The database of one root's index (module docstring). Thread-safe.

    ``build`` fills a database just created (from a walk of the store); it runs once, by the
    one opener that holds the build lock, inside ``open``."""

    def __init__(
        self, index_dir: str, host: HostClaim, *, durable: bool, lock_timeout: float,
        read_only: bool = False,
    ) -> None:
        self.dir = index_dir
        self.read_only = read_only
        self.path = os.path.join(index_dir, DB_NAME)
        self.host = host
        self.durable = durable
        self.lock_timeout = lock_timeout
        self._local = threading.local()  # per thread: its connection; whether its write changed
        self._connections: list[sqlite3.Connection] = []
        self._conn_lock = threading.Lock()
        #: (monotonic) this process's last commit that changed what is stored
        self.changed_at = float("-inf")
        #: which database file the connections are for; bumped when it is replaced.
        self.generation = 0
        self._db_id: tuple[int, int] | None = None
        self.checked_at = time.monotonic()
        self._replace_lock = threading.RLock()
        self._replacing = False  # set while this process moves to a new database
        self._build: Callable[[], None] | None = None
        #: this process's write transactions, one at a time in the order they asked
        self._writers = TicketLock()

    # -- connections and transactions -----------------------------------------------------------

    def con(self) -> sqlite3.Connection:
        """This thread's connection (to the database now at ``path``)."""
        self.check_replaced()
        con: sqlite3.Connection | None = getattr(self._local, "con", None)
        if con is not None and self._local.generation != self.generation:
            self.close_thread_connection()  # of a removed database
            con = None
        if con is None:
            con = self.connect()
            self._local.con = con
            self._local.generation = self.generation
        return con

    def connect(self) -> sqlite3.Connection:
        with self.translated():
            if self.read_only:
                con = self._connect_read_only()
            else:
                con = sqlite3.connect(
                    self.path, timeout=self.lock_timeout, isolation_level=None,
                    check_same_thread=False,  # one thread at a time uses it; close() runs on another
                )
                con.execute(f"PRAGMA synchronous={'FULL' if self.durable else 'NORMAL'}")
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
        path = urllib.parse.quote(self.path)

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
            wal = self.path + "-wal"
            if os.path.exists(wal) and os.path.getsize(wal) > 0:
                root = os.path.dirname(self.dir)
                raise OutOfSpaceError(
                    f"the index of {root} cannot be read: its filesystem is full, a reader "
                    f"needs {self.path}-shm, which cannot be made ({exc}), and the "
                    "write-ahead log holds changes not in the database file. Free a little "
                    "space on that filesystem (remove other files: a few hundred KiB), then "
                    f"run this again, or hicache-store gc file://{root} --max-bytes SIZE",
                    backend="file", operation="open") from exc
            return connect("immutable=1")

    def forget(self, con: sqlite3.Connection) -> None:
        """Stop tracking ``con`` (its owner closes it)."""
        with self._conn_lock:
            if con in self._connections:
                self._connections.remove(con)

    def mark_changed(self) -> None:
        """The write transaction of this thread changes what is stored (``changed_at`` moves
        at its commit: ``exists_recent``'s view is older than that)."""
        self._local.changed = True

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``: takes the write lock up front, so two
        writers never deadlock upgrading; waits up to ``lock_timeout`` for it). Nothing is
        committed once another host has taken the root's index over (``HostClaim.check``
        before each commit: one ``stat``). ``NotSupportedError`` when opened read-only."""
        if self.read_only:
            raise NotSupportedError(f"the index at {self.path} is open read-only",
                                    backend="file", operation="index")
        con = self.con()
        self._local.changed = False
        with self._writers, self.translated():
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
                self.host.check()
                con.execute("COMMIT")
                if self._local.changed:
                    self.changed_at = time.monotonic()
            except BaseException:
                if con.in_transaction:  # SQLite may have rolled back already (e.g. disk full)
                    con.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def read(self, con: sqlite3.Connection | None = None) -> Iterator[sqlite3.Connection]:
        """One read transaction: a consistent view of every table."""
        con = con or self.con()
        with self.translated():
            con.execute("BEGIN")
            try:
                yield con
            finally:
                con.execute("COMMIT")

    @contextlib.contextmanager
    def translated(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            text = str(exc)
            if "locked" in text or "busy" in text:
                raise BackendUnavailableError(
                    f"the index at {self.path} stayed locked for {self.lock_timeout} s",
                    backend="file", operation="index",
                ) from exc
            code = getattr(exc, "sqlite_errorcode", None)
            if code == _SQLITE_FULL or "disk is full" in text or (
                    code in _NO_SHARED_MEMORY and _filesystem_full(self.dir)):
                raise self.out_of_space(text) from exc
            raise BackendIOError(f"index at {self.path}: {text}", backend="file",
                                 operation="index") from exc
        except sqlite3.DatabaseError as exc:
            raise self.unreadable(exc) from exc

    def out_of_space(self, cause: str) -> OutOfSpaceError:
        """The error of an index write that found the filesystem full: it names the root and
        what frees space."""
        root = os.path.dirname(self.dir)
        return OutOfSpaceError(
            f"the filesystem of {root} is full: the index at {self.path} cannot commit "
            f"({cause}). Free space: hicache-store gc file://{root} --max-bytes SIZE (it "
            "deletes objects even while the index cannot commit), or remove other files on "
            "that filesystem; a smaller capacity_bytes leaves the index room to grow",
            backend="file", operation="index",
        )

    def unreadable(self, exc: Exception) -> BackendError:
        return BackendError(
            f"the index at {self.path} is unreadable ({exc}); remove {self.dir} and it "
            "is rebuilt from objects/ at the next open",
            backend="file", operation="index",
        )

    # -- a replaced database -----------------------------------------------------------------------

    def check_replaced(self) -> None:
        """At most every ``REPLACED_CHECK_SECONDS``: if the database at ``path`` is not the
        file this process opened (``index/`` was removed, and rebuilt by another opener or not
        yet), move every connection to the one there, building it first if there is none
        (other openers wait on the build lock)."""
        if time.monotonic() - self.checked_at < REPLACED_CHECK_SECONDS or self._db_id is None:
            return
        with self._replace_lock:
            if self._replacing or time.monotonic() - self.checked_at < REPLACED_CHECK_SECONDS:
                return  # the calls of the move below, or another thread checked meanwhile
            self.checked_at = time.monotonic()
            current = file_id(self.path)
            if current == self._db_id:
                self.host.check()  # the host record is still this kernel's (one stat)
                return
            self._replacing = True
            try:
                self.generation += 1  # first: open's reads must not use the removed file
                if not self.read_only:
                    os.makedirs(self.dir, exist_ok=True)
                self.host.check()  # removed with index/: claimed again before the rebuild
                self._open()  # ready already, or wait for its builder, or build it
            finally:
                self._replacing = False

    def check_due(self) -> bool:
        """Whether ``check_replaced`` has a check to make (``exists_if_current`` then defers
        to a call that may do I/O)."""
        return time.monotonic() - self.checked_at >= REPLACED_CHECK_SECONDS

    # -- open, build, upgrades -----------------------------------------------------------------------

    def open(self, build: Callable[[], None]) -> None:
        """Open the database, creating and building it first if there is none, and bring an
        older one's schema up to date."""
        self._build = build
        self._open()
        if self.read_only:
            return
        self.upgrade_feed()
        self.add_retention()

    def _open(self) -> None:
        if self.read_only:
            if not self.ready():
                raise BackendError(
                    f"the index at {self.path} is not built yet (being built, or removed); "
                    "open the root read-write once, or again in a moment",
                    backend="file", operation="open")
            self._db_id = file_id(self.path)
            return
        try:
            if self.ready():
                self._db_id = file_id(self.path)
                return
        except BackendError:
            pass  # being created by another opener right now: wait for it below
        # No index yet (a new root, or one written before the index existed): one opener
        # builds it while the others wait on the lock, then find it ready.
        with open(os.path.join(self.dir, LOCK_NAME), "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            if not self.ready():
                with self.translated():
                    con = self.con()
                    con.execute("PRAGMA journal_mode=WAL")
                    con.executescript(SCHEMA)
                    holds.create(con)
                if self._build is not None:
                    self._build()
                with self.write() as con:
                    con.execute("INSERT OR REPLACE INTO meta VALUES ('ready', 1)")
        self._db_id = file_id(self.path)

    def ready(self) -> bool:
        if not os.path.exists(self.path):
            return False
        try:
            with self.read() as con:
                row = con.execute("SELECT value FROM meta WHERE name = 'ready'").fetchone()
        except BackendIOError as exc:
            if "no such table" in str(exc):
                return False
            raise
        return row is not None

    def upgrade_feed(self) -> None:
        """Convert the change feed of an index written before the feed was packed (a table
        ``changes`` of one row per change) to ``feed``: once, in one transaction, by whichever
        opener comes first. Change numbers are kept, so the current snapshot stays valid. A
        process of the older code still open on this root fails its next index call (no such
        table) instead of reading a feed that nobody writes any more."""
        self._add_feed_keys()
        find = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'changes'"
        with self.read() as con:
            if not con.execute(find).fetchone():
                return
        with self.write() as con:
            if not con.execute(find).fetchone():
                return  # another opener converted it meanwhile
            con.execute(FEED_TABLE)
            row = con.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
            last = int(row[0]) if row else 0
            snapshot = con.execute(
                "SELECT value FROM meta WHERE name = 'snapshot_seq'").fetchone()[0]
            rows = con.execute("SELECT fp, present FROM changes WHERE seq > ? ORDER BY seq",
                               (snapshot,)).fetchall()
            added = [(fp & _MASK64, present == 1) for fp, present in rows]
            if added:
                records = np.empty(len(added), dtype=FEED_RECORD)
                records["fp"] = np.array([fp for fp, _ in added], dtype=np.uint64)
                records["present"] = [present for _, present in added]
                con.execute("INSERT INTO feed (seq, recs) VALUES (?, ?)", (last, records.tobytes()))
            elif last:
                con.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('feed', ?)", (last,))
            con.execute("DROP TABLE changes")

    def add_retention(self) -> None:
        """Create the retention table (``_file_retention``) if this index has none yet: a new
        one, or one written before retention existed."""
        with self.read() as con:
            if holds.has_table(con):
                return
        with self.write() as con:
            holds.create(con)

    def _add_feed_keys(self) -> None:
        """Give a feed written before it named its changes the ``keys`` column (once, by the
        first opener; older rows keep NULL, which ``changes_after`` reports as unnamed)."""
        def has_keys(con: sqlite3.Connection) -> bool:
            rows = con.execute("PRAGMA table_info(feed)").fetchall()
            return not rows or any(row[1] == "keys" for row in rows)

        with self.read() as con:
            if has_keys(con):
                return
        with self.write() as con:
            if not has_keys(con):
                con.execute("ALTER TABLE feed ADD COLUMN keys TEXT")

    # -- close ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every connection."""
        with self._conn_lock:
            connections, self._connections = self._connections, []
        for con in connections:
            with contextlib.suppress(sqlite3.Error):
                con.close()

    def close_thread_connection(self) -> None:
        con = getattr(self._local, "con", None)
        if con is None:
            return
        self._local.con = None
        self.forget(con)
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


def _filesystem_full(path: str) -> bool:
    """Whether the filesystem of ``path`` has no block left for this process."""
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


def file_id(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of a file; None if there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


__all__ = [
    "DB_NAME", "LOCK_NAME", "REPLACED_CHECK_SECONDS", "IndexDB", "TicketLock", "file_id",
]
