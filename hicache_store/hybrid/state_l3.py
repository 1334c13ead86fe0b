"""The L3 path for non-KV component objects (recurrent snapshots, sliding-window pages, ...).

Each object is named and framed exactly like a KV object: the key is
``{page_hash}_{namespace_digest}_L{first}-{last}_C{component}`` (``layout.keys``) and the
object is a framing header (``layout.framing``: namespace, page hash, component, one xxh3 per
layer block, parent page hash) followed by the payload. The payload is the component's state for
its ``num_layers`` layers, split into that many equal blocks.

Reads verify everything before returning bytes: a miss returns None; a corrupt object (bad
header, another key's header, wrong length, checksum mismatch) also returns None and is counted
in ``StateIO.corruptions``; a backend error or timeout is counted in ``StateIO.errors``. Nothing
raises into the engine's path: the caller then recomputes (a shorter match).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hicache_store.backends.base import Backend
from hicache_store.layout.errors import CorruptObjectError
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key
from hicache_store.layout.namespace import Namespace
from hicache_store.objects import DEFAULT_IO_TIMEOUT_S, Arena, Frame, ObjectIO

from .components import ComponentSpec

log = logging.getLogger(__name__)


@dataclass
class StateIO:
    """Counters of one ``StateL3`` (all objects of its component)."""

    puts: int = 0
    put_failures: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corruptions: int = 0
    errors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class StateL3:
    """Stores and fetches one component's objects in one namespace of a backend.

    ``payload_bytes`` (optional) is the exact size every object of this component has; with it,
    an object of another size is treated as corrupt.
    """

    def __init__(
        self,
        backend: Backend,
        namespace: Namespace,
        spec: ComponentSpec,
        *,
        payload_bytes: int | None = None,
        io_timeout_s: float = DEFAULT_IO_TIMEOUT_S,
        shard: int | None = None,
    ) -> None:
        """``shard``: the rank's shard of a component sharded across ranks (a TP rank's slice
        of the recurrent state or of the window layers' heads), written as the key's head group
        (``_H{shard}``) so that ranks sharing a backend never overwrite each other's objects;
        None for an unsharded component."""
        if spec.component == 0:
            raise ValueError("component 0 is the tier's full-attention KV (use HiCache's L3Link)")
        self.backend = backend
        self.namespace = namespace
        self.spec = spec
        self.coords = ObjectCoords(0, spec.num_layers, shard, spec.component)
        self.payload_bytes = payload_bytes
        self.io_timeout_s = io_timeout_s
        self.io = StateIO()
        self._io = ObjectIO(backend, namespace, io_timeout_s=io_timeout_s)
        self._frames: Arena | None = None

    def object_key(self, page_hash: str) -> ObjectKey:
        return ObjectKey(page_hash, self.namespace.digest, self.coords)

    def key(self, page_hash: str) -> str:
        return format_key(self.object_key(page_hash))

    async def exists(self, page_hashes: Sequence[str]) -> list[bool]:
        """Which objects are stored (an error answers all False and is counted)."""
        if not page_hashes:
            return []
        keys = [self.key(h) for h in page_hashes]
        try:
            return await asyncio.wait_for(self.backend.exists(keys), self.io_timeout_s)
        except Exception as exc:
            self.io.errors += 1
            log.warning("L3 existence check of component %s failed: %s", self.spec.name, exc)
            return [False] * len(keys)

    async def put(
        self,
        page_hash: str,
        payload: bytes | bytearray | memoryview,
        *,
        parent_hash: str | None = None,
    ) -> bool:
        """Frame and store one object; True once stored, False (counted) on any failure."""
        view = memoryview(payload).cast("B")
        if self.payload_bytes is not None and view.nbytes != self.payload_bytes:
            raise ValueError(
                f"{self.spec.name}: payload of {view.nbytes} bytes, expected {self.payload_bytes}"
            )
        key = self.object_key(page_hash)
        header = self._io.header_bytes(self.coords.num_layers)
        arena = self._arena(header + view.nbytes)
        slot = arena.take()
        try:
            frame = slot[: header + view.nbytes]
            frame[header:] = view
            (ok,) = await self._io.put([Frame(key, frame, parent_hash)])
        finally:
            arena.give(slot)
        if not ok:
            self.io.put_failures += 1
            return False
        self.io.puts += 1
        self.io.bytes_written += len(frame)
        return True

    async def get(self, page_hash: str) -> bytes | None:
        """The verified payload of one object, or None (miss, corrupt or error; counted)."""
        self.io.gets += 1
        key = self.object_key(page_hash)
        try:
            if self.payload_bytes is None:
                found = await self._io.read_object(format_key(key))
                payload = None if found is None else bytes(found[1])
            else:
                payload = await self._read_sized(key, self.payload_bytes)
        except CorruptObjectError as exc:
            self.io.corruptions += 1
            log.warning("corrupt %s object treated as a miss: %s", self.spec.name, exc)
            return None
        except Exception as exc:
            self.io.errors += 1
            log.warning("L3 read of %s at %s failed: %r", self.spec.name, page_hash[:16], exc)
            return None
        if payload is None:
            self.io.misses += 1
            return None
        self.io.hits += 1
        self.io.bytes_read += self._io.frame_bytes(self.coords.num_layers, len(payload))
        return payload

    async def _read_sized(self, key: ObjectKey, payload_bytes: int) -> bytes | None:
        header = self._io.header_bytes(self.coords.num_layers)
        arena = self._arena(header + payload_bytes)
        slot = arena.take()
        try:
            frame = slot[: header + payload_bytes]
            if await self._io.read_frame(key, frame) is None:
                return None
            return bytes(frame[header:])
        finally:
            arena.give(slot)

    def _arena(self, nbytes: int) -> Arena:
        if self._frames is None or self._frames.slot_bytes < nbytes:
            self._frames = Arena(nbytes)
        return self._frames
