"""Synchronous access to the async API, for scripts, notebooks and engine threads.

Everything in hicache-store that touches storage is async; this is the one public bridge::

    from hicache_store import sync
    from hicache_store.backends import open_backend

    store = open_backend("file:///var/cache/kv")
    found = sync.run(store.exists(keys))     # any coroutine, on the library's own loop
    sync.close(store)                        # close a backend from synchronous code

``run`` executes the coroutine on one background event loop (a daemon thread started on first
use) and blocks until it is done; it must not be called from that loop itself (async code
awaits instead). Backends bind no loop, so a backend used through ``run`` can also be used from
the caller's own loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._sync import run_sync as run
from ._sync import submit

if TYPE_CHECKING:
    from hicache_store.backends import Backend

__all__ = ["close", "run", "submit"]


def close(backend: Backend, timeout: float | None = 30.0) -> None:
    """Close ``backend`` from synchronous code (idempotent), waiting at most ``timeout`` s."""
    run(backend.close(), timeout)
