"""The tier's L2 <-> L3 transfers: prefetches, backups, and their typed completions.

One transfer path for every component: a prefetch reads the KV pages of a request's prefix (in
order; past a failed page none can extend the prefix) and the component objects its resume
needs, each into a host row of its component's pool, through that component's ``L3Link``
(``hicache_store.objects``); a backup writes a host row to L3 the same way. Transfers run on
the sync bridge's loop; what they finish is reported to the engine's thread as typed records
on a queue (``BackupDone``, ``ReadEnded``) that the tier applies in ``poll``, in FIFO order.

Row lifetime: a fetch's row is returned to its pool only once its read has ended
(``done`` set); a fetch the engine stops waiting for is *abandoned* and its row is returned by
``ReadEnded`` when the read ends, never earlier (the backend contract makes "ended" mean no I/O
into the row is in flight).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hicache_store.backends.lifetime import gather_settled
from hicache_store.objects import IOStats, L3Link, PageWrite

if TYPE_CHECKING:
    from .radix import Held, PageNode

log = logging.getLogger(__name__)

#: L3 backup writes (runs) in flight at once in one batch of the backup worker.
BACKUP_BATCH = 16
#: Pages of one chain moved by one backend call (a run: ``L3Link.write_pages`` for backups,
#: ``L3Link.read_prefix`` for prefetches), and the most row bytes a run holds. Per-object
#: costs (a backend call, a budget wait, on the file backend an index update and a settle)
#: dominate for small pages, so they are paid once per run; past a few MiB the bytes dominate
#: and a longer run would only delay its first page.
RUN_PAGES = 64
RUN_BYTES = 4 << 20


@dataclass(frozen=True)
class BackupEvent:
    """A finished L3 backup of one object: the page, the component (``"kv"`` for KV) and
    whether it is stored. What ``HiCache.drain_events`` returns."""

    page_hash: str
    component: str
    ok: bool


@dataclass
class Fetch:
    """One object a prefetch reads: component ``tag``'s object of page ``index`` of the request
    into host row ``row`` (-1 once the row is back in its pool). ``done``: the read's outcome
    once it ended; ``abandoned``: the engine no longer waits for it."""

    tag: int
    index: int
    page_hash: str
    row: int
    done: bool | None = None
    abandoned: bool = False


@dataclass
class Prefetch:
    """An L3 -> L2 read of a request's KV pages ``kv`` (consecutive, from the first page not in
    memory: the prefix-closed chain, read in order) and component objects ``extra``."""

    kv: list[Fetch]
    extra: list[Fetch]
    finished: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future[None] | None = None
    io: IOStats = field(default_factory=IOStats)
    settled: bool = False

    def completed_prefix(self) -> int:
        """KV pages read, from the first, up to the first that is not (yet) read."""
        for i, fetch in enumerate(self.kv):
            if fetch.done is not True:
                return i
        return len(self.kv)

    def fetches(self) -> list[Fetch]:
        return [*self.kv, *self.extra]

    def retired(self) -> bool:
        """Settled, every read ended, and every row is back in its pool or owned by the tree."""
        return self.settled and self.finished.is_set() and all(f.row < 0 for f in self.fetches())


@dataclass(frozen=True)
class BackupDone:
    """The backup worker finished writing ``node``'s object of component ``tag``."""

    node: PageNode
    tag: int
    ok: bool
    io: IOStats


@dataclass(frozen=True)
class ReadEnded:
    """An abandoned fetch's read ended: its row may go back to its pool."""

    prefetch: Prefetch
    fetch: Fetch


Completion = BackupDone | ReadEnded


@dataclass(frozen=True)
class BackupItem:
    """One object to back up: ``node``'s copy ``held`` of component ``tag``, from its host
    ``row`` (a numpy view, locked by the node until the completion is applied). ``chained``:
    the component's pools are prefix-closed, so the write waits for its parent's (and is
    skipped if that failed): what this instance writes of a chain is a prefix of it."""

    node: PageNode
    tag: int
    held: Held
    row: Any
    parent_hash: str | None
    chained: bool


