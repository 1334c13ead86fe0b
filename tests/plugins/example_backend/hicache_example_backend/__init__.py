"""An example hicache-store backend: objects in a dict shared by every instance that opens the
same name (``example://NAME``), bounded by a number of objects.

This is the template for third-party backends; every method says which contract it keeps.
Its storage is a dict, so every call finishes on the event loop without blocking it. A backend
over a network or a disk runs each blocking call on a bounded executor instead (the loop is
the library's one loop, shared by every call), and a thread that writes into a caller's buffer
is done before the call returns, raises or is cancelled (see the README). It names no location
that opening could create, so it keeps ``creates_location = False``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from hicache_store.backends import (
    Backend,
    BackendURL,
    ByteRange,
    Capabilities,
    CapacityError,
    InvalidRangeError,
    ObjectStat,
)

__all__ = ["ExampleBackend"]


class ExampleBackend(Backend):
    """``example://NAME?capacity_items=N``: a named in-process dict, at most N objects."""

    name = "example"
    # ``mtime``: stat() reports when each object was written (tools such as ``gc --max-age``
    # rely on it; leave the flag out if your store cannot tell).
    capabilities = Capabilities(ranged_reads=True, listing=True, mtime=True)

    #: the "remote storage": one dict per name, shared by instances (so reopen works), and
    #: when each object was written.
    stores: ClassVar[dict[str, dict[str, bytes]]] = {}
    written: ClassVar[dict[str, dict[str, float]]] = {}

    def __init__(self, store_name: str = "default", capacity_items: int = 10_000) -> None:
        super().__init__()
        self.store_name = store_name
        self.capacity_items = capacity_items
        self.data = self.stores.setdefault(store_name, {})
        self.mtimes = self.written.setdefault(store_name, {})

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> ExampleBackend:
        # URL query values are strings: convert what the constructor needs typed.
        opts = dict(options)
        if "capacity_items" in opts:
            opts["capacity_items"] = int(opts["capacity_items"])
        return cls(url.location or "default", **opts)

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        return [key in self.data for key in keys]

    async def _get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        ranges: Sequence[ByteRange | None],
    ) -> list[int | None]:
        out: list[int | None] = []
        for key, buf, rng in zip(keys, buffers, ranges, strict=True):
            data = self.data.get(key)
            if data is None:
                out.append(None)  # a miss is a result
            elif rng is None:
                if len(data) > len(buf):
                    raise InvalidRangeError(
                        f"{len(data)}-byte object, {len(buf)}-byte buffer", backend=self.name, key=key
                    )
                buf[: len(data)] = data
                out.append(len(data))
            else:
                rng.check_within(len(data), backend=self.name, key=key)  # never clamp
                buf[: rng.length] = data[rng.start : rng.end]
                out.append(rng.length)
        return out

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        for key, buf in zip(keys, buffers, strict=True):
            if self.capacity_items < 1:
                raise CapacityError("store has no capacity", backend=self.name, key=key)
            if key not in self.data and len(self.data) >= self.capacity_items:
                victim = next(iter(self.data))  # evict the oldest (insertion order)
                del self.data[victim]
                self.mtimes.pop(victim, None)
            self.data[key] = bytes(buf)  # a private copy, published in one step
            self.mtimes[key] = time.time()

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            self.mtimes.pop(key, None)
        return [self.data.pop(key, None) is not None for key in keys]

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        return [ObjectStat(k, len(self.data[k]), self.mtimes.get(k)) if k in self.data else None
                for k in keys]

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in [k for k in self.data if k.startswith(prefix)]:
            yield key
