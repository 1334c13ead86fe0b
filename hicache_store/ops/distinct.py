"""Counting distinct page hashes among millions of listed keys in bounded memory.

A store's listing names every object, and a page has several objects, in no useful order (the
file backend shards by a hash of the key). ``DistinctCounter`` counts the distinct values
added without a set of them in memory: values gather in a buffer of ``buffer_values``; a full
buffer is sorted and deduplicated (numpy), split by its first byte and appended to 256 bucket
files in a temporary folder; ``count()`` deduplicates each bucket on its own and adds them up.
Memory is one buffer (16 bytes a value, plus the sort's scratch) or one bucket; a store that
fits in one buffer never touches the disk.

Values are the ``xxh3_128`` digest of each page hash (whatever its length or entropy: tests
and tools use small synthetic hashes). Two distinct pages sharing one is a 128-bit hash
collision, far beyond any store's size (about one chance in 10^22 at 100 M pages).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt
import xxhash

#: values kept in memory before a spill (4 MiB; the sort's scratch is about 4 times that).
BUFFER_VALUES = 1 << 18
_BUCKETS = 256


class DistinctCounter:
    """``add(page_hash)`` any number of times, then ``count()`` once; ``close()`` frees the
    spill files (also done by ``count``)."""

    def __init__(self, *, buffer_values: int = BUFFER_VALUES) -> None:
        self.buffer_values = max(1, buffer_values)
        self._buf = bytearray()
        self._last = ""
        self._dir: Path | None = None

    def add(self, value: str) -> None:
        if value == self._last:
            return  # objects of one page often come together (S3 lists in key order)
        self._last = value
        self._buf += xxhash.xxh3_128_digest(value.encode())
        if len(self._buf) >= 16 * self.buffer_values:
            self._spill()

    def count(self) -> int:
        """The number of distinct values added."""
        try:
            if self._dir is None:
                return len(_distinct(np.frombuffer(bytes(self._buf), dtype=">u8")))
            self._spill()
            total = 0
            for bucket in sorted(self._dir.iterdir()):
                total += len(_distinct(np.fromfile(bucket, dtype=">u8")))
            return total
        finally:
            self.close()

    def close(self) -> None:
        self._buf = bytearray()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _spill(self) -> None:
        if not self._buf:
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="hicache-distinct-"))
        pairs = _distinct(np.frombuffer(bytes(self._buf), dtype=">u8"))
        self._buf = bytearray()
        # Sorted by the high word, so each bucket (its top byte) is one contiguous run.
        top = (pairs[:, 0] >> np.uint64(56)).astype(np.int64)
        bounds = np.searchsorted(top, np.arange(_BUCKETS + 1))
        for bucket in range(_BUCKETS):
            lo, hi = int(bounds[bucket]), int(bounds[bucket + 1])
            if lo < hi:
                with open(self._dir / f"{bucket:02x}", "ab") as out:
                    out.write(pairs[lo:hi].astype(">u8").tobytes())


def _distinct(words: npt.NDArray[np.generic]) -> npt.NDArray[np.uint64]:
    """Distinct 128-bit values, sorted, as an ``(n, 2)`` array of native ``uint64`` words."""
    pairs = words.astype(np.uint64).reshape(-1, 2)
    if len(pairs) == 0:
        return pairs
    order = np.lexsort((pairs[:, 1], pairs[:, 0]))
    pairs = pairs[order]
    keep = np.ones(len(pairs), dtype=bool)
    keep[1:] = (pairs[1:, 0] != pairs[:-1, 0]) | (pairs[1:, 1] != pairs[:-1, 1])
    return pairs[keep]
