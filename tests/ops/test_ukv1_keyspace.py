"""The operator tools on SGLang's unified keyspace (``sglang-ukv1``, bare objects).

``prepopulate`` writes it, ``inspect`` lists and verifies it (sizes only: bare objects carry no
checksums), ``gc`` bounds it by pages (no parent links: by age alone), and the namespace's
manifest is readable under its ``ukv1-`` digest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_store.backends import open_backend
from hicache_store.cli import main
from hicache_store.demo.engine.source import MiniEngineSource
from hicache_store.layout.keys import parse_key
from hicache_store.layout.topology import Topology
from hicache_store.layout.ukv1 import ukv1_grid
from hicache_store.ops.gc import collect_garbage
from hicache_store.ops.inspection import inspect_store
from hicache_store.ops.manifest import manifest_key
from hicache_store.ops.prepopulate import namespace_for, prepopulate

PROMPTS = [[(7 * i + j) % 97 + 3 for j in range(48)] for i in range(3)]


async def test_prepopulate_inspect_verify_gc_on_the_ukv1_keyspace(tmp_path: Path) -> None:
    source = MiniEngineSource("tiny", seed=3)
    topology = Topology(2, 1)
    namespace = namespace_for(source, page_size=16,
                              grid=ukv1_grid(source.shape, topology),
                              key_scheme="sglang-ukv1")
    backend = open_backend(f"file://{tmp_path}/kv")
    try:
        report = await prepopulate(backend, source, PROMPTS, namespace, topology)
        assert report.pages_written == report.pages == 9
        assert report.namespace == namespace.digest and namespace.digest.startswith("ukv1-")
        keys = [k async for k in backend.list_prefix("")]
        objects = [k for k in keys if k != manifest_key(namespace)]
        assert manifest_key(namespace) in keys
        assert len(objects) == 9 * report.objects_per_page
        assert all(parse_key(k).namespace_digest == namespace.digest for k in objects)
        assert all("_L0-" in k for k in objects)  # end-exclusive, one object per stage

        store = await inspect_store(backend, verify=True)
        (summary,) = store.namespaces
        assert summary.namespace == namespace and summary.pages == 9
        checked = store.verify
        assert checked is not None and checked.ok == len(objects) and not checked.corrupt
        victim = objects[0]
        data = await backend.get_bytes(victim)
        assert data is not None
        await backend.put([victim], [memoryview(data[:-16])])  # a torn object: wrong size
        checked = (await inspect_store(backend, verify=True)).verify
        assert checked is not None
        assert [c["key"] for c in checked.corrupt_examples] == [victim]

        gc = await collect_garbage(backend, max_bytes=1, max_age=None)
        assert gc.over_budget == len(objects) and gc.failures == 0
        assert gc.headers_read == 0 and gc.headers_unreadable == 0, "bare objects: no header"
        assert [k async for k in backend.list_prefix("")] == [manifest_key(namespace)]
    finally:
        await backend.close()


def test_prepopulate_cli_writes_sglangs_keyspace_from_the_extra_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The deployment's extra-config names the key scheme; prepopulate writes the keys SGLang's
    TP2 x PP2 servers of that deployment read (mini engine: 4 layers, 2 KV heads, float32)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(range(1, 41))}) + "\n")
    extra = json.dumps({"url": "ignored", "key_scheme": "sglang-ukv1", "model": "org/m"})
    store = tmp_path / "store"
    code = main(["prepopulate", f"file://{store}", "--mini-engine", "tiny", "--prompts",
                 str(prompts), "--page-size", "8", "--topology", "tp=2,pp=2",
                 "--extra-config", extra, "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    names = sorted(p.name for p in store.rglob("*")
                   if p.is_file() and "_ukv1-" in p.name and not p.name.startswith("M_"))
    assert len(names) == 5 * 4  # 5 pages, one object per rank (per-stage chunk, one head)
    tails = {n.split("_", 1)[1] for n in names}
    digest = next(iter(tails)).split("_")[0]
    assert tails == {f"{digest}_L{a}-{b}_H{h}" for a, b in ((0, 2), (2, 4)) for h in (0, 1)}
