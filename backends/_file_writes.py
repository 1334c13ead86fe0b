"""The file family's put protocol: ``FileWrites``.

A put is four steps, each a job on the store's pool (``_file_jobs``), every one of them run
for a put that began (a put of one run of writes makes them all in one job, in this order):

1. reserve: the index records the batch as in flight (``ObjectIndex.reserve``) and counts it
   against ``capacity_bytes``; a put whose caller gave up before this step began is never
   begun (nothing reserved, nothing to settle);
2. make room: the index evicts in its order until the batch fits (``make_room``); skipped
   where the reservation found that the batch and the puts before it fit
   (``Reservation.fits``);
3. write: the engine writes each object to a temp file and publishes it by ``rename`` (or
   ``link`` for ``put_if_absent``), in runs of ``FileEngine.write_run``; with
   ``durability=full`` the shard directories are then ``fsync``-ed;
4. settle: the index learns what was stored (``settle_put``), whatever failed before, so it
   stays exact.

A put started from the caller's thread (``start``: ``NativeWrites``) whose engine
``starts_writes``, with ``durability`` other than ``full``, takes these steps apart: the
reservation on the caller's thread; where it fits, the writes on the engine's writer threads,
which never take the GIL (``FileEngine.start_write``); the settle, whatever failed, on the thread
that takes the outcome (``wait`` / ``result``, or the handle's release), before any outcome
is reported. Else (room to make, directories to flush) the put is one pool job as above.

Counters go to the ``BackendStats`` each call is given: evictions, eviction failures, and
refusals by a fleet's index that cannot be reached (``index_refusals``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence

from ._call_order import one_call
from ._file_io import FileEngine, Placement, StartedWrites, WriteOutcome, fsync_dir
from ._file_jobs import FileJobs
from .errors import BackendUnavailableError
from .index import ObjectIndex, Reservation, settle_or_unpublish
from .lifetime import abandonable
from .protocols import PendingWrites
from .types import BackendStats


class FileWrites:
    """The puts of one file store: ``engine`` moves the bytes, ``index`` keeps the count,
    ``jobs`` runs the steps. ``capacity_bytes`` and ``pin_budget_bytes`` bound the index's
    reservations; ``lock`` guards the counters of the stats each call is given."""

    def __init__(self, engine: FileEngine, index: ObjectIndex, places: Placement,
                 jobs: FileJobs, *, io_threads: int, capacity_bytes: int,
                 pin_budget_bytes: int, lock: threading.Lock) -> None:
        self._engine, self._index, self._places, self._jobs = engine, index, places, jobs
        self._io_threads = io_threads
        self._capacity_bytes = capacity_bytes
        self._pin_budget_bytes = pin_budget_bytes
        self._lock = lock

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview],
                  stats: BackendStats) -> None:
        """Reserve (evicting if needed), write, settle: the index stays exact whatever fails.
        Raises the first object's error once every object is written or failed."""
        sizes = [len(view) for view in buffers]
        if self._engine.write_run(len(keys), self._io_threads) >= len(keys):
            # One run of writes: every step in one job on the pool, so a small put (vLLM's
            # secondary tier writes one job's rows per put) waits for one thread hand-off,
            # not one per step (each a wait for the GIL behind a busy engine loop). Not
            # begun when the caller has given up by then (``run_io``: abandonable).
            together = await self._jobs.run_io(self._put_steps, keys, buffers, sizes, stats)
            self._engine.account(stats)
            for outcome in together:
                if isinstance(outcome, BaseException):
                    raise outcome
            return
        # Not begun when the caller has given up by then (``abandonable``): nothing reserved,
        # nothing to settle, no transaction spent on a put nobody waits for.
        reservation = await self._reserve(keys, sizes, stats, abandon=True)
        outcomes: list[WriteOutcome] = []
        try:
            if not reservation.fits:
                await self._make_room(reservation, stats)
            outcomes = await self._write_batch(keys, buffers, stats)
            if self._places.durability == "full" and any(o is True for o in outcomes):
                dirs = sorted({self._places.shard_dir(k)
                               for k, o in zip(keys, outcomes, strict=True) if o is True})
                await self._jobs.call("put", _fsync_dirs, dirs)
        finally:
            await self._settle("put", reservation,
                               [k for k, o in zip(keys, outcomes, strict=False) if o is True])
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def start(self, keys: Sequence[str], buffers: Sequence[memoryview], start_by: float,
              counted: Callable[[], None], stats: BackendStats) -> PendingWrites:
        """``put`` handed over from the caller's thread (no event loop), begun only by
        ``start_by``. With an engine that ``starts_writes`` and ``durability`` other than
        ``full``, and where the reservation (made here) fits: the writes on a thread of their
        own, the settle on the thread that takes the outcome (``_ThreadWrites``). Else one job
        on the pool: ``_put_steps``."""
        # Why not a pool job: timed inside the bench's tier store jobs (one 516 KiB row each,
        # beside vLLM's busy scheduler thread), a pool job waited a median 0.7 ms (mean 3.5)
        # for the GIL to begin, and its C write 1.0 (mean 2.6) including the wait to take
        # the GIL back; the reservation and the settle took 0.4 ms each, the seal 0.1. A
        # thread that never takes the GIL waits for neither. (docs/benchmarks/log.md)
        if not self._engine.starts_writes or self._places.durability == "full":
            return self._start_on_pool(keys, buffers, start_by, counted, stats, None)
        sizes = [len(b) for b in buffers]
        try:
            reservation = self._jobs.translated("put", None, self._index.reserve, keys, sizes,
                                                self._capacity_bytes, self._pin_budget_bytes)
        except BackendUnavailableError as exc:
            self._count_refusal(exc, stats)
            raise
        if not reservation.fits:  # eviction may remove many files: the pool's job, as before
            return self._start_on_pool(keys, buffers, start_by, counted, stats, reservation)
        try:
            writes = self._engine.start_write(keys, buffers, start_by)
        except BaseException:
            self._settle_now(reservation, [])
            raise
        return _ThreadWrites(counted, writes, lambda published: self._settle_now(
            reservation, published), lambda: self._engine.account(stats))

    def _settle_now(self, reservation: Reservation, published: Sequence[str]) -> None:
        self._jobs.translated("put", None, settle_or_unpublish, self._index, reservation,
                              published)

    def _start_on_pool(self, keys: Sequence[str], buffers: Sequence[memoryview],
                       start_by: float, counted: Callable[[], None], stats: BackendStats,
                       reservation: Reservation | None) -> PendingWrites:
        pending = _PoolWrites(counted)
        try:
            with one_call():  # (ordered behind the pool's calls begun before it, as ``put``)
                pending.future = self._jobs.pool.submit(self._put_started, pending, start_by,
                                                        keys, buffers, stats, reservation)
        except BaseException:  # (a pool shut down): nothing written, nothing left reserved
            if reservation is not None:
                self._settle_now(reservation, [])
            raise
        return pending

    def _put_started(self, pending: _PoolWrites, start_by: float, keys: Sequence[str],
                     buffers: Sequence[memoryview], stats: BackendStats,
                     reservation: Reservation | None) -> None:
        try:
            pending.begin(start_by)
        except TimeoutError:
            if reservation is not None:  # reserved by the caller: released, nothing written
                self._settle_now(reservation, [])
            raise
        try:
            outcomes = self._put_steps(keys, buffers, [len(b) for b in buffers], stats,
                                       reservation)
        finally:
            self._engine.account(stats)
            pending.ended = time.monotonic()
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def _put_steps(self, keys: Sequence[str], buffers: Sequence[memoryview],
                   sizes: Sequence[int], stats: BackendStats,
                   reservation: Reservation | None = None) -> list[WriteOutcome]:
        """``put``'s steps on one pool thread, in their order: reserve (unless given the
        ``reservation``), make room where the reservation did not find it, write and publish,
        flush directories, settle (whatever failed). Per key True or the error its write
        raised."""
        translated = self._jobs.translated
        if reservation is None:
            try:
                reservation = translated("put", None, self._index.reserve, keys, sizes,
                                         self._capacity_bytes, self._pin_budget_bytes)
            except BackendUnavailableError as exc:
                self._count_refusal(exc, stats)
                raise
        outcomes: list[WriteOutcome] = []
        try:
            if not reservation.fits:
                counts = translated("put", None, self._index.make_room, self._capacity_bytes,
                                    reservation)
                with self._lock:
                    stats.evictions += counts.evicted
                    stats.eviction_failures += counts.failed
            outcomes = self._engine.write(keys, buffers)
            if self._places.durability == "full" and any(o is True for o in outcomes):
                translated("put", None, _fsync_dirs, sorted({
                    self._places.shard_dir(k) for k, o in zip(keys, outcomes, strict=True)
                    if o is True}))
        finally:
            translated("put", None, settle_or_unpublish, self._index, reservation,
                       [k for k, o in zip(keys, outcomes, strict=False) if o is True])
        return outcomes

    async def put_if_absent(self, key: str, buffer: memoryview, stats: BackendStats) -> bool:
        """One object, published only where no object of ``key`` is (``link`` refuses an
        existing name: atomic across threads and processes); whether it was."""
        reservation = await self._reserve([key], [len(buffer)], stats)
        wrote = False
        try:
            if not reservation.fits:
                await self._make_room(reservation, stats)
            wrote = bool(await self._jobs.run_io(self._engine.write_exclusive, key, buffer))
            self._engine.account(stats)
            if wrote and self._places.durability == "full":
                await self._jobs.run(fsync_dir, self._places.shard_dir(key))
        finally:
            await self._settle("put_if_absent", reservation, [key] if wrote else [])
        return wrote

    async def _reserve(self, keys: Sequence[str], sizes: Sequence[int], stats: BackendStats,
                       *, abandon: bool = False) -> Reservation:
        """The index's reservation of a put (``abandon``: not begun once its caller gave up);
        a refusal because a fleet's index cannot be reached is counted
        (``stats.index_refusals``; the index logs an outage once)."""
        translated = self._jobs.translated
        step: Callable[..., Reservation] = abandonable(translated) if abandon else translated
        try:
            return await self._jobs.run(step, "put", None, self._index.reserve, keys, sizes,
                                        self._capacity_bytes, self._pin_budget_bytes)
        except BackendUnavailableError as exc:
            self._count_refusal(exc, stats)
            raise

    def _count_refusal(self, exc: BackendUnavailableError, stats: BackendStats) -> None:
        """A reservation refused because a fleet's index cannot be reached is counted."""
        if exc.backend == "index":
            with self._lock:
                stats.index_refusals += 1

    async def _settle(self, operation: str, reservation: Reservation,
                      published: Sequence[str]) -> None:
        """Step 4 (``settle_or_unpublish``: a refused settle removes what it published)."""
        await self._jobs.call(operation, settle_or_unpublish, self._index, reservation,
                              published)

    async def _make_room(self, reservation: Reservation, stats: BackendStats) -> None:
        counts = await self._jobs.call("put", self._index.make_room, self._capacity_bytes,
                                       reservation)
        with self._lock:
            stats.evictions += counts.evicted
            stats.eviction_failures += counts.failed

    async def _write_batch(self, keys: Sequence[str], buffers: Sequence[memoryview],
                           stats: BackendStats) -> list[WriteOutcome]:
        """Write and publish each object; per key True (published) or the error it raised:
        jobs of the engine's runs (``FileEngine.write_run``)."""
        per_job = self._engine.write_run(len(keys), self._io_threads)
        starts = range(0, len(keys), per_job)
        runs = [self._jobs.run_io(self._engine.write, keys[i : i + per_job],
                                  buffers[i : i + per_job])
                for i in starts]
        out: list[WriteOutcome] = []
        ended = await asyncio.gather(*runs, return_exceptions=True)
        for start, run in zip(starts, ended, strict=True):
            count = len(keys[start : start + per_job])
            # A job that failed as a whole failed each of its objects.
            out.extend([run] * count if isinstance(run, BaseException) else run)
        self._engine.account(stats)
        return out


