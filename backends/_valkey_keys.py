"""How the Valkey index names what it keeps: object keys packed to bytes, pages by fingerprint.

An object key of a page (``{page_hash}_{namespace}_{coordinates}``) is kept as its page's
*prefix* packed to bytes (a kind byte, the page hash and the namespace digest as raw bytes:
41 bytes for a sha256 page, against 82 characters) and its *suffix* (the coordinates, text);
any other key (a manifest, a foreign name) is a page of its own, kept as kind 0 and the key's
text, with an empty suffix. ``unpack`` is ``pack``'s inverse for every valid storage key.

A page is found by the fingerprint of its prefix (``fp``: xxh3_64, 8 bytes big-endian); its
record lives in one of 65,536 hashes named by the fingerprint's first two bytes
(``P:<4 hex>``), small enough for Valkey to keep them in its compact encoding. An object's
identity in the index's other tables (in flight, holds) is ``fp + suffix``.

| kind | page hash | namespace digest |
|---|---|---|
| 0 | (the key's text: a page of its own) | |
| 1 | 16 bytes (xxh3_128) | 8 bytes |
| 2 | 32 bytes (sha256) | 8 bytes |
| 3 | 16 bytes | ``ukv1-`` + 8 bytes (SGLang's unified keyspace) |
| 4 | 32 bytes | ``ukv1-`` + 8 bytes |

``pack`` keeps the last 65,536 keys it packed (the keys of chains an engine asks about again
and again).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from hicache_store.layout.keys import object_key_parts
from hicache_store.layout.namespace import UKV1_DIGEST_PREFIX


@dataclass(frozen=True, slots=True)
class Packed:
    """One key as the index keeps it (module docstring)."""

    fp: bytes
    prefix: bytes
    suffix: bytes

    @property
    def oid(self) -> bytes:
        """The object's identity in the in-flight and hold tables."""
        return self.fp + self.suffix


@functools.lru_cache(maxsize=1 << 16)
def pack(key: str) -> Packed:
    parts = object_key_parts(key)
    if parts is None:
        prefix, suffix = b"\x00" + key.encode(), b""
    else:
        page_hash, digest = parts
        ukv1 = digest.startswith(UKV1_DIGEST_PREFIX)
        kind = (1 if len(page_hash) == 32 else 2) + (2 if ukv1 else 0)
        raw_digest = digest[len(UKV1_DIGEST_PREFIX):] if ukv1 else digest
        prefix = bytes([kind]) + bytes.fromhex(page_hash) + bytes.fromhex(raw_digest)
        suffix = key[len(page_hash) + len(digest) + 2:].encode()
    return Packed(xxhash.xxh3_64_digest(prefix), prefix, suffix)


def unpack(prefix: bytes, suffix: bytes) -> str:
    kind = prefix[0]
    if kind == 0:
        return prefix[1:].decode()
    hash_len = 16 if kind in (1, 3) else 32
    page_hash = prefix[1 : 1 + hash_len].hex()
    digest = prefix[1 + hash_len :].hex()
    if kind in (3, 4):
        digest = UKV1_DIGEST_PREFIX + digest
    return f"{page_hash}_{digest}_{suffix.decode()}"


def names(blob: bytes) -> list[str]:
    """The keys of a feed record or a reply: each as one length byte and its prefix, then one
    length byte and its suffix."""
    out: list[str] = []
    at = 0
    while at < len(blob):
        n = blob[at]
        prefix = blob[at + 1 : at + 1 + n]
        at += 1 + n
        m = blob[at]
        suffix = blob[at + 1 : at + 1 + m]
        at += 1 + m
        out.append(unpack(prefix, suffix))
    return out


def args_of(packed: Sequence[Packed]) -> list[bytes]:
    """``fp, prefix, suffix`` of each key, flat (a script's arguments)."""
    out: list[bytes] = []
    for p in packed:
        out += [p.fp, p.prefix, p.suffix]
    return out


__all__ = ["Packed", "args_of", "names", "pack", "unpack"]
