"""Page-aligned memory for O_DIRECT I/O, and the alignment test on a caller's buffer.

O_DIRECT moves bytes between the device and user memory without the page cache, and Linux
requires the memory address, the file offset and the length to be multiples of the device's
logical block size. We use 4096 for all three: it covers 512-byte and 4K-native devices and
is what the object framing aligns payloads to.
"""

from __future__ import annotations

import contextlib
import mmap
import threading

import numpy as np

#: the alignment of address, offset and length that O_DIRECT paths here require.
DIRECT_ALIGNMENT = 4096

_local = threading.local()

# ``populate``: transparent huge pages where the kernel gives them, every page faulted in
# before the first I/O. O_DIRECT reads land faster in huge pages than in 4 KiB ones, and 4 KiB
# pages first faulted in by the read itself stay slower on every later read (BENCHMARKS.md,
# "Design figures behind the file backend's index and read policy"). Buffers the CPU fills
# before any I/O (write staging) fault their own pages in and need not populate.
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def aligned_buffer(nbytes: int, *, populate: bool = False) -> memoryview:
    """A writable, zero-filled, page-aligned buffer of ``nbytes`` bytes (anonymous mmap).

    Buffers from here (and torch/numpy views of them) let the file backend use O_DIRECT with
    no bounce copy. The memory is returned to the OS when the last view of it is released.
    ``populate``: huge pages where possible, all resident when this returns; use it for
    buffers that reads land in before the CPU writes them (see above).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return memoryview(bytearray())
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if populate:
        if _HUGEPAGE is not None:
            with contextlib.suppress(OSError):  # THP off or unsupported: 4 KiB pages
                buffer.madvise(_HUGEPAGE)
        # Write faults now, after the advice (MAP_POPULATE would fault 4 KiB pages first).
        np.frombuffer(buffer, dtype=np.uint8).fill(0)
    return memoryview(buffer)


def address_of(view: memoryview) -> int:
    """The address of the first byte of a (C-contiguous) buffer, read-only or not."""
    if len(view) == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def is_aligned(view: memoryview) -> bool:
    return address_of(view) % DIRECT_ALIGNMENT == 0


def scratch_block() -> memoryview:
    """A per-thread aligned block of ``DIRECT_ALIGNMENT`` bytes for unaligned tails."""
    block: memoryview | None = getattr(_local, "block", None)
    if block is None:
        block = aligned_buffer(DIRECT_ALIGNMENT)
        _local.block = block
    return block
