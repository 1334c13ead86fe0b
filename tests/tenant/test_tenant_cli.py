"""The operator tools with a tenant key ring: prepopulate seals, inspect names each key's state
and authenticates what it can, gc removes exactly the objects of retired keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_store.cli import main
from hicache_store.layout.framing import decode_header
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import parse_key
from hicache_store.tenant import (
    KEY_FILE_ENV,
    KEY_TEXT_ENV,
    format_key_ring,
    parse_key_ring,
    retire_text,
    rotate_text,
)

FIRST = format_key_ring(b"\x0a" * 32)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(KEY_TEXT_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def ring_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def prompts(tmp_path: Path, name: str, ids: list[int]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"input_ids": ids}) + "\n")
    return str(path)


def objects(store: Path) -> dict[str, str | None]:
    """Stored object name -> the key id in its header."""
    return {
        p.name: decode_header(p.read_bytes()).key_id
        for p in (store / "objects").rglob("*_L*")
    }


def prepopulate(url: str, prompt_file: str, ring: str) -> int:
    return main(["prepopulate", url, "--mini-engine", "tiny", "--prompts", prompt_file,
                 "--page-size", "4", "--no-progress", "--tenant-key-file", ring])


def test_poison_proof_tools_seal_rotate_inspect_and_remove_retired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    url = f"file://{store}"
    first = ring_file(tmp_path, "r1", FIRST)
    old_ids = list(range(100, 116))
    assert prepopulate(url, prompts(tmp_path, "a.jsonl", old_ids), first) == 0
    out = capsys.readouterr().out
    old_key = parse_key_ring(FIRST).active.key_id
    assert f"sealed with key {old_key}" in out
    stored = objects(store)
    assert stored and set(stored.values()) == {old_key}
    public = set(page_hashes(old_ids, 4))
    assert not {parse_key(name).page_hash for name in stored} & public

    # Rotate: prepopulate writes under the active key (so rerunning it migrates prepopulated
    # KV to the new key before the old one is retired); the old objects stay as they are.
    rotated_text = rotate_text(FIRST)
    rotated = ring_file(tmp_path, "r2", rotated_text)
    new_key = parse_key_ring(rotated_text).active.key_id
    assert prepopulate(url, prompts(tmp_path, "a.jsonl", old_ids), rotated) == 0
    assert "0 failed writes" in capsys.readouterr().out
    assert prepopulate(url, prompts(tmp_path, "b.jsonl", list(range(500, 508))), rotated) == 0
    capsys.readouterr()
    after = objects(store)
    assert {n: k for n, k in after.items() if k == old_key} == stored
    new_objects = {n for n, k in after.items() if k == new_key}
    assert len(new_objects) == len(stored) + 2 and set(after.values()) == {old_key, new_key}

    # inspect --verify authenticates both keys' objects and names their states.
    assert main(["inspect", url, "--verify", "--json", "--no-progress",
                 "--tenant-key-file", rotated]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["namespaces"][0]["namespace"]["sealed"] is True
    verify = report["verify"]
    assert verify["key_ids"] == {old_key: len(stored), new_key: len(new_objects)}
    assert verify["unverified"] == 0 and verify["corrupt"] == 0

    # Retire the old key: inspect shows it retired (headers only), gc removes exactly those.
    retired = ring_file(tmp_path, "r3", retire_text(rotated_text, old_key))
    assert main(["inspect", url, "--verify", "--no-progress", "--tenant-key-file", retired]) == 0
    text = capsys.readouterr().out
    assert f"sealed with key {old_key} (retired): {len(stored)} objects" in text
    assert f"sealed with key {new_key} (active): {len(new_objects)} objects" in text
    assert f"{len(stored)} sealed objects under keys not held" in text
    assert main(["gc", url, "--remove-retired", "--tenant-key-file", retired, "--dry-run"]) == 0
    assert f"would delete {len(stored)} under retired keys" in capsys.readouterr().out
    assert objects(store) == after
    assert main(["gc", url, "--remove-retired", "--tenant-key-file", retired, "--yes"]) == 0
    assert f"deleted {len(stored)} under retired keys" in capsys.readouterr().out
    assert set(objects(store)) == new_objects
    assert any(p.name.startswith("M_") for p in (store / "objects").rglob("*"))  # manifest kept


def test_poison_gc_needs_a_ring_that_retires_something(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path / 'store'}"
    assert main(["gc", url, "--remove-retired"]) == 2
    assert "needs a tenant key ring" in capsys.readouterr().err
    ring = ring_file(tmp_path, "r", FIRST)
    assert main(["gc", url, "--remove-retired", "--tenant-key-file", ring]) == 2
    assert "retires no key" in capsys.readouterr().err
    bad = ring_file(tmp_path, "bad", "active nothex\n")
    assert main(["inspect", url, "--tenant-key-file", bad]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "nothex" not in err


def test_tenant_key_command_makes_rotates_and_retires_rings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ring"
    assert main(["tenant-key", "new", str(path)]) == 0
    first = parse_key_ring(path.read_text()).active
    assert capsys.readouterr().out == f"active  {first.key_id}\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert main(["tenant-key", "new", str(path)]) == 2  # never overwrites a ring
    capsys.readouterr()
    assert main(["tenant-key", "rotate", str(path)]) == 0
    ring = parse_key_ring(path.read_text())
    assert ring.active != first and ring.readable[1] == first
    out = capsys.readouterr().out
    assert f"read    {first.key_id}" in out
    assert sum(line.startswith("active ") for line in path.read_text().splitlines()) == 1
    assert main(["tenant-key", "retire", str(path), first.key_id]) == 0
    assert parse_key_ring(path.read_text()).retired == {first.key_id}
    assert f"retired {first.key_id}" in capsys.readouterr().out
    assert main(["tenant-key", "retire", str(path)]) == 2
    assert main(["tenant-key", "show", str(path), "x"]) == 2
    assert not list(tmp_path.glob(".*tmp"))
