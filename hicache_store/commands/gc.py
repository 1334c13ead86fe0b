"""``hicache-store gc URL``: bound a shared store (an S3 prefix, any listing backend) by size and age.

Object stores have no capacity of their own, and several engines share one prefix, so no
single writer can enforce a budget. ``gc`` runs from one place (cron, a sidecar)::

    hicache-store gc 's3://bucket/kv?endpoint_url=...' --max-bytes 2TiB --max-age 7d --dry-run

It works on whole *pages* (all objects sharing a page hash: every layer chunk and head group)
and on chains: every object header names its page's parent (``layout.framing``), so gc reads
one header per page and rebuilds the chains. It only ever deletes a chain's current tail (a
page none of whose children is stored), least recently written first, so a cached prefix is
shortened from its end and never holed in the middle:

1. tails whose newest object is older than ``--max-age``, repeatedly (an expired page whose
   descendants are still fresh stays until they go);
2. then, while the rest exceeds ``--max-bytes``, the oldest tails.

Pages whose header cannot be read (another format, corrupt) count as chains of their own.

Sealed tenants (``--tenant-key-file F --remove-retired``): every page whose header names a key
that the ring F lists as ``retired`` is deleted first, whatever its age (readers holding F no
longer read it: it only takes space). Headers carry key ids, so this needs no secret and never
touches another tenant's objects (their key ids are not in F) or plain ones.
Namespace manifests (``M_...``) are never deleted. Backends with a cheap
``list_entries(prefix)`` (``s3``: size and mtime come with the listing) use it; any other
listing backend is listed then ``stat``-ed. ``--dry-run`` prints what would go and deletes
nothing. Deletion failures are counted and reported; gc keeps going.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_store._sync import run_sync
from hicache_store.backends import Backend, BackendError, open_backend
from hicache_store.backends.types import ByteRange, parse_size
from hicache_store.cli import UsageError
from hicache_store.layout.errors import CorruptObjectError
from hicache_store.layout.framing import decode_header

_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*", re.IGNORECASE)
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DELETE_CHUNK = 1000
#: headers read per batch, and bytes read of each (enough for objects of up to 494 layers;
#: a longer header fails to decode and its page counts as a chain of its own).
HEADER_CHUNK = 256
HEADER_PROBE = 4096


@dataclass(frozen=True)
class Entry:
    """One stored object as gc sees it."""

    key: str
    size: int
    mtime: float


@dataclass
class GcReport:
    scanned: int = 0
    scanned_bytes: int = 0
    expired: int = 0
    over_budget: int = 0
    deleted_bytes: int = 0
    failures: int = 0
    retired: int = 0


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``30m``, ``12h``, ``7d``, ``2w``."""
    match = _DURATION_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"expected a duration like 30m, 12h or 7d, got {text!r}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2).lower()]


def is_manifest(key: str) -> bool:
    """Namespace manifests (``M_{digest}``, see ``hicache_store.ops.manifest``) are not KV:
    gc never deletes them."""
    return key.startswith("M_")


def page_of(key: str) -> str:
    """The page a key belongs to: its page hash (the part before the first ``_``)."""
    return key.split("_", 1)[0]


def plan_gc(
    entries: Sequence[Entry],
    *,
    now: float,
    max_bytes: int | None,
    max_age: float | None,
    parents: Mapping[str, str | None] | None = None,
) -> tuple[list[Entry], list[Entry]]:
    """``(expired, over_budget)``: the entries to delete, see the module docstring.

    ``parents`` maps a page to its parent page (None: unknown or first); without it every page
    is its own chain. Pure: no I/O.
    """
    parents = parents or {}
    pages: dict[str, list[Entry]] = {}
    for entry in entries:
        if not is_manifest(entry.key):
            pages.setdefault(page_of(entry.key), []).append(entry)
    newest = {page: max(e.mtime for e in objs) for page, objs in pages.items()}
    children: dict[str, int] = dict.fromkeys(pages, 0)
    for page in pages:
        parent = parents.get(page)
        if parent is not None and parent in children and parent != page:
            children[parent] += 1
    order = itertools.count()
    heap = [(newest[p], next(order), p) for p in pages if children[p] == 0]
    heapq.heapify(heap)
    total = sum(e.size for objs in pages.values() for e in objs)
    expired: list[Entry] = []
    over: list[Entry] = []
    waiting: list[tuple[float, int, str]] = []  # fresh tails, kept for the budget phase

    def drop(page: str, into: list[Entry]) -> None:
        nonlocal total
        into.extend(pages[page])
        total -= sum(e.size for e in pages[page])
        parent = parents.get(page)
        if parent is not None and parent in children and parent != page:
            children[parent] -= 1
            if children[parent] == 0:
                heapq.heappush(heap, (newest[parent], next(order), parent))

    while heap:  # 1. age: expired tails, and the parents they uncover
        item = heapq.heappop(heap)
        if max_age is not None and now - item[0] > max_age:
            drop(item[2], expired)
        else:
            waiting.append(item)
    for item in waiting:
        heapq.heappush(heap, item)
    while heap and max_bytes is not None and total > max_bytes:  # 2. budget: oldest tails
        drop(heapq.heappop(heap)[2], over)
    return expired, over


