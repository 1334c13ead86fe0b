"""What a store holds, and whether it is intact: the library behind ``hicache-store inspect``.

``inspect_store`` streams the listing once (``Backend.list_entries``; needs a listing backend)
and groups what it sees:

* **namespaces**: object keys grouped by namespace digest, with objects, bytes and distinct
  pages; the namespace itself (model, KV shape, dtype, page size, grid) comes from its
  manifest (``ops.manifest``) when one is stored, else it is reported as unknown;
* **manifests** whose namespace has no objects are listed too (an emptied namespace);
* **other** keys (neither object nor manifest) are counted, never touched.

With ``verify``, every object is re-read as it is listed and checked by the one verified read
path (``objects.ObjectIO.verify_stored``: the stored size and the header against the key,
every layer block through the object format) and, where the manifest is known, that the
payload has the size the namespace gives that layer chunk; manifests are checked too (JSON,
fields, digest against fields and key). An object that vanished between listing and reading
is counted apart (not corrupt). ``delete_corrupt`` removes what failed as it is found (unless
``dry_run``): a removed object is a miss for every engine, which recomputes it, never wrong
KV.

Sealed objects (``Namespace.sealed``, a tenant's) name their key id in the header: verify
counts objects per key id (``key_ids``) and, given the tenant's key ring, authenticates every
block of those sealed with a key it holds; sealed objects under a key it does not hold
(retired, another tenant's, or no ring given) have their header checked only and are counted
in ``unverified``, never reported corrupt for that.

**Bounded memory at any store size.** Nothing per object is kept: counts per namespace, the
distinct pages through ``ops.distinct`` (spilled to temporary files past 262,144), and at
most ``EXAMPLES`` keys of each kind of problem (the counts stay exact). Verification reads
each object through one ``window``-byte buffer per reader (``concurrency`` readers; a layer
block larger than the window is read whole): a 512 MiB object costs a window, never a copy
of itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache_store.backends import aligned_buffer, reads_not_counted
from hicache_store.backends.base import Backend
from hicache_store.backends.errors import BackendError
from hicache_store.backends.types import ObjectStat
from hicache_store.layout.errors import CorruptObjectError
from hicache_store.layout.framing import ObjectHeader, payload_offset
from hicache_store.layout.keys import ObjectKey, object_key_parts, parse_key
from hicache_store.layout.namespace import MAX_LAYERS_PER_OBJECT, Namespace
from hicache_store.objects import ObjectIO
from hicache_store.tenant import KeyRing

from .distinct import DistinctCounter
from .manifest import ManifestError, decode_manifest, manifest_digest, manifest_key

#: keys kept per kind of problem in a report (the counts are exact).
EXAMPLES = 100
#: bytes each verifying reader reads at a time (one buffer per reader).
VERIFY_WINDOW = 8 << 20
#: the longest header an object can have (``MAX_LAYERS_PER_OBJECT`` layer blocks).
HEADER_MAX = payload_offset(MAX_LAYERS_PER_OBJECT)

#: ``progress(listed, verified, bytes_read)``, called every few hundred objects.
ProgressFn = Callable[[int, int, int], None]


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
class VerifyReport:
    """Counts are exact; the lists hold at most ``EXAMPLES`` entries each."""

    checked: int = 0
    ok: int = 0
    bytes_read: int = 0
    corrupt: int = 0
    vanished: int = 0
    deleted: int = 0
    delete_failures: int = 0
    dry_run: bool = False
    #: sealed objects per key id, and those whose key was not held (header checked only).
    key_ids: dict[str, int] = field(default_factory=dict)
    unverified: int = 0
    corrupt_examples: list[dict[str, str]] = field(default_factory=list)
    vanished_examples: list[str] = field(default_factory=list)
    deleted_examples: list[str] = field(default_factory=list)
    delete_failure_examples: list[str] = field(default_factory=list)

    @property
    def remaining_corrupt(self) -> int:
        """Corrupt objects still stored (found and not deleted)."""
        return self.corrupt - self.deleted

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "remaining_corrupt": self.remaining_corrupt}


@dataclass
class StoreReport:
    namespaces: list[NamespaceSummary] = field(default_factory=list)
    manifests: int = 0
    other_keys: int = 0
    other_bytes: int = 0
    verify: VerifyReport | None = None
    #: with ``namespace`` given: digests of the other namespaces listed (at most
    #: ``EXAMPLES``), so a digest the store does not hold is answered with those it does.
    unselected: list[str] = field(default_factory=list)

    @property
    def objects(self) -> int:
        return sum(n.objects for n in self.namespaces)

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.namespaces)

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "namespaces": [n.as_dict() for n in self.namespaces],
            "objects": self.objects,
            "bytes": self.bytes,
            "manifests": self.manifests,
            "other_keys": self.other_keys,
            "other_bytes": self.other_bytes,
        }
        if self.verify is not None:
            data["verify"] = self.verify.as_dict()
        return data


def _note(examples: list[Any], item: Any) -> None:
    if len(examples) < EXAMPLES:
        examples.append(item)


async def inspect_store(
    backend: Backend,
    *,
    namespace: str | None = None,
    verify: bool = False,
    concurrency: int = 16,
    window: int = VERIFY_WINDOW,
    delete_corrupt: bool = False,
    dry_run: bool = False,
    keys: KeyRing | None = None,
    progress: ProgressFn | None = None,
) -> StoreReport:
    """List the store once and summarise it per namespace (only digest ``namespace`` if
    given); with ``verify``, check every object as it is listed (a tenant's sealed objects
    authenticated with ``keys``, a key ring). See the module docstring."""
    if concurrency < 1 or window < 1:
        raise ValueError(f"concurrency and window must be positive, got {concurrency}, {window}")
    # An inspection's reads are not uses (see ``reads_not_counted``; gc's are not either).
    with reads_not_counted():
        scan = _Scan(backend, namespace)
        checker = (_Verifier(backend, concurrency, window, delete_corrupt, dry_run, keys)
                   if verify else None)
        listed = 0
        try:
            if checker is not None:
                checker.start()
            async for st in backend.list_entries(""):
                listed += 1
                parts = scan.add(st)
                if checker is not None and parts is not None:
                    await checker.submit(st, await scan.namespace_of(parts[1]))
                if progress is not None and listed % 256 == 0:
                    progress(listed, *(checker.done() if checker else (0, 0)))
            report = await scan.finish()
            if checker is not None:
                report.verify = await checker.finish(report)
            if progress is not None:
                progress(listed, *(checker.done() if checker else (0, 0)))
            return report
        finally:
            scan.close()
            if checker is not None:
                checker.cancel()


class _Scan:
    """The per-namespace counts of one listing, and the manifests read along the way."""

    def __init__(self, backend: Backend, namespace: str | None) -> None:
        self.backend = backend
        self.only = namespace
        self.report = StoreReport()
        self.summaries: dict[str, NamespaceSummary] = {}
        self.pages: dict[str, DistinctCounter] = {}
        self.listed_manifests: set[str] = set()
        self.manifests: dict[str, Namespace | ManifestError | None] = {}

    def add(self, st: ObjectStat) -> tuple[str, str] | None:
        """Count one listed object; its ``(page_hash, digest)`` when it is a KV object of a
        namespace being inspected."""
        digest = manifest_digest(st.key)
        if digest is not None:
            self.report.manifests += 1
            self.listed_manifests.add(digest)
            if self.only is not None and digest != self.only:
                self.unselect(digest)
            return None
        parts = object_key_parts(st.key)
        if parts is None:
            self.report.other_keys += 1
            self.report.other_bytes += st.size
            return None
        page, digest = parts
        if self.only is not None and digest != self.only:
            self.unselect(digest)
            return None
        item = self.summary(digest)
        item.objects += 1
        item.bytes += st.size
        self.pages[digest].add(page)
        return parts

    def unselect(self, digest: str) -> None:
        if digest not in self.report.unselected:
            _note(self.report.unselected, digest)

    def summary(self, digest: str) -> NamespaceSummary:
        if digest not in self.summaries:
            self.summaries[digest] = NamespaceSummary(digest)
            self.pages[digest] = DistinctCounter()
        return self.summaries[digest]

    async def namespace_of(self, digest: str) -> Namespace | None:
        """The namespace a digest's manifest describes (read once); None if absent or bad."""
        if digest not in self.manifests:
            key = manifest_key(digest)
            try:
                data = await self.backend.get_bytes(key)
                self.manifests[digest] = None if data is None else decode_manifest(data, key=key)
            except ManifestError as exc:
                self.manifests[digest] = exc
            except BackendError as exc:
                self.manifests[digest] = ManifestError(f"unreadable: {exc}")
        found = self.manifests[digest]
        return found if isinstance(found, Namespace) else None

    async def finish(self) -> StoreReport:
        for digest in self.listed_manifests:
            if self.only is None or digest == self.only:
                self.summary(digest)
        for digest, item in self.summaries.items():
            await self.namespace_of(digest)
            found = self.manifests[digest]
            if isinstance(found, Namespace):
                item.namespace = found
            elif isinstance(found, ManifestError):
                item.manifest_error = str(found)
            item.pages = self.pages[digest].count()
        self.report.namespaces = sorted(self.summaries.values(), key=lambda s: (-s.bytes, s.digest))
        return self.report

    def close(self) -> None:
        for counter in self.pages.values():
            counter.close()


