"""Every exception hicache-store raises, in one place for users.

The hierarchy is rooted at ``HiCacheStoreError`` (defined in ``hicache_store.layout.errors``,
the lowest layer, so every layer raises the same classes); the backend errors are defined in
``hicache_store.backends.errors``. A miss is never an exception.
"""

from __future__ import annotations

from hicache_store.backends.errors import (
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
from hicache_store.layout.errors import (
    BadMagicError,
    ConfigError,
    CorruptObjectError,
    GridMismatchError,
    HeaderChecksumError,
    HeaderFieldError,
    HiCacheStoreError,
    InvalidKeyError,
    InvalidNamespaceError,
    KeyMismatchError,
    MissingKeyError,
    PayloadChecksumError,
    SealingUnavailableError,
    TamperedObjectError,
    TruncatedObjectError,
    UnknownNamespaceError,
    UnsupportedVersionError,
    WeightsError,
)

__all__ = [
    "UsageError",
    "BackendClosedError",
    "BackendError",
    "BackendIOError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "BadMagicError",
    "CapacityError",
    "ConfigError",
    "CorruptObjectError",
    "DuplicateBackendError",
    "GridMismatchError",
    "HeaderChecksumError",
    "HeaderFieldError",
    "HiCacheStoreError",
    "InvalidKeyError",
    "InvalidNamespaceError",
    "InvalidRangeError",
    "KeyMismatchError",
    "MissingDependencyError",
    "MissingKeyError",
    "NotFoundError",
    "NotSupportedError",
    "OutOfSpaceError",
    "PayloadChecksumError",
    "PinBudgetError",
    "SealingUnavailableError",
    "TamperedObjectError",
    "TruncatedObjectError",
    "UnknownBackendError",
    "UnknownNamespaceError",
    "UnsafeIndexError",
    "UnsupportedVersionError",
    "WeightsError",
    "WriterFencedError",
]


class UsageError(Exception):
    """Bad flags or arguments detected after parsing: the CLI reports it on one line and exits
    with code 2. Defined here, below the commands, so library code that validates settings
    (``ops.config``) raises it without importing the CLI."""
