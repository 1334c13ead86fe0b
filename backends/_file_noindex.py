"""``index=none``: the file backend without an index, for a root that several hosts write.

The shared index (``_file_index``) needs every process of a root on one host: SQLite's
write-ahead log keeps its lock state in memory shared between them, which a parallel
filesystem (3FS, Lustre, NFS) does not share across hosts. Without it the directory tree is
the only truth, and everything is read from it:

- ``exists``: one ``stat`` per key (what SGLang's ``HiCacheFile`` does): always current,
  whichever host wrote the object, at the cost of a metadata lookup per key.
- listing walks ``objects/`` (each shard directory once).
- capacity is *sampled*, in the style of Redis' approximated LRU: the store's size is estimated
  from a random sample of its shard directories (exact while it has no more of them than the
  sample), kept current by this process's own writes and deletes, and sampled again every
  ``RESAMPLE_SECONDS``. Eviction deletes the least recently written objects among a few
  sampled directories. The objects of one call get modification times in chain order (the
  tail oldest), so a chain written in one call loses its tail first; but a sampled chain head
  may still go before an unsampled tail of the same chain. The bound and the order are
  approximate; with the index they are exact.

Nothing is held per object, and open reads nothing. A process killed mid-write leaves only
temp files (the backend removes them at open): there is no state to reconcile.
"""

from __future__ import annotations

import contextlib
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from .errors import CapacityError
from .index import EvictionCount, IndexFeatures, ObjectIndex, Reservation

#: how long a size estimate is trusted (this process's own changes are added meanwhile).
RESAMPLE_SECONDS = 30.0
#: shard directories read per size estimate or eviction round.
SAMPLE_DIRS = 64
_MAX_EMPTY_ROUNDS = 8


