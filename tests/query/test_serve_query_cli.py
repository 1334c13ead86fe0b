"""``hicache-store serve-query``: a real process serving a prepopulated file store."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from hicache_store import sync
from hicache_store.backends import open_backend
from hicache_store.demo.engine.source import MiniEngineSource
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.namespace import Grid
from hicache_store.layout.topology import Topology
from hicache_store.ops.prepopulate import namespace_for, prepopulate

PAGE = 4


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hicache_store", *args]


def test_serves_the_longest_stored_prefix_and_the_layout(tmp_path: Path) -> None:
    source = MiniEngineSource("tiny")
    url = f"file://{tmp_path / 'kv'}"
    namespace = namespace_for(source, page_size=PAGE, grid=Grid(1, 1))
    tokens = list(range(100, 100 + 6 * PAGE))
    backend = open_backend(url)
    sync.run(prepopulate(backend, source, [tokens], namespace, Topology(1, 1)))
    sync.close(backend)

    proc = subprocess.Popen(cli("serve-query", url, "--namespace", namespace.digest, "--port", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
        assert first[0] == "serving", proc.stderr.read() if proc.stderr else ""
        base = first[1]
        with urllib.request.urlopen(base + "/layout", timeout=120) as reply:
            layout = json.loads(reply.read())
        assert layout["page_size"] == PAGE and layout["namespace"] == namespace.digest
        body = json.dumps({"tokens": [*tokens[:4 * PAGE], 1, 2, 3, 4, 5]}).encode()
        request = urllib.request.Request(base + "/query", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
        assert answer["medium"]["STORAGE"]["matched_pages"] == 4
        hashes = [*page_hashes(tokens, PAGE)[:3], "0" * 64]
        body = json.dumps({"block_hashes": hashes}).encode()
        request = urllib.request.Request(base + "/query", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert json.loads(reply.read())["medium"]["STORAGE"]["matched_pages"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_unknown_namespace_is_one_clear_error(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    backend = open_backend(f"file://{store}")
    sync.close(backend)
    done = subprocess.run(cli("serve-query", f"file://{store}", "--namespace", "ab" * 8,
                              "--port", "0"), capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode != 0
    assert "no manifest of namespace" in done.stderr and "Traceback" not in done.stderr
