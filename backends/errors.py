"""Backend errors: the part of the ``HiCacheStoreError`` hierarchy that storage raises.

Contract: a *miss* is a result (``None`` / ``False``), never one of these.
These are for what is broken: a bad range, a store that cannot answer, a full disk, an
operation a backend does not offer. Every backend translates its native errors (``OSError``,
SDK exceptions) into this hierarchy exactly once, at its edge, with ``raise ... from native``
so the original stays in ``__cause__``.

::

    HiCacheStoreError                      (hicache_store.layout.errors)
    +-- BackendError
        +-- NotFoundError                  also FileNotFoundError
        +-- InvalidRangeError              also ValueError
        +-- BackendUnavailableError        .retryable
        |   +-- BackendTimeoutError        also TimeoutError, retryable
        |   +-- BackendClosedError         not retryable
        +-- NotSupportedError
        +-- UnsafeIndexError               file backend: the shared index, from another host
        +-- CapacityError
        |   +-- OutOfSpaceError            also OSError(ENOSPC)
        |   +-- PinBudgetError             a pin past the pin budget (refused whole)
        +-- BackendIOError                 any other I/O failure, .retryable
        +-- UnknownBackendError            also ConfigError and LookupError (registry)
        +-- MissingDependencyError         also ImportError (registry), .install_hint
        +-- DuplicateBackendError          also ValueError (registry)
"""

from __future__ import annotations

import errno as _errno
from typing import ClassVar

from hicache_store.layout.errors import ConfigError, HiCacheStoreError


class BackendError(HiCacheStoreError):
    """Root of the errors raised by storage backends and the backend registry."""


class NotFoundError(BackendError, FileNotFoundError):
    """An object an operation *requires* is absent.

    Plain reads never raise this (a miss is ``None``); it is for calls whose contract is
    "the object must exist", such as a helper asked for a required object.
    """


class InvalidRangeError(BackendError, ValueError):
    """A byte range is malformed, reaches past the object's end, or does not fit the buffer.

    Ranges are never clamped: object sizes come from the layout, so an over-long range is a
    caller bug or a corrupt object, and both must be loud.
    """


class _RetryableError(BackendError):
    """An error that says whether trying again may succeed (``retryable``); a class states
    what it is when the raiser does not say (``retryable_by_default``)."""

    retryable_by_default: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        retryable: bool | None = None,
        backend: str | None = None,
        operation: str | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(message, backend=backend, operation=operation, key=key)
        self.retryable = self.retryable_by_default if retryable is None else retryable


class BackendUnavailableError(_RetryableError):
    """The store cannot answer now. ``retryable`` (by default ``True``) says whether trying
    again may succeed."""

    retryable_by_default = True


class BackendTimeoutError(BackendUnavailableError, TimeoutError):
    """An operation took longer than its deadline (retryable)."""


class BackendClosedError(BackendUnavailableError):
    """The backend was closed; nothing will succeed on it again (not retryable)."""

    def __init__(
        self, message: str = "backend is closed", *, backend: str | None = None,
        operation: str | None = None,
    ) -> None:
        super().__init__(message, retryable=False, backend=backend, operation=operation)


class WriterFencedError(BackendUnavailableError):
    """This writer's lease on a shared index lapsed (the process was stopped or cut off) and
    another process reclaimed its puts in flight: a put that reserved before that cannot
    settle, and is reported failed (its objects were not stored). Retryable: the next call
    registers the writer anew."""


class NotSupportedError(BackendError):
    """The backend does not offer this operation (see its ``capabilities``)."""


class UnsafeIndexError(BackendError):
    """The file backend's shared index cannot be used for this root from this process:
    another host uses the root's index, or the root is on a network or FUSE filesystem.

    The message names the remedy (``index=none`` for a root several hosts use) and what was
    found (the host recorded, or the filesystem type). Not retryable: the deployment is wrong.
    """


class CapacityError(BackendError):
    """The store is full and could not make room for a write."""


class PinBudgetError(CapacityError):
    """A pin would take the pinned bytes past the backend's pin budget. The message says the
    budget, the bytes pinned already and the bytes asked; nothing of the call was applied."""


class OutOfSpaceError(CapacityError, OSError):
    """The device or quota ran out of space (ENOSPC / EDQUOT). Reads are unaffected.

    ``errno`` is ``ENOSPC`` so code that only knows ``OSError`` still recognises it. ``where``
    is ``backend`` / ``operation`` / ``key``, as for every ``HiCacheStoreError``.
    """

    def __init__(self, message: str, **where: str | None) -> None:
        super().__init__(message, **where)
        self.errno = _errno.ENOSPC


class BackendIOError(_RetryableError):
    """Any other I/O failure of the store. ``retryable`` (by default ``False``) as for
    ``BackendUnavailableError``."""


class UnknownBackendError(BackendError, ConfigError, LookupError):
    """No backend is registered under this name (the message gives the close spellings and
    lists the known names). A wrong URL is a configuration error: also a ``ConfigError``, so
    the CLI reports it as bad usage (exit 2)."""


class MissingDependencyError(BackendError, ImportError):
    """A backend's module or one of its optional dependencies cannot be imported.

    ``install_hint`` is the command that fixes it, when one is known.
    """

    def __init__(self, message: str, *, install_hint: str | None = None,
                 backend: str | None = None) -> None:
        if install_hint:
            message = f"{message}; install it with: {install_hint}"
        super().__init__(message, backend=backend)
        self.install_hint = install_hint


class DuplicateBackendError(BackendError, ValueError):
    """A backend name is already registered; names are never silently overridden."""


#: errno values that mean "retrying later may work".
_RETRYABLE_ERRNOS = frozenset(
    {_errno.EAGAIN, _errno.EINTR, _errno.EBUSY, _errno.ETIMEDOUT, _errno.ENOBUFS, _errno.ENOMEM}
)
_SPACE_ERRNOS = frozenset({_errno.ENOSPC, _errno.EDQUOT})


def translate_os_error(
    exc: OSError, *, backend: str, operation: str, key: str | None = None
) -> BackendError:
    """Map an ``OSError`` to this hierarchy (the caller raises the result ``from exc``).

    ENOSPC/EDQUOT become ``OutOfSpaceError``, ENOENT ``NotFoundError``, a timeout
    ``BackendTimeoutError``; everything else ``BackendIOError`` with ``retryable`` set for
    transient errnos. The message keeps the errno name and strerror.
    """
    code = exc.errno
    name = _errno.errorcode.get(code, str(code)) if code is not None else "OSError"
    message = f"{operation} failed: [{name}] {exc.strerror or exc}"
    where = {"backend": backend, "operation": operation, "key": key}
    if code in _SPACE_ERRNOS:
        return OutOfSpaceError(message, **where)
    if code == _errno.ENOENT:
        return NotFoundError(message, **where)
    if isinstance(exc, TimeoutError) or code == _errno.ETIMEDOUT:
        return BackendTimeoutError(message, retryable=True, **where)
    return BackendIOError(message, retryable=code in _RETRYABLE_ERRNOS, **where)