class NoIndex(ObjectIndex):
    """The ``ObjectIndex`` contract answered from the file system, estimated where it must be
    (``features``: not exact; no retention, no feed). Thread-safe."""

    features = IndexFeatures(hosts=True)

    def __init__(
        self,
        objects_dir: str,
        path_of: Callable[[str], str],
        list_dir: Callable[[str], Iterator[tuple[str, int, float]]],
        *,
        seed: int | None = None,
    ) -> None:
        self._objects = objects_dir
        self._path_of = path_of
        self._list_dir = list_dir
        self._lock = threading.Lock()
        self._reserved = 0
        self._estimate: tuple[int, int] | None = None
        self._estimated_at = 0.0
        self._dirs: set[str] = set()
        self._dirs_at = -RESAMPLE_SECONDS
        self._rng = random.Random(seed)

    # -- existence and listing ---------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # A regular file only (``file._list_dir``): a directory or a symlink under a key's
        # name is not an object.
        out = []
        for key in keys:
            try:
                mode = os.stat(self._path_of(key), follow_symlinks=False).st_mode
            except FileNotFoundError:
                out.append(False)
            else:
                out.append(stat.S_ISREG(mode))
        return out

    def exists_if_current(self, keys: Sequence[str]) -> list[bool] | None:
        return None  # every answer costs I/O: never on the caller's thread

    def exists_recent(self, keys: Sequence[str], max_age_s: float) -> list[bool] | None:
        return None  # (nothing in memory)

    def key_pages(self, prefix: str) -> Iterator[list[str]]:
        """Keys starting with ``prefix``, one shard directory at a time (no order)."""
        for directory in self._list_shard_dirs():
            page = [key for key, _, _ in self._list_dir(directory) if key.startswith(prefix)]
            if page:
                yield page

    def entry_pages(self, prefix: str) -> Iterator[list[tuple[str, int, float]]]:
        """``(key, size, mtime)`` of the keys starting with ``prefix``, one shard directory at
        a time (the files' own sizes and modification times)."""
        for directory in self._list_shard_dirs():
            page = [entry for entry in self._list_dir(directory) if entry[0].startswith(prefix)]
            if page:
                yield page

    # -- writes and eviction -----------------------------------------------------------------------

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], capacity: int,
                pin_budget: int | None = None) -> Reservation:
        # ``pin_budget`` changes nothing: without an index there are no pins to charge.
        incoming = sum(sizes)
        if incoming > capacity:
            raise CapacityError(
                f"{incoming} bytes cannot fit a capacity of {capacity} bytes",
                backend="file", operation="put", key=keys[0] if len(keys) == 1 else None,
            )
        with self._lock:
            self._reserved += incoming
        return Reservation(list(keys), 0, incoming, time.time())

    def make_room(self, capacity: int, reservation: Reservation | None = None) -> EvictionCount:
        """Delete the oldest objects of sampled directories until the estimate fits (an
        estimate across this process's puts: ``reservation`` does not change it)."""
        counts = EvictionCount()
        skip: set[str] = set()
        empty_rounds = 0
        while True:
            used = self.totals()[0]
            with self._lock:
                need = used + self._reserved - capacity
            if need <= 0:
                return counts
            found = sorted(
                (mtime, key, size)
                for directory in self._sample(SAMPLE_DIRS)
                for key, size, mtime in self._list_dir(directory)
                if key not in skip
            )
            evicted = 0
            for _mtime, key, size in found:
                if need <= 0:
                    break
                try:
                    os.unlink(self._path_of(key))
                except FileNotFoundError:
                    continue  # another process took it: re-estimate below
                except OSError:
                    skip.add(key)
                    counts.failed += 1
                    continue
                self._account(-size, -1)
                need -= size
                evicted += 1
            counts.evicted += evicted
            if evicted == 0:
                empty_rounds += 1
                if empty_rounds >= _MAX_EMPTY_ROUNDS:
                    raise CapacityError(
                        f"no room: about {need} bytes over a capacity of {capacity} bytes and "
                        f"nothing more could be evicted ({counts.failed} eviction failures)",
                        backend="file", operation="put",
                    )
                self._forget_estimate()

    def settle_put(self, reservation: Reservation) -> None:
        """Count what the put published and give its files chain-ordered mtimes."""
        now = time.time_ns()
        added = 0
        count = 0
        for depth, key in enumerate(dict.fromkeys(reservation.keys)):
            path = self._path_of(key)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if st.st_mtime < reservation.started - 1.0:
                continue  # not written by this call (it failed; an older copy stays)
            # (1 s of slack: file times come from the kernel's coarse clock.)
            added += st.st_size
            count += 1
            with self._lock:
                self._dirs.add(os.path.dirname(path))  # sampled from now on
            # The tail of the call is the oldest: evicted first (1 us per step of depth).
            with contextlib.suppress(FileNotFoundError):
                os.utime(path, ns=(now, now - depth * 1000))
        with self._lock:
            self._reserved -= reservation.incoming
        self._account(added, count)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        removed: list[bool] = []
        for key in keys:
            path = self._path_of(key)
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                removed.append(False)
                continue
            self._account(-size, -1)
            removed.append(True)
        return removed

    # -- what the index would do, done by the file system ------------------------------------------

    def touch(self, keys: Sequence[str]) -> bool:
        return False  # eviction order is write order here: reads leave no trace

    def flush_touches(self) -> None:
        return None

    def repair_missing(self, key: str) -> None:
        return None

    def adopt(self, keys: Sequence[str]) -> int:
        return sum(self.exists(keys))

    def delete_until_held(self, groups: Sequence[Sequence[str]]) -> tuple[int, list[bool]]:
        # no index, no holds: every group goes
        return len(groups), self.delete([key for group in groups for key in group])

    def delete_unindexed(self, keys: Sequence[str]) -> int:
        return 0  # the files are the index: none is unaccounted

    def recover(self) -> int:
        return 0

    def close(self) -> None:
        return None

    # -- size estimate -------------------------------------------------------------------------------

    def totals(self) -> tuple[int, int]:
        """``(bytes, objects)`` of the store, estimated (see the module docstring)."""
        with self._lock:
            if self._estimate is not None and (
                time.monotonic() - self._estimated_at < RESAMPLE_SECONDS
            ):
                return self._estimate
        dirs = self._shard_dirs()
        sample = dirs if len(dirs) <= SAMPLE_DIRS else self._rng.sample(dirs, SAMPLE_DIRS)
        size = count = 0
        for directory in sample:
            for _key, nbytes, _mtime in self._list_dir(directory):
                size += nbytes
                count += 1
        scale = len(dirs) / len(sample) if sample else 0.0
        estimate = (round(size * scale), round(count * scale))
        with self._lock:
            self._estimate, self._estimated_at = estimate, time.monotonic()
        return estimate

    def reserved_bytes(self) -> int:
        with self._lock:
            return self._reserved

    def _account(self, nbytes: int, count: int) -> None:
        with self._lock:
            if self._estimate is not None:
                size, objects = self._estimate
                self._estimate = (max(0, size + nbytes), max(0, objects + count))

    def _forget_estimate(self) -> None:
        with self._lock:
            self._estimate = None
            self._dirs_at = -RESAMPLE_SECONDS

    def _sample(self, n: int) -> list[str]:
        dirs = self._shard_dirs()
        return dirs if len(dirs) <= n else self._rng.sample(dirs, n)

    def _shard_dirs(self) -> list[str]:
        """Every second-level shard directory that exists (at most 65,536 names): listed again
        after ``RESAMPLE_SECONDS``; meanwhile the ones this process writes into are added."""
        with self._lock:
            if time.monotonic() - self._dirs_at < RESAMPLE_SECONDS and self._dirs:
                return sorted(self._dirs)
        found = set(self._list_shard_dirs())
        with self._lock:
            self._dirs, self._dirs_at = found, time.monotonic()
        return sorted(found)

    def _list_shard_dirs(self) -> list[str]:
        out: list[str] = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self._objects) as tops:
            for top in tops:
                if not top.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError), os.scandir(top.path) as subs:
                    out.extend(s.path for s in subs if s.is_dir(follow_symlinks=False))
        return out


__all__ = ["NoIndex", "RESAMPLE_SECONDS", "SAMPLE_DIRS"]
