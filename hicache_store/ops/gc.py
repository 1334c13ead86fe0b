"""Garbage collection of a shared store at any size: the library behind ``hicache-store gc``.

gc works on whole *pages* (every object sharing a page hash) and on chains: each object header
names its page's parent (``layout.framing``), and gc only ever deletes a chain's current tail (a
page none of whose children is stored), so a cached prefix is shortened from its end, never
holed. In order:

0. with ``retired`` tenant key ids (``--tenant-key-file F --remove-retired``), every tail whose
   header names one of them, repeatedly, whatever its age (headers carry key ids: no secret is
   needed, and no other tenant's or plain object is touched);
1. tails whose newest object is older than ``max_age``, repeatedly;
2. then, while the rest exceeds ``max_bytes``, the oldest tails (ties: page hash order).

Objects without a modification time are never aged out, and for the byte budget their pages go
after every dated page. Namespace manifests (``M_...``) are never deleted. A page's parent comes
from one of its objects' headers (the next object's when one is corrupt, unreadable or gone);
pages with no readable header, and bare objects without headers, are chains of their own.

Guarantees:

- **Bounded memory**: the listing streams (``Backend.list_entries``) into an on-disk working set
  (SQLite) in ``state_dir``; memory is a few batches plus ``CACHE_MIB``; disk about 100 bytes per
  object while a run lasts.
- **Resumable**: a run interrupted and started again with the same options resumes at its phase
  (scan -> parents -> plan -> delete); other options start over; ``fresh=True`` starts over
  keeping ``parents.sqlite``, which outlives runs (a page's parent never changes). Two runs never
  share a state directory (a lock file).
- **Deleting in order**: children before parents, ``DELETE_CHUNK`` objects per call; after a
  failed call the store is asked what is left, and the failed pages' ancestors stay (``kept``).
- **Most of the store**: with ``refuse_above``, a plan that would delete more than that share of
  the scanned objects or bytes raises ``GcRefusedError`` before the first delete, saying how
  much; its plan is kept for the confirmed run.
- **Holds** (``backends.retention``): on a backend that declares ``capabilities.retention``, a
  page with a held object is never a tail, so its ancestors stay; deletions go through
  ``Backend.delete_until_held``, one page a group, children first, so a page pinned at any moment
  after the scan is kept (``kept``), and so are its ancestors. The report counts ``held`` and
  ``held_pages``, a dry run too.
- A header read that fails because the store is down stops the run with the error, resumable.

Why gc is built this way (chains, what a run sees, S3's unordered deletes):
docs/design/gc.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import heapq
import json
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hicache_store.backends import Backend, BackendError, reads_not_counted
from hicache_store.backends.lifetime import gather_settled
from hicache_store.backends.types import ObjectStat
from hicache_store.layout.errors import CorruptObjectError, HiCacheStoreError
from hicache_store.layout.framing import ObjectHeader
from hicache_store.objects import ObjectIO

from .progress import human_bytes

#: keys per ``delete`` call.
DELETE_CHUNK = 1000
#: headers per backend call, and headers in flight at once (also recorded per transaction).
HEADER_BATCH = 512
HEADER_READS_IN_FLIGHT = 2048
#: listed objects per SQLite transaction, and tails taken per planning query.
SCAN_BATCH = 20_000
PLAN_BATCH = 4096
#: SQLite page cache per database file (the working set and the parent cache).
CACHE_MIB = 16
#: the share of a store's objects or bytes past which the CLI asks for ``--yes``
#: (``collect_garbage(refuse_above=...)``): a mistyped budget or age must not empty a store.
MOST_OF_THE_STORE = 0.5
#: the working set's schema; a state from another version is discarded.
STATE_VERSION = 3

#: ``progress(phase, done, total)``; ``total`` is None while unknown (the listing).
ProgressFn = Callable[[str, int, "int | None"], None]

_EXPIRED, _OVER_BUDGET, _RETIRED = 1, 2, 3
_DELETED, _FAILED, _KEPT = 1, 2, 3


class GcError(HiCacheStoreError):
    """gc cannot run: its state directory is busy or unusable, or the store failed."""


class GcRefusedError(GcError):
    """A plan would delete more than ``refuse_above`` of the store (``collect_garbage``):
    nothing was deleted. ``planned`` / ``planned_bytes`` is what the plan deletes,
    ``stored`` / ``stored_bytes`` the store it scanned (manifests aside: never deleted)."""

    def __init__(self, message: str, *, planned: int, planned_bytes: int, stored: int,
                 stored_bytes: int) -> None:
        super().__init__(message)
        self.planned, self.planned_bytes = planned, planned_bytes
        self.stored, self.stored_bytes = stored, stored_bytes


#: why a key prefix is refused (``collect_garbage`` and ``hicache-store gc --prefix``).
PREFIX_REFUSED = (
    "a key prefix is refused: keys start with their page's hash, so a prefix selects pages "
    "out of their chains, gc cannot see their children, and it would delete pages in the "
    "middle of chains (every chain it touches holed); bound the whole store (an S3 prefix "
    "belongs in the URL: s3://bucket/prefix)"
)


def is_manifest(key: str) -> bool:
    """Namespace manifests (``M_{digest}``, see ``hicache_store.ops.manifest``) are not KV:
    gc never deletes them."""
    return key.startswith("M_")


def page_of(key: str) -> str:
    """The page a key belongs to: its page hash (the part before the first ``_``)."""
    return key.split("_", 1)[0]


@dataclass(frozen=True)
class GcPolicy:
    """What to delete. ``max_bytes`` / ``max_age`` (seconds) None: that rule is off;
    ``retired`` empty: no page goes for its sealing key."""

    max_bytes: int | None = None
    max_age: float | None = None
    prefix: str = ""
    dry_run: bool = False
    #: tenant key ids whose objects go first, whatever their age (``--remove-retired``).
    retired: frozenset[str] = frozenset()


@dataclass
class GcReport:
    """What a run saw and did (a resumed run reports the whole run, not only its last part).

    Object counts are objects; ``*_pages`` count pages. ``undated`` objects have no mtime and
    were never aged out; ``held`` objects were pinned or retained at the scan (their pages are
    never deleted). ``failures`` counts the objects of pages whose deletion failed;
    ``kept_pages`` were planned but stayed because a child's deletion failed. ``seconds``
    holds each phase's wall time in this process.
    """

    scanned: int = 0
    scanned_bytes: int = 0
    pages: int = 0
    manifests: int = 0
    undated: int = 0
    held: int = 0
    held_pages: int = 0
    retired: int = 0
    retired_pages: int = 0
    expired: int = 0
    expired_pages: int = 0
    over_budget: int = 0
    over_budget_pages: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    failures: int = 0
    kept_pages: int = 0
    headers_read: int = 0
    headers_cached: int = 0
    headers_unreadable: int = 0
    dry_run: bool = False
    resumed_from: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def doomed(self) -> int:
        """Objects the plan deletes (or would delete, in a dry run)."""
        return self.retired + self.expired + self.over_budget

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "doomed": self.doomed}


class GcState:
    """The on-disk working set of one gc run, and the parent cache that outlives runs.

    ``run.sqlite``: the run's options and phase (table ``meta``), the objects listed
    (``objects``), one row per page with its size, newest mtime, parent, number of stored
    children and place in the plan (``pages``). Removed when a run completes.
    ``parents.sqlite``: page -> parent ('' for a first page) for every header ever decoded.
    """

    def __init__(self, directory: Path | None) -> None:
        """Open (or create) the state in ``directory``; None keeps it in memory (for inputs
        that are in memory already: ``plan_gc``)."""
        self.directory = directory
        self._lock_fd: int | None = None
        if directory is None:
            self.db = sqlite3.connect(":memory:", isolation_level=None)
            self.db.execute("ATTACH DATABASE ':memory:' AS cache")
        else:
            self._lock(directory)
            self.db = sqlite3.connect(directory / "run.sqlite", isolation_level=None)
            self.db.execute("ATTACH DATABASE ? AS cache", (str(directory / "parents.sqlite"),))
            for schema in ("main", "cache"):
                self.db.execute(f"PRAGMA {schema}.journal_mode=WAL")
                self.db.execute(f"PRAGMA {schema}.synchronous=NORMAL")
                self.db.execute(f"PRAGMA {schema}.cache_size={-CACHE_MIB * 1024}")
            self.db.execute("PRAGMA temp_store=FILE")  # sorts spill to disk, not to memory
        self.db.executescript(
            """
            CREATE TABLE IF NOT EXISTS cache.parents (
                page TEXT PRIMARY KEY, parent TEXT NOT NULL, key_id TEXT) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            """
        )

    def _lock(self, directory: Path) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise GcError(f"cannot use gc state directory {directory}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GcError(f"another gc is running with state directory {directory}") from None
        self._lock_fd = fd

    # -- meta -----------------------------------------------------------------------------------

    def get(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set(self, key: str, value: object) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, str(value)))

    def add(self, key: str, amount: int) -> None:
        self.set(key, int(self.get(key) or 0) + amount)

    def reset(self, options: str, started: float) -> None:
        """Forget any previous run (the parent cache stays) and start one."""
        self.db.executescript(
            """
            DROP TABLE IF EXISTS objects; DROP TABLE IF EXISTS pages; DELETE FROM meta;
            CREATE TABLE objects (page TEXT NOT NULL, tail TEXT NOT NULL,
                                  size INTEGER NOT NULL, mtime REAL,
                                  held INTEGER NOT NULL DEFAULT 0);
            """
        )
        self.set("version", STATE_VERSION)
        self.set("options", options)
        self.set("started", repr(started))
        self.set("phase", "scan")

    def close(self, *, finished: bool) -> None:
        """Close; ``finished`` removes the run (the parent cache stays)."""
        self.db.close()
        if finished and self.directory is not None:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / f"run.sqlite{suffix}")
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def scalar(self, sql: str, *args: Any) -> int:
        row = self.db.execute(sql, args).fetchone()
        return int(row[0] or 0) if row is not None else 0


def default_state_dir(url: str, prefix: str = "") -> Path:
    """Where the CLI keeps a store's gc state: under ``$XDG_CACHE_HOME`` (``~/.cache``), one
    folder per store URL and prefix (a digest: credentials in a URL never reach a path)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(f"{url}\0{prefix}".encode()).hexdigest()[:20]
    return base / "hicache-store" / "gc" / digest