async def read_parents(
    backend: Backend, entries: Sequence[Entry], key_ids: dict[str, str | None] | None = None
) -> dict[str, str | None]:
    """Each page's parent, from the header of one of its objects (None where unreadable).

    ``key_ids``, when given, receives each page's sealing key id (None: plain or unreadable).
    """
    first: dict[str, Entry] = {}
    for entry in entries:
        if not is_manifest(entry.key):
            first.setdefault(page_of(entry.key), entry)
    parents: dict[str, str | None] = {}
    items = list(first.items())
    for start in range(0, len(items), HEADER_CHUNK):
        chunk = items[start : start + HEADER_CHUNK]
        buffers = [bytearray(min(e.size, HEADER_PROBE)) for _, e in chunk]
        ranges = [ByteRange(0, len(b)) for b in buffers]
        try:
            got = await backend.get_into([e.key for _, e in chunk], buffers, ranges)
        except BackendError:
            got = [None] * len(chunk)
        for (page, _entry), buf, n in zip(chunk, buffers, got, strict=True):
            parent = key_id = None
            if n:
                try:
                    header = decode_header(memoryview(buf)[:n])
                    parent, key_id = header.parent_hash, header.key_id
                except CorruptObjectError:
                    pass
            parents[page] = parent
            if key_ids is not None:
                key_ids[page] = key_id
    return parents


async def scan(backend: Backend, prefix: str) -> list[Entry]:
    """Every object under ``prefix`` with its size and mtime."""
    lister = getattr(backend, "list_entries", None)
    if lister is not None:
        return [Entry(k, s, m) async for k, s, m in lister(prefix)]
    keys = [key async for key in backend.list_prefix(prefix)]
    entries = []
    for start in range(0, len(keys), DELETE_CHUNK):
        for st in await backend.stat(keys[start : start + DELETE_CHUNK]):
            if st is not None:
                entries.append(Entry(st.key, st.size, st.mtime or 0.0))
    return entries


async def collect_garbage(
    backend: Backend,
    *,
    max_bytes: int | None,
    max_age: float | None,
    prefix: str = "",
    dry_run: bool = False,
    now: float | None = None,
    retired: frozenset[str] = frozenset(),
) -> GcReport:
    """Scan, plan and (unless ``dry_run``) delete. Failed deletions are counted, not raised.

    ``retired``: key ids whose pages go first (see the module docstring).
    """
    entries = await scan(backend, prefix)
    report = GcReport(scanned=len(entries), scanned_bytes=sum(e.size for e in entries))
    key_ids: dict[str, str | None] = {}
    parents = await read_parents(backend, entries, key_ids)
    gone = [e for e in entries
            if not is_manifest(e.key) and key_ids.get(page_of(e.key)) in retired]
    if gone:
        entries = [e for e in entries if is_manifest(e.key) or key_ids.get(page_of(e.key))
                   not in retired]
    report.retired = len(gone)
    expired, over = plan_gc(
        entries,
        now=time.time() if now is None else now,
        max_bytes=max_bytes,
        max_age=max_age,
        parents=parents,
    )
    report.expired, report.over_budget = len(expired), len(over)
    doomed = gone + expired + over
    report.deleted_bytes = sum(e.size for e in doomed)
    if dry_run:
        return report
    for start in range(0, len(doomed), DELETE_CHUNK):
        chunk = doomed[start : start + DELETE_CHUNK]
        try:
            await backend.delete([e.key for e in chunk])
        except BackendError:
            report.failures += len(chunk)
            report.deleted_bytes -= sum(e.size for e in chunk)
    return report


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gc",
        help="delete old objects and keep a shared store under a size budget",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("url", help="backend URL, e.g. s3://bucket/prefix?endpoint_url=...")
    parser.add_argument("--max-bytes", help="size budget, e.g. 500GiB")
    parser.add_argument("--max-age", help="delete objects older than this, e.g. 7d or 12h")
    parser.add_argument("--prefix", default="", help="only keys starting with this")
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would go, delete nothing"
    )
    parser.add_argument("--tenant-key-file", metavar="PATH",
                        help="a tenant key ring (default: $HICACHE_STORE_TENANT_KEY_FILE or "
                             "$HICACHE_STORE_TENANT_KEY), for --remove-retired")
    parser.add_argument("--remove-retired", action="store_true",
                        help="delete the objects sealed with keys the ring lists as retired")
    parser.set_defaults(func=run)


def _retired_ids(args: argparse.Namespace) -> frozenset[str]:
    if not getattr(args, "remove_retired", False):  # callers may build args without it
        return frozenset()
    from hicache_store.tenant import load_key_ring

    try:
        ring = load_key_ring(getattr(args, "tenant_key_file", None))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if ring is None:
        raise UsageError("--remove-retired needs a tenant key ring (--tenant-key-file)")
    if not ring.retired:
        raise UsageError(f"{ring.source} retires no key")
    return ring.retired


def run(args: argparse.Namespace) -> int:
    retired = _retired_ids(args)
    if args.max_bytes is None and args.max_age is None and not retired:
        raise UsageError("give --max-bytes, --max-age, --remove-retired or a combination")
    try:
        max_bytes = None if args.max_bytes is None else parse_size(args.max_bytes)
        max_age = None if args.max_age is None else parse_duration(args.max_age)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc

    async def go() -> GcReport:
        backend = open_backend(args.url)
        try:
            return await collect_garbage(
                backend,
                max_bytes=max_bytes,
                max_age=max_age,
                prefix=args.prefix,
                dry_run=args.dry_run,
                retired=retired,
            )
        finally:
            await backend.close()

    report = run_sync(go())
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"scanned {report.scanned} objects ({report.scanned_bytes} bytes); {verb} "
        f"{report.expired} expired and {report.over_budget} over budget "
        f"({report.deleted_bytes} bytes); {report.failures} failures"
        + (f"; {verb} {report.retired} under retired keys" if retired else "")
    )
    return 1 if report.failures else 0
