"""``hicache-store inspect URL``: the namespaces a store holds, and (``--verify``) whether intact.

For each namespace (from its manifest ``M_{digest}``): model, KV shape, dtype, page size, grid,
objects, pages and bytes; objects of a namespace without a manifest are listed as unknown::

    hicache-store inspect file:///var/cache/kv
    hicache-store inspect 's3://bucket/kv?endpoint_url=...' --verify --json
    hicache-store inspect file:///var/cache/kv --verify --delete-corrupt --dry-run

One pass over the listing, memory bounded at any store size. ``--verify`` re-reads every object
as it is listed, through a fixed window per reader, and checks its header and every per-layer
checksum (and its size against the namespace); corrupt ones are counted and the first 100
listed. ``--delete-corrupt`` removes them (``--dry-run``: only say so). Progress on stderr (a
redrawn line on a terminal, a plain line every few seconds otherwise). A path that holds no
store is an error: nothing is created. Exit code 1 when corrupt objects remain (found and not
deleted). Sealed (tenant) objects are counted per key id, each marked active, read, retired
or unknown against ``--tenant-key-file``; those under a key the ring holds are authenticated,
the others have their header checked only. Library: ``hicache_store.ops.inspection``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hicache_store._sync import run_sync
from hicache_store.backends.types import parse_size
from hicache_store.commands._common import (
    add_report_arguments,
    add_store_command,
    add_tenant_key_argument,
)
from hicache_store.errors import UsageError
from hicache_store.ops.config import layered, require, resolve
from hicache_store.ops.inspection import StoreReport, inspect_store
from hicache_store.ops.progress import ProgressBar, counted, human_bytes
from hicache_store.ops.store import open_store
from hicache_store.tenant import KeyRing


def register(subparsers: Any) -> None:
    parser = add_store_command(
        subparsers, "inspect",
        help="list namespaces, objects and bytes in a store; verify checksums", doc=__doc__)
    parser.add_argument("--namespace", metavar="DIGEST", help="only this namespace")
    parser.add_argument("--verify", action="store_true",
                        help="re-read every object and check every checksum")
    parser.add_argument("--delete-corrupt", action="store_true",
                        help="with --verify: delete the corrupt objects found")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --delete-corrupt: list what would be deleted, delete nothing")
    add_tenant_key_argument(parser, "a tenant key ring: authenticate its sealed objects and "
                                    "name the state of each key id")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="objects read at once by --verify (default: 16)")
    parser.add_argument("--window", default="8MiB",
                        help="bytes each --verify reader holds at a time (default: 8MiB)")
    add_report_arguments(parser, "report")
    layered(parser, section="inspect")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resolve(args)
    url = require(args, "url", "a backend URL")
    if args.delete_corrupt and not args.verify:
        raise UsageError("--delete-corrupt needs --verify")
    if args.dry_run and not args.delete_corrupt:
        raise UsageError("--dry-run only applies to --delete-corrupt")
    if args.namespace is not None:
        from hicache_store.layout.errors import InvalidNamespaceError
        from hicache_store.layout.manifest import manifest_key

        try:
            manifest_key(args.namespace)
        except InvalidNamespaceError as exc:
            raise UsageError(f"--namespace: {exc}; `hicache-store inspect URL` lists the "
                             "namespaces the store holds") from None
    if args.concurrency < 1:
        raise UsageError(f"--concurrency must be positive, got {args.concurrency}")
    try:
        window = parse_size(getattr(args, "window", "8MiB"))
    except ValueError as exc:
        raise UsageError(f"--window: {exc}") from None
    if window < 4096:
        raise UsageError(f"--window must be at least 4KiB, got {window} bytes")
    from hicache_store.tenant import load_key_ring

    try:
        keys = load_key_ring(getattr(args, "tenant_key_file", None))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    bar = ProgressBar(None, "objects", label="verify" if args.verify else "inspect",
                      enabled=not args.no_progress)

    def progress(listed: int, verified: int, nbytes: int) -> None:
        if args.verify:
            bar.update(verified, nbytes=nbytes)
        else:
            bar.update(listed)

    async def go() -> StoreReport:
        # Read-only unless corrupt objects are to be deleted: nothing is written, so an
        # inspection works on a full filesystem too.
        backend = open_store(url, existing=True,
                             read_only=not (args.delete_corrupt and not args.dry_run))
        try:
            return await inspect_store(
                backend, namespace=args.namespace, verify=args.verify,
                concurrency=args.concurrency, window=window,
                delete_corrupt=args.delete_corrupt, dry_run=args.dry_run, keys=keys,
                progress=progress,
            )
        finally:
            await backend.close()

    try:
        report = run_sync(go())
    finally:
        bar.close()
    if args.namespace is not None and not report.namespaces:
        held = ", ".join(report.unselected) or "none"
        raise UsageError(f"--namespace: the store holds no namespace {args.namespace} (no "
                         f"object, no manifest); namespaces it holds: {held}")
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        _print_text(report, keys)
    verified = report.verify
    return 1 if verified is not None and verified.remaining_corrupt else 0


def _print_text(report: StoreReport, keys: KeyRing | None) -> None:
    print(f"{counted(len(report.namespaces), 'namespace')}, "
          f"{counted(report.objects, 'object')}, {human_bytes(report.bytes)}; "
          f"{counted(report.manifests, 'manifest')}, {counted(report.other_keys, 'other key')}")
    for item in report.namespaces:
        ns = item.namespace
        if ns is None:
            why = f" ({item.manifest_error})" if item.manifest_error else ""
            print(f"  {item.digest}  unknown namespace (no readable manifest{why})")
        else:
            shape = (f"{ns.kv_kind} {ns.num_layers} layers x {ns.num_kv_heads} KV heads x "
                     f"{ns.head_dim}")
            tenant = f", tenant salt {ns.tenant_salt!r}" if ns.tenant_salt else ""
            tenant += ", sealed" if ns.sealed else ""
            print(f"  {item.digest}  {ns.model}{'@' + ns.model_revision if ns.model_revision else ''}"
                  f"  {shape}, {ns.dtype}, page {ns.page_size}, grid {ns.grid} "
                  f"({ns.objects_per_page} objects/page){tenant}")
        print(f"      {counted(item.pages, 'page')}, {counted(item.objects, 'object')}, "
              f"{human_bytes(item.bytes)}")
    verified = report.verify
    if verified is None:
        return
    print(f"verified {counted(verified.checked, 'object')} ({human_bytes(verified.bytes_read)}): "
          f"{verified.ok} ok, {verified.corrupt} corrupt, {verified.vanished} vanished")
    for key_id, count in sorted(verified.key_ids.items()):
        state = (keys.state(key_id) if keys is not None else None) or "unknown"
        print(f"  sealed with key {key_id} ({state}): {counted(count, 'object')}")
    if verified.unverified:
        print(f"  {verified.unverified} sealed objects under keys not held: header checked only")
    for item_ in verified.corrupt_examples:
        print(f"  corrupt {item_['key']}: {item_['error']}")
    if verified.corrupt > len(verified.corrupt_examples):
        print(f"  ... and {verified.corrupt - len(verified.corrupt_examples)} more")
    if verified.dry_run and verified.corrupt:
        print(f"would delete {counted(verified.corrupt, 'corrupt object')}")
    elif verified.deleted or verified.delete_failures:
        print(f"deleted {counted(verified.deleted, 'corrupt object')}; "
              f"{counted(verified.delete_failures, 'failure')}")
