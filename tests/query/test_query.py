"""``hicache_store.query``: real HTTP on loopback answers what ``exists_prefix_pages`` does."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hicache_store import sync
from hicache_store.backends import open_backend
from hicache_store.demo.engine.source import MiniEngineSource
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import Grid
from hicache_store.layout.topology import Topology
from hicache_store.ops.prepopulate import namespace_for, prepopulate
from hicache_store.query import QueryServer
from hicache_store.reader import KVReader

PAGE = 4
#: seconds a request may take: a hang detector, not a speed limit (a loaded machine is slow).
HANG_S = 120


def post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url + "/query", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    source = MiniEngineSource("tiny")
    url = f"file://{tmp_path_factory.mktemp('q') / 'kv'}"
    namespace = namespace_for(source, page_size=PAGE, grid=Grid(1, 1))
    rng = random.Random(7)
    base = [rng.randrange(500) for _ in range(8 * PAGE)]
    backend = open_backend(url)
    sync.run(prepopulate(backend, source, [base], namespace, Topology(1, 1)))
    reader = KVReader(backend, namespace)
    server = QueryServer(reader).start()
    yield server, reader, base, namespace
    server.close()
    sync.close(backend)


def test_answers_equal_the_backend_search_for_random_prompts(served: Any) -> None:
    server, reader, base, namespace = served
    rng = random.Random(1)
    hits = set()
    for _ in range(1000):
        cut = rng.randrange(len(base) + 1)
        prompt = base[:cut] + [rng.randrange(500) for _ in range(rng.randrange(3 * PAGE))]
        status, reply = post(server.url, json.dumps({"tokens": prompt}).encode())
        assert status == 200
        expected = reader.stored_pages(prompt)
        got = reply["medium"]["STORAGE"]["matched_pages"]
        assert got == expected and reply["medium"]["STORAGE"]["matched_tokens"] == got * PAGE
        hashes = page_hashes(prompt, PAGE, algo=namespace.hash_algo)
        status, by_hash = post(server.url, json.dumps({"block_hashes": hashes}).encode())
        assert status == 200 and by_hash["medium"] == reply["medium"]
        hits.add(got)
    assert 8 in hits and 0 in hits  # both ends were exercised


def test_layout_descriptor(served: Any) -> None:
    server, _reader, _base, namespace = served
    with urllib.request.urlopen(server.url + "/layout", timeout=HANG_S) as response:
        layout = json.loads(response.read())
    assert layout["page_size"] == PAGE and layout["namespace"] == namespace.digest
    assert layout["hash_algo"] == namespace.hash_algo and layout["sealed"] is False


@pytest.mark.parametrize(("body", "status"), [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (b'{"tokens": "abc"}', 400),
    (b'{"tokens": [1.5]}', 400),
    (b'{"tokens": [-1]}', 400),
    (b'{"tokens": [1], "block_hashes": []}', 400),
    (b'{"block_hashes": ["zz"]}', 400),
    (b'{"block_hashes": [3]}', 400),
])
def test_malformed_requests_are_4xx(served: Any, body: bytes, status: int) -> None:
    code, reply = post(served[0].url, body)
    assert code == status and reply["error"]


def test_too_large_body_is_413(served: Any) -> None:
    server = served[0]
    old = server.max_body
    server.max_body = 16
    try:
        code, reply = post(server.url, json.dumps({"tokens": list(range(100))}).encode())
    finally:
        server.max_body = old
    assert code == 413 and "at most" in reply["error"]


def test_stopped_backend_is_503(tmp_path: Path) -> None:
    source = MiniEngineSource("tiny")
    namespace = namespace_for(source, page_size=PAGE, grid=Grid(1, 1))
    backend = open_backend(f"file://{tmp_path / 'kv'}")
    reader = KVReader(backend, namespace)
    server = QueryServer(reader).start()
    try:
        sync.close(backend)
        code, reply = post(server.url, json.dumps({"tokens": list(range(3 * PAGE))}).encode())
    finally:
        server.close()
    assert code == 503 and "did not answer" in reply["error"]


def raw_request(url: str, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One request written byte for byte over a socket (headers ``urllib`` would not send):
    status, response headers (lowercase names), body."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_S) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)  # as http.server decodes it
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    top, _, payload = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, payload


def test_a_deeply_nested_body_is_400_not_500(served: Any) -> None:
    code, reply = post(served[0].url, b"[" * 100_000 + b"]" * 100_000)
    assert code == 400 and "not JSON" in reply["error"]
    nested = b'{"tokens": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    code, reply = post(served[0].url, nested)
    assert code == 400


def test_a_content_length_that_is_no_decimal_number_is_411(served: Any) -> None:
    url = served[0].url
    for length in ("²", "1²", "12a", "-1"):  # "²".isdigit() is true; int("²") fails
        status, _headers, payload = raw_request(
            url, f"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
                 "Connection: close\r\n", b'{"tokens": []}')
        assert status == 411, (length, payload)
        assert "Content-Length" in json.loads(payload)["error"]


def test_unknown_fields_are_refused_naming_them(served: Any) -> None:
    server, _reader, base, _namespace = served
    code, reply = post(server.url, json.dumps({"tokens": base, "tokenz": 1, "model": "x"}).encode())
    assert code == 400
    assert "'model'" in reply["error"] and "'tokenz'" in reply["error"]


def test_the_namespace_field_must_be_the_one_served(served: Any) -> None:
    server, reader, base, namespace = served
    code, reply = post(server.url, json.dumps({"tokens": base, "namespace": "0" * 16}).encode())
    assert code == 400 and namespace.digest in reply["error"]
    assert "matched_pages" not in reply
    code, reply = post(server.url,
                       json.dumps({"tokens": base, "namespace": namespace.digest}).encode())
    assert code == 200
    assert reply["medium"]["STORAGE"]["matched_pages"] == reader.stored_pages(base) == 8


def test_health_and_the_wrong_method(served: Any) -> None:
    server, _reader, _base, namespace = served
    with urllib.request.urlopen(server.url + "/health", timeout=HANG_S) as response:
        assert response.status == 200
        assert json.loads(response.read()) == {"status": "ok", "namespace": namespace.digest}
    status, headers, payload = raw_request(
        server.url, "GET /query HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
    assert status == 405 and headers["allow"] == "POST"
    assert "POST" in json.loads(payload)["error"]
    status, headers, _ = raw_request(
        server.url, "POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                    "Connection: close\r\n", b"{}")
    assert status == 405 and headers["allow"] == "GET"
    status, _, payload = raw_request(
        server.url, "GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
    assert status == 404 and "/health" in json.loads(payload)["error"]
