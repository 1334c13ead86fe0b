"""Reused page-aligned staging: slots of one size, made a block at a time, handed out and back.

Framed writes need a buffer laid out ``[header | payload]`` and reads need somewhere for the
header to land; making a fresh mmap for each object costs a system call, page faults and a
TLB shootdown per object. An arena makes ``block_slots`` slots with one mapping, hands them out
(``take``) and takes them back (``give``) for the next object, so the data path maps memory only
while its peak concurrency grows. Its peak is bounded by the callers' own bounds (the byte
budgets of ``ObjectIO``); memory is never returned to the OS before the arena is dropped.

Slots are 4096-byte aligned and their size is a multiple of 4096 (O_DIRECT-ready). ``Arenas``
keeps one arena per slot size, made on first use, for callers whose buffers come in a few sizes.

Lifetime: a slot handed back must no longer be read or written by anyone. ``ObjectIO`` hands a
read slot back only after the backend call it was given to has returned, raised or been
cancelled; the backend contract (``backends.base``, buffer lifetime) guarantees nothing lands
in it afterwards.
"""

from __future__ import annotations

import threading

from hicache_store.backends import DIRECT_ALIGNMENT, aligned_buffer


def round_up(nbytes: int, to: int = DIRECT_ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return -(-nbytes // to) * to


class Arena:
    """Aligned slots of ``slot_bytes`` (rounded up to 4096) each; thread-safe."""

    def __init__(self, slot_bytes: int, *, block_slots: int = 8, populate: bool = False) -> None:
        if slot_bytes < 1 or block_slots < 1:
            raise ValueError(f"arena: {block_slots} slots of {slot_bytes} bytes")
        self.slot_bytes = round_up(slot_bytes)
        self.block_slots = block_slots
        self.populate = populate
        self._free: list[memoryview] = []
        self._lock = threading.Lock()
        self.blocks = 0  # mappings made (the data path's mmap count)

    @property
    def slots(self) -> int:
        """Slots made so far (in use or free)."""
        return self.blocks * self.block_slots

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> memoryview:
        """A writable slot of exactly ``slot_bytes`` bytes (contents undefined)."""
        with self._lock:
            if not self._free:
                block = aligned_buffer(self.slot_bytes * self.block_slots, populate=self.populate)
                self.blocks += 1
                size = self.slot_bytes
                self._free.extend(block[i * size : (i + 1) * size] for i in range(self.block_slots))
            return self._free.pop()

    def give(self, slot: memoryview) -> None:
        """Return a slot from ``take`` (nobody may touch it afterwards)."""
        if len(slot) != self.slot_bytes:
            raise ValueError(f"arena: a slot of {len(slot)} bytes is not one of mine")
        with self._lock:
            self._free.append(slot)


class Arenas:
    """One ``Arena`` per slot size (``nbytes`` rounded up to 4096), made on first use; thread-safe.

    ``block_slots`` and ``populate`` apply to every arena made here.
    """

    def __init__(self, *, block_slots: int = 8, populate: bool = False) -> None:
        self.block_slots = block_slots
        self.populate = populate
        self._arenas: dict[int, Arena] = {}
        self._lock = threading.Lock()

    def made(self) -> list[Arena]:
        """The arenas made so far, one per slot size."""
        with self._lock:
            return list(self._arenas.values())

    def arena(self, nbytes: int) -> Arena:
        """The arena whose slots hold ``nbytes`` bytes."""
        size = round_up(nbytes)
        with self._lock:
            found = self._arenas.get(size)
            if found is None:
                found = Arena(size, block_slots=self.block_slots, populate=self.populate)
                self._arenas[size] = found
            return found
