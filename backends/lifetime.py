"""Buffer lifetime: once a call that touches caller memory ends, no byte of it is touched again.

The contract (``backends.base``, "Buffer lifetime"): once ``get_into`` / ``get_scatter``
returns, raises, times out or is cancelled, nothing is written into the caller's buffers any
more; once ``put`` / ``put_if_absent`` ends the same way, they are not read any more. Callers
(the cache tier) hand that memory to the next page the moment a call ends, so a late read
landing there would serve another page's KV.

How it is kept, once for every backend:

1. ``guarded(core)``: the public methods run the core of such a call as a task of its own,
   shielded from the caller's cancellation. When the caller gives up (cancelled, or its
   ``wait_for`` deadline passes) the call is flagged abandoned, and ``guarded`` returns only
   once the core has ended: I/O already running in a thread or a request finishes first.
2. ``abandonable(fn)``: a worker-thread job of an abandoned call does not start
   (``CallAbandoned``): a thread's ``preadv`` cannot be interrupted, only not started.
3. ``until_abandoned(aw)``: a wait of the core that touches no caller memory (injected
   latency, queueing, a request landing in the backend's own memory) ends at once when the
   caller gives up.
4. ``Handoff``: a backend whose core gives up on a deadline of its own while a thread is still
   busy lands that thread's I/O in memory of its own and copies to or from the caller's
   buffers only while the caller still waits.
5. ``gather_settled``: a core that fans out I/O into caller buffers ends only when all of it
   has.

A cancelled call may therefore outlast the caller's deadline by the time the I/O in flight
takes; each backend bounds that time (see its docstring). The conformance suite checks every
backend (``hicache_store.testing.lifetime``).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Call:
    """One buffer-touching call whose caller may give up (see ``guarded``).

    ``flag`` is read by worker threads (``abandonable``); ``waiters`` are the event-loop waits
    that give way at once when the caller gives up (``until_abandoned``).
    """

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.waiters: set[asyncio.Future[None]] = set()

    def abandon(self) -> None:
        self.flag.set()
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)


#: the call whose core runs in this context (``guarded``), if any.
_CURRENT_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "hicache_store_current_call", default=None
)


class CallAbandoned(Exception):
    """Raised instead of starting I/O for a call whose caller already gave up.

    Only the core of an abandoned call sees it; the public method drops the core's outcome and
    raises ``CancelledError`` to its caller.
    """


async def guarded(core: Coroutine[Any, Any, T]) -> T:
    """Run the core of a call that touches caller buffers; the call ends when the core has.

    The core runs as a task of its own, shielded from the caller's cancellation. When the
    caller is cancelled (or its ``wait_for`` deadline passes), the call is flagged abandoned,
    then this waits for the core to end before re-raising ``CancelledError``: no I/O of the
    call is left running against the caller's buffers. An abandoned core skips what it has
    not started (``abandonable`` thread jobs) and its waits that touch no caller memory end
    at once (``until_abandoned``), so the wait is only for I/O already in flight. Nested calls
    (a wrapper backend forwarding to another) share the outermost call.
    """
    call = _CURRENT_CALL.get() or _Call()
    token = _CURRENT_CALL.set(call)
    try:
        task = asyncio.ensure_future(core)  # the task copies the context: it sees ``call``
    finally:
        _CURRENT_CALL.reset(token)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        call.abandon()
        await outlast(task)
        raise


def abandonable(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` wrapped for a worker thread: it raises ``CallAbandoned`` instead of running when
    the caller of the current call has given up by the time a thread picks it up.

    Call it on the event loop, in the core of a public read or write (it captures that call's
    flag from the context); outside one it returns ``fn`` itself. This is how a cancelled
    batch skips the I/O it has not started, while the public method waits for the I/O that
    has: a thread's ``preadv`` cannot be interrupted, only not started.
    """
    call = _CURRENT_CALL.get()
    if call is None:
        return fn
    flag = call.flag

    def job(*args: Any, **kwargs: Any) -> T:
        if flag.is_set():
            raise CallAbandoned
        return fn(*args, **kwargs)

    return job


async def until_abandoned(aw: Awaitable[T]) -> T:
    """Await ``aw``, unless the caller of the current call gives up first: then ``aw`` is
    cancelled and ``CallAbandoned`` raised at once.

    The public methods wait for a core to end after its caller gave up (``guarded``); this is
    how a core says that a wait may end early because nothing aimed at the caller's buffers is
    in flight during it: injected latency, queueing, a request whose answer lands in memory of
    the backend's own and reaches the caller only through a ``Handoff``. Never around I/O into
    (or out of) caller memory. Outside a guarded call it is a plain ``await``.
    """
    call = _CURRENT_CALL.get()
    if call is None:
        return await aw
    task = asyncio.ensure_future(aw)
    if call.flag.is_set():
        task.cancel()
        await outlast(task)
        raise CallAbandoned
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    call.waiters.add(gone)
    try:
        either: list[asyncio.Future[Any]] = [task, gone]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        await outlast(task)
        raise
    finally:
        call.waiters.discard(gone)
    if not task.done():
        task.cancel()
        await outlast(task)
        raise CallAbandoned
    return task.result()


async def gather_settled(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` that ends only when every awaitable has: results in order, or the
    first exception (by position) once all are done.

    Plain ``gather`` raises the first failure at once and leaves the others running: for reads
    into caller memory that would end a call while sibling I/O still writes (the buffer
    lifetime contract). Use it wherever a call fans out I/O that touches caller buffers.
    """
    outcomes = await asyncio.gather(*aws, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes  # type: ignore[return-value]  # no exception left: every item is a T


class Handoff:
    """Caller memory touched from a worker thread only while the caller still waits.

    For backends whose core gives up on a deadline of its own while a thread is still busy
    (a request that cannot be interrupted): the thread lands its I/O in memory of its own and
    copies between that memory and the caller's buffers only inside ``deliver``; the event
    loop calls ``close`` before raising. ``close`` waits for a copy already running (one
    ``memcpy``, never I/O), and every later ``deliver`` is refused, so nothing touches the
    caller's buffers after the call ended.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True

    def deliver(self, copy: Callable[[], None]) -> bool:
        """Run ``copy`` (a worker thread's copy to or from caller memory) unless the caller
        has gone; True when it ran."""
        with self._lock:
            if not self._open:
                return False
            copy()
            return True

    def close(self) -> None:
        """The caller stops waiting: wait for a copy in progress, refuse every later one."""
        with self._lock:
            self._open = False


async def outlast(task: asyncio.Future[Any]) -> None:
    """Wait until ``task`` is done, through any number of cancellations of the waiter; its
    outcome is dropped (and marked retrieved): the caller that wanted it gave up."""
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            continue  # cancelled again: the I/O is still running, keep waiting for it
    if not task.cancelled():
        task.exception()


__all__ = [
    "CallAbandoned",
    "Handoff",
    "abandonable",
    "gather_settled",
    "guarded",
    "outlast",
    "until_abandoned",
]
