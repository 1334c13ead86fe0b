"""Object framing: a small fixed header, then the payload at a 4096-byte aligned offset.

Binary format, version 1 (all integers little-endian)::

    offset  size  field
    0       8     magic b"HCSTORE\\0"
    8       2     format version (1)
    10      2     kv planes (2 = MHA K/V, 1 = MLA)
    12      4     payload offset (a multiple of 4096)
    16      8     payload length in bytes
    24      8     namespace digest (the 16 hex characters as 8 bytes)
    32      1     page-hash length in bytes (16 or 32)
    33      1     parent page-hash length (0 = unknown or first page, else the page's)
    34      2     component (0 = full-attention KV)
    36      4     first layer
    40      4     last layer (inclusive, as in the key)
    44      4     head group (0xFFFFFFFF = none, MLA)
    48      4     number of layer blocks (= last - first + 1)
    52      4     reserved, 0
    56      32    page hash (zero-padded when 16 bytes)
    88      32    parent page hash: the previous page of the chain (zero-padded; zero if unknown)
    120     8*n   xxh3_64 of each layer block, in layer order
    120+8n  8     xxh3_64 of bytes [0, 120+8n): the header's own checksum
    ...           zero padding up to the payload offset

Sealed objects (a ``Namespace.sealed`` namespace, ``layout.sealing``) are format version 2:
the same fixed part, then the key id and salt, and a GCM tag per layer block in place of the
checksums; the payload is the ciphertext, block for block at the same offsets::

    120     8     key id of the tenant key that sealed it
    128     16    salt (derives the object's AES key)
    144     16*n  AES-256-GCM tag of each layer block, in layer order
    144+16n 8     xxh3_64 of bytes [0, 144+16n): the header's own checksum

Bytes ``[0, 144)`` are part of every block's associated data, so nothing in them can change
without every block failing authentication; the header checksum still tells accidental
corruption (``HeaderChecksumError``) from forgery (``TamperedObjectError``).

The parent link lets tools that see only stored objects (``hicache-store gc``) rebuild the
chains and shorten them from the tail, never leaving a hole in the middle of a cached prefix.

The payload is ``n`` equal layer blocks; block ``i`` holds layer ``first + i``. One checksum per
layer block means a range read of some layers is verified without reading the others.

``decode_header`` is strict and bounded: it never reads past the buffer it is given, checks
every length and offset with exact integer arithmetic (Python ints cannot overflow, and every
value is checked against explicit bounds before use), and raises one specific
``CorruptObjectError`` subclass per way a header can be wrong. ``encode_header`` is its inverse.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from . import sealing
from .errors import (
    BadMagicError,
    HeaderChecksumError,
    HeaderFieldError,
    KeyMismatchError,
    MissingKeyError,
    PayloadChecksumError,
    TamperedObjectError,
    TruncatedObjectError,
    UnsupportedVersionError,
)
from .keys import ObjectCoords, ObjectKey, format_key, key_tail, validate_page_hash
from .namespace import MAX_LAYERS_PER_OBJECT

MAGIC = b"HCSTORE\x00"
FORMAT_VERSION = 1
#: the format version of sealed objects.
SEALED_FORMAT_VERSION = 2
#: payloads start at a multiple of this (O_DIRECT and page alignment).
PAYLOAD_ALIGNMENT = 4096
#: an object's payload can be at most this large (1 TiB: far above any page, catches garbage).
MAX_PAYLOAD_BYTES = 1 << 40
_NO_GROUP = 0xFFFFFFFF
_FIXED = struct.Struct("<8sHHIQ8sBBHIIIII32s32s")
_FIXED_SIZE = _FIXED.size  # 120
_SEAL = struct.Struct(f"<{sealing.KEY_ID_BYTES}s{sealing.SALT_BYTES}s")
_SEALED_FIXED_SIZE = _FIXED_SIZE + _SEAL.size  # 144
_U64 = struct.Struct("<Q")
#: anything exposing contiguous bytes through the buffer protocol (numpy arrays work too).
BytesLike = bytes | bytearray | memoryview


def header_bytes_used(num_layers: int, *, sealed: bool = False) -> int:
    """Bytes of header content (fixed part, checksum or tag table, header checksum)."""
    if sealed:
        return _SEALED_FIXED_SIZE + sealing.TAG_BYTES * num_layers + 8
    return _FIXED_SIZE + 8 * num_layers + 8


def payload_offset(num_layers: int, *, sealed: bool = False) -> int:
    """Where the payload starts for an object of ``num_layers`` layer blocks (4096-aligned).

    Plain and sealed objects of up to 246 layers both start their payload at 4096.
    """
    used = header_bytes_used(num_layers, sealed=sealed)
    return -(-used // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


def block_checksum(block: BytesLike) -> int:
    """The checksum of one layer block (xxh3_64)."""
    return int(xxhash.xxh3_64_intdigest(block))


@dataclass(frozen=True)
class ObjectHeader:
    """A decoded header. ``block_checksums[i]`` covers layer ``coords.layer_start + i``.

    ``parent_hash`` is the previous page of the chain, or None when the writer did not know it
    (or this is a chain's first page). A sealed header has ``key_id``, ``salt``,
    ``block_tags`` (one GCM tag per layer block) and ``sealed_fixed`` (its bytes ``[0, 144)``,
    the blocks' associated data) instead of ``block_checksums`` (empty).
    """

    namespace_digest: str
    page_hash: str
    coords: ObjectCoords
    kv_planes: int
    payload_offset: int
    payload_length: int
    block_checksums: tuple[int, ...]
    parent_hash: str | None = None
    key_id: str | None = None
    salt: bytes | None = None
    block_tags: tuple[bytes, ...] = ()
    sealed_fixed: bytes = b""

    @property
    def sealed(self) -> bool:
        return self.key_id is not None

    @property
    def num_blocks(self) -> int:
        return self.coords.num_layers

    @property
    def block_length(self) -> int:
        return self.payload_length // self.num_blocks

    @property
    def object_length(self) -> int:
        return self.payload_offset + self.payload_length

    def key(self) -> ObjectKey:
        return ObjectKey(self.page_hash, self.namespace_digest, self.coords)

    def storage_key(self) -> str:
        """The storage key this header describes (``format_key(self.key())`` without
        re-validating fields the header's checksum and decoder already checked)."""
        return self.page_hash + key_tail(self.namespace_digest, self.coords)

    def describes(self, key: ObjectKey | str) -> bool:
        """Whether this header is the one of ``key`` (parsed, or a storage key)."""
        if isinstance(key, str):
            return self.storage_key() == key
        return (self.page_hash, self.namespace_digest, self.coords) == (
            key.page_hash, key.namespace_digest, key.coords)

    def block_range(self, layer_start: int, layer_stop: int) -> tuple[int, int]:
        """Object-absolute byte range ``[start, stop)`` of layers ``[layer_start, layer_stop)``."""
        first = layer_start - self.coords.layer_start
        last = layer_stop - self.coords.layer_start
        if not 0 <= first < last <= self.num_blocks:
            raise ValueError(
                f"layers [{layer_start}, {layer_stop}) are not inside the object's "
                f"[{self.coords.layer_start}, {self.coords.layer_stop})"
            )
        return (
            self.payload_offset + first * self.block_length,
            self.payload_offset + last * self.block_length,
        )


def checksum_blocks(payload: BytesLike, num_blocks: int) -> tuple[int, ...]:
    """Checksums of ``num_blocks`` equal blocks of ``payload`` (its length must divide)."""
    view = memoryview(payload).cast("B")
    if num_blocks <= 0 or len(view) % num_blocks:
        raise ValueError(f"payload of {len(view)} bytes cannot be split into {num_blocks} blocks")
    step = len(view) // num_blocks
    return tuple(block_checksum(view[i * step : (i + 1) * step]) for i in range(num_blocks))


def encode_header(
    key: ObjectKey,
    payload: BytesLike,
    kv_planes: int,
    *,
    block_checksums: Sequence[int] | None = None,
    parent_hash: str | None = None,
    seal: sealing.TenantKey | None = None,
    salt: bytes | None = None,
) -> bytes:
    """The header (padded to the payload offset) for ``payload`` stored under ``key``.

    The payload is split into one block per layer of ``key.coords``. Pass precomputed
    ``block_checksums`` to avoid hashing twice, and the chain's previous page hash as
    ``parent_hash`` when known. ``decode_header`` is the inverse.

    With ``seal`` (a tenant key) the object is sealed (format version 2): ``payload`` is
    **encrypted in place** (it must be writable; it then holds the ciphertext to store after
    the header) and the header carries the key id, a random salt (or ``salt``, for tests) and
    the blocks' tags. ``block_checksums`` does not apply.
    """
    coords = key.coords
    num_blocks = coords.num_layers
    if num_blocks > MAX_LAYERS_PER_OBJECT:
        raise ValueError(f"an object holds at most {MAX_LAYERS_PER_OBJECT} layers")
    length = memoryview(payload).nbytes
    if length == 0 or length % num_blocks or length > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {length} bytes does not split into {num_blocks} layer blocks")
    raw_hash = bytes.fromhex(key.page_hash)
    raw_parent = b"" if parent_hash is None else bytes.fromhex(validate_page_hash(parent_hash))
    sealed = seal is not None
    offset = payload_offset(num_blocks, sealed=sealed)
    fixed = _FIXED.pack(
        MAGIC,
        SEALED_FORMAT_VERSION if sealed else FORMAT_VERSION,
        kv_planes,
        offset,
        length,
        bytes.fromhex(key.namespace_digest),
        len(raw_hash),
        len(raw_parent),
        coords.component,
        coords.layer_start,
        coords.layer_stop - 1,
        _NO_GROUP if coords.head_group is None else coords.head_group,
        num_blocks,
        0,
        raw_hash.ljust(32, b"\x00"),
        raw_parent.ljust(32, b"\x00"),
    )
    if seal is not None:
        if block_checksums is not None:
            raise ValueError("a sealed object has tags, not checksums")
        salt = os.urandom(sealing.SALT_BYTES) if salt is None else salt
        fixed += _SEAL.pack(bytes.fromhex(seal.key_id), salt)
        tags = sealing.seal_blocks(
            seal.object_cipher_key(salt),
            sealing.associated_data(format_key(key), fixed),
            memoryview(payload),
            num_blocks,
        )
        body = fixed + b"".join(tags)
    else:
        sums = (
            tuple(block_checksums)
            if block_checksums is not None
            else checksum_blocks(payload, num_blocks)
        )
        if len(sums) != num_blocks:
            raise ValueError(f"{len(sums)} checksums for {num_blocks} layer blocks")
        body = fixed + b"".join(_U64.pack(s) for s in sums)
    body += _U64.pack(xxhash.xxh3_64_intdigest(body))
    return body.ljust(offset, b"\x00")


def encode_object(
    key: ObjectKey,
    payload: BytesLike,
    kv_planes: int,
    *,
    parent_hash: str | None = None,
    seal: sealing.TenantKey | None = None,
) -> bytes:
    """Header and payload as one bytes object (convenient for small objects and tests).

    ``payload`` is left as it is (sealing works on a copy).
    """
    body = bytearray(payload) if seal is not None else payload
    return encode_header(key, body, kv_planes, parent_hash=parent_hash, seal=seal) + bytes(body)


def decode_header(
    data: BytesLike,
    *,
    expected: ObjectKey | str | None = None,
    object_length: int | None = None,
    sealed: bool | None = None,
) -> ObjectHeader:
    """Decode and check the header at the start of ``data``.

    ``data`` must hold at least the whole header, padding included (``payload_offset`` bytes;
    fewer raise ``TruncatedObjectError``), and the padding must be zero. With ``expected``, the
    header must describe exactly that key, parsed or as its storage key (``KeyMismatchError``
    otherwise). With ``object_length`` (the stored object's size), the payload must end exactly
    there (``TruncatedObjectError`` / ``HeaderFieldError``).

    ``sealed`` is what the reader's namespace says: True refuses a plain object
    (``TamperedObjectError``: anyone can write one under a sealed namespace's key), False
    refuses a sealed one (``UnsupportedVersionError``); None (tools) accepts both. Decoding
    checks a sealed header's structure only: ``verify_blocks`` authenticates.
    """
    view = memoryview(data).cast("B")
    if len(view) < 8 or bytes(view[:8]) != MAGIC:
        if len(view) < 8 and bytes(view) == MAGIC[: len(view)]:
            raise TruncatedObjectError(f"object of {len(view)} bytes is shorter than the magic")
        raise BadMagicError("object does not start with the hicache-store magic")
    if len(view) < _FIXED_SIZE:
        raise TruncatedObjectError(f"header truncated at {len(view)} of {_FIXED_SIZE} bytes")
    (
        _magic,
        version,
        kv_planes,
        offset,
        length,
        raw_ns,
        hash_len,
        parent_len,
        component,
        first,
        last,
        group,
        num_blocks,
        reserved_b,
        raw_hash,
        raw_parent,
    ) = _FIXED.unpack_from(view)
    if version not in (FORMAT_VERSION, SEALED_FORMAT_VERSION):
        raise UnsupportedVersionError(
            f"object format version {version} (this reads {FORMAT_VERSION} and "
            f"{SEALED_FORMAT_VERSION})"
        )
    is_sealed = version == SEALED_FORMAT_VERSION
    if sealed is True and not is_sealed:
        raise TamperedObjectError("a plain object where the namespace stores sealed ones")
    if sealed is False and is_sealed:
        raise UnsupportedVersionError("a sealed object where the namespace stores plain ones")
    if not 1 <= num_blocks <= MAX_LAYERS_PER_OBJECT:
        raise HeaderFieldError(
            f"layer block count {num_blocks} outside [1, {MAX_LAYERS_PER_OBJECT}]"
        )
    used = header_bytes_used(num_blocks, sealed=is_sealed)
    if len(view) < used:
        raise TruncatedObjectError(f"header truncated at {len(view)} of {used} bytes")
    stored_sum = _U64.unpack_from(view, used - 8)[0]
    if xxhash.xxh3_64_intdigest(view[: used - 8]) != stored_sum:
        raise HeaderChecksumError("header checksum mismatch")
    # The header is intact as written; now check that what was written is coherent.
    if kv_planes not in (1, 2):
        raise HeaderFieldError(f"kv planes {kv_planes} is neither 1 nor 2")
    if reserved_b:
        raise HeaderFieldError("reserved header fields are not zero")
    if parent_len not in (0, 16, 32) or any(raw_parent[parent_len:]):
        raise HeaderFieldError(f"parent hash length {parent_len} is not 0, 16 or 32")
    if hash_len not in (16, 32) or any(raw_hash[hash_len:]):
        raise HeaderFieldError(f"page hash length {hash_len} is neither 16 nor 32")
    want_offset = payload_offset(num_blocks, sealed=is_sealed)
    if offset != want_offset:
        raise HeaderFieldError(
            f"payload offset {offset} is not {want_offset} for {num_blocks} blocks"
        )
    if len(view) < offset:
        raise TruncatedObjectError(f"header truncated at {len(view)} of {offset} bytes")
    if bytes(view[used:offset]) != bytes(offset - used):
        raise HeaderFieldError("header padding is not zero")
    if last < first or last - first + 1 != num_blocks:
        raise HeaderFieldError(f"layers {first}-{last} do not match {num_blocks} blocks")
    if not 0 < length <= MAX_PAYLOAD_BYTES or length % num_blocks:
        raise HeaderFieldError(f"payload length {length} does not split into {num_blocks} blocks")
    if object_length is not None:
        end = offset + length
        if object_length < end:
            raise TruncatedObjectError(f"object is {object_length} bytes, header says {end}")
        if object_length > end:
            raise HeaderFieldError(f"object is {object_length} bytes, header says {end}")
    sums: tuple[int, ...] = ()
    tags: tuple[bytes, ...] = ()
    key_id: str | None = None
    salt: bytes | None = None
    sealed_fixed = b""
    if is_sealed:
        raw_key_id, salt = _SEAL.unpack_from(view, _FIXED_SIZE)
        key_id = raw_key_id.hex()
        tag = sealing.TAG_BYTES
        tags = tuple(
            bytes(view[_SEALED_FIXED_SIZE + tag * i : _SEALED_FIXED_SIZE + tag * (i + 1)])
            for i in range(num_blocks)
        )
        sealed_fixed = bytes(view[:_SEALED_FIXED_SIZE])
    else:
        sums = tuple(_U64.unpack_from(view, _FIXED_SIZE + 8 * i)[0] for i in range(num_blocks))
    try:
        coords = ObjectCoords(first, last + 1, None if group == _NO_GROUP else group, component)
    except ValueError as exc:
        raise HeaderFieldError(f"header coordinates: {exc}") from None
    header = ObjectHeader(
        namespace_digest=raw_ns.hex(),
        page_hash=raw_hash[:hash_len].hex(),
        coords=coords,
        kv_planes=kv_planes,
        payload_offset=offset,
        payload_length=length,
        block_checksums=sums,
        parent_hash=raw_parent[:parent_len].hex() if parent_len else None,
        key_id=key_id,
        salt=salt,
        block_tags=tags,
        sealed_fixed=sealed_fixed,
    )
    if expected is not None and not header.describes(expected):
        raise KeyMismatchError(
            f"object header describes {header.storage_key()} but {expected} was asked for"
        )
    return header


def verify_blocks(
    header: ObjectHeader,
    data: BytesLike,
    layer_start: int,
    layer_stop: int,
    *,
    key: sealing.TenantKey | None = None,
) -> None:
    """Check layers ``[layer_start, layer_stop)`` held contiguously in ``data``.

    ``data`` is exactly those layer blocks (as returned by a range read of
    ``header.block_range(layer_start, layer_stop)``). Plain objects: the checksums; raises
    ``PayloadChecksumError`` naming the first bad layer. Sealed objects: authenticates and
    **decrypts ``data`` in place** with ``key`` (the tenant key whose id the header names;
    ``MissingKeyError`` without one); raises ``TamperedObjectError`` naming the first layer
    that fails, and ``data`` is then garbage. A read-only ``data`` is authenticated only.
    Either way ``TruncatedObjectError`` if ``data`` has the wrong length.
    """
    start, stop = header.block_range(layer_start, layer_stop)
    view = memoryview(data).cast("B")
    if len(view) != stop - start:
        raise TruncatedObjectError(
            f"layer blocks {layer_start}-{layer_stop - 1}: got {len(view)} bytes, "
            f"expected {stop - start}"
        )
    first = layer_start - header.coords.layer_start
    count = layer_stop - layer_start
    if header.sealed:
        if key is None:
            raise MissingKeyError(f"object {header.key()} is sealed: its tenant key is needed")
        if key.key_id != header.key_id or header.salt is None:
            raise ValueError(f"key {key.key_id} is not the object's key {header.key_id}")
        sealing.open_blocks(
            key.object_cipher_key(header.salt),
            sealing.associated_data(format_key(header.key()), header.sealed_fixed),
            view,
            header.block_tags[first : first + count],
            first_block=first,
            first_layer=layer_start,
        )
        return
    step = header.block_length
    check_block_sums(
        header, [block_checksum(view[i * step : (i + 1) * step]) for i in range(count)],
        layer_start, layer_stop,
    )


def check_block_sums(
    header: ObjectHeader, sums: Sequence[int], layer_start: int, layer_stop: int
) -> None:
    """Check layers ``[layer_start, layer_stop)`` of a plain object by their checksums
    (``block_checksum`` of each block, in layer order), computed by whoever read the blocks
    (``verify_blocks``, or a reader that hashes inside its read). Raises
    ``PayloadChecksumError`` naming the first layer whose checksum differs from the header's,
    ``ValueError`` for a sealed header (it has no checksums: ``verify_blocks``) or a count of
    sums other than the count of layers."""
    if header.sealed:
        raise ValueError(f"object {header.key()} is sealed: its blocks are opened, not summed")
    first = layer_start - header.coords.layer_start
    if (first < 0 or len(sums) != layer_stop - layer_start
            or first + len(sums) > len(header.block_checksums)):
        raise ValueError(f"{len(sums)} checksums for layers {layer_start}-{layer_stop - 1}")
    for i, got in enumerate(sums):
        if got != header.block_checksums[first + i]:
            raise PayloadChecksumError(
                f"checksum mismatch in layer {layer_start + i}", layer=layer_start + i
            )


def decode_object(
    data: BytesLike,
    *,
    expected: ObjectKey | None = None,
    sealed: bool | None = None,
    key: sealing.TenantKey | None = None,
) -> tuple[ObjectHeader, memoryview]:
    """Decode a whole object, verify every block, and return the header and payload view.

    ``sealed`` as for ``decode_header``; a sealed object needs ``key`` and is decrypted in
    place when ``data`` is writable (``verify_blocks``).
    """
    view = memoryview(data).cast("B")
    header = decode_header(view, expected=expected, object_length=len(view), sealed=sealed)
    payload = view[header.payload_offset :]
    verify_blocks(header, payload, header.coords.layer_start, header.coords.layer_stop, key=key)
    return header, payload
