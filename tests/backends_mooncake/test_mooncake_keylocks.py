"""``KeyLocks``: the per-key ordering of one Mooncake client's calls (no server needed)."""

from __future__ import annotations

import threading
import time

from hicache_store.backends._mooncake_client import KeyLocks


def started(fn: object) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_readers_share_a_key_and_a_writer_waits_for_them() -> None:
    locks, events = KeyLocks(), []
    with locks.hold(shared=["k"]), locks.hold(shared=["k", "j"]):  # readers share
        def write() -> None:
            with locks.hold(exclusive=["k"]):
                events.append("write")
        writer = started(write)
        time.sleep(0.2)
        assert events == []  # held back while a read of "k" is in flight
        events.append("reads done")
    writer.join(5)
    assert events == ["reads done", "write"]


def test_a_waiting_writer_goes_before_later_readers_and_other_keys_are_free() -> None:
    locks, events = KeyLocks(), []

    def write() -> None:
        with locks.hold(exclusive=["k"]):
            events.append("write")
            time.sleep(0.1)

    def read() -> None:
        with locks.hold(shared=["k"]):
            events.append("late read")

    with locks.hold(shared=["k"]):
        writer = started(write)
        time.sleep(0.2)
        reader = started(read)  # arrives while the writer waits: must not starve it
        time.sleep(0.2)
        with locks.hold(exclusive=["other"]):  # another key is not held up
            events.append("other")
    writer.join(5)
    reader.join(5)
    assert events == ["other", "write", "late read"]


def test_a_batch_takes_all_its_keys_at_once() -> None:
    # Two writers whose batches overlap in opposite order never deadlock (all or nothing).
    locks, done = KeyLocks(), []

    def batch(keys: list[str]) -> None:
        for _ in range(200):
            with locks.hold(exclusive=keys, shared=["s"]):
                pass
        done.append(keys)

    threads = [started(lambda: batch(["a", "b"])), started(lambda: batch(["b", "a"])),
               started(lambda: batch(["b"]))]
    for thread in threads:
        thread.join(10)
    assert len(done) == 3