async def collect_garbage(
    backend: Backend,
    *,
    max_bytes: int | None,
    max_age: float | None,
    prefix: str = "",
    dry_run: bool = False,
    now: float | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    progress: ProgressFn | None = None,
    fresh: bool = False,
    retired: frozenset[str] = frozenset(),
    refuse_above: float | None = None,
) -> GcReport:
    """Scan, plan and (unless ``dry_run``) delete; see the module docstring.

    ``refuse_above`` (a share, e.g. ``MOST_OF_THE_STORE``): a plan that would delete more
    than that share of the store's objects or of its bytes raises ``GcRefusedError`` before
    anything is deleted (the plan stays in ``state_dir``: a run with the same options and no
    bound resumes at the deletion). The CLI sets it unless ``--yes``.

    ``now`` (default: the time the run started) is what ages are measured from.
    ``state_dir`` holds the working set and makes the run resumable; None uses a temporary
    directory removed afterwards (no resume, no parent cache); ``fresh`` discards an
    interrupted run instead of resuming it; ``retired``: tenant key ids whose pages go
    first (module docstring). Failed deletions are counted,
    not raised. Raises ``GcError`` (state directory busy or unusable; a header read failed;
    a non-empty ``prefix``: ``PREFIX_REFUSED``) and the backend's errors from listing.
    """
    if prefix:
        raise GcError(PREFIX_REFUSED)
    policy = GcPolicy(max_bytes, max_age, prefix, dry_run, frozenset(retired))
    # gc's header reads are not uses: counted, they would make every page it read look just
    # used (the file backend's listed mtime), so the next run would age nothing out.
    with reads_not_counted():
        if state_dir is None:
            scratch = tempfile.mkdtemp(prefix="hicache-gc-")
            try:
                return await _collect(backend, policy, Path(scratch), now, progress, fresh,
                                      refuse_above)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        return await _collect(backend, policy, Path(state_dir), now, progress, fresh,
                              refuse_above)


