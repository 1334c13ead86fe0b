"""A small SQLite backend that keeps every contract, and mutants of it that each break one.

``SqliteBackend`` is a correct, persistent backend (one table, a row per object); it must pass
the conformance suite. Each class in ``MUTANTS`` overrides one method with a defect that once
got past the suite (issue 18's list), so each must fail it: ``test_mutants.py`` runs the suite
on all of them and checks that.

Not a product backend: the database is used from the event loop thread without an executor
(fine for tests, where every call is small: well inside the suite's watch on the loop).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from hicache_store.backends import (
    Backend,
    BackendURL,
    ByteRange,
    Capabilities,
    InvalidRangeError,
    NotFoundError,
    ObjectStat,
)
from hicache_store.backends.types import convert_options

_SCHEMA = "CREATE TABLE IF NOT EXISTS objects (key TEXT PRIMARY KEY, data BLOB, mtime REAL)"
_CHUNK = 500  # keys per IN (...) query, under SQLite's variable limit


class SqliteBackend(Backend):
    """Objects as rows of one SQLite table (a file: persistent across reopen)."""

    name = "sqlite"
    # Connecting creates the database file: ``create=False`` (the read-only tools) must not.
    creates_location = True
    capabilities = Capabilities(
        ranged_reads=True, listing=True, atomic_put=True, persistent=True, mtime=True
    )
    schema = _SCHEMA

    def __init__(self, path: str, *, create: bool = True) -> None:
        super().__init__()
        self.path = path
        if not create and not os.path.isfile(path):
            raise NotFoundError(f"no database at {path} (nothing was created)",
                                backend=self.name, operation="open")
        target, uri = (path, False) if create else (f"file:{path}?mode=rw", True)
        self.db = sqlite3.connect(target, uri=uri, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA synchronous = OFF")  # a test backend: no fsync per row
        self.db.execute(self.schema)

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> SqliteBackend:
        """``sqlite:///path/to/file.db``, option ``create``."""
        return cls(url.local_path(), **convert_options(options, bools=("create",)))

    # -- the core --------------------------------------------------------------------------------

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        found = self._present(keys)
        return [key in found for key in keys]

    def _present(self, keys: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for s in range(0, len(keys), _CHUNK):
            chunk = list(keys[s : s + _CHUNK])
            marks = ",".join("?" * len(chunk))
            found.update(r[0] for r in self.db.execute(
                f"SELECT key FROM objects WHERE key IN ({marks})", chunk))
        return found

    def _read(self, key: str) -> bytes | None:
        row = self.db.execute("SELECT data FROM objects WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: Sequence[ByteRange | None]
    ) -> list[int | None]:
        return [self._fill(key, self._read(key), buf, rng)
                for key, buf, rng in zip(keys, buffers, ranges, strict=True)]

    def _fill(self, key: str, data: bytes | None, buf: memoryview, rng: ByteRange | None
              ) -> int | None:
        if data is None:
            return None
        if rng is None:
            if len(data) > len(buf):
                raise InvalidRangeError(f"{len(data)}-byte object, {len(buf)}-byte buffer",
                                        backend=self.name, key=key)
            buf[: len(data)] = data
            return len(data)
        rng.check_within(len(data), backend=self.name, key=key)
        buf[: rng.length] = data[rng.start : rng.end]
        return rng.length

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        now = time.time()
        rows = [(key, self._stored(bytes(buf)), now) for key, buf in zip(keys, buffers, strict=True)]
        self.db.execute("BEGIN")  # the batch in one transaction
        self.db.executemany("INSERT OR REPLACE INTO objects VALUES (?, ?, ?)", rows)
        self.db.execute("COMMIT")

    def _stored(self, data: bytes) -> bytes:
        return data

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        return [self.db.execute("DELETE FROM objects WHERE key = ?", (k,)).rowcount > 0
                for k in keys]

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        out: list[ObjectStat | None] = []
        for key in keys:
            row = self.db.execute(
                "SELECT length(data), mtime FROM objects WHERE key = ?", (key,)).fetchone()
            out.append(None if row is None else ObjectStat(key, int(row[0]), float(row[1])))
        return out

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        rows = self.db.execute("SELECT key FROM objects WHERE substr(key, 1, ?) = ?",
                               (len(prefix), prefix)).fetchall()
        for (key,) in rows:
            yield key

    async def _put_if_absent(self, key: str, buffer: memoryview) -> bool:
        cursor = self.db.execute("INSERT OR IGNORE INTO objects VALUES (?, ?, ?)",
                                 (key, bytes(buffer), time.time()))
        return cursor.rowcount > 0

    async def _close(self) -> None:
        self.db.close()

    # -- oracle access (around the API) ------------------------------------------------------------

    def raw_get(self, key: str) -> bytes | None:
        return self._read(key)

    def raw_set(self, key: str, data: bytes) -> None:
        self.db.execute("INSERT OR REPLACE INTO objects VALUES (?, ?, ?)", (key, data, time.time()))


# -- one defect each ---------------------------------------------------------------------------


class ExistsWrongPast64(SqliteBackend):
    """Answers past the 64th key of a batch repeat the first 64 answers (a chunking bug)."""

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        head = await super()._exists(keys[:64])
        return head + [head[i % 64] for i in range(64, len(keys))]


class GetIntoWrongBuffersOver32(SqliteBackend):
    """Batches over 32 keys are read with one query whose rows (in key order) are matched to
    the buffers in request order."""

    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: Sequence[ByteRange | None]
    ) -> list[int | None]:
        if len(keys) <= 32:
            return await super()._get_into(keys, buffers, ranges)
        rows = dict(self.db.execute(
            f"SELECT key, data FROM objects WHERE key IN ({','.join('?' * len(keys))})",
            list(keys)).fetchall())
        in_key_order = [rows.get(k) for k in sorted(keys)]
        out: list[int | None] = []
        for key, data, buf, rng in zip(keys, in_key_order, buffers, ranges, strict=True):
            try:
                out.append(self._fill(key, None if data is None else bytes(data), buf, rng))
            except InvalidRangeError:
                out.append(None)  # and swallows the size mismatch it causes
        return out


