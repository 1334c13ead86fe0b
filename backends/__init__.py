"""Async storage backends: the ``Backend`` ABC, the registry and the built-in backends.

Open any backend the same way::

    from hicache_store.backends import open_backend
    store = open_backend("file:///var/cache/hicache?durability=data", capacity_bytes="200GiB")
    async with store:
        await store.put(keys, buffers)
        sizes = await store.get_into(keys, buffers)      # None = miss

Built-in names: ``file``, ``memory``, ``faulty``, ``s3``, ``fsspec``, ``hf3fs``, ``mooncake``;
third-party backends register through the entry-point group ``hicache_store.backends``; any
class works by its ``module:Class`` spec. Backend modules are imported only when opened.
"""

from __future__ import annotations

from hicache_store.layout.errors import ConfigError

from ._aligned import DIRECT_ALIGNMENT, aligned_buffer
from ._file_site import RootSite
from .base import Backend, ReadCounts, ReadRanges, reads_are_uses, reads_not_counted
from .errors import (
    BackendClosedError,
    BackendError,
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    CapacityError,
    DuplicateBackendError,
    InvalidRangeError,
    MissingDependencyError,
    NotFoundError,
    NotSupportedError,
    OutOfSpaceError,
    PinBudgetError,
    UnknownBackendError,
    UnsafeIndexError,
    WriterFencedError,
)
from .protocols import HostBuffers, InlineExists, NativeReads, PendingReads
from .registry import (
    ENTRY_POINT_GROUP,
    BackendSpec,
    available_backends,
    backends,
    get_backend_class,
    open_backend,
    register_backend,
    unregister_backend,
)
from .retention import Retention
from .types import (
    BackendStats,
    BackendURL,
    ByteRange,
    Capabilities,
    DeletedUntilHeld,
    ObjectStat,
)

__all__ = [
    "DIRECT_ALIGNMENT",
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendClosedError",
    "BackendError",
    "BackendIOError",
    "BackendSpec",
    "BackendStats",
    "BackendTimeoutError",
    "BackendURL",
    "BackendUnavailableError",
    "ByteRange",
    "Capabilities",
    "CapacityError",
    "PinBudgetError",
    "ReadCounts",
    "ReadRanges",
    "Retention",
    "RootSite",
    "ConfigError",
    "DuplicateBackendError",
    "InvalidRangeError",
    "MissingDependencyError",
    "NotFoundError",
    "NotSupportedError",
    "DeletedUntilHeld",
    "HostBuffers",
    "InlineExists",
    "NativeReads",
    "ObjectStat",
    "PendingReads",
    "OutOfSpaceError",
    "UnknownBackendError",
    "UnsafeIndexError",
    "WriterFencedError",
    "aligned_buffer",
    "available_backends",
    "backends",
    "get_backend_class",
    "open_backend",
    "reads_are_uses",
    "reads_not_counted",
    "register_backend",
    "unregister_backend",
]
