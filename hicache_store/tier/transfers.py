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

from hicache_store.objects import IOStats, L3Link

if TYPE_CHECKING:
    from .radix import Held, PageNode

log = logging.getLogger(__name__)

#: L3 backups written concurrently in one batch of the backup worker.
BACKUP_BATCH = 16


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
        stopping at the first that fails."""

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

        async def run() -> None:
            try:
                await asyncio.gather(*(one(f) for f in op.extra))
                failed = False
                for fetch in op.kv:
                    ok = False if failed else await read(fetch)
                    failed = failed or not ok  # past a failure no page extends the prefix
                    finish(fetch, ok)
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

    async def _worker(self, links: dict[int, L3Link]) -> None:
        """Drain the backup queue in FIFO batches, one batch at a time.

        Objects of a batch are written concurrently; a chained object's write starts only
        after its parent's succeeded (and is skipped if the parent's failed), so what this
        instance writes to L3 of a chain is always a prefix of it. Outcomes go to
        ``held.write_ok`` (chained objects; touched only here) and to ``acks``, in queue order.
        """
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), BACKUP_BATCH))]
            tasks: dict[tuple[int, int], asyncio.Task[bool]] = {}
            ios = [IOStats() for _ in batch]

            async def write(
                item: BackupItem,
                io: IOStats,
                tasks: dict[tuple[int, int], asyncio.Task[bool]] = tasks,
            ) -> bool:
                parent = item.node.parent
                if item.chained and parent is not None and parent.depth >= 0:
                    above = parent.held(item.tag)
                    if above is None or not above.in_l3:
                        before = tasks.get((item.tag, id(parent)))
                        parent_ok = (
                            await before
                            if before is not None
                            else above is not None and above.write_ok
                        )
                        if not parent_ok:
                            return False
                try:
                    return await links[item.tag].write_page(
                        item.node.page_hash, item.row, io, item.parent_hash
                    )
                except Exception:
                    # write_page reports failures as False; anything else is a bug below it.
                    # It is logged and the backup counted as failed (``backups_l3_failed``).
                    log.warning(
                        "L3 backup of %s (component %d) raised", item.node.page_hash[:16],
                        item.tag, exc_info=True,
                    )
                    return False

            keys = [(i.tag, id(i.node)) if i.chained else (i.tag, -id(i)) for i in batch]
            for item, io, key in zip(batch, ios, keys, strict=True):
                tasks[key] = asyncio.ensure_future(write(item, io))
            for item, io, key in zip(batch, ios, keys, strict=True):
                ok = await tasks[key]
                if item.chained:
                    item.held.write_ok = ok
                self.acks.append(BackupDone(item.node, item.tag, ok, io))