async def _collect(
    backend: Backend, policy: GcPolicy, directory: Path, now: float | None,
    progress: ProgressFn | None, fresh: bool, refuse_above: float | None,
) -> GcReport:
    state = GcState(directory)
    finished = False
    try:
        report = GcReport(dry_run=policy.dry_run)
        options = json.dumps({**asdict(policy), "retired": sorted(policy.retired), "now": now},
                             sort_keys=True)
        phase = state.get("phase")
        if (fresh or phase is None or state.get("options") != options
                or state.get("version") != str(STATE_VERSION) or phase == "scan"):
            state.reset(options, time.time() if now is None else now)
        else:
            report.resumed_from = phase
        started = float(state.get("started") or 0.0)
        step = _Steps(state, report, progress)
        if state.get("phase") == "scan":
            await step.timed("scan", _scan(backend, state, policy.prefix, step.tick("scan")))
            state.set("phase", "pages")
        if state.get("phase") == "pages":
            step.timed_sync("pages", lambda: _group_pages(state))
            state.set("headers_cached",
                      state.scalar("SELECT count(*) FROM pages WHERE parent_known = 1"))
            state.set("phase", "parents")
        if state.get("phase") == "parents":
            if _could_delete(state, policy, started):
                await step.timed("parents", _read_parents(backend, state, step.tick("parents")))
            state.set("phase", "plan")
        if state.get("phase") == "plan":
            step.timed_sync("plan", lambda: _plan(state, policy, started))
            state.set("phase", "delete")
        if state.get("phase") == "delete":
            if not policy.dry_run:
                if refuse_above is not None:
                    _refuse_most_of_the_store(state, refuse_above)
                await step.timed("delete", _delete(backend, state, step.tick("delete")))
            _prune_parent_cache(state)
            state.set("phase", "done")
        _fill_report(state, report)
        finished = True
        return report
    finally:
        state.close(finished=finished)


class _Steps:
    """Times the phases and forwards progress."""

    def __init__(self, state: GcState, report: GcReport, progress: ProgressFn | None) -> None:
        self.state, self.report, self.progress = state, report, progress

    def tick(self, phase: str) -> Callable[[int, int | None], None]:
        def tick(done: int, total: int | None) -> None:
            if self.progress is not None:
                self.progress(phase, done, total)
        return tick

    async def timed(self, phase: str, work: Any) -> None:
        start = time.perf_counter()
        await work
        self.report.seconds[phase] = round(time.perf_counter() - start, 3)

    def timed_sync(self, phase: str, work: Callable[[], None]) -> None:
        start = time.perf_counter()
        work()
        self.report.seconds[phase] = round(time.perf_counter() - start, 3)


