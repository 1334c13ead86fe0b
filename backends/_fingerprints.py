"""The fingerprint set the file index answers ``exists`` from: a sorted snapshot plus a delta.

A *snapshot* is a sorted array of the 64-bit fingerprints of every stored key as of one change
(a file mapped read-only, shared through the page cache). The *delta* is what changed after it,
read from the index's change feed: fingerprint -> present, the last change of a fingerprint
winning. ``lookup`` answers membership for a batch of fingerprints from the two.

**The feed is stored packed**: one feed row holds every change of one index write, as records of
``FEED_RECORD`` (the fingerprint, then 1 present / 0 absent; 9 bytes), so a process catching up
with the feed reads one SQLite row per write, not one per key, and decodes them with numpy
(BENCHMARKS.md, "Design figures behind the file backend's index and read policy").

**The delta is two layers of sorted numpy arrays**: the bulk of the changes as a sorted array of
fingerprints and a parallel array of presence (9 bytes a change, no Python object per change: a
dict costs about 100 bytes a change, private to the process), and the changes of the last few
reads of the feed in a second, recent pair of arrays in front of it (merging a read into the
recent pair costs O(its size), where merging into the bulk is O(delta)). The recent pair is
merged into the bulk once it outgrows it (and ``FOLD_MIN``), so merging costs O(1) amortized
per change, and a lookup searches at most two arrays besides the snapshot. A merge is linear:
the new changes are sorted once (the latest change of a fingerprint winning), then inserted by
binary search; no sort of the whole.

**A lookup is array work only**: the keys are hashed into one uint64 array (by the C accelerator
of ``hicache_store.layout.keys`` when it is built: no ``encode``, no int per key), probed in
order of their top bits against the snapshot (``Snapshot``: two levels, the second one
branch-free), then against each layer of the delta, newest last.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from hicache_store.layout.keys import xxh3_64_each

#: one change of the feed: the fingerprint (little-endian u64), then 1 (present) or 0 (absent).
FEED_RECORD = np.dtype([("fp", "<u8"), ("present", "u1")])
#: the recent changes are merged into the bulk beyond max(FOLD_MIN, bulk) of them.
FOLD_MIN = 4096


def fingerprint(key: str) -> int:
    """The unsigned 64-bit fingerprint of a key (xxh3_64 of its UTF-8 bytes)."""
    return xxhash.xxh3_64_intdigest(key.encode())


def fingerprints(keys: Sequence[str]) -> np.ndarray:
    """``fingerprint`` of each key, as a uint64 array."""
    return xxh3_64_each(keys)


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


#: a snapshot is searched in two levels: its fences (every ``BLOCK``-th fingerprint, an array
#: in the process of 1/BLOCK of the snapshot's bytes) give a probe's block, then a branch-free
#: halving search inside the block.
BLOCK = 256


class Snapshot:
    """A sorted array of unique fingerprints (the mapped snapshot file) and its fences.

    Why two levels: ``np.searchsorted`` over 1 M fingerprints mispredicts a branch at each of
    its 20 levels; the fences (3,800 values at 1 M objects) stay in cache and the last 8 steps
    over a 2 KiB block are branch-free (figures in BENCHMARKS.md).
    """

    __slots__ = ("fences", "fps")

    def __init__(self, fps: np.ndarray) -> None:
        self.fps = fps
        self.fences = np.array(fps[BLOCK - 1 :: BLOCK])  # the last fingerprint of each block

    def __len__(self) -> int:
        return len(self.fps)

    def members(self, probes: np.ndarray) -> np.ndarray:
        """Whether each probe is in the snapshot (a bool array)."""
        fps, n = self.fps, len(self.fps)
        if n == 0:
            return np.zeros(len(probes), dtype=bool)
        # The probe's block: the first whose last fingerprint is >= the probe (past the last
        # fence: the partial block at the end). Then the count of the block's fingerprints
        # below the probe, one halving a step; indices past the end read the last fingerprint,
        # which is >= the probe wherever the probe can be found.
        at = np.searchsorted(self.fences, probes) * BLOCK
        step = BLOCK // 2
        while step:
            ahead = np.minimum(at + (step - 1), n - 1)
            at += (fps[ahead] < probes) * step
            step //= 2
        np.minimum(at, n - 1, out=at)
        hit: np.ndarray = fps[at] == probes
        return hit


class Delta:
    """The changes after a snapshot: fingerprint -> present, the latest change winning."""

    def __init__(self) -> None:
        self.fps = _EMPTY_FPS  # the bulk: sorted, unique
        self.present = _EMPTY_PRESENT  # parallel to fps
        self.recent_fps = _EMPTY_FPS  # newer than the bulk: sorted, unique
        self.recent_present = _EMPTY_PRESENT

    def __len__(self) -> int:
        """About how many fingerprints changed (a fingerprint in both layers counts twice)."""
        return len(self.fps) + len(self.recent_fps)

    def apply(self, records: np.ndarray) -> None:
        """Add changes (``FEED_RECORD`` records, oldest first) that came after all before."""
        if not len(records):
            return
        fps, present = _latest(records)
        self.recent_fps, self.recent_present = _merged(
            self.recent_fps, self.recent_present, fps, present)
        if len(self.recent_fps) > max(FOLD_MIN, len(self.fps)):
            self.fps, self.present = _merged(
                self.fps, self.present, self.recent_fps, self.recent_present)
            self.recent_fps, self.recent_present = _EMPTY_FPS, _EMPTY_PRESENT


_EMPTY_FPS = np.zeros(0, dtype=np.uint64)
_EMPTY_PRESENT = np.zeros(0, dtype=bool)


def _latest(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The records' fingerprints sorted and unique, each with its latest presence."""
    fps = records["fp"].astype(np.uint64)  # native order, and a copy the caller may keep
    present = records["present"] == 1
    if present.all() or not present.any():  # only puts, or only deletes: a sort of the values
        fps.sort()  # (half the CPU of the permutation below)
        first = np.ones(len(fps), dtype=bool)
        first[1:] = fps[1:] != fps[:-1]
        return fps[first], present[: int(first.sum())]
    order = np.argsort(fps, kind="stable")  # stable: the changes of one fingerprint stay in order
    fps, present = fps[order], present[order]
    last = np.ones(len(fps), dtype=bool)
    last[:-1] = fps[1:] != fps[:-1]  # the last change of each run of one fingerprint
    return fps[last], present[last]


