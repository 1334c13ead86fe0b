"""Namespace manifests on a backend: store one unless present, read one, list them.

The format (keys ``M_{digest}``, JSON bytes, checks) is ``hicache_store.layout.manifest``.
"""

from __future__ import annotations

from hicache_store.backends.base import Backend
from hicache_store.layout.manifest import (
    MANIFEST_PREFIX,
    decode_manifest,
    encode_manifest,
    manifest_digest,
    manifest_key,
)
from hicache_store.layout.namespace import Namespace


async def ensure_manifest(backend: Backend, namespace: Namespace) -> bool:
    """Store the namespace's manifest unless present; True when this call wrote it."""
    return await backend.put_if_absent(manifest_key(namespace), encode_manifest(namespace))


async def read_manifest(backend: Backend, key: str) -> Namespace | None:
    """The namespace under a manifest key; None when absent. Raises ``ManifestError``."""
    data = await backend.get_bytes(key)
    return None if data is None else decode_manifest(data, key=key)


async def list_manifests(backend: Backend) -> list[str]:
    """Every manifest key in the store (needs a listing backend)."""
    return sorted([k async for k in backend.list_prefix(MANIFEST_PREFIX)
                   if manifest_digest(k) is not None])
