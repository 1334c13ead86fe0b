"""The one bridge from synchronous code (CLI, engine threads) into async code.

``run_sync(coro)`` runs a coroutine on a single background event loop, owned by a daemon
thread started on first use, and blocks the calling thread until the result is ready. Any
number of threads may call it at once; their coroutines interleave on that one loop, which is
what the backends expect (they bind no loop at construction and offload blocking I/O to their
own pools).

Calling it from the bridge's own loop would deadlock, so that raises ``RuntimeError``. Calling
it from a thread that runs another event loop works but blocks that loop: async code should
``await`` instead.

An interrupt of the waiting thread (``KeyboardInterrupt``: Ctrl-C, or the CLI's SIGTERM)
cancels the coroutine and waits up to ``INTERRUPT_GRACE_S`` for it to end (its ``finally``
blocks run: writes in flight end, backends close) before the interrupt propagates, so the
process never exits with work still running on the bridge's thread.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from hicache_store.backends.aio import result_within

T = TypeVar("T")

#: seconds an interrupted ``run_sync`` waits for its cancelled coroutine to end.
INTERRUPT_GRACE_S = 30.0

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def _bridge_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever, name="hicache-store-sync-bridge", daemon=True
            )
            thread.start()
            _loop, _thread = loop, thread
        return _loop


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the bridge loop and return its result (or raise its exception).

    With ``timeout`` (seconds), the coroutine is cancelled and ``TimeoutError`` raised when it
    takes longer.
    """
    loop = _bridge_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("run_sync called from the sync bridge's own loop: await instead")
    ended = threading.Event()
    future = asyncio.run_coroutine_threadsafe(_signalling(coro, ended), loop)
    try:
        return result_within(future, timeout)
    except TimeoutError:
        future.cancel()
        raise
    except BaseException:
        if not future.done():  # interrupted while waiting (else: the coroutine's own error)
            future.cancel()
            ended.wait(INTERRUPT_GRACE_S)
        raise


async def _signalling(coro: Coroutine[Any, Any, T], ended: threading.Event) -> T:
    """``await coro``, then set ``ended`` however it ends."""
    try:
        return await coro
    finally:
        ended.set()


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start ``coro`` on the bridge loop without waiting; the future carries its outcome.

    For callers that overlap I/O with their own work (the cache tier's prefetch and backup).
    """
    return asyncio.run_coroutine_threadsafe(coro, _bridge_loop())


#: how long the interpreter's exit waits for the bridge loop to stop before leaving it.
_STOP_WAIT_S = 2.0


def _shutdown() -> None:
    """At exit: stop the bridge loop and close it once stopped. A loop left open is closed
    by its own finaliser at some point of the interpreter's teardown, possibly after its
    self-pipe socket was finalised ("Exception ignored in BaseEventLoop.__del__")."""
    global _loop
    with _lock:
        loop, _loop = _loop, None
        thread = _thread
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(_STOP_WAIT_S)
        if not loop.is_running():
            loop.close()


atexit.register(_shutdown)
