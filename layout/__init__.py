"""The unified KV layout: pure arithmetic, no I/O, no torch.

Namespaces, page hashes, object keys, namespace manifests, the object header format, topologies and shards,
read/write plans, host-page layouts and CP page ownership. Everything above (kernels, backends,
the cache tier, engine adapters) takes its byte arithmetic from here.
"""

from __future__ import annotations

from .errors import (
    CorruptObjectError,
    GridMismatchError,
    HiCacheStoreError,
    InvalidKeyError,
    InvalidNamespaceError,
)
from .framing import ObjectHeader, decode_header, decode_object, encode_header, encode_object
from .keys import ObjectCoords, ObjectKey, format_key, parse_key, validate_storage_key
from .namespace import Grid, ModelShape, Namespace

__all__ = [
    "CorruptObjectError",
    "Grid",
    "GridMismatchError",
    "HiCacheStoreError",
    "InvalidKeyError",
    "InvalidNamespaceError",
    "ModelShape",
    "Namespace",
    "ObjectCoords",
    "ObjectHeader",
    "ObjectKey",
    "decode_header",
    "decode_object",
    "encode_header",
    "encode_object",
    "format_key",
    "parse_key",
    "validate_storage_key",
]
