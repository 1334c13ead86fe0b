"""Small blocking helpers of the S3 backend: body streaming into caller buffers, range math.

Everything here runs on the backend's executor threads (never on the event loop).
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .types import ByteRange

_CONTENT_RANGE_RE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


class ViewReader(io.RawIOBase):
    """A read-only, seekable file over a memoryview, so botocore can stream a PUT body (and
    rewind it for a checksum or a retry) straight from the caller's buffer, without a copy.

    Only used during the call that owns the buffer: it is never kept after ``put`` returns.
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = len(self._view) - self._pos
        chunk = bytes(self._view[self._pos : self._pos + size])
        self._pos += len(chunk)
        return chunk

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


def read_exact(body: Any, view: memoryview) -> None:
    """Fill ``view`` from a botocore ``StreamingBody`` with ``readinto`` (no extra copy).

    A body that ends early raises botocore's ``IncompleteReadError`` (a connection cut
    mid-object: retryable once translated), so a short object never passes as whole.
    """
    from botocore.exceptions import IncompleteReadError

    got = 0
    while got < len(view):
        n = body.readinto(view[got:])
        if not n:
            raise IncompleteReadError(actual_bytes=got, expected_bytes=len(view))
        got += n


def parse_content_range(header: str | None) -> tuple[int, int, int | None] | None:
    """``bytes a-b/total`` as ``(a, b_exclusive, total or None)``; None when absent/unparsable."""
    if not header:
        return None
    match = _CONTENT_RANGE_RE.fullmatch(header.strip())
    if match is None:
        return None
    first, last, total = match.groups()
    return int(first), int(last) + 1, None if total == "*" else int(total)


@dataclass
class Fetch:
    """One GET the backend will issue: a key, a range (None = whole object), and the batch
    entries it serves as ``(index, offset inside the fetched bytes, length)``."""

    key: str
    rng: ByteRange | None
    members: list[tuple[int, int, int]] = field(default_factory=list)


def plan_fetches(
    keys: Sequence[str], ranges: Sequence[ByteRange | None], gap: int
) -> list[Fetch]:
    """Group a batch's reads into GETs: whole-object reads stay one GET each; the ranges of one
    key that overlap or lie at most ``gap`` bytes apart merge into one ranged GET.

    With ``gap=0`` only touching or overlapping ranges merge, so the bytes on the wire never
    exceed the bytes asked for; a larger gap trades wire bytes for fewer requests.
    """
    fetches: list[Fetch] = []
    by_key: dict[str, list[int]] = {}
    for i, (key, rng) in enumerate(zip(keys, ranges, strict=True)):
        if rng is None:
            fetches.append(Fetch(key, None, [(i, 0, -1)]))
        else:
            by_key.setdefault(key, []).append(i)
    for key, indices in by_key.items():
        indices.sort(key=lambda i: (ranges[i].start, ranges[i].end))  # type: ignore[union-attr]
        current: Fetch | None = None
        for i in indices:
            rng = ranges[i]
            assert rng is not None
            if current is not None and current.rng is not None and rng.start <= current.rng.end + gap:
                merged = ByteRange(current.rng.start, max(current.rng.end, rng.end))
                current.rng = merged
                current.members.append((i, rng.start - merged.start, rng.length))
            else:
                current = Fetch(key, rng, [(i, 0, rng.length)])
                fetches.append(current)
    return fetches
