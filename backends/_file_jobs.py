"""The file family's blocking work: ``FileJobs``, its pool and the edge where errors are ours.

Every system call and index call of a file store runs as a job on one ``CallOrderPool`` of
``io_threads`` threads (the jobs of the oldest call first: ``_call_order``); an ``OSError`` a
job raises is translated there, once (``translate_os_error``), and an error already ours
passes as it is.

Buffer lifetime (``backends.base``): a job that reads into or writes from the caller's buffers
goes through ``run_io``: one whose caller gave up before a thread picked it up does not start
(``abandonable``); one already in its ``preadv`` / ``pwrite`` runs to the end, and the public
method waits for it, so the caller's memory is never touched after the call ended. Waiting, not
staging: reads keep landing straight in the caller's buffer with O_DIRECT. Bookkeeping jobs
(the index) use ``run``: they must run even for an abandoned call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from ._call_order import CallOrderPool
from .errors import BackendError, translate_os_error
from .lifetime import abandonable

T = TypeVar("T")


class FileJobs:
    """The pool of one file store (``pool``, ``threads`` threads); errors name ``backend``."""

    def __init__(self, backend: str, threads: int) -> None:
        self.backend = backend
        self.pool = CallOrderPool(threads, "hicache-file")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the pool, run whatever the caller does meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def run_io(self, fn: Callable[..., T], *args: Any) -> T:
        """``run`` for a job that touches the caller's buffers: not started once the caller
        gave up (module docstring)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, abandonable(fn), *args)

    def translated(self, operation: str, key: str | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` with an ``OSError`` translated into this backend's error."""
        try:
            return fn(*args)
        except BackendError:
            raise  # already ours (some of ours are also OSErrors)
        except OSError as exc:
            raise translate_os_error(exc, backend=self.backend, operation=operation,
                                     key=key) from exc

    async def call(self, operation: str, fn: Callable[..., T], *args: Any) -> T:
        """``run`` of ``translated``: a bookkeeping job of ``operation``."""
        return await self.run(self.translated, operation, None, fn, *args)

    async def shutdown(self) -> None:
        """Wait for the running jobs (they own their file descriptors); nothing new starts."""
        await asyncio.get_running_loop().run_in_executor(None, self.pool.shutdown, True)


__all__ = ["FileJobs"]