def plan_gc(
    entries: Iterable[ObjectStat],
    *,
    now: float,
    max_bytes: int | None,
    max_age: float | None,
    parents: Mapping[str, str | None] | None = None,
) -> tuple[list[str], list[str]]:
    """The keys gc would delete for these listed objects: ``(expired, over_budget)``, each in
    deletion order. ``parents`` maps a page to its parent (a page it lacks is a chain of its
    own). The same planner as ``collect_garbage``, without a backend (state in memory)."""
    parents = parents or {}
    policy = GcPolicy(max_bytes, max_age)
    state = GcState(None)
    try:
        state.reset("plan", now)
        with state.transaction() as db:
            db.executemany("INSERT INTO objects (page, tail, size, mtime) VALUES (?, ?, ?, ?)", [
                (page_of(e.key), e.key[len(page_of(e.key)):], e.size, e.mtime)
                for e in entries if not is_manifest(e.key)])
        _group_pages(state)
        with state.transaction() as db:
            db.executemany("UPDATE pages SET parent = ?, parent_known = 1 WHERE page = ?",
                           [(parent, page) for page, parent in parents.items()])
        _plan(state, policy, now)
        planned: dict[int, list[str]] = {_EXPIRED: [], _OVER_BUDGET: []}
        for rule, page, tail in state.db.execute(
                "SELECT p.rule, p.page, o.tail FROM pages p JOIN objects o USING (page)"
                " WHERE p.step IS NOT NULL ORDER BY p.step, o.tail"):
            planned[rule].append(page + tail)
        return planned[_EXPIRED], planned[_OVER_BUDGET]
    finally:
        state.close(finished=True)


# -- 1. scan --------------------------------------------------------------------------------------


async def _scan(backend: Backend, state: GcState, prefix: str,
                tick: Callable[[int, int | None], None]) -> None:
    """Stream the listing into ``objects``, one transaction per ``SCAN_BATCH`` objects, each
    object marked ``held`` when the backend reports a retention entry on it."""
    rows: list[tuple[str, str, int, float | None]] = []
    seen = manifests = 0

    async def flush() -> None:
        held = await _held(backend, [page + tail for page, tail, _, _ in rows])
        with state.transaction() as db:
            db.executemany("INSERT INTO objects VALUES (?, ?, ?, ?, ?)",
                           [(*row, int(h)) for row, h in zip(rows, held, strict=True)])
        rows.clear()

    async for st in backend.list_entries(prefix):
        seen += 1
        if is_manifest(st.key):
            manifests += 1
            continue
        page = page_of(st.key)
        rows.append((page, st.key[len(page):], st.size, st.mtime))
        if len(rows) >= SCAN_BATCH:
            await flush()
            tick(seen, None)
    await flush()
    tick(seen, None)
    state.set("manifests", manifests)


async def _held(backend: Backend, keys: Sequence[str]) -> list[bool]:
    """Whether each key has a retention entry that holds now (never, without the capability)."""
    if not keys or not backend.capabilities.retention:
        return [False] * len(keys)
    return [bool(entries) for entries in await backend.retention_of(keys)]


# -- 2. pages -------------------------------------------------------------------------------------


def _group_pages(state: GcState) -> None:
    """One row per page (from the index over ``objects``: no second sort), with its parent
    where the cache already knows it."""
    state.db.executescript(
        """
        CREATE INDEX IF NOT EXISTS objects_page ON objects(page);
        DROP TABLE IF EXISTS pages;
        CREATE TABLE pages (
            page TEXT PRIMARY KEY, size INTEGER NOT NULL, objects INTEGER NOT NULL,
            undated INTEGER NOT NULL, newest REAL NOT NULL, tail TEXT NOT NULL,
            parent TEXT, key_id TEXT, parent_known INTEGER NOT NULL DEFAULT 0,
            children INTEGER NOT NULL DEFAULT 0, step INTEGER, rule INTEGER,
            outcome INTEGER, blocked INTEGER NOT NULL DEFAULT 0,
            held INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID;
        BEGIN;
        INSERT INTO pages (page, size, objects, undated, newest, tail, held)
            SELECT page, sum(size), count(*), max(mtime IS NULL), coalesce(max(mtime), 0.0),
                   min(tail), max(held)
            FROM objects GROUP BY page;
        UPDATE pages SET parent = nullif(c.parent, ''), key_id = c.key_id, parent_known = 1
            FROM cache.parents AS c WHERE c.page = pages.page;
        COMMIT;
        CREATE INDEX pages_unknown ON pages(page) WHERE parent_known = 0;
        """
    )


def _could_delete(state: GcState, policy: GcPolicy, now: float) -> bool:
    """Whether any rule can delete anything at all (if not, no header is worth reading).
    Retired keys are named only by headers: with any, they are read."""
    if policy.retired:
        return True
    if policy.max_bytes is not None and (
            state.scalar("SELECT sum(size) FROM pages") > policy.max_bytes):
        return True
    if policy.max_age is not None:
        cutoff = now - policy.max_age
        return bool(state.scalar(
            "SELECT count(*) FROM (SELECT 1 FROM pages WHERE undated = 0 AND newest < ? LIMIT 1)",
            cutoff))
    return False


