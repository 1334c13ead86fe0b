"""The one exception hierarchy of hicache-store.

It lives in the lowest layer so that every layer above raises and catches the same classes;
``hicache_store.errors`` re-exports it together with the backend errors built on it.

Contract: a *miss* is never an exception (it is ``None`` / ``False`` in results). Exceptions are
for what is broken: bad input, a corrupt object, a backend that cannot answer.
"""

from __future__ import annotations


class HiCacheStoreError(Exception):
    """Root of every error raised by hicache-store.

    ``backend``, ``operation`` and ``key`` say where it happened when known; they are also
    rendered into ``str(error)`` so a log line is self-explanatory.
    """

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        operation: str | None = None,
        key: str | None = None,
    ) -> None:
        self.message = message
        self.backend = backend
        self.operation = operation
        self.key = key
        super().__init__(message)

    def __str__(self) -> str:
        where = [
            f"{name}={value}"
            for name, value in (
                ("backend", self.backend),
                ("operation", self.operation),
                ("key", self.key),
            )
            if value is not None
        ]
        return f"{self.message} ({', '.join(where)})" if where else self.message


class ConfigError(HiCacheStoreError, ValueError):
    """A configuration value is wrong: a backend URL or option, an engine's extra-config.

    One line that names the option and the value it got (and the close spellings of a
    misspelled option), raised before anything is created on disk or connected. Also a
    ``ValueError``, which is what such mistakes raised before this class existed.
    """


class InvalidNamespaceError(HiCacheStoreError, ValueError):
    """A namespace field is impossible (the message names the field)."""


class UnknownNamespaceError(HiCacheStoreError, LookupError):
    """A namespace named by its digest that the store holds no manifest of (``KVReader``,
    the operator tools). Also a ``LookupError``, what this raised before the class existed."""


class WeightsError(HiCacheStoreError, ValueError):
    """A model directory's weights cannot be identified: an unreadable file, or a weights file
    that is not what its suffix says (a safetensors header out of bounds). The message names
    the file."""


class InvalidKeyError(HiCacheStoreError, ValueError):
    """A key is outside the key grammar; refused before any backend sees it."""


class GridMismatchError(HiCacheStoreError, ValueError):
    """A shard does not align with the partition grid; ``suggestions`` lists grids that would.

    Each suggestion is a ``(layers_per_chunk, heads_per_group)`` pair, coarsest first.
    """

    def __init__(self, message: str, suggestions: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__(message)
        self.suggestions = suggestions


class CorruptObjectError(HiCacheStoreError):
    """A stored object failed validation. Readers turn this into a miss plus a counted event."""


class BadMagicError(CorruptObjectError):
    """The object does not start with the hicache-store magic."""


class UnsupportedVersionError(CorruptObjectError):
    """The object's format version is not one this library reads."""


class TruncatedObjectError(CorruptObjectError):
    """The object (or its header) is shorter than its own fields say."""


class HeaderFieldError(CorruptObjectError):
    """A header field is out of range, inconsistent, or points outside the object."""


class HeaderChecksumError(CorruptObjectError):
    """The header's own checksum does not match its bytes."""


class PayloadChecksumError(CorruptObjectError):
    """A layer block's checksum does not match its bytes."""

    def __init__(self, message: str, layer: int | None = None) -> None:
        super().__init__(message)
        self.layer = layer


class KeyMismatchError(CorruptObjectError):
    """The header describes another object than the key that was asked for."""


class TamperedObjectError(CorruptObjectError):
    """A sealed object failed authentication: forged, swapped between keys, altered, sealed
    with a key this reader never had, or a plain object where a sealed one belongs.

    Readers count it as ``tamper`` and treat it as a miss; the bytes are never used.
    """


class MissingKeyError(HiCacheStoreError, ValueError):
    """A sealed namespace was used without a tenant key ring, or a key ring is malformed.

    Messages name the source (file, line, environment variable), never a secret.
    """


class SealingUnavailableError(HiCacheStoreError, ImportError):
    """Sealing needs the optional ``cryptography`` package; the message says how to install it."""
