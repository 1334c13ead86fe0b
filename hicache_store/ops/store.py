"""Opening a backend for a command: ``open_backend`` plus an install hint on any ImportError,
and, for commands that only read or clean a store, a refusal to create one.

The registry turns an import failure of a backend's *module* into ``MissingDependencyError``
with its install hint, but a backend that imports its SDK lazily (``s3`` imports boto3 in its
constructor) raises a plain ``ImportError`` from ``from_url``. Commands open stores through
``open_store`` so both cases read the same: one line naming what to install.

``existing=True`` is for ``inspect`` and ``gc``: a typo'd path must not become an empty store
that is then reported empty, and an unrelated folder must not receive store files. Backends
that may create their location at open (``Backend.creates_location``: file, hf3fs, fsspec) are
opened with ``create=False``; when no store is there, ``StoreNotFoundError`` names the location
and nothing has been created.
"""

from __future__ import annotations

from typing import Any

from hicache_store.backends import (
    Backend,
    MissingDependencyError,
    available_backends,
    get_backend_class,
    open_backend,
)
from hicache_store.backends.errors import NotFoundError
from hicache_store.backends.registry import scheme_backend
from hicache_store.backends.types import BackendURL


class StoreNotFoundError(NotFoundError):
    """A command that never creates a store was pointed at a location that holds none."""


def open_store(url: str, *, existing: bool = False, read_only: bool = False,
               **options: Any) -> Backend:
    """``open_backend(url, **options)``; an ``ImportError`` becomes ``MissingDependencyError``.

    ``existing``: the store must already exist (see the module docstring); raises
    ``StoreNotFoundError`` naming the location otherwise. ``read_only``: for a tool that only
    reads, a backend that can open read-only (``Backend.opens_read_only``: file, hf3fs) is
    opened so, and writes nothing (it works on a full filesystem); others open as usual.
    """
    try:
        scheme = scheme_backend(BackendURL.parse(url).scheme) if "://" in url else ""
        if read_only and scheme and get_backend_class(scheme).opens_read_only:
            options = {**options, "read_only": True}
        if existing and "://" in url:
            parsed = BackendURL.parse(url)
            if get_backend_class(scheme).creates_location:
                options = {**options, "create": False}
                try:
                    return open_backend(url, **options)
                except NotFoundError as exc:
                    raise StoreNotFoundError(
                        f"no hicache-store store at {parsed.location!r} ({url}); nothing was "
                        "created. Check the path, or write to it first (prepopulate, an engine)",
                        backend=parsed.scheme, operation="open",
                    ) from exc
        return open_backend(url, **options)
    except MissingDependencyError:
        raise
    except ImportError as exc:
        name = BackendURL.parse(url).scheme if "://" in url else url
        spec = available_backends().get(name)
        hint = spec.install_hint if spec is not None else None
        raise MissingDependencyError(
            f"backend {name!r} needs {exc.name or 'a module'} that is not installed ({exc})",
            install_hint=hint, backend=name,
        ) from exc
