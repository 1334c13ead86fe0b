"""``exists`` for a file root's index: the fingerprint set, kept current from the change feed.

A point lookup in SQLite costs microseconds of CPU per key even in one ``IN`` query
(BENCHMARKS.md, "Design figures behind the file backend's index and read policy"), so
``exists`` reads a *fingerprint set* instead: a sorted array of the 64-bit xxh3 fingerprints of
every key as of change ``S`` (a file in ``index/``, mapped read-only and shared through the page
cache: 8 bytes per object, none of it process-private), plus the changes after ``S``, which every
process reads from the database's change feed before it answers (one query when another
connection has committed since the last look, none otherwise; the feed packs the changes of
each write into one row, read and kept as numpy arrays: ``_fingerprints``). So a key written by
another process a moment ago is found at numpy speed.

**Compaction.** When the changes since ``S`` outgrow a bound (an eighth of the store, at least
``MIN_DELTA`` and at most ``MAX_DELTA`` changes), the writer that notices, holding a lease,
writes a new snapshot and prunes the feed; the others map it at their next look.

A fingerprint can collide: an absent key is reported present with probability n / 2^64 (one in
10^11 lookups at 100 M objects); reads are exact (a miss).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ._file_index_db import IndexDB
from ._file_index_rows import feed_seq, meta
from ._fingerprints import Delta, Snapshot, decode_changes, fingerprints, lookup
from ._lru import now_ms
from .errors import BackendError

#: how long a compaction lease lasts without renewal.
COMPACT_LEASE_MS = 10 * 60 * 1000
MIN_DELTA = 8 * 1024
MAX_DELTA = 1 << 20
#: temp snapshot files older than this are a killed compactor's.
STALE_TEMP_SECONDS = 3600.0


def snapshot_name(seq: int) -> str:
    return f"fp-{seq:016x}.u64"


@dataclass
class _View:
    """The fingerprint set one process answers ``exists`` from (see the module docstring)."""

    snapshot_seq: int = -2  # none mapped yet (-1: the store has no snapshot)
    seen_seq: int = 0
    snapshot: Snapshot = field(default_factory=lambda: Snapshot(np.zeros(0, dtype=np.uint64)))
    delta: Delta = field(default_factory=Delta)
    data_version: int = -1
    refreshed_at: float = float("-inf")  # (monotonic) when its last refresh began


class Membership:
    """The fingerprint set of one index, and its compaction. Thread-safe. ``tmp_tag`` names
    this process's temp snapshot files."""

    def __init__(self, db: IndexDB, tmp_tag: str) -> None:
        self._db = db
        self._tmp_tag = tmp_tag
        self._view = _View()
        self._lock = threading.Lock()  # guards _view and _feed
        self._feed: sqlite3.Connection | None = None
        self._feed_generation = 0
        self._compactor: threading.Thread | None = None
        self._compact_tried = -1.0
        self._stopping = threading.Event()

    # -- existence ---------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is indexed, as of now (other processes' commits included)."""
        fps = fingerprints(keys)
        with self._lock:
            self._refresh()
            return lookup(self._view.snapshot, self._view.delta, fps)

    def exists_if_current(self, keys: Sequence[str]) -> list[bool] | None:
        """``exists`` when it can answer at once: the fingerprint set is up to date and no
        other thread is using it; otherwise None (call ``exists``). Never waits on I/O or a
        lock, so an event loop may call it inline."""
        if self._db.host.taken_over is not None or not self._lock.acquire(blocking=False):
            return None  # (taken over: ``exists`` raises)
        try:
            if (self._feed is None or self._feed_generation != self._db.generation
                    or self._db.check_due()
                    or self._data_version() != self._view.data_version):
                return None  # (a check of the database file is due: ``exists`` makes it)
            return lookup(self._view.snapshot, self._view.delta, fingerprints(keys))
        finally:
            self._lock.release()

    def exists_recent(self, keys: Sequence[str], max_age_s: float) -> list[bool] | None:
        """``exists`` as of the last time the fingerprint set was brought up to date, if that
        began at most ``max_age_s`` ago and after this process's last change of what is
        stored, and no other thread is using the set; otherwise None. No I/O, no SQLite call,
        never waits: for a thread that must not release the GIL (a scheduler), which accepts
        an answer that may miss other processes' changes of the last ``max_age_s`` (see
        ``Backend.exists_now``); this process's own puts and deletes are never missed."""
        if self._db.host.taken_over is not None or not self._lock.acquire(blocking=False):
            return None
        try:
            refreshed = self._view.refreshed_at
            if (self._feed is None or self._feed_generation != self._db.generation
                    or refreshed <= self._db.changed_at
                    or time.monotonic() - refreshed > max_age_s):
                return None
            return lookup(self._view.snapshot, self._view.delta, fingerprints(keys))
        finally:
            self._lock.release()

    def _data_version(self) -> int:
        """The feed connection's ``data_version`` (caller holds ``_lock``)."""
        assert self._feed is not None
        with self._db.translated():
            version: int = self._feed.execute("PRAGMA data_version").fetchone()[0]
        return version

    def _refresh(self) -> None:
        """Bring the fingerprint set up to date (caller holds ``_lock``).

        The feed connection never writes, so its ``data_version`` moves exactly when some
        other connection (this process's writers included) has committed."""
        started = time.monotonic()  # every commit before this is in the view after it
        self._db.check_replaced()
        if self._feed is not None and self._feed_generation != self._db.generation:
            self._db.forget(self._feed)
            self._feed.close()  # of a removed database: start over from the new one
            self._feed, self._view = None, _View()
        view = self._view
        if self._feed is None:
            self._feed = self._db.connect()
            self._feed_generation = self._db.generation
        feed = self._feed
        version = self._data_version()
        if version == view.data_version:
            view.refreshed_at = started
            return
        for attempt in range(3):
            with self._db.read(feed) as con:
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
                raise self._db.unreadable(exc) from exc
            view.delta.apply(changes)
            view.seen_seq = rows[-1][0]
        # No compaction from here: the writers start one once the feed outgrows its bound
        # (``maybe_compact``), and a reader's delta costs 9 bytes and O(log) per change.
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
        return os.path.join(self._db.dir, snapshot_name(seq))

    # -- snapshots (compaction) ------------------------------------------------------------------

    def maybe_compact(self) -> None:
        """Start a compaction when the feed has outgrown its bound (after a write)."""
        with self._db.read() as con:
            seq = feed_seq(con)
            snap = meta(con, "snapshot_seq")
            count = meta(con, "count")
        if seq - snap > max(MIN_DELTA, min(count // 8, MAX_DELTA)):
            self._compact_soon()

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
            self._db.close_thread_connection()

    def compact(self) -> bool:
        """Write a snapshot of every fingerprint and prune the feed; False if another process
        holds the compaction lease."""
        now = now_ms()
        with self._db.write() as con:
            until = meta(con, "compact_lease")
            if until > now:
                return False
            con.execute("UPDATE meta SET value = ? WHERE name = 'compact_lease'",
                        (now + COMPACT_LEASE_MS,))
        try:
            self.compact_now()
        finally:
            with self._db.write() as con:
                con.execute("UPDATE meta SET value = 0 WHERE name = 'compact_lease'")
        return True

    def compact_now(self) -> None:
        with self._db.read() as con:
            seq = feed_seq(con)
            fps = np.fromiter((fp for (fp,) in con.execute("SELECT fp FROM objects")),
                              dtype=np.int64)
        snap = fps.view(np.uint64)
        snap.sort()
        # A snapshot is named by the last change it holds (0: none, e.g. right after a build):
        # racing builders of one number write the same content.
        path = self._snapshot_path(seq)
        tmp = f"{path}.{self._tmp_tag}.tmp"
        try:
            snap.astype("<u8", copy=False).tofile(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with self._db.write() as con:
            current = meta(con, "snapshot_seq")
            if seq > current:
                con.execute("UPDATE meta SET value = ? WHERE name = 'snapshot_seq'", (seq,))
                con.execute("DELETE FROM feed WHERE seq <= ?", (seq,))
                current = seq
        self._remove_old_snapshots(keep=current)

    def _remove_old_snapshots(self, keep: int) -> None:
        """Delete snapshots older than the one before ``keep`` (a process that read the
        previous number a moment ago may still be about to map it)."""
        names = sorted(n for n in os.listdir(self._db.dir) if n.startswith("fp-"))
        older = [n for n in names if n.endswith(".u64") and n < snapshot_name(keep)]
        stale = [n for n in names if n.endswith(".tmp") and _older_than(
            os.path.join(self._db.dir, n), STALE_TEMP_SECONDS)]  # a killed compactor's
        for name in older[:-1] + stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._db.dir, name))

    def stop(self) -> None:
        """Stop a compaction running here (close)."""
        self._stopping.set()
        if self._compactor is not None:
            self._compactor.join()


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > seconds
    except FileNotFoundError:
        return False


__all__ = ["COMPACT_LEASE_MS", "MAX_DELTA", "MIN_DELTA", "Membership", "snapshot_name"]
