"""The fingerprint set the file index answers ``exists`` from: a sorted snapshot plus a delta.

A *snapshot* is a sorted array of the 64-bit fingerprints of every stored key as of one change
(a file mapped read-only, shared through the page cache). The *delta* is what changed after it,
read from the index's change feed: fingerprint -> present, the last change of a fingerprint
winning. ``lookup`` answers membership for a batch of fingerprints from the two.

**The feed is stored packed**: one feed row holds every change of one index write, as records of
``FEED_RECORD`` (the fingerprint, then 1 present / 0 absent; 9 bytes), so a process catching up
with the feed reads one SQLite row per write, not one per key, and decodes them with numpy. Measured
on this machine (2 vCPUs, 125,000 changes, CPU time): one row per change through Python's sqlite3
102 ms, plus 20 ms to build the dict the delta was; packed rows of 1,000 changes 0.8 ms to read and
11 ms to fold into the arrays below; packed rows of one change each (single-key puts) 43 ms.

**The delta is numpy arrays plus a small dict**: the bulk of the changes as a sorted array of
fingerprints and a parallel array of presence (9 bytes a change, no Python object per change: a
dict costs about 100 bytes a change, private to the process), and the changes of the last few
reads of the feed in a dict (an update is O(changes), where re-sorting the arrays is O(delta)). The
dict is folded into the arrays once it outgrows an eighth of them (at least ``FOLD_MIN``), so
folding costs O(log) per change amortized.
"""

from __future__ import annotations

import numpy as np
import xxhash

#: one change of the feed: the fingerprint (little-endian u64), then 1 (present) or 0 (absent).
FEED_RECORD = np.dtype([("fp", "<u8"), ("present", "u1")])
#: the dict of recent changes is folded into the arrays beyond max(FOLD_MIN, arrays / 8).
FOLD_MIN = 4096


def fingerprint(key: str) -> int:
    """The unsigned 64-bit fingerprint of a key (xxh3_64 of its UTF-8 bytes)."""
    return xxhash.xxh3_64_intdigest(key.encode())


def encode_changes(fps: list[int], present: bool) -> bytes:
    """Feed records (``FEED_RECORD``) saying that each fingerprint became present / absent."""
    records = np.empty(len(fps), dtype=FEED_RECORD)
    records["fp"] = np.array(fps, dtype=np.uint64)
    records["present"] = present
    return records.tobytes()


def decode_changes(blob: bytes) -> np.ndarray:
    """The records of one or more concatenated feed rows, in order."""
    if len(blob) % FEED_RECORD.itemsize:
        raise ValueError(f"a change feed of {len(blob)} bytes is not a whole number of records")
    return np.frombuffer(blob, dtype=FEED_RECORD)


class Delta:
    """The changes after a snapshot: fingerprint -> present, the latest change winning."""

    def __init__(self) -> None:
        self.fps = np.zeros(0, dtype=np.uint64)  # sorted, unique
        self.present = np.zeros(0, dtype=bool)  # parallel to fps
        self.recent: dict[int, bool] = {}  # newer than the arrays

    def __len__(self) -> int:
        """About how many fingerprints changed (a fingerprint in both parts counts twice)."""
        return len(self.fps) + len(self.recent)

    def apply(self, records: np.ndarray) -> None:
        """Add changes (``FEED_RECORD`` records, oldest first) that came after all before."""
        if not len(records):
            return
        if len(self.recent) + len(records) <= max(FOLD_MIN, len(self.fps) // 8):
            fps, present = records["fp"].tolist(), (records["present"] == 1).tolist()
            self.recent.update(zip(fps, present, strict=True))
            return
        recent = np.empty(len(self.recent), dtype=FEED_RECORD)
        recent["fp"] = np.fromiter(self.recent.keys(), dtype=np.uint64, count=len(self.recent))
        recent["present"] = np.fromiter(self.recent.values(), dtype=bool, count=len(self.recent))
        ordered = np.empty(len(self.fps), dtype=FEED_RECORD)
        ordered["fp"], ordered["present"] = self.fps, self.present
        # Oldest first: the arrays, then the dict (no fingerprint is in it twice), then records.
        every = np.concatenate([ordered, recent, records])[::-1]
        # Reversed, the first occurrence of a fingerprint is its latest change.
        self.fps, first = np.unique(every["fp"], return_index=True)
        self.present = every["present"][first] == 1
        self.recent = {}


def lookup(snapshot: np.ndarray, delta: Delta, fps: list[int]) -> list[bool]:
    """Membership of fingerprints in a sorted ``snapshot``, overridden by ``delta``. The whole
    of ``exists`` once keys are hashed."""
    if not len(snapshot) and not len(delta.fps):
        hits = [False] * len(fps)
    else:
        wanted = np.array(fps, dtype=np.uint64)
        # Searched in sorted order: neighbouring probes touch neighbouring pages of the
        # snapshot (at 1 M objects, 20% less CPU than probing in the caller's order).
        order = np.argsort(wanted)
        wanted = wanted[order]
        found_sorted = _members(snapshot, wanted)
        if len(delta.fps):
            pos = np.minimum(np.searchsorted(delta.fps, wanted), len(delta.fps) - 1)
            changed = delta.fps[pos] == wanted
            found_sorted = np.where(changed, delta.present[pos], found_sorted)
        found = np.empty(len(fps), dtype=bool)
        found[order] = found_sorted
        hits = found.tolist()
    if delta.recent:
        hits = list(map(delta.recent.get, fps, hits))  # recent.get(fp, default=the arrays')
    return hits


def _members(sorted_set: np.ndarray, wanted_sorted: np.ndarray) -> np.ndarray:
    if not len(sorted_set):
        return np.zeros(len(wanted_sorted), dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_set, wanted_sorted), len(sorted_set) - 1)
    hit: np.ndarray = sorted_set[pos] == wanted_sorted
    return hit


__all__ = ["FEED_RECORD", "FOLD_MIN", "Delta", "decode_changes", "encode_changes",
           "fingerprint", "lookup"]
