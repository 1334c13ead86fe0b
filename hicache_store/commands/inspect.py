"""``hicache-store inspect URL``: the namespaces a store holds, and (``--verify``) whether intact.

For each namespace (from its manifest ``M_{digest}``): model, KV shape, dtype, page size, grid,
objects, pages and bytes; objects of a namespace without a manifest are listed as unknown::

    hicache-store inspect file:///var/cache/kv
    hicache-store inspect 's3://bucket/kv?endpoint_url=...' --verify --json
    hicache-store inspect file:///var/cache/kv --verify --delete-corrupt --dry-run

``--verify`` re-reads every object and checks its header and every per-layer checksum (and
its size against the namespace), with a progress bar on stderr, and lists corrupt ones.
``--delete-corrupt`` removes them (``--dry-run``: only say so). Exit code 1 when corrupt
objects remain (found and not deleted). Sealed (tenant) objects are counted per key id, each
marked active, read, retired or unknown against ``--tenant-key-file``; those under a key the
ring holds are authenticated, the others have their header checked only.
Library: ``hicache_store.ops.inspection``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hicache_store._sync import run_sync
from hicache_store.cli import UsageError
from hicache_store.ops.config import layered, require, resolve
from hicache_store.ops.inspection import StoreReport, VerifyReport, inspect_store, verify_store
from hicache_store.ops.progress import ProgressBar, human_bytes
from hicache_store.ops.store import open_store
from hicache_store.tenant import KeyRing


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect", help="list namespaces, objects and bytes in a store; verify checksums",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("url", nargs="?", default=None,
                        help="backend URL, e.g. file:///var/cache/kv (or HICACHE_STORE_URL)")
    parser.add_argument("--namespace", metavar="DIGEST", help="only this namespace")
    parser.add_argument("--verify", action="store_true",
                        help="re-read every object and check every checksum")
    parser.add_argument("--delete-corrupt", action="store_true",
                        help="with --verify: delete the corrupt objects found")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --delete-corrupt: list what would be deleted, delete nothing")
    parser.add_argument("--tenant-key-file", metavar="PATH",
                        help="a tenant key ring: authenticate its sealed objects and name the "
                             "state of each key id (default: $HICACHE_STORE_TENANT_KEY_FILE)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="objects read at once by --verify (default: 16)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    layered(parser, section="inspect")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resolve(args)
    url = require(args, "url", "a backend URL")
    if args.delete_corrupt and not args.verify:
        raise UsageError("--delete-corrupt needs --verify")
    if args.dry_run and not args.delete_corrupt:
        raise UsageError("--dry-run only applies to --delete-corrupt")
    if args.concurrency < 1:
        raise UsageError(f"--concurrency must be positive, got {args.concurrency}")
    from hicache_store.tenant import load_key_ring

    try:
        keys = load_key_ring(args.tenant_key_file)
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    async def go() -> tuple[StoreReport, VerifyReport | None]:
        backend = open_store(url)
        try:
            report = await inspect_store(backend, namespace=args.namespace)
            if not args.verify:
                return report, None
            total = sum(len(keys) for keys in report.keys.values())
            bar = ProgressBar(total, "objects", label="verify", enabled=not args.no_progress)
            try:
                checked = await verify_store(
                    backend, report, concurrency=args.concurrency,
                    delete_corrupt=args.delete_corrupt, dry_run=args.dry_run, keys=keys,
                    progress=lambda done, nbytes: bar.update(done, nbytes=nbytes),
                )
                bar.update(checked.checked, nbytes=checked.bytes_read, final=True)
            finally:
                bar.close()
            return report, checked
        finally:
            await backend.close()

    report, verified = run_sync(go())
    if args.json:
        data = report.as_dict()
        if verified is not None:
            data["verify"] = verified.as_dict()
        print(json.dumps(data, indent=2))
    else:
        _print_text(report, verified, keys)
    if verified is None:
        return 0
    remaining = {c["key"] for c in verified.corrupt} - set(verified.deleted)
    return 1 if remaining else 0


def _print_text(report: StoreReport, verified: VerifyReport | None, keys: KeyRing | None) -> None:
    print(f"{len(report.namespaces)} namespaces, {report.objects} objects, "
          f"{human_bytes(report.bytes)}; {report.manifests} manifests, "
          f"{report.other_keys} other keys")
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
        print(f"      {item.pages} pages, {item.objects} objects, {human_bytes(item.bytes)}")
    if verified is None:
        return
    print(f"verified {verified.checked} objects ({human_bytes(verified.bytes_read)}): "
          f"{verified.ok} ok, {len(verified.corrupt)} corrupt, {len(verified.vanished)} vanished")
    for key_id, count in sorted(verified.key_ids.items()):
        state = (keys.state(key_id) if keys is not None else None) or "unknown"
        print(f"  sealed with key {key_id} ({state}): {count} objects")
    if verified.unverified:
        print(f"  {verified.unverified} sealed objects under keys not held: header checked only")
    for item_ in verified.corrupt:
        print(f"  corrupt {item_['key']}: {item_['error']}")
    verb = "would delete" if verified.dry_run else "deleted"
    if verified.deleted or verified.dry_run:
        count = len(verified.corrupt) if verified.dry_run else len(verified.deleted)
        print(f"{verb} {count} corrupt objects; {len(verified.delete_failures)} failures")