def _merged(
    fps: np.ndarray, present: np.ndarray, new_fps: np.ndarray, new_present: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``fps`` (with ``present``) updated by newer sorted unique changes, as new
    arrays (the old ones are not modified: O(len(fps) + len(new_fps)))."""
    if not len(fps):
        return new_fps, new_present
    pos = np.searchsorted(fps, new_fps)
    known = np.zeros(len(new_fps), dtype=bool)
    inside = pos < len(fps)
    known[inside] = fps[pos[inside]] == new_fps[inside]
    present = present.copy()
    present[pos[known]] = new_present[known]
    fresh = ~known
    return (np.insert(fps, pos[fresh], new_fps[fresh]),
            np.insert(present, pos[fresh], new_present[fresh]))


def lookup(snapshot: Snapshot, delta: Delta, fps: np.ndarray) -> list[bool]:
    """Membership of fingerprints (a uint64 array) in ``snapshot``, overridden by ``delta``.
    The whole of ``exists`` once keys are hashed."""
    if not len(fps):
        return []
    # Probed in order of their top 16 bits: neighbouring probes touch neighbouring pages of
    # the snapshot (``np.searchsorted`` of 10,000 probes in 1 M fingerprints: 66 ns a probe,
    # against 218 in the caller's order). A stable sort of 16-bit values is a radix sort: 4 ns
    # a probe, where sorting the full 64 bits costs 39.
    order = np.argsort((fps >> np.uint64(48)).astype(np.uint16), kind="stable")
    probes = fps[order]
    found = snapshot.members(probes)
    for changed_fps, changed_present in (
        (delta.fps, delta.present), (delta.recent_fps, delta.recent_present)  # newest last
    ):
        if len(changed_fps):
            pos = np.searchsorted(changed_fps, probes)
            np.minimum(pos, len(changed_fps) - 1, out=pos)
            changed = changed_fps[pos] == probes
            found[changed] = changed_present[pos[changed]]
    hits = np.empty(len(fps), dtype=bool)
    hits[order] = found
    result: list[bool] = hits.tolist()
    return result


__all__ = ["BLOCK", "FEED_RECORD", "FOLD_MIN", "Delta", "Snapshot", "decode_changes",
           "encode_changes", "fingerprint", "fingerprints", "lookup"]