# -- 3. parents -----------------------------------------------------------------------------------


async def _read_parents(backend: Backend, state: GcState,
                        tick: Callable[[int, int | None], None]) -> None:
    """Read one header per page whose parent is not known yet; remember every one decoded."""
    io = ObjectIO(backend)
    total = state.scalar("SELECT count(*) FROM pages WHERE parent_known = 0")
    done = 0
    tick(0, total)
    last = ""
    while True:
        rows = state.db.execute(
            "SELECT page, tail FROM pages WHERE parent_known = 0 AND page > ? ORDER BY page"
            " LIMIT ?", (last, HEADER_READS_IN_FLIGHT)).fetchall()
        if not rows:
            break
        last = rows[-1][0]
        keys = [page + tail for page, tail in rows]
        chunks = [keys[i : i + HEADER_BATCH] for i in range(0, len(keys), HEADER_BATCH)]
        # settled: a cancelled gc closes its store only once every read has ended
        found = [h for part in await gather_settled(*(_headers(io, c) for c in chunks))
                 for h in part]
        for i, (page, tail) in enumerate(rows):
            if not isinstance(found[i], ObjectHeader):
                other = await _other_header(io, state, page, tail)
                if other is not None:
                    found[i] = other
        known, cached = [], []
        for (page, _tail), header in zip(rows, found, strict=True):
            parent = key_id = None
            if isinstance(header, ObjectHeader):
                parent, key_id = header.parent_hash, header.key_id
            known.append((parent if parent != page else None, key_id, page))
            # A stored header (not one a bare format synthesised: no parent link there).
            if isinstance(header, ObjectHeader) and header.payload_offset > 0:
                cached.append((page, parent or "", key_id))
        with state.transaction() as db:
            db.executemany("INSERT OR REPLACE INTO cache.parents VALUES (?, ?, ?)", cached)
            db.executemany("UPDATE pages SET parent = ?, key_id = ?, parent_known = 1 "
                           "WHERE page = ?", known)
            state.add("headers_read", len(cached))
            state.add("headers_unreadable",
                      sum(isinstance(h, CorruptObjectError) for h in found))
        done += len(rows)
        tick(done, total)


async def _other_header(io: ObjectIO, state: GcState, page: str, tail: str
                        ) -> ObjectHeader | None:
    """The header of another object of ``page`` than ``page + tail`` (whose header is
    corrupt, unreadable or gone), None if none decodes. Every object of a page names the same
    parent: one damaged object must not make its page parentless, or the parent would be
    planned as a tail while the page's intact objects and its descendants stay, stranded
    behind the hole."""
    others = [page + t for (t,) in state.db.execute(
        "SELECT tail FROM objects WHERE page = ? AND tail != ? ORDER BY tail", (page, tail))]
    for start in range(0, len(others), HEADER_BATCH):
        for header in await _headers(io, others[start : start + HEADER_BATCH]):
            if isinstance(header, ObjectHeader):
                return header
    return None


async def _headers(io: ObjectIO, keys: Sequence[str]) -> list[ObjectHeader | CorruptObjectError | None]:
    """The headers of ``keys`` (``ObjectIO.read_headers``: checked against each key; None
    for an object that vanished). A failed call is tried once more, then key by key: one
    object the store cannot read (no read permission, a directory under its name) fails the
    whole call, and must not stop every run of gc at it. A key whose own read fails without
    a retryable error, while the store still answers ``exists`` for it, is unreadable (a
    ``CorruptObjectError`` here, as a header that does not decode); absent, it vanished. A
    retryable error, or a store that cannot answer ``exists`` either, stops the run
    (``GcError``, resumable)."""
    failure: BackendError | TimeoutError | None = None
    for _attempt in range(2):
        try:
            return await io.read_headers(keys)
        except (BackendError, TimeoutError) as exc:
            failure = exc
    out: list[ObjectHeader | CorruptObjectError | None] = []
    failed: dict[int, BackendError] = {}
    for i, key in enumerate(keys):
        try:
            out.extend(await io.read_headers([key]))
        except (BackendError, TimeoutError) as exc:
            if not isinstance(exc, BackendError) or getattr(exc, "retryable", False):
                raise _stopped(exc) from exc
            failed[i] = exc
            out.append(None)
    if failed:
        failing = [keys[i] for i in failed]
        try:
            present = await io.backend.exists(failing)
        except (BackendError, TimeoutError) as exc:
            raise _stopped(failure or exc) from exc
        for (i, error), there in zip(failed.items(), present, strict=True):
            if there:
                out[i] = CorruptObjectError(f"{keys[i]}: unreadable ({error})")
    return out


def _stopped(exc: BaseException) -> GcError:
    return GcError(f"reading object headers failed ({exc!r}); nothing was deleted by this "
                   "step: run gc again to resume")


# -- 4. plan --------------------------------------------------------------------------------------


