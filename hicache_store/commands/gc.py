"""``hicache-store gc URL``: bound a shared store (an S3 prefix, any listing backend) by size and age.

Object stores have no capacity of their own, and several engines share one prefix, so no
single writer can enforce a budget. ``gc`` runs from one place (cron, a sidecar)::

    hicache-store gc 's3://bucket/kv?endpoint_url=...' --max-bytes 2TiB --max-age 7d --dry-run

What it deletes, in order:

1. every object older than ``--max-age`` (by its store mtime);
2. then, while the rest exceeds ``--max-bytes``, whole *pages* (all objects sharing a page
   hash: every layer chunk and head group), oldest write second first, and within one second
   the later-written page first. Engines write a prefix's pages in chain order in one batch, so
   inside a batch the chain's tail goes before its head and a cached chain is shortened from
   its end, never holed in the middle. Listings carry no parent links, so across batches
   the order is plain age.

Backends with a cheap ``list_entries(prefix)`` (``s3``: size and mtime come with the listing)
use it; any other listing backend is listed then ``stat``-ed. ``--dry-run`` prints what would go
and deletes nothing. Deletion failures are counted and reported; gc keeps going.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache_store._sync import run_sync
from hicache_store.backends import Backend, BackendError, open_backend
from hicache_store.backends.types import parse_size
from hicache_store.cli import UsageError

_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*", re.IGNORECASE)
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DELETE_CHUNK = 1000


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
    entries: Sequence[Entry], *, now: float, max_bytes: int | None, max_age: float | None
) -> tuple[list[Entry], list[Entry]]:
    """``(expired, over_budget)``: the entries to delete, see the module docstring.

    Pure: no I/O. A page is dropped whole once any of its objects is picked for the budget.
    """
    entries = [e for e in entries if not is_manifest(e.key)]
    expired = [e for e in entries if max_age is not None and now - e.mtime > max_age]
    gone = {e.key for e in expired}
    rest = [e for e in entries if e.key not in gone]
    over: list[Entry] = []
    total = sum(e.size for e in rest)
    if max_bytes is None or total <= max_bytes:
        return expired, over
    pages: dict[str, list[Entry]] = {}
    for entry in rest:
        pages.setdefault(page_of(entry.key), []).append(entry)
    # A page's age is its newest object's; oldest second first, then later-written first.
    order = sorted(pages.values(), key=lambda objs: (
        math.floor(max(o.mtime for o in objs)), -max(o.mtime for o in objs)))
    for objs in order:
        if total <= max_bytes:
            break
        over.extend(objs)
        total -= sum(o.size for o in objs)
    return expired, over


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
    backend: Backend, *, max_bytes: int | None, max_age: float | None, prefix: str = "",
    dry_run: bool = False, now: float | None = None,
) -> GcReport:
    """Scan, plan and (unless ``dry_run``) delete. Failed deletions are counted, not raised."""
    entries = await scan(backend, prefix)
    report = GcReport(scanned=len(entries), scanned_bytes=sum(e.size for e in entries))
    expired, over = plan_gc(entries, now=time.time() if now is None else now,
                            max_bytes=max_bytes, max_age=max_age)
    report.expired, report.over_budget = len(expired), len(over)
    doomed = expired + over
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
        "gc", help="delete old objects and keep a shared store under a size budget",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("url", help="backend URL, e.g. s3://bucket/prefix?endpoint_url=...")
    parser.add_argument("--max-bytes", help="size budget, e.g. 500GiB")
    parser.add_argument("--max-age", help="delete objects older than this, e.g. 7d or 12h")
    parser.add_argument("--prefix", default="", help="only keys starting with this")
    parser.add_argument("--dry-run", action="store_true", help="print what would go, delete nothing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.max_bytes is None and args.max_age is None:
        raise UsageError("give --max-bytes, --max-age or both")
    try:
        max_bytes = None if args.max_bytes is None else parse_size(args.max_bytes)
        max_age = None if args.max_age is None else parse_duration(args.max_age)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc

    async def go() -> GcReport:
        backend = open_backend(args.url)
        try:
            return await collect_garbage(backend, max_bytes=max_bytes, max_age=max_age,
                                         prefix=args.prefix, dry_run=args.dry_run)
        finally:
            await backend.close()

    report = run_sync(go())
    verb = "would delete" if args.dry_run else "deleted"
    print(f"scanned {report.scanned} objects ({report.scanned_bytes} bytes); {verb} "
          f"{report.expired} expired and {report.over_budget} over budget "
          f"({report.deleted_bytes} bytes); {report.failures} failures")
    return 1 if report.failures else 0
