"""An HTTP prefix query for L3: how many leading pages of a prompt a store holds.

A cache-aware router asks, for a prompt, how long a prefix the shared store (L3, the medium
``STORAGE``) already holds, and sends the request where loading it is cheapest. The answer comes
from ``KVReader.stored_pages`` (``Backend.exists_prefix_pages``'s search: O(log pages) round
trips, each bounded by the reader's ``io_timeout_s``).

Endpoints (JSON in and out):

- ``POST /query`` with ``{"tokens": [int, ...]}`` or ``{"block_hashes": [hex, ...]}`` (the chain
  page hashes of ``hicache_store.layout.hashing.page_hashes``, parent first) answers
  ``{"medium": {"STORAGE": {"matched_pages": n, "matched_tokens": n * page_size}},
  "page_size": p, "namespace": digest}``. The body may also name ``"namespace"``: it must be
  the digest served (a server answers for one namespace; another is a 400 naming the one
  served, never another namespace's answer). Any other field is a 400 naming it.
- ``GET /layout``: what a router needs to build the hashes itself: ``page_size``,
  ``namespace`` (digest), ``hash_algo``, ``key_scheme``, ``sealed``.
- ``GET /health``: ``{"status": "ok", "namespace": digest}`` while the server runs (it does
  not ask the store: a store that fails makes ``/query`` a 503).

Bad input is a 4xx with ``{"error": "..."}``: 400 for bad JSON (nested too deep to
parse included), an unknown field or wrong types (a partial last page of tokens is
ignored, as everywhere: only full pages are stored), 404 for another path, 405 for a path
asked with the other method (with ``Allow``), 411 for a missing or malformed Content-Length,
413 for a too large body, 403 for plain hashes against a sealed namespace. A backend that
fails or times out is a 503 naming the error.

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
import re
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
#: the fields a ``/query`` body may hold.
FIELDS = ("tokens", "block_hashes", "namespace")
#: path -> the method it answers.
ENDPOINTS = {"/query": "POST", "/layout": "GET", "/health": "GET"}
_CONTENT_LENGTH = re.compile(r"[0-9]{1,19}")


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
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise QueryError(400, f"unknown field{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(map(repr, unknown))}; a query holds "
                              f"{', '.join(map(repr, FIELDS))}")
    if "namespace" in body and body["namespace"] != namespace.digest:
        raise QueryError(400, f"namespace {body['namespace']!r} is not served here: this "
                              f"server answers for {namespace.digest} only")
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

        def _route(self, method: str) -> None:
            """404 for a path that is no endpoint, 405 (with ``Allow``) for the wrong method."""
            allowed = ENDPOINTS.get(self.path)
            if allowed is None:
                listed = ", ".join(f"{m} {p}" for p, m in ENDPOINTS.items())
                raise QueryError(404, f"no endpoint {self.path} ({listed})")
            if allowed != method:
                self.close_connection = True  # a body sent with it is not read
                raise QueryError(405, f"{self.path} answers {allowed}, not {method}")

        def _fail(self, exc: QueryError) -> None:
            status = exc.status
            self.send_response(status)
            data = json.dumps({"error": str(exc)}).encode()
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 405:
                self.send_header("Allow", ENDPOINTS[self.path])
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            try:
                self._route("GET")
                if self.path == "/layout":
                    self._send(200, layout_descriptor(server.namespace))
                else:
                    self._send(200, {"status": "ok", "namespace": server.namespace.digest})
            except QueryError as exc:
                self._fail(exc)

        def do_POST(self) -> None:
            try:
                self._route("POST")
                length = self.headers.get("Content-Length")
                # ASCII digits only: ``str.isdigit`` takes "²", which ``int`` refuses.
                if length is None or _CONTENT_LENGTH.fullmatch(length) is None:
                    raise QueryError(411, "a Content-Length header of decimal digits is required")
                if int(length) > server.max_body:
                    self.close_connection = True  # the body is not read
                    raise QueryError(413, f"body of {length} bytes, at most {server.max_body}")
                raw = self.rfile.read(int(length))
                self._send(200, answer(server.reader, server.namespace, _parse(raw)))
            except QueryError as exc:
                self._fail(exc)
            except Exception as exc:  # a bug must answer, not drop the connection
                self._send(500, {"error": f"{type(exc).__name__}: {exc}"})

    return Handler


def _parse(raw: bytes) -> object:
    """The JSON of a request body; ``QueryError`` 400 when it is not JSON, also when it is
    nested too deep for the parser (``RecursionError``, caught: the parser unwinds cleanly)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise QueryError(400, f"the body is not JSON: {type(exc).__name__}: {exc}") from None
