"""Sealing and opening large payloads on worker threads, off the event loop.

Sealing a frame (its checksums, or AES-256-GCM in a sealed namespace) and opening its blocks
cost CPU in proportion to the payload: about 0.1 CPU-second per GB for AES-GCM with AES-NI,
a fifth of that for the checksums. On the event loop that work ran one object at a time and
stalled every other transfer of the loop (no new I/O issued, no completion handled while a
frame was encrypted), and a batch's writes began only once every frame was sealed. Both the
cipher (``cryptography``) and the checksums (``xxhash``) release the GIL on large buffers, so
on worker threads the work of one object overlaps the I/O of the others and uses every core.

Payloads under ``OFFLOAD_BYTES`` stay on the loop: a thread hop costs more than they do.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

# The one "wait for it through any number of cancellations" (the buffer lifetime contract).
from hicache_store.backends.lifetime import outlast

T = TypeVar("T")

#: payloads at least this large are sealed / opened on a worker thread.
OFFLOAD_BYTES = 1 << 20

class _Workers:
    """One pool for the process (every ``ObjectIO`` shares it): one thread per core. A forked
    child starts a pool of its own (the parent's threads do not exist there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool = None

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max(2, os.cpu_count() or 2), thread_name_prefix="hicache-seal"
                )
            return self._pool


_WORKERS = _Workers()


async def off_loop(nbytes: int, fn: Callable[[], T]) -> T:
    """``fn()``, on a worker thread when it works on ``nbytes >= OFFLOAD_BYTES`` bytes.

    ``fn`` may write into caller memory (it seals or opens in place): when the awaiting task
    is cancelled, this returns only once ``fn`` has ended, then re-raises ``CancelledError``,
    so nothing touches the caller's buffer after the call ended. ``fn``'s exceptions are
    raised here.
    """
    if nbytes < OFFLOAD_BYTES:
        return fn()
    job = asyncio.get_running_loop().run_in_executor(_WORKERS.pool(), fn)
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await outlast(job)
        raise
