"""One backend's object writes, in order: ``WriteQueue``.

Every write of ``ObjectIO`` (``put``, ``put_together``) to one backend, whoever makes it, goes
through that backend's one queue on the running event loop (``queue_of``):

1. **Queue.** A caller hands its pages in its order. A page is a group of frames stored or
   failed together (one page's objects; a ``put_together`` batch); it joins the back of the
   queue with ``start_by``, the time after which it is not started.
2. **Runs.** At most ``WINDOW`` runs are in flight. A free slot takes the oldest queued pages
   as one run: consecutive pages under one byte budget and deadline rule, up to ``RUN_BYTES``
   (and the budget's limit) and ``RUN_OBJECTS``, and no more than the store wrote in
   ``RUN_SHARE`` of the deadline's floor at the pace of recent runs (one page until a pace is
   known), never part of a page (a larger page is a run alone). A page past its ``start_by``
   is not started: ``LATE``. So the oldest pages, across
   every caller, are written first, and what a backend call costs apart from its bytes (on the
   file backend an index reservation and settle) is paid once per run, not per object.
3. **Work.** The run takes its bytes from the budget, seals its frames in place (off the loop
   when large) and stores them in one ``Backend.put``, which may take ``Deadline.seconds`` of
   the bytes the backend has to move to finish it (its own and those of the runs handed out
   before it, still in flight), from that moment: a page's deadline measures the work, never
   the queue in front of it. A page whose ``start_by`` passed while its run waited for the
   budget is not started either.
4. **Outcomes**, per page: ``STORED`` once the call returned; ``LATE`` when the run ran past
   its deadline (a page cut in flight may still become visible: it is never reported stored);
   ``FAILED`` when the call raised. A failed call of several pages whose error names a key
   fails that key's page and stores the others again (within the same deadline), so a bad
   object fails only its own page; an error that names no key (a store that is down) fails
   the run.
5. **Giving up.** A caller cancelled while its pages wait takes them out unstarted; it returns
   once the runs holding its other pages have ended, so no frame is read after its caller
   returned. A page whose ``seal`` raises (a bug, not a lost copy) raises it to its caller.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hicache_store.backends.aio import timeout_at
from hicache_store.backends.base import Backend
from hicache_store.layout.errors import HiCacheStoreError

from . import failures
from .offload import off_loop

log = logging.getLogger(__name__)

#: runs in flight per backend (and loop): enough to keep a device's queue full with large
#: objects and one run's index work overlapping another's writes with small ones; runs handed
#: out are done oldest first by the file backend (``_call_order``).
WINDOW = 8
#: the most bytes and objects of one run (one backend call).
RUN_BYTES = 4 << 20
RUN_OBJECTS = 1024
#: the share of a deadline's floor one run should take at the pace of recent runs: a run
#: larger than the store can write in its deadline would be lost whole where its first pages
#: would have been stored.
RUN_SHARE = 0.25


class Outcome(enum.Enum):
    STORED = "stored"
    LATE = "late"
    FAILED = "failed"


class Budget(Protocol):
    """A limit on bytes in flight (``io.ByteBudget``)."""

    @property
    def limit(self) -> int: ...

    async def acquire(self, nbytes: int) -> int: ...

    async def release(self, taken: int) -> None: ...


class Rule(Protocol):
    """How long a transfer may take (``io.Deadline``)."""

    def seconds(self, nbytes: int) -> float: ...


@dataclass(frozen=True)
class PageOut:
    """One page to write: storage keys and frame buffers (parallel), and ``seal``, which seals
    the frames in place; it is called once, just before the page is stored."""

    keys: Sequence[str]
    buffers: Sequence[memoryview]
    seal: Callable[[], None]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers)


@dataclass(eq=False)
class _Entry:
    page: PageOut
    nbytes: int
    budget: Budget
    rule: Rule
    start_by: float
    done: asyncio.Future[Outcome]
    started: bool = False

    def end(self, outcome: Outcome) -> None:
        if not self.done.done():
            self.done.set_result(outcome)

    def joins(self, run: list[_Entry], nbytes: int, objects: int, cap: int) -> bool:
        """Whether this page may be added to ``run`` (of ``nbytes`` and ``objects`` so far,
        at most ``cap`` bytes)."""
        head = run[0]
        return (
            self.budget is head.budget
            and self.rule == head.rule
            and nbytes + self.nbytes <= min(cap, self.budget.limit)
            and objects + len(self.page.keys) <= RUN_OBJECTS
        )


@dataclass(eq=False)
class WriteQueue:
    """The write queue of one backend on one loop; see the module docstring."""

    backend: weakref.ref[Backend]
    _queue: collections.deque[_Entry] = field(default_factory=collections.deque)
    #: runs in flight, in the order they were handed out: their bytes
    _runs: dict[asyncio.Task[None], int] = field(default_factory=dict)
    #: seconds per byte of recent runs (their own bytes and those of the runs ahead of them);
    #: None until one has ended
    pace: float | None = None

    async def write(
        self, pages: Sequence[PageOut], *, budget: Budget, rule: Rule, start_by: float
    ) -> list[Outcome]:
        """Queue ``pages`` (in order, behind every page queued before them) and wait for
        their outcomes; see the module docstring."""
        loop = asyncio.get_running_loop()
        entries = [
            _Entry(p, p.nbytes, budget, rule, start_by, loop.create_future()) for p in pages
        ]
        self._queue.extend(entries)
        self._pump()
        try:
            if entries:
                await asyncio.wait([e.done for e in entries])
        except asyncio.CancelledError:
            for e in entries:
                if not e.started:
                    e.end(Outcome.LATE)  # taken out: never started (``_take`` skips it)
            await _outlast([e.done for e in entries])
            raise
        return [e.done.result() for e in entries]

    def _pump(self) -> None:
        """Hand out runs while the window has room."""
        while len(self._runs) < WINDOW:
            run = self._take()
            if not run:
                return
            task = asyncio.ensure_future(self._store(run))
            self._runs[task] = sum(e.nbytes for e in run)
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        del self._runs[task]
        if not task.cancelled() and task.exception() is not None:
            log.error("write queue: a run raised", exc_info=task.exception())
        self._pump()

    def _take(self) -> list[_Entry]:
        """The next run: the oldest live pages that go together."""
        now = time.monotonic()
        run: list[_Entry] = []
        nbytes = objects = 0
        while self._queue:
            entry = self._queue[0]
            if entry.done.done():  # its caller gave up
                self._queue.popleft()
                continue
            if now >= entry.start_by:
                self._queue.popleft()
                entry.end(Outcome.LATE)
                continue
            if run and not entry.joins(run, nbytes, objects, self._cap(run[0].rule)):
                break
            self._queue.popleft()
            entry.started = True
            run.append(entry)
            nbytes += entry.nbytes
            objects += len(entry.page.keys)
        return run

    def _cap(self, rule: Rule) -> int:
        """The most bytes of the next run (see the module docstring)."""
        if self.pace is None:
            return 0  # one page
        return min(RUN_BYTES, int(RUN_SHARE * rule.seconds(0) / self.pace))

    async def _store(self, run: list[_Entry]) -> None:
        head = run[0]
        nbytes = sum(e.nbytes for e in run)
        try:
            taken = await head.budget.acquire(nbytes)
            try:
                sealed = []
                now = time.monotonic()
                for entry in run:
                    if now >= entry.start_by:  # the wait for the budget was its queue too
                        entry.end(Outcome.LATE)
                        continue
                    try:
                        await off_loop(entry.nbytes, entry.page.seal)
                    except Exception as exc:
                        entry.done.set_exception(exc)
                    else:
                        sealed.append(entry)
                me = asyncio.current_task()
                ahead = 0
                for task, size in self._runs.items():
                    if task is me:
                        break
                    ahead += size
                own = sum(e.nbytes for e in sealed)
                started = time.monotonic()
                await self._put(sealed, head.rule.seconds(ahead + own))
                if sealed:
                    pace = (time.monotonic() - started) / (ahead + own)
                    self.pace = pace if self.pace is None else (self.pace + pace) / 2
            finally:
                await head.budget.release(taken)
        finally:
            for entry in run:  # (cancelled: the loop is closing)
                entry.end(Outcome.FAILED)

    async def _put(self, run: list[_Entry], seconds: float) -> None:
        backend = self.backend()
        pending = list(run)
        try:
            async with timeout_at(asyncio.get_running_loop().time() + seconds):
                while pending and backend is not None:
                    try:
                        await backend.put(
                            [k for e in pending for k in e.page.keys],
                            [b for e in pending for b in e.page.buffers],
                        )
                    except Exception as exc:
                        key, bad = _holding(pending, exc)
                        if bad is None:
                            objects = sum(len(e.page.keys) for e in pending)
                            first = pending[0].page.keys[0]
                            what = first if objects == 1 else f"{objects} objects, the first {first},"
                            failures.put_failed(backend, what, exc, objects)
                            break
                        failures.put_failed(backend, key, exc, len(bad.page.keys))
                        bad.end(Outcome.FAILED)
                        pending.remove(bad)
                        continue
                    failures.put_stored(backend)
                    for entry in pending:
                        entry.end(Outcome.STORED)
                    return
        except TimeoutError:
            for entry in pending:
                entry.end(Outcome.LATE)
        for entry in pending:
            entry.end(Outcome.FAILED)


def _holding(run: list[_Entry], exc: Exception) -> tuple[str, _Entry | None]:
    """The key ``exc`` names and the page of ``run`` that holds it, when there are others to
    store without it (else None)."""
    key = exc.key if isinstance(exc, HiCacheStoreError) else None
    if key is None or len(run) < 2:
        return "", None
    return key, next((e for e in run if key in e.page.keys), None)


async def _outlast(futures: list[asyncio.Future[Outcome]]) -> None:
    """Wait until every one of ``futures`` is done, whatever cancels the waiting task."""
    while not all(f.done() for f in futures):
        try:
            await asyncio.wait(futures)
        except asyncio.CancelledError:
            continue


_QUEUES: weakref.WeakKeyDictionary[
    Backend, weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WriteQueue]
] = weakref.WeakKeyDictionary()


def queue_of(backend: Backend) -> WriteQueue:
    """``backend``'s write queue on the running loop (made at its first write there)."""
    loop = asyncio.get_running_loop()
    by_loop = _QUEUES.get(backend)
    if by_loop is None:
        by_loop = _QUEUES[backend] = weakref.WeakKeyDictionary()
    queue = by_loop.get(loop)
    if queue is None:
        queue = by_loop[loop] = WriteQueue(weakref.ref(backend))
    return queue
