"""Failed writes in the log: the first few whole, then one line for the rest, per store.

A store that fails every write (a full filesystem, a stopped server) fails every object of
every backup the same way, and a warning each buries the cause under hundreds of lines. Per
backend, ``put_failed`` logs the first ``FIRST_LOGGED`` failures of an episode with the whole
key and the error, then only counts them; the count goes out as one line (how many, the
store, the last error) when the episode ends (``put_stored``: an object of that store was
stored), at most every ``SUMMARY_EVERY_S`` seconds while it lasts, and at ``flush`` (the end
of a run). The next failure after that opens a new episode. Thread-safe; the state per
backend goes with it (weak references).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass

from hicache_store.backends.base import Backend

log = logging.getLogger("hicache_store.objects.io")

#: failures of an episode logged one by one, with the whole key.
FIRST_LOGGED = 3
#: at most this long between two summaries while failures go on.
SUMMARY_EVERY_S = 60.0


@dataclass
class _Episode:
    since: float  # monotonic: when the last line about it was written
    calls: int = 0  # failed writes (a write may be of several objects)
    failed: int = 0  # their objects
    unlogged: int = 0
    last: BaseException | None = None


_episodes: weakref.WeakKeyDictionary[Backend, _Episode] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def put_failed(backend: Backend, what: str, exc: BaseException, objects: int = 1) -> None:
    """A write of ``what`` (a key, or a batch of ``objects`` named by its first key) to
    ``backend`` failed with ``exc``: logged whole if among the first of its episode, else
    counted (by its objects)."""
    now = time.monotonic()
    with _lock:
        episode = _episodes.get(backend)
        if episode is None:
            episode = _episodes[backend] = _Episode(since=now)
        episode.calls += 1
        episode.failed += objects
        whole = episode.calls <= FIRST_LOGGED
        last_whole = episode.calls == FIRST_LOGGED
        if not whole:
            episode.unlogged += objects
            episode.last = exc
        due = not whole and now - episode.since >= SUMMARY_EVERY_S
    if whole:
        more = " (further failures are counted, then logged in one line)" * last_whole
        log.warning("put of %s to %r failed: %r%s", what, backend, exc, more)
    elif due:
        _summarize(backend, end=False)


def put_stored(backend: Backend) -> None:
    """An object was stored on ``backend``: an episode of failures there has ended."""
    if backend in _episodes:  # (the common case, without the lock: nothing failed)
        _summarize(backend, end=True)


def flush(backend: Backend | None = None) -> None:
    """Log the failures counted but not yet logged (of ``backend``, or of every store): the
    end of a run, whose failures may never be followed by a stored object."""
    with _lock:
        backends = list(_episodes) if backend is None else [backend]
    for each in backends:
        _summarize(each, end=True)


def _summarize(backend: Backend, *, end: bool) -> None:
    with _lock:
        episode = _episodes.get(backend)
        if episode is None:
            return
        unlogged, failed, last = episode.unlogged, episode.failed, episode.last
        if end:
            del _episodes[backend]
        else:
            episode.unlogged, episode.since = 0, time.monotonic()
    if unlogged:
        log.warning("put: %d more objects failed on %r (%d in all since the first logged "
                    "above); the last: %r", unlogged, backend, failed, last)
