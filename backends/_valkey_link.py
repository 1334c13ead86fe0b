"""The Valkey index's connection: one root's keys on a Valkey or Redis server, or a cluster.

The maintained client does the protocol (``valkey`` on PyPI; ``redis://`` and ``valkey://``
URLs both, ``rediss://`` / ``valkeys://`` with TLS). A server in cluster mode is found at
connect (``INFO cluster``) and spoken to with the cluster client; every key of one root
carries the hash tag ``{<root id>}``, so all of them live in one slot and every script runs on
one node.

**Every call is bounded.** The socket's connect and read timeouts are ``timeout_s``; a
connection error, a timeout, a server loading its data or busy running a script, a cluster
that is down: each becomes ``BackendUnavailableError`` (retryable) at this edge. After one, the
link refuses calls at once for ``RETRY_S`` (no call waits out a timeout behind another that
just did), then tries again. An outage is logged once, when it begins, with the number of calls
it refused logged when the server answers again; ``refused`` counts them all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .errors import BackendUnavailableError, MissingDependencyError

log = logging.getLogger(__name__)
T = TypeVar("T")
#: seconds during which calls are refused at once after the server failed to answer
RETRY_S = 0.5
#: replies of a server that cannot answer now (a retry may succeed)
_UNAVAILABLE_REPLIES = ("BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY")


def _client_module() -> Any:
    try:
        import valkey
    except ImportError as exc:
        raise MissingDependencyError(
            "the Valkey index needs the valkey client",
            install_hint="pip install 'hicache-store[valkey]'", backend="index",
        ) from exc
    return valkey


class Link:
    """The client of one root's keys (module docstring). Thread-safe."""

    def __init__(self, url: str, root_id: str, *, timeout_s: float, connections: int,
                 scripts: dict[str, str]) -> None:
        valkey = _client_module()
        self._errors: tuple[type[BaseException], ...] = (
            valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError)
        self._response_error: type[BaseException] = valkey.exceptions.ResponseError
        self.url = url
        self.root_id = root_id
        self.prefix = f"hc:{{{root_id}}}:"
        self.meta = self.prefix + "M"
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._refused_in_outage = 0
        #: calls refused because the server could not be reached (since open)
        self.refused = 0
        options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                   "retry_on_timeout": False}
        self.client: Any = valkey.Valkey.from_url(url, max_connections=connections, **options)
        self.cluster = False
        try:
            info = self.client.info("cluster")
        except Exception as exc:
            raise self._translate(exc, "open") from exc
        if info.get("cluster_enabled") in (1, "1"):
            from valkey.cluster import ValkeyCluster

            self.client.close()
            self.client = ValkeyCluster.from_url(url, **options)  # type: ignore[no-untyped-call]
            self.cluster = True
        self._scripts = {name: self.client.register_script(src) for name, src in scripts.items()}

    def key(self, name: str) -> str:
        return self.prefix + name

    def script(self, name: str, args: Sequence[bytes | str | int | float], *,
               operation: str) -> list[Any]:
        """Run one of ``scripts`` on this root's keys; its reply (a list)."""
        reply: list[Any] = self.call(operation, self._scripts[name], keys=[self.meta],
                                     args=list(args))
        return reply

    def call(self, operation: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` (a client call), with the server's failures translated."""
        with self._lock:
            if self._down_since is not None and time.monotonic() < self._retry_at:
                self.refused += 1
                self._refused_in_outage += 1
                raise BackendUnavailableError(
                    f"the index at {self.url} did not answer (retrying in under {RETRY_S} s)",
                    backend="index", operation=operation)
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            error = self._translate(exc, operation)
            if isinstance(error, BackendUnavailableError):
                self._went_down(exc)
            raise error from exc
        if self._down_since is not None:
            self._came_back()
        return result

    def pipeline(self, operation: str, build: Callable[[Any], object]) -> list[Any]:
        """The replies of the commands ``build`` queues on one pipeline (one round trip)."""
        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            build(pipe)
            replies: list[Any] = pipe.execute()
            return replies

        return self.call(operation, run)

    def _translate(self, exc: BaseException, operation: str) -> Exception:
        if isinstance(exc, self._errors) or (
                isinstance(exc, self._response_error) and str(exc).startswith(
                    _UNAVAILABLE_REPLIES)):
            return BackendUnavailableError(f"the index at {self.url}: {exc}", backend="index",
                                           operation=operation)
        return exc if isinstance(exc, Exception) else RuntimeError(str(exc))

    def _went_down(self, exc: BaseException) -> None:
        with self._lock:
            self.refused += 1
            self._retry_at = time.monotonic() + RETRY_S
            if self._down_since is None:
                self._down_since = time.monotonic()
                self._refused_in_outage = 1
                log.warning("the fleet index at %s does not answer (%s): writes are refused and "
                            "reads probe the store until it does", self.url, exc)
            else:
                self._refused_in_outage += 1

    def _came_back(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            down_s = time.monotonic() - self._down_since
            refused = self._refused_in_outage
            self._down_since = None
        log.warning("the fleet index at %s answers again after %.1f s (%d calls refused)",
                    self.url, down_s, refused)

    @property
    def down(self) -> bool:
        """Whether the last call found the server unreachable."""
        return self._down_since is not None

    def close(self) -> None:
        try:
            self.client.close()
        except Exception as exc:
            log.debug("closing the index client: %r", exc)


__all__ = ["RETRY_S", "Link"]
