"""The Valkey index read whole, and built whole: listings, the change feed, a build from a walk.

``Pages`` reads what one store's index holds beyond single keys: the change feed (a stream whose
entry ``<seq>-0`` carries the changes numbered up to ``seq``: ``changes_after``), every page
record (``pages``: the 65,536 page hashes a chunk at a time, in pipelines) and a listing exact
as of one change number (``listing``). ``Builder`` makes the index when there is none (a new
store, or one lost with its server): one process builds it from a walk of the store under a
lock (a key with a TTL, renewed while it builds), the others wait; its change numbers start
above any an earlier index of the store gave, so a feed reader starts over from a listing. An
index of the previous format (``_valkey_scripts.FORMAT``) is migrated under the same lock, a
chunk of pages per atomic step; one of a later format is refused.
The keys and scripts are ``_valkey_scripts``'.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ._valkey_keys import names, unpack
from ._valkey_link import RETRY_S, Link
from ._valkey_scripts import FORMAT
from .errors import BackendError, BackendUnavailableError
from .index import FeedChanges, Measured, ObjectSite

log = logging.getLogger(__name__)
T = TypeVar("T")

#: the 65,536 page hashes (``_valkey_keys``), read this many per round trip in a listing (a
#: round trip's work stays far inside one ``timeout_s`` on a loaded server)
BUCKETS = 1 << 16
SCAN_CHUNK = 512
_RANK_EPOCH_MS = 1704067200000
_BUILD_LOCK_MS = 60_000
_BUILD_CHUNK = 500  # objects per step of a build
_TRIES = 5  # tries of one idempotent step of a build or a listing that timed out
_MIGRATE_CHUNK = 2000  # pages per step of a migration from an earlier format


def retried(step: Callable[[], T]) -> T:
    """``step()``, tried again after a timeout (the link refuses calls for ``RETRY_S`` after
    one), up to ``_TRIES`` times: for idempotent steps of bulk work, which a loaded server may
    answer late once."""
    for attempt in range(_TRIES):
        try:
            return step()
        except BackendUnavailableError:
            if attempt == _TRIES - 1:
                raise
            time.sleep(RETRY_S * (attempt + 2))
    raise AssertionError("unreachable")


def rank_seconds(score: float) -> float:
    """The time (unix seconds) a page's rank records (``_valkey_scripts``)."""
    return (int(score) // 4096 + _RANK_EPOCH_MS) / 1000.0


class Pages:
    """Listings and the feed of one store's index (module docstring). ``ready``: makes sure the
    index exists (``Builder.ready``), asked before a listing."""

    def __init__(self, link: Link, ready: Callable[[], None]) -> None:
        self._link = link
        self._ready = ready

    def changes_after(self, seq: int, limit: int = 64) -> FeedChanges:
        """``ObjectIndex.changes_after``: one round trip (the stream's entries after ``seq``
        and the last change number)."""
        link = self._link
        entries, last = link.pipeline("changes_after", lambda pipe: [
            pipe.xrange(link.key("F"), min=f"{seq + 1}-0", max="+", count=limit),
            pipe.hget(link.meta, "seq")])
        last_seq = int(last or 0)
        changes: list[tuple[str, bool]] = []
        at = seq
        for entry_id, fields in entries:
            entry_seq = int(bytes(entry_id).split(b"-")[0])
            count = int(fields[b"n"])
            if entry_seq - count != at:
                return FeedChanges(last_seq, seq, [], complete=False)
            present = fields[b"p"] == b"1"
            changes += [(key, present) for key in names(bytes(fields[b"k"]))]
            at = entry_seq
        if not entries and last_seq != seq:
            return FeedChanges(last_seq, seq, [], complete=False)
        return FeedChanges(last_seq, at, changes, complete=True)

    def listing(self) -> tuple[int, list[str]]:
        """``ObjectIndex.listing``. The buckets are read a chunk at a time while writers go on;
        the changes made meanwhile are read from the feed and applied, so the listing is exact
        as of its change number."""
        self._ready()
        for _ in range(5):
            before = int(self._link.call("listing", self._link.client.hget, self._link.meta,
                                         "seq") or 0)
            keys = {key for page in self.pages("") for key, _, _ in page}
            after = before
            while True:
                found = self.changes_after(after, limit=1024)
                if not found.complete:
                    break
                for key, present in found.changes:
                    (keys.add if present else keys.discard)(key)
                after = found.upto
                if after >= found.last:
                    return after, sorted(keys)
        raise BackendUnavailableError("the change feed moved faster than a listing",
                                      backend="index", operation="listing")

    def pages(self, prefix: str) -> Iterator[list[tuple[str, int, float]]]:
        """``(key, size, last use)`` of the indexed keys starting with ``prefix``, one chunk
        of page hashes at a time (no order)."""
        link = self._link
        for start in range(0, BUCKETS, SCAN_CHUNK):

            def read(pipe: Any, start: int = start) -> None:
                for b in range(start, start + SCAN_CHUNK):
                    pipe.hgetall(link.key(f"P:{b:04x}"))
                    pipe.zrange(link.key(f"R:{b:04x}"), 0, -1, withscores=True)

            replies = retried(functools.partial(link.pipeline, "list", read))
            ranks = {bytes(fp): score for ranked in replies[1::2] for fp, score in ranked}
            out: list[tuple[str, int, float]] = []
            for record in replies[0::2]:
                for fp, value in record.items():
                    score = ranks.get(bytes(fp))
                    when = rank_seconds(score) if score is not None else 0.0
                    for key, size in _objects(bytes(value)):
                        if key.startswith(prefix):
                            out.append((key, size, when))
            if out:
                yield out


class Builder:
    """Builds one store's index from a walk of ``site`` (module docstring). ``holder`` names
    the builder in its lock; ``set_from(keys, measured, operation, mode)`` sets keys from the
    store (the SET step, ``mode`` "build"); ``waiting`` yields pauses until a deadline."""

    def __init__(self, link: Link, site: ObjectSite, holder: str,
                 set_from: Callable[[list[str], list[Measured | None], str, str], int],
                 waiting: Callable[[], Iterator[float]]) -> None:
        self._link = link
        self._site = site
        self._holder = holder
        self._set_from = set_from
        self._waiting = waiting

    def ready(self) -> bool:
        """Make sure the index exists: build it from a walk of the store when it does not
        (one process builds, under a lock; the others wait up to ``lock_timeout``). True when
        this call built it and found objects (``rebuilt``)."""
        link = self._link
        if self._state() == "ready":
            return False
        lock = link.key("L")
        for pause in self._waiting():
            if link.call("open", link.client.set, lock, self._holder, nx=True,
                         px=_BUILD_LOCK_MS):
                try:
                    state = self._state()
                    if state == "none":
                        return self._build(lock)
                    if state == "old":
                        self._migrate(lock)
                finally:
                    link.call("open", link.client.delete, lock)
                return False
            if self._state() == "ready":
                return False
            time.sleep(max(pause, 0.05) - pause)
        raise BackendUnavailableError(
            f"the index at {link.url} is being built by another process", backend="index",
            operation="open")

    def _state(self) -> str:
        """``ready`` (an index of this format), ``old`` (of an earlier format: migrated at
        open), ``none`` (none, or one being built). An index of a later format is refused."""
        link = self._link
        ready, written = link.call("open", link.client.hmget, link.meta, "ready", "format")
        if ready is None:
            return "none"
        found = int(written or 1)
        if found > FORMAT:
            raise BackendError(
                f"the index of {link.root_id} at {link.url} was written by a later version of "
                f"hicache-store (format {found}; this one reads format {FORMAT} and earlier): "
                "run this process with that version (a fleet's processes share one version)",
                backend="index", operation="open")
        return "ready" if found == FORMAT else "old"

    def _migrate(self, lock: str) -> None:
        """Move an index of format 1 (one rank set of every page) to this format, a chunk of
        pages per step (each step atomic; a migration cut short goes on at the next open)."""
        link = self._link
        log.warning("the index of %s at %s is of an earlier format: moving its ranks into "
                    "buckets (pins, retention and the eviction order are kept)", link.root_id,
                    link.url)
        while True:
            left = retried(lambda: link.script("migrate", [_MIGRATE_CHUNK], operation="open"))
            if int(left[1]) == 0:
                return
            link.call("open", link.client.pexpire, lock, _BUILD_LOCK_MS)

    def _build(self, lock: str) -> bool:
        self.clear()
        found = 0
        chunk: list[tuple[str, Measured]] = []
        for item in self._site.walk():
            chunk.append(item)
            if len(chunk) >= _BUILD_CHUNK:
                found += self._build_chunk(chunk)
                chunk = []
                self._link.call("open", self._link.client.pexpire, lock, _BUILD_LOCK_MS)
        if chunk:
            found += self._build_chunk(chunk)
        # change numbers above any the lost index gave: a feed reader starts over
        base = time.time_ns() // 1000
        self._link.script("built", [base, secrets.randbits(48), "1" if found else "0"],
                          operation="open")
        if found:
            log.warning("the index of %s at %s was built from a walk of the store (%d objects):"
                        " pins and retention set before it was lost are gone",
                        self._link.root_id, self._link.url, found)
        return found > 0

    def _build_chunk(self, chunk: list[tuple[str, Measured]]) -> int:
        """Index one chunk of a walk (setting keys from the store twice sets them once: the
        step is idempotent, and tried again after a timeout)."""
        return retried(lambda: self._set_from([k for k, _ in chunk], [m for _, m in chunk],
                                              "open", "build"))

    def clear(self) -> None:
        """Delete every key of this store's index (a rebuild starts from nothing). The page
        hashes and rank sets are deleted only where pages may be left (a rank set of buckets,
        or of an earlier format's, exists): a new store, or one whose server lost everything,
        has none."""
        link = self._link
        writers = link.call("clear", link.client.hkeys, link.key("W"))
        names_ = [link.key(n) for n in ("R", "RB", "BP", "BD", "W", "T", "N", "F")]
        names_ += [link.key(f"Q:{bytes(w).decode()}") for w in writers]
        names_ += [link.key(f"H:{bytes(w).decode()}") for w in writers]
        if link.call("clear", link.client.exists, link.key("RB"), link.key("R")):
            names_ += [link.key(f"{kind}:{b:04x}") for b in range(BUCKETS) for kind in "PR"]
        names_.append(link.meta)
        for start in range(0, len(names_), SCAN_CHUNK):
            batch = names_[start : start + SCAN_CHUNK]

            def drop(pipe: Any, batch: list[str] = batch) -> None:
                for name in batch:
                    pipe.delete(name)

            link.pipeline("clear", drop)


def _objects(value: bytes) -> Iterator[tuple[str, int]]:
    """``(key, size)`` of each object of a page record (``_valkey_scripts``)."""
    n = value[0]
    prefix = value[1 : 1 + n]
    for line in value[1 + n :].split(b"\n")[1:]:
        suffix, size = line.split(b" ")[:2]  # (then the bytes charged, where they differ)
        yield unpack(prefix, suffix), int(size)


__all__ = ["BUCKETS", "Builder", "Pages", "rank_seconds"]
