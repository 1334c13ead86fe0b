"""Object formats: how a payload becomes a stored object and back, in one place each way.

A format owns four things and nothing else: the storage key of an object (and the page hash it
is stored under, ``stored_hash``: the page hash itself, or a keyed form), the bytes reserved
before its payload (``header_bytes``), ``seal`` (called once per object on the write path, after
the payload is in place: fills the header, and may transform the payload in place) and
``open_header`` / ``open_blocks`` (called on the read path: check the header read for a key,
then check, and may transform in place, the layer blocks that were read). ``ObjectIO`` calls
exactly these, so a format is the extension point for:

* **encryption at rest** (``objects.sealed.SealedFormat``): keyed page hashes in
  ``storage_key``, each layer block sealed in place with the object's key and header as
  associated data in ``seal`` and opened in ``open_blocks``; nothing else on the data path
  changes.
* **another engine's object layout** (SGLang's bare ``page-unified-v1``): a format
  with ``header_bytes == 0``, its own ``storage_key``, an ``open_header`` that synthesises the
  header from the key and the expected size, and no block checks.

``FRAMED`` is this library's format (``layout.framing``: a checksummed header with one xxh3 per
layer block, the payload at a 4096-byte aligned offset). ``PAGE_UNIFIED`` is SGLang's bare
``page-unified-v1`` object: the payload and nothing else, which is what the ``sglang-ukv1`` key
scheme stores (SGLang reads those objects raw). ``format_for`` is the one rule that picks.

**What a bare object loses** (against ``FRAMED``): no per-layer checksums, so a flipped or torn
byte is served as KV (only a wrong *size* is caught: a short object fails its range read, a long
one its whole read); no recorded key, so an object stored under the wrong key cannot be told
from a right one; no parent page hash, so ``hicache-store gc`` cannot rebuild chains and
shortens them by age alone (possibly leaving a hole mid-chain); no format version. What it keeps:
the namespace digest and coordinates in the key, so dtype, model and grid mismatches still
miss.
"""

from __future__ import annotations

from typing import Protocol

from hicache_store.layout.framing import (
    ObjectHeader,
    decode_header,
    encode_header,
    payload_offset,
    verify_blocks,
)
from hicache_store.layout.keys import ObjectKey, format_key, is_ukv1_digest
from hicache_store.layout.namespace import Namespace


class ObjectFormat(Protocol):
    """How payloads are stored. See the module docstring for what each method may do."""

    @property
    def name(self) -> str: ...

    @property
    def sealed(self) -> bool:
        """Whether this format writes ``Namespace.sealed`` objects (``ObjectIO`` refuses a
        format that does not match its namespace)."""
        ...

    def stored_hash(self, page_hash: str) -> str:
        """The page hash that names ``page_hash``'s objects in the store (and their headers):
        ``page_hash`` itself, or a keyed form. ``storage_key`` of a key with ``page_hash`` is
        ``stored_hash(page_hash)`` followed by the key's other parts."""
        ...

    def storage_key(self, key: ObjectKey) -> str:
        """The backend key of ``key`` (validated again by the backend)."""
        ...

    def header_bytes(self, num_layers: int) -> int:
        """Bytes before the payload in an object of ``num_layers`` layer blocks (0: none)."""
        ...

    def seal(
        self, key: ObjectKey, frame: memoryview, *, kv_planes: int, parent_hash: str | None
    ) -> None:
        """Make ``frame`` (``header_bytes`` reserved, then the payload) the stored object."""
        ...

    def open_header(self, key: ObjectKey, header: memoryview, *, payload_bytes: int) -> ObjectHeader:
        """Check the ``header_bytes`` read for ``key`` (whose payload must be ``payload_bytes``
        long); raise ``CorruptObjectError`` on any disagreement."""
        ...

    def open_blocks(
        self, header: ObjectHeader, data: memoryview, layer_start: int, layer_stop: int
    ) -> None:
        """Check the layer blocks ``[layer_start, layer_stop)`` read contiguously into ``data``;
        raise ``CorruptObjectError`` when one is wrong."""
        ...


class _PlainKeys:
    """The keys of a format that does not seal: objects are stored under the plain page hash
    and the key as ``layout.keys`` writes it."""

    sealed = False

    def stored_hash(self, page_hash: str) -> str:
        return page_hash

    def storage_key(self, key: ObjectKey) -> str:
        return format_key(key)


class FramedFormat(_PlainKeys):
    """Format version 1 of ``layout.framing``: header, per-layer xxh3 checksums, aligned payload."""

    name = "framed-v1"

    def header_bytes(self, num_layers: int) -> int:
        return payload_offset(num_layers)

    def seal(
        self, key: ObjectKey, frame: memoryview, *, kv_planes: int, parent_hash: str | None
    ) -> None:
        size = self.header_bytes(key.coords.num_layers)
        header = encode_header(key, frame[size:], kv_planes, parent_hash=parent_hash)
        frame[:size] = header

    def open_header(self, key: ObjectKey, header: memoryview, *, payload_bytes: int) -> ObjectHeader:
        size = self.header_bytes(key.coords.num_layers)
        return decode_header(header, expected=key, object_length=size + payload_bytes)

    def open_blocks(
        self, header: ObjectHeader, data: memoryview, layer_start: int, layer_stop: int
    ) -> None:
        verify_blocks(header, data, layer_start, layer_stop)


#: this library's object format (the default everywhere).
FRAMED: ObjectFormat = FramedFormat()


class PageUnifiedFormat(_PlainKeys):
    """SGLang's bare ``page-unified-v1`` objects: the payload is the object (no header).

    The payload's byte order is this library's unified payload (``(layer, K/V, token,
    head_in_group, head_dim)`` per head group, ``(layer, token, dim)`` for MLA), which is
    SGLang's page block cut into chunks. See the module docstring for what is not checked.
    """

    name = "page-unified-v1"

    def header_bytes(self, num_layers: int) -> int:
        return 0

    def seal(
        self, key: ObjectKey, frame: memoryview, *, kv_planes: int, parent_hash: str | None
    ) -> None:
        pass  # nothing to add: the payload is the object

    def open_header(self, key: ObjectKey, header: memoryview, *, payload_bytes: int) -> ObjectHeader:
        """The header a bare object would have had: from the key and the size asked for."""
        coords = key.coords
        return ObjectHeader(
            namespace_digest=key.namespace_digest,
            page_hash=key.page_hash,
            coords=coords,
            kv_planes=1 if coords.head_group is None else 2,
            payload_offset=0,
            payload_length=payload_bytes,
            block_checksums=(0,) * coords.num_layers,  # none stored: never compared
        )

    def open_blocks(
        self, header: ObjectHeader, data: memoryview, layer_start: int, layer_stop: int
    ) -> None:
        pass  # no checksums to compare (the module docstring says what is lost)


#: SGLang's bare object format (the ``sglang-ukv1`` key scheme's).
PAGE_UNIFIED: ObjectFormat = PageUnifiedFormat()


def format_for(namespace_or_key: Namespace | ObjectKey) -> ObjectFormat:
    """The format objects of a namespace (or under a key) are stored in: SGLang's bare
    ``page-unified-v1`` for its ukv1 keyspace, ``FRAMED`` for this library's."""
    digest = (
        namespace_or_key.digest
        if isinstance(namespace_or_key, Namespace)
        else namespace_or_key.namespace_digest
    )
    return PAGE_UNIFIED if is_ukv1_digest(digest) else FRAMED
