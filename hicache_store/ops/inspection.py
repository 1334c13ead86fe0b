"""What a store holds, and whether it is intact: the library behind ``hicache-store inspect``.

``inspect_store`` lists every key once (needs a listing backend) with its size, and groups
them:

* **namespaces**: object keys (``parse_key``) grouped by namespace digest, with objects, bytes
  and distinct pages; the namespace itself (model, KV shape, dtype, page size, grid) comes
  from its manifest (``ops.manifest``) when one is stored, else it is reported as unknown;
* **manifests** whose namespace has no objects are listed too (an emptied namespace);
* **other** keys (neither object nor manifest) are counted, never touched.

``verify_store`` re-reads every object whole and checks it with the layout's own decoder
(``framing.decode_object``: strict header, key match, per-layer xxh3 checksums, exact
length) and, where the manifest is known, that the payload has the size the namespace gives
that layer chunk; manifests are checked too (JSON, fields, digest against fields and key). An
object that vanished between listing and reading is counted apart (not corrupt). Reads run
``concurrency`` at a time. ``delete_corrupt`` removes what failed (unless ``dry_run``): a
removed object is a miss for every engine, which recomputes it, never wrong KV.

Sealed objects (``Namespace.sealed``) name their key id in the header. ``verify_store`` counts
objects per key id (``key_ids``) and, given the tenant's key ring, authenticates every block of
those sealed with a key it holds; sealed objects under a key it does not hold (retired,
another tenant's, or no ring given) have their header checked only and are counted in
``unverified``, never reported corrupt for that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache_store.backends.base import Backend
from hicache_store.backends.errors import BackendError
from hicache_store.commands.gc import Entry, scan
from hicache_store.layout.errors import CorruptObjectError, InvalidKeyError
from hicache_store.layout.framing import decode_header, verify_blocks
from hicache_store.layout.keys import ObjectKey, is_ukv1_digest, parse_key
from hicache_store.layout.namespace import Namespace
from hicache_store.tenant import KeyRing

from .manifest import ManifestError, decode_manifest, manifest_digest, manifest_key


@dataclass
class NamespaceSummary:
    digest: str
    namespace: Namespace | None = None
    manifest_error: str | None = None
    objects: int = 0
    bytes: int = 0
    pages: int = 0

    def as_dict(self) -> dict[str, Any]:
        ns = self.namespace
        return {
            "digest": self.digest,
            "manifest": ns is not None,
            "manifest_error": self.manifest_error,
            "namespace": ns.to_json() if ns is not None else None,
            "grid": str(ns.grid) if ns is not None else None,
            "objects": self.objects,
            "bytes": self.bytes,
            "pages": self.pages,
            "objects_per_page": ns.objects_per_page if ns is not None else None,
        }


@dataclass
class StoreReport:
    namespaces: list[NamespaceSummary] = field(default_factory=list)
    manifests: int = 0
    other_keys: int = 0
    other_bytes: int = 0
    #: object keys per namespace digest (for ``verify_store``); not in ``as_dict``.
    keys: dict[str, list[Entry]] = field(default_factory=dict)

    @property
    def objects(self) -> int:
        return sum(n.objects for n in self.namespaces)

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.namespaces)

    def as_dict(self) -> dict[str, Any]:
        return {
            "namespaces": [n.as_dict() for n in self.namespaces],
            "objects": self.objects,
            "bytes": self.bytes,
            "manifests": self.manifests,
            "other_keys": self.other_keys,
            "other_bytes": self.other_bytes,
        }


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    bytes_read: int = 0
    corrupt: list[dict[str, str]] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    delete_failures: list[str] = field(default_factory=list)
    dry_run: bool = False
    #: sealed objects per key id, and those whose key was not held (header checked only).
    key_ids: dict[str, int] = field(default_factory=dict)
    unverified: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def inspect_store(backend: Backend, *, namespace: str | None = None) -> StoreReport:
    """List the store and summarise it per namespace (optionally only digest ``namespace``)."""
    entries = await scan(backend, "")
    report = StoreReport()
    by_digest: dict[str, NamespaceSummary] = {}
    pages: dict[str, set[str]] = {}
    manifests: dict[str, Entry] = {}

    def summary(digest: str) -> NamespaceSummary:
        if digest not in by_digest:
            by_digest[digest] = NamespaceSummary(digest)
            pages[digest] = set()
            report.keys[digest] = []
        return by_digest[digest]

    for entry in entries:
        digest = manifest_digest(entry.key)
        if digest is not None:
            manifests[digest] = entry
            report.manifests += 1
            continue
        try:
            key = parse_key(entry.key)
        except InvalidKeyError:
            report.other_keys += 1
            report.other_bytes += entry.size
            continue
        item = summary(key.namespace_digest)
        item.objects += 1
        item.bytes += entry.size
        pages[key.namespace_digest].add(key.page_hash)
        report.keys[key.namespace_digest].append(entry)
    for digest, entry in manifests.items():
        item = summary(digest)
        try:
            data = await backend.get_bytes(entry.key)
            item.namespace = None if data is None else decode_manifest(data, key=entry.key)
        except (ManifestError, BackendError) as exc:
            item.manifest_error = str(exc)
    for digest, item in by_digest.items():
        item.pages = len(pages[digest])
    chosen = [s for d, s in sorted(by_digest.items()) if namespace is None or d == namespace]
    report.namespaces = sorted(chosen, key=lambda s: (-s.bytes, s.digest))
    if namespace is not None:
        report.keys = {d: k for d, k in report.keys.items() if d == namespace}
    return report


def _check_object(
    key: str, data: bytes, namespace: Namespace | None, keys: KeyRing | None = None
) -> tuple[str | None, bool]:
    """Check one whole object; ``(key id or None, verified)``. Raises ``CorruptObjectError``."""
    expected = parse_key(key)
    if is_ukv1_digest(expected.namespace_digest):
        # SGLang's bare page-unified-v1 objects: no header, no checksums; all there is to
        # check is the size the namespace gives (when its manifest is known).
        if namespace is not None:
            _check_geometry(expected, len(data), namespace.kv_planes, namespace)
        return None, True
    sealed = None if namespace is None else namespace.sealed
    header = decode_header(data, expected=expected, object_length=len(data), sealed=sealed)
    tenant_key = None
    if header.key_id is not None:
        tenant_key = None if keys is None else keys.key(header.key_id)
    if tenant_key is not None or not header.sealed:
        # Read-only bytes: a sealed object's blocks are authenticated, not decrypted.
        verify_blocks(
            header,
            memoryview(data)[header.payload_offset :],
            header.coords.layer_start,
            header.coords.layer_stop,
            key=tenant_key,
        )
    if namespace is not None:
        _check_geometry(expected, header.payload_length, header.kv_planes, namespace)
    return header.key_id, tenant_key is not None or not header.sealed


def _check_geometry(key: ObjectKey, payload: int, planes: int, ns: Namespace) -> None:
    coords = key.coords
    try:
        chunk = ns.chunk_of_layer(coords.layer_start)
    except IndexError:
        chunk = -1
    try:
        start, stop = ns.chunk_layers(chunk)
    except IndexError:
        start, stop = -1, -1
    if (start, stop) != (coords.layer_start, coords.layer_stop):
        raise CorruptObjectError(f"layers {coords.suffix} are not a chunk of grid {ns.grid}")
    if planes != ns.kv_planes or payload != ns.object_payload_bytes(chunk):
        raise CorruptObjectError(
            f"payload of {payload} bytes, namespace {ns.digest} says "
            f"{ns.object_payload_bytes(chunk)}"
        )


async def verify_store(
    backend: Backend,
    report: StoreReport,
    *,
    concurrency: int = 16,
    delete_corrupt: bool = False,
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
    keys: KeyRing | None = None,
) -> VerifyReport:
    """Re-read and check every object (and manifest) that ``report`` lists; see the docstring.

    ``progress(done, bytes_read)`` is called after each object. ``keys``: a tenant key ring,
    to authenticate the sealed objects under its readable keys.
    """
    result = VerifyReport(dry_run=dry_run)
    known = {s.digest: s.namespace for s in report.namespaces}
    jobs: list[tuple[str, Namespace | None]] = [
        (entry.key, known.get(digest)) for digest, entries in report.keys.items()
        for entry in entries
    ]
    for item in report.namespaces:
        if item.manifest_error is not None:
            result.corrupt.append({"key": manifest_key(item.digest), "error": item.manifest_error})
    limit = asyncio.Semaphore(max(1, concurrency))

    async def check(key: str, namespace: Namespace | None) -> None:
        async with limit:
            data = await backend.get_bytes(key)
        result.checked += 1
        if data is None:
            result.vanished.append(key)
        else:
            result.bytes_read += len(data)
            try:
                key_id, verified = _check_object(key, data, namespace, keys)
                result.ok += 1
                if key_id is not None:
                    result.key_ids[key_id] = result.key_ids.get(key_id, 0) + 1
                result.unverified += not verified
            except CorruptObjectError as exc:
                result.corrupt.append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
        if progress is not None:
            progress(result.checked, result.bytes_read)

    await asyncio.gather(*(check(k, ns) for k, ns in jobs))
    result.corrupt.sort(key=lambda c: c["key"])
    if delete_corrupt and result.corrupt and not dry_run:
        await _delete(backend, [c["key"] for c in result.corrupt], result)
    return result


async def _delete(backend: Backend, keys: Iterable[str], result: VerifyReport) -> None:
    for key in keys:
        try:
            await backend.delete([key])
            result.deleted.append(key)
        except BackendError:
            result.delete_failures.append(key)
