"""The one way to follow a store's change feed.

A backend that declares ``capabilities.change_feed`` gives a ``ChangeFeed``
(``backends.protocols``: ``changes_after`` and ``listing``) from ``Backend.change_feed()``:
every change of presence of every object, whoever made it (each writer's puts, each process's
evictions, deletes, gc, a read that found an object gone), numbered in order
(``backends.index``).

``FeedFollower`` is the one reader of that protocol (the store-wide KV events, the vLLM tier's
removal events): it follows the feed from a number and, whenever the feed cannot name every
change since, starts over from a listing. Its reader therefore sees either named changes after
what it saw, or a listing that replaces what it knew; applied in order, both converge on the
store's listing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .protocols import ChangeFeed


@dataclass(frozen=True)
class FeedRead:
    """One ``FeedFollower.read``. ``listing``: when not None, the feed could not name every
    change since the last read, and this is every key present now (replace what you knew);
    ``changes``: the named changes after it (or after the last read), ``(key, present)`` in
    order; ``more``: the feed holds more changes than this read took."""

    changes: list[tuple[str, bool]]
    listing: list[str] | None = None
    more: bool = False


class FeedFollower:
    """Follows one ``ChangeFeed`` (module docstring). Not thread-safe: one reader at a time.

    ``from_start``: the first ``read`` is a listing of the whole store (a reader that must
    describe all of it: the KV events); otherwise it follows from the changes after the last
    one now (a reader that only cares what happens next: the vLLM tier)."""

    def __init__(self, feed: ChangeFeed, *, from_start: bool) -> None:
        self.feed = feed
        #: the number of the last change read; None: the next read starts over from a listing
        self.seq: int | None = None
        #: how many times a read started over from a listing
        self.resyncs = 0
        if not from_start:
            # asked for the changes after any number there can be, the feed answers with none
            # and the number of its last change
            self.seq = feed.changes_after(sys.maxsize, limit=1).last

    def read(self, max_records: int = 1024) -> FeedRead:
        """The changes since the last read (at most about ``max_records`` feed records), or a
        listing to start over from (``FeedRead``)."""
        listing: list[str] | None = None
        if self.seq is None:
            listing = self._start_over()
        assert self.seq is not None
        changes: list[tuple[str, bool]] = []
        read = 0
        while True:
            found = self.feed.changes_after(self.seq, limit=min(256, max_records))
            if not found.complete:
                # what was read so far is in the listing too: it replaces all of it
                listing, changes = self._start_over(), []
                read += max_records // 4  # (a feed pruned again at once: the next read goes on)
                if read >= max_records:
                    return FeedRead(changes, listing, more=True)
                continue
            changes.extend(found.changes)
            self.seq = found.upto
            read += max(1, len(found.changes))
            if found.upto >= found.last:
                return FeedRead(changes, listing)
            if read >= max_records:
                return FeedRead(changes, listing, more=True)

    def _start_over(self) -> list[str]:
        self.resyncs += 1
        self.seq, keys = self.feed.listing()
        return keys


__all__ = ["ChangeFeed", "FeedFollower", "FeedRead"]