def _plan(state: GcState, policy: GcPolicy, now: float) -> None:
    """Number the pages to delete (``step``), children before parents; see the docstring."""
    db = state.db
    db.executescript(
        """
        BEGIN;
        UPDATE pages SET children = 0, step = NULL, rule = NULL, outcome = NULL, blocked = 0
            WHERE children != 0 OR step IS NOT NULL OR rule IS NOT NULL OR outcome IS NOT NULL
               OR blocked != 0;
        CREATE INDEX IF NOT EXISTS pages_parent ON pages(parent) WHERE parent IS NOT NULL;
        UPDATE pages SET children = (
            SELECT count(*) FROM pages AS c WHERE c.parent = pages.page AND c.page != c.parent)
            WHERE page IN (SELECT parent FROM pages WHERE parent IS NOT NULL);
        COMMIT;
        CREATE INDEX IF NOT EXISTS pages_tails ON pages(undated, newest, page)
            WHERE children = 0 AND step IS NULL AND held = 0;
        CREATE INDEX IF NOT EXISTS pages_step ON pages(step) WHERE step IS NOT NULL;
        """
    )
    planner = _Planner(state)
    if policy.retired:
        ids = sorted(policy.retired)
        marks = ", ".join("?" * len(ids))
        planner.remove(f"key_id IN ({marks})", ids, _RETIRED)
    if policy.max_age is not None:
        planner.remove("undated = 0 AND newest < ?", [now - policy.max_age], _EXPIRED)
    if policy.max_bytes is not None:
        planner.fit(policy.max_bytes)


_TailKey = tuple[int, float, str]


class _Planner:
    """Drops chain tails in the order of the module docstring, tracking the uncovered parents.

    The tails wait in an index (``pages_tails``); dropping one decrements its parent's
    ``children`` and, at zero, the parent joins the index. ``fit`` pops tails oldest first
    across index batches: parents uncovered during a batch wait in a small heap and are
    merged in key order, so the order is exactly a global heap's.

    Within a batch the parents' rows are read once each and decremented in memory (a chain
    uncovered page by page costs one indexed read a page, not an index-maintaining UPDATE);
    the batch's plan and counts are written together at its end, or every ``PLAN_BATCH``
    planned pages when one batch uncovers more (a long chain): memory stays one batch.
    """

    def __init__(self, state: GcState) -> None:
        self.state = state
        self.db = db = state.db
        self.step = 0
        self.total = int(db.execute("SELECT coalesce(sum(size), 0) FROM pages").fetchone()[0])
        #: ``(step, rule, page)`` planned since the last write: no query of the batch needs
        #: them (a page is planned only once it has no children left, so none of its children
        #: is planned after it), except ``_parent`` reads, which ``parents`` answers.
        self.planned: list[tuple[int, int, str]] = []
        #: page -> ``[children, undated, newest, size, parent]`` as decremented since the last
        #: write; None once planned.
        self.parents: dict[str, list[Any] | None] = {}

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        with self.state.transaction():
            yield
            self._write()

    def _write(self) -> None:
        """Write the plan and the decremented counts held in memory (inside a transaction)."""
        self.db.executemany("UPDATE pages SET children = ? WHERE page = ?",
                            [(row[0], page) for page, row in self.parents.items()
                             if row is not None])
        self.db.executemany("UPDATE pages SET step = ?, rule = ?, children = 0 WHERE page = ?",
                            self.planned)
        self.planned = []
        self.parents = {}

    def _parent(self, page: str) -> list[Any] | None:
        """``page``'s row as this batch left it; None if it is planned, not stored or held
        (a held page never becomes a tail)."""
        if page in self.parents:
            return self.parents[page]
        row = self.db.execute(
            "SELECT children, undated, newest, size, parent FROM pages "
            "WHERE page = ? AND step IS NULL AND held = 0", (page,)).fetchone()
        self.parents[page] = entry = None if row is None else list(row)
        return entry

    def drop(self, page: str, size: int, parent: str | None, rule: int
             ) -> tuple[_TailKey, int, str | None] | None:
        """Plan ``page``; return its parent as a new tail ``(key, size, parent)`` if it is one."""
        self.step += 1
        self.total -= size
        self.planned.append((self.step, rule, page))
        row = None if parent is None else self._parent(parent)
        self.parents[page] = None
        uncovered = None
        if row is not None:
            row[0] -= 1
            if row[0] == 0:
                assert parent is not None
                uncovered = (int(row[1]), float(row[2]), parent), int(row[3]), row[4]
        if len(self.planned) >= PLAN_BATCH:
            self._write()
        return uncovered

    def remove(self, where: str, params: Sequence[object], rule: int) -> None:
        """Phases 0 and 1: every tail matching ``where`` (a retired key, an expired age),
        until none is left (a matching page whose descendants do not match stays)."""
        while True:
            rows = self.db.execute(
                "SELECT page, size, parent FROM pages WHERE children = 0 AND step IS NULL "  # noqa: S608
                f"AND held = 0 AND {where} ORDER BY undated, newest, page LIMIT ?",
                (*params, PLAN_BATCH)).fetchall()
            if not rows:
                return
            with self._batch():
                for page, size, parent in rows:
                    self.drop(page, size, parent, rule)

    def fit(self, max_bytes: int) -> None:
        """Phase 2: the oldest tails while the pages left exceed ``max_bytes``."""
        while self.total > max_bytes:
            rows = self.db.execute(
                "SELECT undated, newest, page, size, parent FROM pages "
                "WHERE children = 0 AND step IS NULL AND held = 0 "
                "ORDER BY undated, newest, page LIMIT ?",
                (PLAN_BATCH,)).fetchall()
            if not rows:
                return
            # Tails up to ``horizon`` are all in ``rows``; uncovered parents past it wait for
            # the next query (they are in the index by then).
            horizon: _TailKey | None = None if len(rows) < PLAN_BATCH else tuple(rows[-1][:3])
            waiting: list[tuple[_TailKey, int, str | None]] = []
            with self._batch():
                self._merge(rows, horizon, waiting, max_bytes)

    def _merge(self, rows: list[Any], horizon: _TailKey | None,
               waiting: list[tuple[_TailKey, int, str | None]], max_bytes: int) -> None:
        """Drop tails from ``rows`` and ``waiting`` in key order while over ``max_bytes``."""
        i = 0
        while self.total > max_bytes:
            heap_first = waiting and (i >= len(rows) or waiting[0][0] < tuple(rows[i][:3]))
            if heap_first and (horizon is None or waiting[0][0] <= horizon):
                key, size, parent = heapq.heappop(waiting)
                page = key[2]
            elif i < len(rows):
                _undated, _newest, page, size, parent = rows[i]
                i += 1
            else:
                return  # the next tails are past this query's horizon: query again
            uncovered = self.drop(page, size, parent, _OVER_BUDGET)
            if uncovered is not None:
                heapq.heappush(waiting, uncovered)