class Transfers:
    """Starts prefetches and backups on the bridge loop; completions go to ``acks`` (a
    thread-safe deque the engine thread drains)."""

    def __init__(self, submit: Callable[[Any], concurrent.futures.Future[Any]]) -> None:
        self._submit = submit
        self.acks: collections.deque[Completion] = collections.deque()
        self._queue: collections.deque[BackupItem] = collections.deque()
        self._lock = threading.Lock()
        self._running = False
        self.in_flight = 0  # backups queued or running (engine thread's count)

    # -- prefetch ---------------------------------------------------------------------------

    def start_prefetch(
        self,
        op: Prefetch,
        links: dict[int, L3Link],
        rows: Callable[[Fetch], Any],
    ) -> None:
        """Read ``op``'s objects: component objects concurrently, then the KV pages in order,
        in runs (``L3Link.read_prefix``: one backend call per run of small pages), stopping at
        the first that fails."""

        def finish(fetch: Fetch, ok: bool) -> None:
            # Set the outcome, then look at abandonment: the engine thread does the opposite
            # (``abandon``), so every abandoned row is returned exactly once (the tier's
            # release is idempotent: row -1).
            fetch.done = ok
            if fetch.abandoned:
                self.acks.append(ReadEnded(op, fetch))

        async def read(fetch: Fetch) -> bool:
            if fetch.abandoned:
                return False
            return await links[fetch.tag].read_page(fetch.page_hash, rows(fetch), op.io)

        async def one(fetch: Fetch) -> None:
            finish(fetch, await read(fetch))

        async def read_run(run: list[Fetch]) -> int:
            if run[0].abandoned:
                return 0
            link = links[run[0].tag]
            return await link.read_prefix(
                [f.page_hash for f in run], [rows(f) for f in run], op.io
            )

        async def run() -> None:
            try:
                # settled: a failed read ends the prefetch only once its siblings stopped
                # writing into their rows
                await gather_settled(*(one(f) for f in op.extra))
                failed = False
                for chunk in _runs(op.kv, rows(op.kv[0]).nbytes if op.kv else 0):
                    read = 0 if failed else await read_run(chunk)
                    failed = read < len(chunk)  # past a failure no page extends the prefix
                    for i, fetch in enumerate(chunk):
                        finish(fetch, i < read)
            finally:
                op.finished.set()

        op.future = self._submit(run())

    # -- backups ----------------------------------------------------------------------------

    def queue_backups(self, items: Sequence[BackupItem], links: dict[int, L3Link]) -> None:
        """Queue L3 backups; each one's ``BackupDone`` comes back in FIFO order."""
        self.in_flight += len(items)
        with self._lock:
            self._queue.extend(items)
            if not self._running:
                self._running = True
                self._submit(self._worker(links))

    def _take_batch(self) -> list[list[BackupItem]] | None:
        """The next batch from the queue, as runs (``_extends``), at most ``BACKUP_BATCH``
        runs of at most ``RUN_PAGES`` items; None (the worker stops) when the queue is
        empty."""
        with self._lock:
            if not self._queue:
                self._running = False
                return None
            runs: list[list[BackupItem]] = []
            while self._queue:
                item = self._queue[0]
                if runs and _extends(runs[-1], item):
                    runs[-1].append(item)
                elif len(runs) < BACKUP_BATCH:
                    runs.append([item])
                else:
                    break
                self._queue.popleft()
            return runs

    async def _worker(self, links: dict[int, L3Link]) -> None:
        """Drain the backup queue in FIFO batches, one batch at a time.

        A batch's runs are written concurrently, each run's pages in one backend call
        (``L3Link.write_pages``: the per-object costs of small pages paid once per run). A
        chained run starts only after its first page's parent was written (and is skipped if
        that failed), and a run is stored or not as a whole, so what this instance writes to
        L3 of a chain is always a prefix of it. Outcomes go to ``held.write_ok`` (chained
        objects; touched only here) and to ``acks``, in queue order.
        """
        while (runs := self._take_batch()) is not None:
            tasks: dict[tuple[int, int], asyncio.Task[bool]] = {}
            ios = [IOStats() for _ in runs]

            async def write(
                run: list[BackupItem],
                io: IOStats,
                tasks: dict[tuple[int, int], asyncio.Task[bool]] = tasks,
            ) -> bool:
                first = run[0]
                parent = first.node.parent
                if first.chained and parent is not None and parent.depth >= 0:
                    above = parent.held(first.tag)
                    if above is None or not above.in_l3:
                        before = tasks.get((first.tag, id(parent)))
                        parent_ok = (
                            await before
                            if before is not None
                            else above is not None and above.write_ok
                        )
                        if not parent_ok:
                            return False
                link = links[first.tag]
                try:
                    if len(run) == 1:
                        return await link.write_page(
                            first.node.page_hash, first.row, io, first.parent_hash
                        )
                    return await link.write_pages(
                        [PageWrite(i.node.page_hash, i.row, i.parent_hash) for i in run], io
                    )
                except Exception:
                    # The writes report failures as False; anything else is a bug below them.
                    # It is logged and the run's backups counted as failed
                    # (``backups_l3_failed``).
                    log.warning(
                        "L3 backup of %d page(s) from %s (component %d) raised", len(run),
                        first.node.page_hash[:16], first.tag, exc_info=True,
                    )
                    return False

            started = [asyncio.ensure_future(write(run, io)) for run, io in zip(runs, ios, strict=True)]
            for run, task in zip(runs, started, strict=True):
                for item in run:  # a chained run answers for every node in it
                    if item.chained:
                        tasks[(item.tag, id(item.node))] = task
            for run, io, task in zip(runs, ios, started, strict=True):
                ok = await task
                for n, item in enumerate(run):
                    if item.chained:
                        item.held.write_ok = ok
                    # The run's bytes are reported once, with its first page.
                    self.acks.append(BackupDone(item.node, item.tag, ok, io if n == 0 else IOStats()))


def _extends(run: list[BackupItem], item: BackupItem) -> bool:
    """Whether ``item`` continues ``run``: chained items of one component, each the child of
    the one before, up to ``RUN_PAGES`` of them and ``RUN_BYTES`` of rows."""
    last = run[-1]
    return (
        item.chained
        and last.chained
        and item.tag == last.tag
        and item.node.parent is last.node
        and len(run) < RUN_PAGES
        and (len(run) + 1) * item.row.nbytes <= RUN_BYTES
    )


def _runs(fetches: list[Fetch], row_bytes: int) -> list[list[Fetch]]:
    """``fetches`` (a prefetch's KV pages, rows of ``row_bytes`` each) cut into runs of at
    most ``RUN_PAGES`` pages and ``RUN_BYTES`` of rows."""
    size = max(1, min(RUN_PAGES, RUN_BYTES // max(1, row_bytes)))
    return [fetches[i : i + size] for i in range(0, len(fetches), size)]
