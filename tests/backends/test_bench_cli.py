"""``hicache-store bench backend``: a tiny run end to end, JSON and table, and bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_store.cli import main


def test_bench_backend_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "backend", f"file://{tmp_path}/kv", "--objects", "6", "--size", "64KiB",
                 "--batch", "4", "--exists-keys", "50", "--drop-caches", "no", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    phases = {m["phase"]: m for m in report["measures"]}
    assert set(phases) == {"write", "cold read", "warm read", "range read", "exists"}
    assert phases["write"]["nbytes"] == 6 * 64 * 1024
    assert phases["exists"]["items"] == 50
    assert phases["write"]["raw_gbps"] is not None and phases["write"]["ratio"] is not None
    objects = [p for p in (tmp_path / "kv" / "objects").rglob("*") if p.is_file()]
    assert objects == [], "the benchmark's objects were not deleted"
    assert [p.name for p in (tmp_path / "kv").iterdir() if p.name.startswith("bench-raw")] == []


def test_bench_backend_table_for_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "backend", "memory://", "--objects", "3", "--size", "8KiB",
                 "--exists-keys", "10", "--drop-caches", "no"]) == 0
    out = capsys.readouterr().out
    assert "cold read" in out
    assert "keys/s" in out
    assert "raw = O_DIRECT" not in out  # no raw baseline for a non-file backend


def test_bench_backend_bad_size_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "backend", "memory://", "--size", "lots"]) == 2
    assert "--size" in capsys.readouterr().err
