"""``hicache-store gc URL``: bound a shared store (an S3 prefix, a file store) by size and age.

Deletes whole pages, chain tails first (a cached prefix is shortened from its end, never
holed), expired pages first, then the oldest while over the budget::

    hicache-store gc 's3://bucket/kv?endpoint_url=...' --max-bytes 2TiB --max-age 7d --dry-run

``--max-bytes`` and ``--max-age`` take units (``100GiB``, ``500MB``, ``0B``; ``7d``, ``12h``,
``30min``, ``90s``, ``2w``): a bare number is refused, never taken for bytes or seconds. A run
whose plan would delete more than half of the store's objects or bytes deletes nothing
without ``--yes`` (it says how much it would delete, exit 2; the plan is kept, so the run
with ``--yes`` resumes at the deletion). ``--dry-run`` deletes nothing and needs no ``--yes``.

Memory stays bounded at any store size (the working set is on disk, in ``--state-dir``); an
interrupted run started again with the same options resumes where it stopped (``--fresh``:
start over). Objects without a modification time are never aged out (``--max-age`` on a
backend that records none is refused). Progress goes to stderr (a redrawn line on a
terminal, a plain line every few seconds otherwise); ``--json`` prints the report as JSON.
``--tenant-key-file F --remove-retired`` first deletes the objects sealed with keys the ring
retires, whatever their age. Exit code 1 when some deletions failed. Library:
``hicache_store.ops.gc``.

On a store with an index of its own (a file root; any store indexed by Valkey) gc first
reconciles the index with a listing of the store (``Backend.check_index``): objects the index
does not account for (published by a writer that lost its lease) are removed, keys whose
object is gone are unindexed. ``--rebuild-index`` builds the index anew from the listing
instead (a fleet's index lost with its server; the pins and retention it held are gone), and
may be given alone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from hicache_store._sync import run_sync
from hicache_store.backends.errors import NotSupportedError
from hicache_store.backends.index import IndexCheck
from hicache_store.backends.types import parse_size
from hicache_store.commands._common import (
    add_command,
    add_report_arguments,
    add_tenant_key_argument,
)
from hicache_store.errors import UsageError
from hicache_store.layout.errors import ConfigError
from hicache_store.ops.gc import (
    MOST_OF_THE_STORE,
    PREFIX_REFUSED,
    GcRefusedError,
    GcReport,
    collect_garbage,
    default_state_dir,
)
from hicache_store.ops.progress import ProgressBar, human_bytes
from hicache_store.ops.store import open_store

_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|min|m|h|d|w)\s*", re.IGNORECASE)
_UNIT_SECONDS = {"s": 1, "min": 60, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_BARE_NUMBER_RE = re.compile(r"\s*[0-9]+(?:\.[0-9]+)?\s*")
_PHASE_UNITS = {"scan": "objects", "parents": "pages", "delete": "pages"}


def parse_duration(text: str) -> float:
    """Seconds from ``90s``, ``30min`` (or ``30m``), ``12h``, ``7d``, ``2w``; a unit is
    required (``ValueError``: a bare ``7`` could mean seconds or days)."""
    match = _DURATION_RE.fullmatch(text)
    if match is None:
        hint = (f"give a unit: {text.strip()}d, {text.strip()}h, {text.strip()}min or "
                f"{text.strip()}s" if _BARE_NUMBER_RE.fullmatch(text) else
                "expected a duration like 30min, 12h or 7d")
        raise ValueError(f"--max-age {text!r}: {hint}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2).lower()]


def parse_budget(text: str) -> int:
    """Bytes from ``100GiB``, ``500MB``, ``0B`` (``parse_size``); a unit is required
    (``ValueError``: a bare ``5`` is refused, never taken for 5 bytes)."""
    if _BARE_NUMBER_RE.fullmatch(text):
        n = text.strip()
        raise ValueError(f"--max-bytes {text!r}: give a unit: {n}GiB, {n}MiB or {n}B for bytes")
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ValueError(f"--max-bytes {text!r}: {exc}") from None


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "gc", doc=__doc__,
                         help="delete old objects and keep a shared store under a size budget")
    parser.add_argument("url", help="backend URL, e.g. s3://bucket/prefix?endpoint_url=...")
    parser.add_argument("--max-bytes", help="size budget with a unit, e.g. 500GiB or 0B")
    parser.add_argument("--max-age",
                        help="delete objects older than this, with a unit: 7d, 12h, 30min")
    parser.add_argument("--prefix", default="",
                        help="refused: a key prefix would hole chains (put an S3 prefix in the URL)")
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would go, delete nothing"
    )
    parser.add_argument("--state-dir", help="where the working set is kept (default: one "
                        "folder per store under ~/.cache/hicache-store/gc)")
    add_tenant_key_argument(parser, "a tenant key ring, for --remove-retired")
    parser.add_argument("--remove-retired", action="store_true",
                        help="delete the objects sealed with keys the ring lists as retired")
    parser.add_argument("--fresh", action="store_true",
                        help="start over instead of resuming an interrupted run")
    parser.add_argument("--yes", action="store_true",
                        help="delete even when the plan takes more than half of the store's "
                             "objects or bytes (refused otherwise, saying how much)")
    parser.add_argument("--rebuild-index", action="store_true",
                        help="build the store's index anew from a listing (its pins and "
                             "retention are lost); alone, or before the collection")
    add_report_arguments(parser, "report")
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
    if args.prefix:
        raise UsageError(f"--prefix: {PREFIX_REFUSED}")
    rebuild = getattr(args, "rebuild_index", False)
    collect = not (args.max_bytes is None and args.max_age is None and not retired)
    if not collect and not rebuild:
        raise UsageError("give --max-bytes, --max-age, --remove-retired, --rebuild-index or a "
                         "combination")
    try:
        max_bytes = None if args.max_bytes is None else parse_budget(args.max_bytes)
        max_age = None if args.max_age is None else parse_duration(args.max_age)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    state_dir = getattr(args, "state_dir", None) or default_state_dir(args.url, args.prefix)
    show = not getattr(args, "no_progress", False)
    bars: dict[str, ProgressBar] = {}

    def progress(phase: str, done: int, total: int | None) -> None:
        if phase not in bars:
            for bar in bars.values():
                bar.close()
            bars[phase] = ProgressBar(total, _PHASE_UNITS.get(phase, "items"),
                                      label=f"gc {phase}", enabled=show)
        bars[phase].total = total
        bars[phase].update(done)

    async def go() -> GcReport | None:
        backend = open_store(args.url, existing=True)
        try:
            if max_age is not None and not backend.capabilities.mtime:
                raise UsageError(
                    f"--max-age: the {backend.name} backend records no modification times, so "
                    "nothing could be aged out; use --max-bytes")
            if rebuild and args.dry_run:
                raise UsageError("--rebuild-index changes the index: not with --dry-run")
            try:
                check = await backend.check_index(repair=not args.dry_run, rebuild=rebuild)
            except NotSupportedError as exc:
                raise UsageError(f"--rebuild-index: {exc}") from None
            if check is not None:
                _print_index(check, args)
            if not collect:
                return None
            return await collect_garbage(
                backend, max_bytes=max_bytes, max_age=max_age, prefix=args.prefix,
                dry_run=args.dry_run, state_dir=state_dir, progress=progress,
                fresh=getattr(args, "fresh", False), retired=retired,
                refuse_above=None if getattr(args, "yes", False) else MOST_OF_THE_STORE,
            )
        finally:
            await backend.close()

    try:
        report = run_sync(go())
    except GcRefusedError as exc:
        raise UsageError(
            f"gc {args.url}: {exc}; nothing was deleted. Check --max-bytes and --max-age, see "
            "the plan with --dry-run, and run again with --yes to delete it (that run resumes "
            "this plan)") from None
    finally:
        for bar in bars.values():
            bar.close()
    if report is None:
        return 0
    if getattr(args, "json", False):
        print(json.dumps(report.as_dict(), indent=2))
    else:
        _print_text(report, bool(retired))
    return 1 if report.failures else 0


def _print_index(check: IndexCheck, args: argparse.Namespace) -> None:
    """One line on stderr: what the reconcile (or rebuild) of the store's index did (nothing
    when the index and the store agreed)."""
    if not (check.rebuilt or check.removed or check.repaired or check.unindexed
            or check.missing):
        return
    if check.rebuilt:
        what = (f"index rebuilt from a listing: {check.indexed_objects} objects, "
                f"{check.indexed_bytes} bytes (pins and retention it held are gone)")
    elif args.dry_run:
        what = (f"index: {check.unindexed} objects not indexed and {check.missing} indexed but "
                "gone would be reconciled")
    else:
        what = (f"index reconciled: {check.removed} objects it did not account for removed, "
                f"{check.repaired} gone objects unindexed")
    print(what, file=sys.stderr)


def _print_text(report: GcReport, retired: bool) -> None:
    if report.resumed_from is not None:
        print(f"resumed an interrupted gc (at its {report.resumed_from} phase)")
    verb = "would delete" if report.dry_run else "deleted"
    print(
        f"scanned {report.scanned} objects ({report.scanned_bytes} bytes, "
        f"{human_bytes(report.scanned_bytes)}) in {report.pages} pages; {verb} "
        f"{report.expired} expired and {report.over_budget} over budget "
        f"({report.deleted_bytes} bytes); {report.failures} failures"
        + (f"; {verb} {report.retired} under retired keys" if retired else "")
    )
    if report.undated:
        print(f"{report.undated} objects have no modification time: never aged out by "
              "--max-age; under --max-bytes they go after every dated page")
    if report.held:
        print(f"{report.held} objects in {report.held_pages} pages pinned or retained: kept, "
              "with the pages before them in their chains")
    if report.kept_pages:
        print(f"{report.kept_pages} planned pages kept: a child's deletion failed or a page "
              "was pinned since the scan, and a chain is never holed")
    if report.headers_unreadable:
        print(f"{report.headers_unreadable} pages with an unreadable header counted as "
              "chains of their own")
