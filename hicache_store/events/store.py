"""Store-wide KV events: what happens to a shared store, whoever does it.

Every process that writes, evicts or deletes through a store with a change feed (a file root's
shared index, a fleet's Valkey index: ``capabilities.change_feed``) records each change there,
named; ``StoreEvents`` follows that feed (``backends.feed.FeedFollower``) and publishes the pages that appear and go as ``BlockStored`` / ``BlockRemoved`` with medium
``STORAGE``: every writer's puts, every process's capacity evictions, gc and operator deletes
through the library. Deletes behind the store's back (``rm``) are seen when the index learns
of them (a read that misses repairs the row).

**Pages, not objects.** A page is held while at least one of its KV objects (every layer
chunk and head group; component objects and manifests are not pages) is in the store: stored
at its first object, removed with its last. The block hash is the page hash of the key as
bytes (for a sealed namespace that is the keyed hash: the store holds no other). Parents and
tokens are not in the store's index: ``parent_block_hash`` is None and ``token_ids`` empty;
``block_size`` is the namespace's page size from its manifest (0 when it has none).

**Catching up.** Whenever the feed cannot name every change since the last look (a
compaction pruned it before this process read it, an index rebuilt, rows written by an older
version), the follower lists the store as of one change and the difference from what was
published goes out (removals, then stores): subscribers converge on the store's listing
either way.

**Starts and restarts.** A publisher that starts cannot know what an earlier one published,
nor what went while none ran (pages removed in between would otherwise stay in a subscriber
that keeps its view), so its first batch (sequence number 0: numbers start again at every
start) is ``AllBlocksCleared`` followed by the whole store's pages as ``BlockStored``. The
resync rule for a subscriber: a sequence number lower than the last one it applied means the
publisher restarted; it asks the replay socket from 0 (the batch that clears and lists the
store, then what followed) and applies that, as a subscriber that joins late does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from hicache_store._sync import run_sync
from hicache_store.backends import Backend
from hicache_store.backends.feed import FeedFollower
from hicache_store.layout.keys import object_key_parts
from hicache_store.layout.manifest import manifest_key
from hicache_store.objects.manifest import read_manifest

from .publisher import EventPublisher
from .wire import MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, Event

log = logging.getLogger(__name__)

#: block hashes per event (a batch holds the events of one look at the feed).
BLOCKS_PER_EVENT = 512


class StoreEvents:
    """Publishes a store's page changes (module docstring). ``namespace``: only that
    namespace digest's pages (None: every namespace's). ``NotSupportedError`` for a store
    without a change feed."""

    def __init__(self, backend: Backend, publisher: EventPublisher, *,
                 namespace: str | None = None) -> None:
        self.backend = backend
        self.follower = FeedFollower(backend.change_feed(), from_start=True)
        self.publisher = publisher
        self.namespace = namespace
        #: page hash -> (namespace digest, objects held).
        self.pages: dict[str, tuple[str, int]] = {}
        self._page_sizes: dict[str, int] = {}
        self._started = False  # the first listing published (with AllBlocksCleared)

    @property
    def resyncs(self) -> int:
        """How many times the feed was read over from a listing (the start included)."""
        return self.follower.resyncs

    def poll(self) -> int:
        """Publish what changed since the last call (the whole store at the first); return
        the number of pages reported stored or removed."""
        reported = 0
        while True:
            found = self.follower.read()
            if found.listing is not None:
                reported += self._resync(found.listing)
            # Each page touched: whether it was held before this look (only the net change
            # of a look is published: a page stored and removed in one look is neither).
            before: dict[str, tuple[str, bool]] = {}
            for key, present in found.changes:
                page = self._page_of(key)
                if page is None:
                    continue
                page_hash, digest = page
                _, count = self.pages.get(page_hash, (digest, 0))
                before.setdefault(page_hash, (digest, count > 0))
                count += 1 if present else -1
                if count > 0:
                    self.pages[page_hash] = (digest, count)
                else:
                    self.pages.pop(page_hash, None)
            stored = [(h, d) for h, (d, held) in before.items() if not held and h in self.pages]
            removed = [(h, d) for h, (d, held) in before.items() if held and h not in self.pages]
            reported += self._publish(stored, removed)
            if not found.more:
                return reported

    def run(self, stop: threading.Event, interval_s: float = 0.05) -> None:
        """``poll`` every ``interval_s`` until ``stop`` is set. A feed that fails (its index
        unreachable) is logged once, with the count of failed looks when it answers again,
        not at every look."""
        failed = 0
        while not stop.is_set():
            try:
                self.poll()
            except Exception:
                if not failed:
                    log.exception("kv events: reading the store's change feed failed; retrying")
                failed += 1
            else:
                if failed:
                    log.warning("kv events: the change feed answers again (%d looks failed)",
                                failed)
                failed = 0
            stop.wait(interval_s)

    def _resync(self, keys: list[str]) -> int:
        """Publish the difference between what was published and the store's listing; at
        the first (the start): ``AllBlocksCleared``, then the whole listing."""
        now: dict[str, tuple[str, int]] = {}
        for key in keys:
            page = self._page_of(key)
            if page is not None:
                digest, count = now.get(page[0], (page[1], 0))
                now[page[0]] = (digest, count + 1)
        removed = [(h, d) for h, (d, _) in self.pages.items() if h not in now]
        stored = [(h, d) for h, (d, _) in now.items() if h not in self.pages]
        cleared = not self._started
        self.pages, self._started = now, True
        return self._publish(stored, removed, cleared=cleared)

    def _page_of(self, key: str) -> tuple[str, str] | None:
        """(page hash, namespace digest) of a KV object key of the namespace watched."""
        if "_C" in key:
            return None  # a component object: not a page of KV
        parts = object_key_parts(key)
        if parts is None or (self.namespace is not None and parts[1] != self.namespace):
            return None
        return parts

    def _page_size(self, digest: str) -> int:
        size = self._page_sizes.get(digest)
        if size is None:
            try:
                ns = run_sync(read_manifest(self.backend, manifest_key(digest)))
            except Exception as exc:
                log.warning("kv events: the manifest of %s is unreadable: %s", digest, exc)
                ns = None
            size = self._page_sizes[digest] = 0 if ns is None else ns.page_size
        return size

    def _publish(self, stored: list[tuple[str, str]], removed: list[tuple[str, str]], *,
                 cleared: bool = False) -> int:
        """One batch: ``AllBlocksCleared`` first when ``cleared`` (even for an empty store),
        then the removals, then the stores."""
        events: list[Event] = [AllBlocksCleared()] if cleared else []
        events.extend(
            BlockRemoved(tuple(bytes.fromhex(h) for h, _ in chunk), MEDIUM_STORAGE)
            for chunk in _chunks(removed)
        )
        by_namespace: dict[str, list[tuple[str, str]]] = {}
        for page in stored:
            by_namespace.setdefault(page[1], []).append(page)
        for digest, pages in by_namespace.items():
            size = self._page_size(digest)
            events.extend(
                BlockStored(tuple(bytes.fromhex(h) for h, _ in chunk), None, (), size,
                            MEDIUM_STORAGE)
                for chunk in _chunks(pages)
            )
        if events:
            self.publisher.publish(events)
        return len(stored) + len(removed)


def _chunks(pages: list[tuple[str, str]]) -> Iterable[list[tuple[str, str]]]:
    for at in range(0, len(pages), BLOCKS_PER_EVENT):
        yield pages[at:at + BLOCKS_PER_EVENT]