class ExistsHangsOver50(SqliteBackend):
    """An exists call on more than 50 keys waits for a wake-up that never comes."""

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        if len(keys) > 50:
            await asyncio.Event().wait()
        return await super()._exists(keys)


class TruncatesOver2MiB(SqliteBackend):
    """Objects over 2 MiB are cut to 2 MiB (a fixed-size column or a single read)."""

    def _stored(self, data: bytes) -> bytes:
        return data[: 2 << 20]


class CaseInsensitiveKeys(SqliteBackend):
    """Keys compared without case (a NOCASE column, a case-insensitive filesystem)."""

    schema = _SCHEMA.replace("key TEXT PRIMARY KEY", "key TEXT PRIMARY KEY COLLATE NOCASE")


class LikeListing(SqliteBackend):
    """Listing built on SQL ``LIKE``: ``_`` matches any character (and case is ignored)."""

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        rows = self.db.execute("SELECT key FROM objects WHERE key LIKE ? || '%'",
                               (prefix,)).fetchall()
        for (key,) in rows:
            yield key


class StaleReadCache(SqliteBackend):
    """A read cache filled on reads and never invalidated by writes or deletes."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.cache: dict[str, bytes] = {}

    def _read(self, key: str) -> bytes | None:
        if key in self.cache:
            return self.cache[key]
        data = super()._read(key)
        if data is not None:
            self.cache[key] = data
        return data


class StatWithoutMtime(SqliteBackend):
    """Declares ``mtime`` but leaves it out of ``stat`` (gc would age every object as 1970)."""

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        return [None if st is None else ObjectStat(st.key, st.size)
                for st in await super()._stat(keys)]


class WipesOnOpen(SqliteBackend):
    """Declares ``persistent`` but empties the table whenever it is opened."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.db.execute("DELETE FROM objects")


class OverwriteDeletesFirst(SqliteBackend):
    """Overwrites an object by deleting it, then inserting the new bytes (two statements, with
    the loop free in between): a reader in that gap finds no object at all."""

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        await self._delete(keys)
        await asyncio.sleep(0.002)
        await super()._put(keys, buffers)


class CreatesItsLocationUndeclared(SqliteBackend):
    """Creates its database file at open without declaring ``creates_location``: ``inspect``
    or ``gc`` pointed at a mistyped path would leave a new, empty store there."""

    creates_location = False


class IgnoresCreateFalse(SqliteBackend):
    """Declares ``creates_location`` and takes ``create``, but creates the file anyway."""

    def __init__(self, path: str, *, create: bool = True) -> None:
        super().__init__(path)


class BlocksTheLoop(SqliteBackend):
    """Writes each object with a blocking round trip on the event loop's thread (as a
    synchronous SDK call made without an executor does; here a 50 ms sleep per key)."""

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        for _ in keys:
            time.sleep(0.05)  # noqa: ASYNC251 - the defect
        await super()._put(keys, buffers)


class CrashesOnLargeBatches(SqliteBackend):
    """Its reads share one connection among threads without a lock, a race that ends in
    SIGSEGV; here the crash comes every time, on the first exists call over 50 keys."""

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        if len(keys) > 50:
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return await super()._exists(keys)


#: every mutant, by the name of the defect, with the suite test that must catch it.
MUTANTS: dict[str, tuple[type[SqliteBackend], str]] = {
    "exists_wrong_past_64": (
        ExistsWrongPast64, "test_large_batches_map_every_key_to_its_own_buffer"),
    "get_into_wrong_buffers_over_32": (
        GetIntoWrongBuffersOver32, "test_large_batches_map_every_key_to_its_own_buffer"),
    "exists_hangs_over_50": (
        ExistsHangsOver50, "test_large_batches_map_every_key_to_its_own_buffer"),
    "truncates_over_2_mib": (TruncatesOver2MiB, "test_a_16_mib_object"),
    "case_insensitive_keys": (CaseInsensitiveKeys, "test_keys_differing_only_in_case_are_distinct"),
    "like_listing": (LikeListing, "test_listing_prefixes_are_literal"),
    "stale_read_cache": (StaleReadCache, "test_reads_after_a_rewrite_or_delete_are_never_stale"),
    "stat_without_mtime": (StatWithoutMtime, "test_stat_reports_the_write_time_when_declared"),
    "wipes_on_open": (WipesOnOpen, "test_objects_survive_a_reopen"),
    "overwrite_deletes_first": (OverwriteDeletesFirst, "test_no_partial_object_is_ever_visible"),
    "creates_its_location_undeclared": (
        CreatesItsLocationUndeclared, "test_opening_a_missing_location_creates_nothing"),
    "ignores_create_false": (IgnoresCreateFalse, "test_opening_a_missing_location_creates_nothing"),
    "blocks_the_loop": (BlocksTheLoop, "test_large_batches_map_every_key_to_its_own_buffer"),
}

__all__ = ["MUTANTS", "SqliteBackend"]
