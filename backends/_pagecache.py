"""Whether a read should use the page cache: the file backend's read policy.

The file backend reads cold bytes with O_DIRECT (faster than buffered reads: BENCHMARKS.md
"Backends"), but bytes already in the page cache are read fastest from there
(a memory copy). Two pieces decide:

- ``is_cached(fd, offset, length)``: the ``cachestat`` system call (Linux 6.5+) counts the
  cached pages of a range without side effects. Why not a non-blocking buffered read first
  (``preadv2`` with ``RWF_NOWAIT``): on a miss the kernel still starts readahead of the whole
  range before it answers EAGAIN (BENCHMARKS.md), so every cold read would cost the device
  twice. Where ``cachestat`` is missing
  (older kernels, other systems) the answer is "unknown" and the read goes O_DIRECT.
- ``SecondTouch``: O_DIRECT reads never fill the page cache, so without admission a hot object
  would never become warm. A key read cold a second time within a window is read buffered
  (filling the cache), so its later reads are warm: 2Q-style admission, which keeps one-off
  reads (a long prompt scanned once) from flushing the cache. The window is a fixed 1 MiB
  table of generations indexed by the key's hash: no per-object memory, and it forgets keys
  after about half a million other first touches.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

#: ``cachestat`` system call numbers (the generic table's 451 is shared by x86_64 and arm64).
_CACHESTAT_NR = {"x86_64": 451, "aarch64": 451, "arm64": 451}
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


class _Cachestat:
    def __init__(self) -> None:
        self.number = _CACHESTAT_NR.get(platform.machine(), 0) if os.name == "posix" else 0
        self._syscall = None
        if self.number:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                self._syscall = libc.syscall
            except (OSError, AttributeError):
                self._syscall = None

    def __call__(self, fd: int, offset: int, length: int) -> bool | None:
        if self._syscall is None or length <= 0:
            return None
        rng, stat = _Range(offset, length), _Stat()
        rc = self._syscall(
            ctypes.c_long(self.number), ctypes.c_uint(fd), ctypes.byref(rng),
            ctypes.byref(stat), ctypes.c_uint(0),
        )
        if rc != 0:
            self._syscall = None  # ENOSYS (old kernel) or refused by a sandbox: stop asking
            return None
        first = offset // _PAGE
        pages = (offset + length + _PAGE - 1) // _PAGE - first
        return bool(stat.nr_cache >= pages)


#: ``is_cached(fd, offset, length)``: True when every page of the range is in the page cache,
#: False when some is not, None when the system cannot tell.
is_cached = _Cachestat()


class SecondTouch:
    """Remembers keys read cold recently; ``admit(h)`` is True on the second cold read.

    ``h`` is any well-mixed 64-bit hash of the key. Two keys sharing a slot can admit each
    other early (a buffered read where O_DIRECT would do): harmless for correctness."""

    SLOTS = 1 << 20

    def __init__(self) -> None:
        self._seen = bytearray(self.SLOTS)
        self._generation = 1
        self._marked = 0
        self._lock = threading.Lock()

    def seen(self, h: int) -> bool:
        """What ``admit(h)`` would answer now, without recording anything."""
        slot = h & (self.SLOTS - 1)
        with self._lock:
            gen = self._generation
            return self._seen[slot] in (gen, gen - 1 if gen > 1 else 255)

    def admit(self, h: int) -> bool:
        slot = h & (self.SLOTS - 1)
        with self._lock:
            gen = self._generation
            previous = gen - 1 if gen > 1 else 255
            mark = self._seen[slot]
            if mark in (gen, previous):
                self._seen[slot] = 0
                return True
            self._seen[slot] = gen
            self._marked += 1
            if self._marked >= self.SLOTS // 2:
                # Age: marks two generations old stop counting (a slot is reused after 255).
                self._generation = gen % 255 + 1
                self._marked = 0
            return False


__all__ = ["SecondTouch", "is_cached"]
