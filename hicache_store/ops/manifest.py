"""Namespace manifests for the operator tools: the format (``layout.manifest``) and the backend
calls (``objects.manifest``) in one import."""

from __future__ import annotations

from hicache_store.layout.manifest import (
    MANIFEST_PREFIX,
    MAX_MANIFEST_BYTES,
    ManifestError,
    decode_manifest,
    encode_manifest,
    manifest_digest,
    manifest_key,
)
from hicache_store.objects.manifest import ensure_manifest, list_manifests, read_manifest

__all__ = [
    "MANIFEST_PREFIX",
    "MAX_MANIFEST_BYTES",
    "ManifestError",
    "decode_manifest",
    "encode_manifest",
    "ensure_manifest",
    "list_manifests",
    "manifest_digest",
    "manifest_key",
    "read_manifest",
]