# -- 5. delete ------------------------------------------------------------------------------------


def _refuse_most_of_the_store(state: GcState, share: float) -> None:
    """``GcRefusedError`` when the pages still to delete are more than ``share`` of the
    store's objects or bytes (as scanned; manifests are never deleted and not counted)."""
    stored, stored_bytes = (int(v or 0) for v in state.db.execute(
        "SELECT count(*), sum(size) FROM objects").fetchone())
    planned, planned_bytes = (int(v or 0) for v in state.db.execute(
        "SELECT sum(objects), sum(size) FROM pages WHERE step IS NOT NULL AND outcome IS NULL"
    ).fetchone())
    if planned <= share * stored and planned_bytes <= share * stored_bytes:
        return
    raise GcRefusedError(
        f"this run would delete {planned} of {stored} objects ({_percent(planned, stored)}) "
        f"and {human_bytes(planned_bytes)} of {human_bytes(stored_bytes)} "
        f"({_percent(planned_bytes, stored_bytes)}): more than {share:.0%} of the store",
        planned=planned, planned_bytes=planned_bytes, stored=stored, stored_bytes=stored_bytes)


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


async def _delete(backend: Backend, state: GcState,
                  tick: Callable[[int, int | None], None]) -> None:
    """Delete the planned pages in plan order; see "Deleting in order" in the docstring."""
    db = state.db
    total = state.scalar("SELECT count(*) FROM pages WHERE step IS NOT NULL")
    done = state.scalar("SELECT count(*) FROM pages WHERE outcome IS NOT NULL")
    tick(done, total)
    # Resume at the first page without an outcome (a crash may leave a batch unsettled
    # below pages already settled as kept).
    last = state.scalar("SELECT min(step) FROM pages WHERE step IS NOT NULL AND outcome IS NULL")
    last = last - 1 if last else 0
    batch = _DeleteBatch()
    while True:
        rows = db.execute(
            "SELECT step, page, parent, blocked FROM pages WHERE step > ? AND outcome IS NULL"
            " ORDER BY step LIMIT ?", (last, PLAN_BATCH)).fetchall()
        if not rows:
            break
        for step, page, parent, blocked in rows:
            last = step
            keys = [page + str(tail) for (tail,) in db.execute(
                "SELECT tail FROM objects WHERE page = ?", (page,))]
            if batch.keys and len(batch.keys) + len(keys) > DELETE_CHUNK:
                done += await batch.flush(backend, state)
                tick(done, total)
            # After the flush: a child that failed in it blocks this page.
            if blocked or page in batch.blocked:
                with state.transaction():
                    _settle(db, [(page, parent)], _KEPT, batch.blocked)
                done += 1
                continue
            batch.add(page, parent, keys)
        batch.blocked.clear()  # settled in the database: later queries see ``blocked``
    done += await batch.flush(backend, state)
    tick(done, total)


