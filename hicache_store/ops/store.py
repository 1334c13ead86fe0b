"""Opening a backend for a command: ``open_backend`` plus an install hint on any ImportError.

The registry turns an import failure of a backend's *module* into ``MissingDependencyError``
with its install hint, but a backend that imports its SDK lazily (``s3`` imports boto3 in its
constructor) raises a plain ``ImportError`` from ``from_url``. Commands open stores through
``open_store`` so both cases read the same: one line naming what to install.
"""

from __future__ import annotations

from typing import Any

from hicache_store.backends import Backend, MissingDependencyError, available_backends, open_backend
from hicache_store.backends.types import BackendURL


def open_store(url: str, **options: Any) -> Backend:
    """``open_backend(url, **options)``; an ``ImportError`` becomes ``MissingDependencyError``."""
    try:
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
