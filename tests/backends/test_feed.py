"""The change-feed capability and its one follower (``backends.feed``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hicache_store.backends import NotSupportedError, open_backend
from hicache_store.backends.faulty import FaultyBackend
from hicache_store.backends.feed import FeedFollower
from hicache_store.backends.index import FeedChanges


class ScriptedFeed:
    """A change feed of named changes 1..n (key ``k{i}``, present), of which the first
    ``pruned`` cannot be named any more; ``listing`` is the keys 1..n."""

    def __init__(self, n: int, pruned: int = 0) -> None:
        self.n, self.pruned, self.listings = n, pruned, 0

    def changes_after(self, seq: int, limit: int = 64) -> FeedChanges:
        if seq < self.pruned:
            return FeedChanges(self.n, seq, [], complete=False)
        upto = min(self.n, seq + limit)
        return FeedChanges(self.n, upto, [(f"k{i}", True) for i in range(seq + 1, upto + 1)],
                           complete=True)

    def listing(self) -> tuple[int, list[str]]:
        self.listings += 1
        return self.n, [f"k{i}" for i in range(1, self.n + 1)]


def test_a_follower_from_the_start_lists_then_names_each_change() -> None:
    feed = ScriptedFeed(3)
    follower = FeedFollower(feed, from_start=True)
    first = follower.read()
    assert first.listing == ["k1", "k2", "k3"] and first.changes == [] and not first.more
    feed.n = 5
    assert follower.read().changes == [("k4", True), ("k5", True)]
    assert follower.read().changes == []
    assert (follower.resyncs, feed.listings) == (1, 1)


def test_a_follower_from_now_sees_only_what_comes_next() -> None:
    feed = ScriptedFeed(7)
    follower = FeedFollower(feed, from_start=False)
    assert follower.read().changes == [] and feed.listings == 0
    feed.n = 8
    found = follower.read()
    assert found.listing is None and found.changes == [("k8", True)]


def test_a_feed_that_cannot_name_its_changes_is_read_again_from_a_listing() -> None:
    feed = ScriptedFeed(4)
    follower = FeedFollower(feed, from_start=False)
    feed.n, feed.pruned = 10, 6  # changes 5 and 6 pruned before the follower read them
    found = follower.read()
    assert found.listing == [f"k{i}" for i in range(1, 11)] and found.changes == []
    assert follower.resyncs == 1 and follower.seq == 10


def test_a_long_feed_is_read_in_bounded_steps() -> None:
    feed = ScriptedFeed(0)
    follower = FeedFollower(feed, from_start=False)
    feed.n = 3000
    steps = []
    while True:
        found = follower.read(max_records=1000)
        steps.append(len(found.changes))
        if not found.more:
            break
    assert steps == [1024, 1024, 952]  # (whole feed records: 256 at a time)


def test_the_capability_says_which_stores_have_a_feed(tmp_path: Path) -> None:
    async def main() -> None:
        indexed = open_backend(f"file://{tmp_path}/a")
        unindexed = open_backend(f"file://{tmp_path}/b?index=none")
        memory = open_backend("memory://")
        try:
            assert indexed.capabilities.change_feed
            await indexed.put(["a0"], [b"x"])
            assert FeedFollower(indexed.change_feed(), from_start=True).read().listing == ["a0"]
            for store in (unindexed, memory):
                assert not store.capabilities.change_feed
                with pytest.raises(NotSupportedError):
                    store.change_feed()
        finally:
            for store in (indexed, unindexed, memory):
                await store.close()

    asyncio.run(main())


def test_a_fault_injecting_wrapper_gives_the_feed_it_declares(tmp_path: Path) -> None:
    # FaultyBackend declares the inner store's change_feed: the feed it gives must be the
    # inner one's, naming what was put and deleted through the wrapper.
    async def main() -> None:
        faulty = FaultyBackend(open_backend(f"file://{tmp_path}/kv"))
        try:
            assert faulty.capabilities.change_feed
            follower = FeedFollower(faulty.change_feed(), from_start=False)
            await faulty.put(["a0", "b0"], [b"x", b"y"])
            await faulty.delete(["a0"])
            assert follower.read().changes == [("a0", True), ("b0", True), ("a0", False)]
        finally:
            await faulty.close()

    asyncio.run(main())
