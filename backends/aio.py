"""Deadlines that raise the builtin ``TimeoutError`` on every supported Python (3.10 on).

From 3.11 on ``asyncio.TimeoutError`` and ``concurrent.futures.TimeoutError`` are the builtin
``TimeoutError`` and ``asyncio.timeout_at`` exists; on 3.10 neither holds. The library writes
``except TimeoutError`` after a deadline, so every deadline goes through one of these:

- ``timeout_at(when)``: ``asyncio.timeout_at``. An async context manager that cancels its
  block at loop time ``when`` (``time.monotonic()`` on the default loop) and then raises
  ``TimeoutError``; ``expired()`` says whether the deadline cut the block.
- ``wait_for(aw, timeout)``: ``asyncio.wait_for``, raising ``TimeoutError``.
- ``result_within(future, timeout)``: a ``concurrent.futures.Future``'s ``result(timeout)``,
  raising ``TimeoutError``.

On 3.10 a cancellation from elsewhere that lands in the same loop step as the deadline reads
as the deadline's (3.10 has no ``Task.uncancel`` to tell them apart).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections.abc import Awaitable
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["result_within", "timeout_at", "wait_for"]


class _Deadline:
    """``asyncio.timeout_at`` for 3.10 (the subset the library uses)."""

    def __init__(self, when: float | None) -> None:
        self._when = when
        self._expired = False
        self._task: asyncio.Task[Any] | None = None
        self._handle: asyncio.Handle | None = None

    def expired(self) -> bool:
        return self._expired

    async def __aenter__(self) -> _Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("timeout_at must be used inside a task")
        self._task = task
        if self._when is not None:
            loop = asyncio.get_running_loop()
            self._handle = loop.call_at(self._when, self._fire)
        return self

    def _fire(self) -> None:
        assert self._task is not None
        self._expired = True
        self._task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._expired and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


if sys.version_info >= (3, 11):
    timeout_at = asyncio.timeout_at
    wait_for = asyncio.wait_for

    def result_within(future: concurrent.futures.Future[T], timeout: float | None) -> T:
        """``future.result(timeout)`` (``TimeoutError`` past it)."""
        return future.result(timeout)
else:
    def timeout_at(when: float | None) -> _Deadline:
        """``asyncio.timeout_at(when)``."""
        return _Deadline(when)

    async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
        """``asyncio.wait_for(aw, timeout)``, raising the builtin ``TimeoutError``."""
        try:
            return await asyncio.wait_for(aw, timeout)
        except asyncio.TimeoutError as exc:
            raise TimeoutError from exc

    def result_within(future: concurrent.futures.Future[T], timeout: float | None) -> T:
        """``future.result(timeout)``, raising the builtin ``TimeoutError``."""
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            raise TimeoutError from exc
