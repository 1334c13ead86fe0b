"""Namespace manifests: one small object per namespace saying what its KV objects mean.

Object keys carry only a namespace *digest*; a manifest maps the digest back to the namespace
(model, KV shape and dtype, page size, grid, layout version, hash algorithm, tenant salt), so
tools can tell what a store holds without any deployment's configuration.

Format (version 1):

* key ``M_{namespace_digest}`` (``M`` is the manifest tag letter of the storage-key grammar,
  then ``_`` and the 16-hex digest: e.g. ``M_3f9c0a6b12d4e7f0``); it cannot collide with an
  object key, which starts with a page hash (lowercase hex);
* value: ``Namespace.to_json()`` as UTF-8 JSON with sorted keys (``Namespace.to_json_text()``),
  which carries ``"digest"``; ``Namespace.from_json`` re-derives the digest from the fields and
  refuses a mismatch, and the digest must also match the key.

A manifest is content-addressed (equal namespaces give equal bytes), so writing it any number
of times from any number of writers is harmless; writers use ``put_if_absent`` so a warm store
costs one existence check. Every writer of a namespace should call ``ensure_manifest`` once
before its first object (``prepopulate`` does; the cache tier does when its L3 link is
created). Manifests are not framed objects and carry no page hash.

This module is the format (pure: keys, bytes, checks); ``hicache_store.objects.manifest`` stores
and reads manifests on a backend.
"""

from __future__ import annotations

import json
import re

from .errors import InvalidNamespaceError
from .namespace import DIGEST_HEX_CHARS, UKV1_DIGEST_PREFIX, Namespace

#: the tag and separator every manifest key starts with (a listing prefix).
MANIFEST_PREFIX = "M_"
#: the largest manifest read (a namespace is well under 1 KiB; this bounds a bogus object).
MAX_MANIFEST_BYTES = 64 * 1024
#: digests of this library's keyspace, or of SGLang's (``ukv1-`` + 16 hex).
_MANIFEST_KEY_RE = re.compile(
    rf"M_(?P<digest>(?:{re.escape(UKV1_DIGEST_PREFIX)})?[0-9a-f]{{{DIGEST_HEX_CHARS}}})"
)


class ManifestError(InvalidNamespaceError):
    """A manifest object is unreadable: not JSON, not a namespace, or under the wrong key."""


def manifest_key(digest_or_namespace: str | Namespace) -> str:
    """The storage key of a namespace's manifest; ``manifest_digest`` is its inverse."""
    digest = (
        digest_or_namespace.digest
        if isinstance(digest_or_namespace, Namespace)
        else digest_or_namespace
    )
    key = f"{MANIFEST_PREFIX}{digest}"
    if _MANIFEST_KEY_RE.fullmatch(key) is None:
        raise InvalidNamespaceError(
            f"{digest!r} is not a namespace digest ({DIGEST_HEX_CHARS} hex digits)")
    return key


def manifest_digest(key: str) -> str | None:
    """The namespace digest a manifest key names, or None if ``key`` is not a manifest key."""
    match = _MANIFEST_KEY_RE.fullmatch(key)
    return None if match is None else match["digest"]


def encode_manifest(namespace: Namespace) -> bytes:
    """The manifest's bytes; ``decode_manifest`` is the inverse."""
    return json.dumps(namespace.to_json(), sort_keys=True, indent=2).encode("utf-8")


def decode_manifest(data: bytes, *, key: str | None = None) -> Namespace:
    """Parse a manifest, checking its digest against its fields and (given) its key."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"manifest is not JSON: {exc}") from None
    try:
        namespace = Namespace.from_json(parsed)
    except (InvalidNamespaceError, TypeError) as exc:
        raise ManifestError(f"manifest is not a namespace: {exc}") from None
    if key is not None and manifest_digest(key) != namespace.digest:
        raise ManifestError(f"manifest under {key} describes namespace {namespace.digest}")
    return namespace