class _PoolWrites(PendingWrites):
    """A put run as one job of the store's pool (``FileWrites.start``)."""

    future: concurrent.futures.Future[None]

    def begin(self, start_by: float) -> None:
        """On the pool thread, before anything is reserved: late, never begun."""
        now = time.monotonic()
        if now > start_by:
            raise TimeoutError("put not begun by its deadline")
        self.began = now

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        concurrent.futures.wait([self.future])

    def _result(self) -> None:
        self.future.result()


class _ThreadWrites(PendingWrites):
    """A put whose writes run on a thread of their own (``FileEngine.start_write``); the
    reservation is settled, once, by the first ``wait`` or ``result`` (or when the handle is
    dropped), on that caller's thread: before any outcome is taken, so a put is never
    reported stored before the index counts it. ``ended`` is when the writes ended (their
    objects published)."""

    def __init__(self, counted: Callable[[], None], writes: StartedWrites,
                 settle: Callable[[Sequence[str]], None], account: Callable[[], None]) -> None:
        super().__init__(counted)
        self._writes, self._settle, self._account = writes, settle, account
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._finished = False

    def done(self) -> bool:
        return self._finished or self._writes.done()

    def wait(self) -> None:
        with self._lock:
            if self._finished:
                return
            outcomes, self.began, self.ended = self._writes.wait()
            self._account()
            published = [k for k, o in zip(self._writes.keys, outcomes, strict=True) if o is True]
            self._finished = True
            try:
                self._settle(published)
            except BaseException as exc:  # (settle_or_unpublish removed what it published)
                self._error = exc
                return
            if self.began is None:
                self._error = TimeoutError("put not begun by its deadline")
                return
            self._error = next((o for o in outcomes if isinstance(o, BaseException)), None)

    def _result(self) -> None:
        self.wait()
        if self._error is not None:
            raise self._error

    def __del__(self) -> None:
        if not self._finished:  # dropped untaken: its reservation is still settled
            with contextlib.suppress(Exception):
                self.wait()


def _fsync_dirs(paths: Sequence[str]) -> None:
    for path in paths:
        fsync_dir(path)


__all__ = ["FileWrites"]