class _DeleteBatch:
    """Pages deleted by one ``delete`` call, in plan order (children first)."""

    def __init__(self) -> None:
        self.pages: list[tuple[str, str | None, list[str]]] = []
        self.keys: list[str] = []
        #: pages blocked since the current query ran (its rows do not show it yet).
        self.blocked: set[str] = set()

    def add(self, page: str, parent: str | None, keys: list[str]) -> None:
        self.pages.append((page, parent, keys))
        self.keys.extend(keys)

    async def flush(self, backend: Backend, state: GcState) -> int:
        """Delete the batch's pages in order, each a group of ``delete_until_held``: a page
        found held (pinned since the scan) is kept and blocks its ancestors, which come later
        in the batch, and the call goes on after it. On a failure, ask the store which pages
        are still there: those failed, and block their ancestors. Returns the number of
        pages settled."""
        count = len(self.pages)
        pages, self.pages, self.keys = self.pages, [], []
        while pages:
            go: list[tuple[str, str | None, list[str]]] = []
            with state.transaction() as db:
                for page, parent, keys in pages:  # children first: one pass blocks a chain
                    if page in self.blocked:
                        _settle(db, [(page, parent)], _KEPT, self.blocked)
                    else:
                        go.append((page, parent, keys))
            if not go:
                break
            try:
                done = (await backend.delete_until_held([keys for _, _, keys in go])).groups
            except BackendError:
                await self._settle_failed(backend, state, go)
                break
            with state.transaction() as db:
                _settle(db, [(p, q) for p, q, _ in go[:done]], _DELETED, self.blocked)
                if done < len(go):  # held: kept, and its ancestors with it
                    _settle(db, [go[done][:2]], _KEPT, self.blocked)
            pages = go[done + 1:]
        return count

    async def _settle_failed(self, backend: Backend, state: GcState,
                             pages: list[tuple[str, str | None, list[str]]]) -> None:
        """A delete call failed: the pages whose objects are still there failed (their
        ancestors are blocked), the others were deleted."""
        keys = [key for _, _, page_keys in pages for key in page_keys]
        try:
            present = await backend.exists(keys)
        except BackendError:
            present = [True] * len(keys)  # cannot tell: count them all as failed
        left = {key for key, there in zip(keys, present, strict=True) if there}
        failed = {page for page, _, page_keys in pages if left.intersection(page_keys)}
        with state.transaction() as db:
            _settle(db, [(p, q) for p, q, _ in pages if p not in failed], _DELETED,
                    self.blocked)
            _settle(db, [(p, q) for p, q, _ in pages if p in failed], _FAILED, self.blocked)


def _settle(db: sqlite3.Connection, pages: Sequence[tuple[str, str | None]], outcome: int,
            blocked: set[str]) -> None:
    """Record pages' outcome; a page that stays blocks its parent (the rest of its chain
    stays reachable)."""
    db.executemany("UPDATE pages SET outcome = ? WHERE page = ?",
                   [(outcome, page) for page, _ in pages])
    if outcome != _DELETED:
        parents = [parent for _, parent in pages if parent is not None]
        db.executemany("UPDATE pages SET blocked = 1 WHERE page = ?", [(p,) for p in parents])
        blocked.update(parents)


# -- 6. report ------------------------------------------------------------------------------------


def _prune_parent_cache(state: GcState) -> None:
    """Forget the parents of pages this run did not see, or deleted (the cache stays the size
    of the store)."""
    with state.transaction() as db:
        db.execute("DELETE FROM cache.parents WHERE page NOT IN (SELECT page FROM pages)")
        db.execute("DELETE FROM cache.parents WHERE page IN "
                   "(SELECT page FROM pages WHERE outcome = ?)", (_DELETED,))


def _fill_report(state: GcState, report: GcReport) -> None:
    one = state.db.execute
    report.scanned, report.scanned_bytes, report.undated, report.held = (int(v or 0) for v in one(
        "SELECT count(*), sum(size), sum(mtime IS NULL), sum(held) FROM objects").fetchone())
    report.held_pages = state.scalar("SELECT count(*) FROM pages WHERE held = 1")
    report.manifests = int(state.get("manifests") or 0)
    report.scanned += report.manifests
    report.pages = state.scalar("SELECT count(*) FROM pages")
    report.headers_cached = int(state.get("headers_cached") or 0)
    report.headers_read = int(state.get("headers_read") or 0)
    report.headers_unreadable = int(state.get("headers_unreadable") or 0)
    for rule, attr in ((_RETIRED, "retired"), (_EXPIRED, "expired"),
                       (_OVER_BUDGET, "over_budget")):
        pages, objects = one("SELECT count(*), sum(objects) FROM pages WHERE rule = ?",
                             (rule,)).fetchone()
        setattr(report, attr, int(objects or 0))
        setattr(report, f"{attr}_pages", int(pages or 0))
    if report.dry_run:
        report.deleted_bytes = state.scalar("SELECT sum(size) FROM pages WHERE step IS NOT NULL")
        return
    deleted, nbytes = one("SELECT sum(objects), sum(size) FROM pages WHERE outcome = ?",
                          (_DELETED,)).fetchone()
    report.deleted, report.deleted_bytes = int(deleted or 0), int(nbytes or 0)
    report.failures = state.scalar("SELECT sum(objects) FROM pages WHERE outcome = ?", _FAILED)
    report.kept_pages = state.scalar("SELECT count(*) FROM pages WHERE outcome = ?", _KEPT)