class _Verifier:
    """``concurrency`` readers, each with one ``window``-byte buffer, fed by a short queue (the
    listing waits when they fall behind: memory stays bounded)."""

    def __init__(self, backend: Backend, concurrency: int, window: int, delete_corrupt: bool,
                 dry_run: bool, keys: KeyRing | None) -> None:
        self.backend = backend
        self.keys = keys
        self.io = ObjectIO(backend)
        self.concurrency = concurrency
        self.window = -(-window // 4096) * 4096  # whole 4 KiB blocks: O_DIRECT-friendly
        self.delete_corrupt = delete_corrupt
        self.result = VerifyReport(dry_run=dry_run)
        self.queue: asyncio.Queue[tuple[ObjectStat, Namespace | None] | None] = asyncio.Queue(
            maxsize=2 * concurrency)
        self.workers: list[asyncio.Task[None]] = []
        #: the first read that failed for another reason than corruption (the store is
        #: down): readers then drain the queue without reading, and the run raises it.
        self.failure: BackendError | TimeoutError | None = None

    def start(self) -> None:
        self.workers = [asyncio.ensure_future(self._work()) for _ in range(self.concurrency)]

    async def submit(self, st: ObjectStat, namespace: Namespace | None) -> None:
        if self.failure is not None:
            raise self.failure
        await self.queue.put((st, namespace))

    def done(self) -> tuple[int, int]:
        return self.result.checked, self.result.bytes_read

    async def finish(self, report: StoreReport) -> VerifyReport:
        for _ in self.workers:
            await self.queue.put(None)
        await asyncio.gather(*self.workers)
        if self.failure is not None:
            raise self.failure
        for item in report.namespaces:  # a bad manifest is a corrupt object too
            if item.manifest_error is not None:
                await self._corrupt(manifest_key(item.digest), item.manifest_error)
        self.result.corrupt_examples.sort(key=lambda c: c["key"])
        return self.result

    def cancel(self) -> None:
        for task in self.workers:
            task.cancel()

    async def _work(self) -> None:
        buffer = aligned_buffer(max(self.window, HEADER_MAX))  # room for any header
        while (job := await self.queue.get()) is not None:
            st, namespace = job
            if self.failure is not None:
                continue
            try:
                found = await verify_object(self.io, st.key, namespace, buffer,
                                            window=self.window, keys=self.keys)
            except (BackendError, TimeoutError) as exc:
                self.failure = exc
                continue
            except _Vanished:
                self.result.checked += 1
                self.result.vanished += 1
                _note(self.result.vanished_examples, st.key)
                continue
            self.result.checked += 1
            self.result.bytes_read += st.size
            if isinstance(found, str):
                await self._corrupt(st.key, found)
                continue
            self.result.ok += 1
            if found.key_id is not None:
                self.result.key_ids[found.key_id] = self.result.key_ids.get(found.key_id, 0) + 1
            if found.sealed and (self.keys is None or self.keys.key(found.key_id or "") is None):
                self.result.unverified += 1

    async def _corrupt(self, key: str, error: str) -> None:
        result = self.result
        result.corrupt += 1
        _note(result.corrupt_examples, {"key": key, "error": error})
        if not self.delete_corrupt or result.dry_run:
            return
        try:
            await self.backend.delete([key])
        except BackendError:
            result.delete_failures += 1
            _note(result.delete_failure_examples, key)
        else:
            result.deleted += 1
            _note(result.deleted_examples, key)


class _Vanished(Exception):
    """The object was deleted between the listing and the read."""


async def verify_object(
    io: ObjectIO, key: str, namespace: Namespace | None, buffer: memoryview,
    *, window: int | None = None, keys: KeyRing | None = None,
) -> ObjectHeader | str:
    """Check one stored object (``ObjectIO.verify_stored``: stored size, header, every layer
    block, through ``buffer`` at most ``window`` bytes at a time; a tenant's sealed object
    authenticated with ``keys`` when they hold its key) and, when the namespace is known, its
    geometry: its header when intact, else the error as ``"Kind: message"``. Raises
    ``_Vanished`` when the object is gone."""
    try:
        header = await io.verify_stored(key, buffer, window=window, keys=keys)
        if header is None:
            raise _Vanished(key)
        if namespace is not None:
            _check_geometry(parse_key(key), header.payload_length, header.kv_planes, namespace)
    except CorruptObjectError as exc:
        return f"{type(exc).__name__}: {exc}"
    return header


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
