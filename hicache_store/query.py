"""An HTTP prefix query for L3: how many leading pages of a prompt a store holds.

A cache-aware router asks, for a prompt, how long a prefix the shared store (L3, the medium
``STORAGE``) already holds, and sends the request where loading it is cheapest. The answer comes
from ``KVReader.stored_pages`` (``Backend.exists_prefix_pages``'s search: O(log pages) round
trips, each bounded by the reader's ``io_timeout_s``).

Endpoints (JSON in and out):

- ``POST /query`` with ``{"tokens": [int, ...]}`` or ``{"block_hashes": [hex, ...]}`` (the chain
  page hashes of ``hicache_store.layout.hashing.page_hashes``, parent first) answers
  ``{"medium": {"STORAGE": {"matched_pages": n, "matched_tokens": n * page_size}},
  "page_size": p, "namespace": digest}``.
- ``GET /layout``: what a router needs to build the hashes itself: ``page_size``,
  ``namespace`` (digest), ``hash_algo``, ``key_scheme``, ``sealed``.

Bad input is a 4xx with ``{"error": "..."}``: 400 for bad JSON or wrong types (a partial last page
of tokens is ignored, as everywhere: only full pages are stored), 404 for another path, 411/413 for a missing or too large body,
403 for plain hashes against a sealed namespace. A backend that fails or times out is a 503
naming the error.

**Sealed namespaces.** Answers are counts: they never carry token ids or page hashes, plain
or keyed. A sealed namespace's keyed names need its ring, which the server holds; a router
without the ring cannot compute them, so it sends tokens, and ``block_hashes`` are refused
(plain hashes are what sealing hides from the store's readers, and the server would be an
oracle for them). Threat model: whoever can reach the port can learn whether a prompt is
cached in that namespace (as the engine can); bind the server to loopback or a trusted
network.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hicache_store.layout.errors import InvalidKeyError
from hicache_store.layout.namespace import Namespace
from hicache_store.reader import KVReader

__all__ = ["MAX_BODY_BYTES", "QueryServer", "layout_descriptor"]

#: the largest request body accepted (a 1M-token prompt of 7-digit ids fits).
MAX_BODY_BYTES = 16 << 20
#: the largest prompt accepted, in tokens or pages.
MAX_ITEMS = 4 << 20


class QueryError(Exception):
    """A request the server answers with ``status`` and this message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def layout_descriptor(namespace: Namespace) -> dict[str, Any]:
    """What a router needs to compute our page hashes (``GET /layout``)."""
    return {
        "page_size": namespace.page_size,
        "namespace": namespace.digest,
        "hash_algo": namespace.hash_algo,
        "key_scheme": namespace.key_scheme,
        "sealed": namespace.sealed,
        "medium": "STORAGE",
    }


def answer(reader: KVReader, namespace: Namespace, body: object) -> dict[str, Any]:
    """The answer to one ``/query`` body (parsed JSON); ``QueryError`` for bad input."""
    if not isinstance(body, dict):
        raise QueryError(400, "the body must be a JSON object")
    wanted = {"tokens", "block_hashes"} & body.keys()
    if len(wanted) != 1:
        raise QueryError(400, "give exactly one of 'tokens' and 'block_hashes'")
    field = wanted.pop()
    items = body[field]
    if not isinstance(items, list):
        raise QueryError(400, f"'{field}' must be a list")
    if len(items) > MAX_ITEMS:
        raise QueryError(413, f"'{field}': {len(items)} items, at most {MAX_ITEMS}")
    try:
        if field == "tokens":
            if not all(type(t) is int and 0 <= t < 1 << 63 for t in items):
                raise QueryError(400, "'tokens' must be integers in [0, 2**63)")
            pages = reader.stored_pages(items)
        else:
            if namespace.sealed:
                raise QueryError(403, "this namespace is sealed: send 'tokens', not hashes")
            if not all(isinstance(h, str) for h in items):
                raise QueryError(400, "'block_hashes' must be strings")
            try:
                pages = reader.stored_pages_of_hashes(items)
            except InvalidKeyError as exc:
                raise QueryError(400, f"'block_hashes': {exc}") from None
    except QueryError:
        raise
    except Exception as exc:  # the backend failed or timed out: say so, do not crash
        raise QueryError(503, f"the store did not answer: {type(exc).__name__}: {exc}") from None
    return {
        "medium": {"STORAGE": {"matched_pages": pages,
                               "matched_tokens": pages * namespace.page_size}},
        "page_size": namespace.page_size,
        "namespace": namespace.digest,
    }


class QueryServer:
    """``/query`` and ``/layout`` over ``reader`` (see the module docstring), in threads.

    ``start()`` serves in a background thread (tests, embedding), ``serve_forever()`` in this
    one; ``close()`` stops it. ``port=0`` picks a free port (``self.port``).
    """

    def __init__(self, reader: KVReader, host: str = "127.0.0.1", port: int = 0,
                 *, max_body: int = MAX_BODY_BYTES) -> None:
        self.reader = reader
        self.namespace = reader.namespace()
        self.max_body = max_body
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        address = self._httpd.server_address
        self.host, self.port = str(address[0]), int(address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> QueryServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()


def _handler(server: QueryServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # A client that stalls mid-body cannot hold a thread forever.
        timeout = 30

        def log_message(self, format: str, *args: Any) -> None:
            pass  # no access log: requests would fill the operator's terminal

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/layout":
                self._send(200, layout_descriptor(server.namespace))
            else:
                self._send(404, {"error": f"no endpoint {self.path} (GET /layout, POST /query)"})

        def do_POST(self) -> None:
            try:
                if self.path != "/query":
                    raise QueryError(404, f"no endpoint {self.path} (POST /query)")
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit():
                    raise QueryError(411, "a Content-Length header is required")
                if int(length) > server.max_body:
                    self.close_connection = True  # the body is not read
                    raise QueryError(413, f"body of {length} bytes, at most {server.max_body}")
                raw = self.rfile.read(int(length))
                try:
                    body = json.loads(raw)
                except (ValueError, UnicodeDecodeError) as exc:
                    raise QueryError(400, f"the body is not JSON: {exc}") from None
                self._send(200, answer(server.reader, server.namespace, body))
            except QueryError as exc:
                self._send(exc.status, {"error": str(exc)})
            except Exception as exc:  # a bug must answer, not drop the connection
                self._send(500, {"error": f"{type(exc).__name__}: {exc}"})

    return Handler
