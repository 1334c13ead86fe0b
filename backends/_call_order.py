"""``CallOrderPool``: a thread pool that runs the jobs of the oldest call first.

A call of a backend that takes several steps on a pool (a file put: reserve, write, settle)
submits each step when the one before has ended. On a first-in-first-out pool with many calls
in flight, every call's first step then runs before any call's second, and all the calls end
together, late: with 1,500 concurrent puts under a deadline each, none ended in time.

Here every job carries its call's number, taken when the call began (``one_call``) and kept
by all of its steps; a free thread takes the queued job with the smallest number, first come
first served among equals. A call's later step therefore runs before the first step of any
call that began after it, and calls end in the order they began. A job submitted outside a
call is numbered when it is submitted, so such jobs keep first-in-first-out order among
themselves and with the calls.

Threads are started as jobs need them, up to ``threads``, and are daemons: ``shutdown``
waits for them when asked to; a pool left open does not hold the interpreter at exit.
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

#: numbers of calls and of jobs outside calls, from one count: older is smaller.
_NUMBERS = itertools.count()
#: the number of the call whose steps run in this context, if any.
_CALL: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "hicache_store_call_number", default=None
)


@contextlib.contextmanager
def one_call() -> Iterator[int]:
    """Number the jobs submitted inside (and by the tasks started inside) as one call's,
    begun now. Inside another call, the outer call's number is kept."""
    current = _CALL.get()
    if current is not None:
        yield current
        return
    number = next(_NUMBERS)
    token = _CALL.set(number)
    try:
        yield number
    finally:
        _CALL.reset(token)


class CallOrderPool(Executor):
    """An ``Executor`` of ``threads`` threads named ``{name}_{i}``; see the module docstring."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"a pool of {threads} threads")
        self._max = threads
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        # (call number, submission number, future, job); the submission number breaks ties
        self._queue: list[tuple[int, int, Future[Any], Callable[[], Any]]] = []
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        order = next(_NUMBERS)
        number = _CALL.get()
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            job = (order if number is None else number, order, future, lambda: fn(*args, **kwargs))
            heapq.heappush(self._queue, job)
            if self._idle > len(self._queue) - 1 or len(self._threads) >= self._max:
                self._cond.notify()
            else:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._queue and not self._closed:
                    self._cond.wait()
                self._idle -= 1
                if not self._queue:
                    return  # closed, and nothing left to run
                _, _, future, job = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = job()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Accept no more jobs; the queued ones still run unless ``cancel_futures``."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                for _, _, future, _ in self._queue:
                    future.cancel()
                self._queue.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()
