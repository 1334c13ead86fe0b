"""A store of N framed objects that exist only as arithmetic: ``gc`` / ``inspect`` beyond 1 M.

``SyntheticStore(objects)`` is a real ``Backend`` (listing, stat, ranged reads, delete) whose
objects are computed on the fly: object ``j`` of the listing has page hash ``j`` spread over
the 256-bit space (``j * STRIDE``, 64 hex characters: the listing is in key order, as S3's
and the file index's are), one 8 KiB object per page (a 4 KiB header and a 4 KiB payload).
Pages form chains of ``CHAIN`` written parent first, but scattered across the key space: the
chain position of ``j`` is ``pi(j) = j * A mod N`` (``A`` coprime to ``N``), so a page's parent
is ``pi^-1(pi(j) - 1)`` (a far-away key, as real content hashes are), and its mtime is
``BASE + pi(j)`` seconds (older pages older). A ranged read of the header range returns the
header ``encode_header`` writes for that page, parent link included. Nothing is held per
object: the store costs a few hundred bytes at any N, so a process running ``gc`` on it
measures gc's own memory and CPU, not the store's (its CPU, ``spent``, is counted apart).
``delete`` only counts: deleted objects stay listed (a run lists once).

Used by ``bench_ops_scale.py --synthetic``; not part of the library.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from hicache_store.backends.base import Backend
from hicache_store.backends.errors import NotSupportedError
from hicache_store.backends.types import ByteRange, Capabilities, ObjectStat
from hicache_store.layout.framing import encode_header
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key

CHAIN = 16
NS = "0123456789abcdef"
PAYLOAD = bytes(range(256)) * 16  # 4 KiB
OBJECT_BYTES = 4096 + len(PAYLOAD)
BASE = 1_700_000_000.0
_SPACE = 1 << 256
_TAIL = format_key(ObjectKey("0" * 64, NS, ObjectCoords(0, 1, 0)))[64:]


class SyntheticStore(Backend):
    """``objects`` computed framed objects; see the module docstring."""

    name = "synthetic"
    capabilities = Capabilities(ranged_reads=True, listing=True, mtime=True)

    def __init__(self, objects: int) -> None:
        super().__init__()
        self.objects = objects
        self.stride = _SPACE // max(objects, 1)
        mult = int(objects * 0.6180339887) | 1
        while math.gcd(mult, objects) != 1:
            mult += 2
        self.mult = mult
        self.inverse = pow(mult, -1, objects) if objects > 1 else 0
        #: CPU seconds spent in this store's own methods (to subtract from a run's).
        self.spent = 0.0
        self.deleted = 0

    # -- arithmetic ----------------------------------------------------------------------------

    def page(self, j: int) -> str:
        return f"{j * self.stride:064x}"

    def index(self, page: str) -> int:
        return int(page, 16) // self.stride

    def position(self, j: int) -> int:
        return j * self.mult % self.objects

    def parent(self, j: int) -> int | None:
        pos = self.position(j)
        if pos % CHAIN == 0:
            return None
        return (pos - 1) * self.inverse % self.objects

    def header(self, j: int) -> bytes:
        parent = self.parent(j)
        key = ObjectKey(self.page(j), NS, ObjectCoords(0, 1, 0))
        return encode_header(key, PAYLOAD, 2,
                             parent_hash=None if parent is None else self.page(parent))

    # -- Backend -------------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: Any, options: dict[str, Any]) -> SyntheticStore:
        raise NotSupportedError("the synthetic store has no URL: the bench constructs it",
                                backend=cls.name, operation="open")

    def _known(self, key: str) -> int | None:
        if not key.endswith(_TAIL) or len(key) != 64 + len(_TAIL):
            return None
        j = self.index(key[:64])
        return j if 0 <= j < self.objects and self.page(j) == key[:64] else None

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        return [self._known(k) is not None for k in keys]

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        out: list[ObjectStat | None] = []
        for key in keys:
            j = self._known(key)
            out.append(None if j is None else ObjectStat(key, OBJECT_BYTES,
                                                         BASE + self.position(j)))
        return out

    async def _get_into(self, keys: Sequence[str], buffers: Sequence[memoryview],
                        ranges: Sequence[ByteRange | None]) -> list[int | None]:
        start = time.process_time()
        out: list[int | None] = []
        for key, buf, rng in zip(keys, buffers, ranges, strict=True):
            j = self._known(key)
            if j is None:
                out.append(None)
                continue
            if rng is None or rng.end > 4096:
                raise NotSupportedError("the synthetic store serves header ranges only",
                                        backend=self.name, operation="get_into", key=key)
            data = self.header(j)[rng.start : rng.end]
            buf[: len(data)] = data
            out.append(len(data))
        self.spent += time.process_time() - start
        return out

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        raise NotSupportedError("the synthetic store is read-only", backend=self.name,
                                operation="put")

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        self.deleted += len(keys)
        return [True] * len(keys)

    async def _list_entries(self, prefix: str) -> AsyncIterator[ObjectStat]:
        for first in range(0, self.objects, 4096):
            start = time.process_time()
            batch = [ObjectStat(key, OBJECT_BYTES, BASE + self.position(j))
                     for j in range(first, min(first + 4096, self.objects))
                     if (key := self.page(j) + _TAIL).startswith(prefix)]
            self.spent += time.process_time() - start
            for st in batch:
                yield st

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        async for st in self._list_entries(prefix):
            yield st.key
