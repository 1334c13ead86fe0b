"""``hicache-store bench backend``: a tiny run end to end, JSON and table, and bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_store.cli import main


def test_bench_backend_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "backend", f"file://{tmp_path}/kv", "--objects", "6", "--size", "64KiB",
                 "--batch", "4", "--exists-keys", "50", "--drop-caches", "no", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    phases = {m["phase"]: m for m in report["measures"]}
    assert set(phases) == {"write", "cold read", "second read", "warm read", "range read", "exists"}
    assert phases["write"]["nbytes"] == 6 * 64 * 1024
    assert phases["exists"]["items"] == 50
    assert phases["write"]["raw_gbps"] is not None and phases["write"]["ratio"] is not None
    objects = [p for p in (tmp_path / "kv" / "objects").rglob("*") if p.is_file()]
    assert objects == [], "the benchmark's objects were not deleted"
    assert [p.name for p in (tmp_path / "kv").iterdir() if p.name.startswith("bench-raw")] == []


def test_the_baseline_alone_opens_no_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # ``--baseline only``: the raw row of a comparison, measured in its own process as a backend's
    # run is (a backend measured after the baseline in one process is not measured alike).
    code = main(["bench", "backend", f"file://{tmp_path}/kv", "--objects", "3", "--size", "1MB",
                 "--batch", "2", "--baseline", "only", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    phases = {m["phase"]: m for m in report["measures"]}
    assert set(phases) == {"write", "cold read"}
    for m in phases.values():
        assert m["nbytes"] == 3_000_000 and m["gbps"] > 0 and m["ratio"] == pytest.approx(1.0)
    assert phases["cold read"]["note"] == ""  # its own files were evicted before the read
    assert list((tmp_path / "kv").iterdir()) == []  # no store made, the raw files removed


def test_the_baseline_alone_needs_a_local_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "backend", "memory://", "--baseline", "only"]) == 2
    assert "--baseline only" in capsys.readouterr().err


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


def test_unaligned_size_and_own_files_evicted_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1MB = 1,000,000 bytes: not a whole number of 4 KiB blocks (the raw O_DIRECT baseline
    # once failed with EINVAL). By default only the benchmark's own files leave the page cache.
    code = main(["bench", "backend", f"file://{tmp_path}/kv", "--objects", "3", "--size", "1MB",
                 "--batch", "2", "--exists-keys", "5", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["object_bytes"] == 1_000_000 and report["drop_caches"] == "files"
    cold = next(m for m in report["measures"] if m["phase"] == "cold read")
    assert cold["note"] == "" and cold["raw_gbps"] is not None
    assert "page cache" not in err  # nothing machine-wide happened, so nothing to announce


def test_dropping_the_whole_page_cache_is_asked_for_and_announced(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "backend", "memory://", "--objects", "2", "--size", "8KiB",
                 "--exists-keys", "2", "--drop-caches", "all", "--quiet"]) == 0
    assert "whole machine's page cache" in capsys.readouterr().err


def _cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("hicache-store")
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, **env}, cwd=tmp_path)


def test_a_closed_pipe_is_not_a_traceback(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("hicache-store")
    result = subprocess.run(
        f"'{script}' plan --layers 60 --kv-heads 8 --head-dim 128 --layer-partition 1 "
        "--head-partition 1 --writer tp=4,pp=2 --reader tp=2,pp=1 | head -1",
        shell=True, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
    assert len(result.stdout.splitlines()) == 1
    assert result.stderr == ""


BLOCKED_RUN = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name.split(".")[0])
        return None
sys.meta_path.insert(0, Blocker())
from hicache_store.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    ("blocked", "argv", "code", "message"),
    [
        ({"torch"}, ["bench", "multiturn", "--workdir", "w"], 2,
         "bench multiturn needs torch: pip install torch==2.13.0"),
        ({"matplotlib"}, ["bench", "multiturn", "--chart", "c.png", "--workdir", "w"], 2,
         "--chart needs matplotlib: pip install matplotlib (the bench extra)"),
        ({"torch"}, ["prepopulate", "memory://", "--mini-engine", "tiny", "--prompts", "p.jsonl"],
         1, "needs torch: pip install torch==2.13.0"),
    ],
)
def test_a_missing_package_is_one_line_before_any_work(
    tmp_path: Path, blocked: set[str], argv: list[str], code: int, message: str
) -> None:
    (tmp_path / "p.jsonl").write_text('{"input_ids": [1, 2, 3, 4]}\n')
    result = subprocess.run([sys.executable, "-c", BLOCKED_RUN.format(blocked=blocked, argv=argv)],
                            capture_output=True, text=True, timeout=120, check=False,
                            cwd=tmp_path)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "w").exists(), "the benchmark started before the check"


def test_json_dash_writes_stdout(tmp_path: Path) -> None:
    result = _cli(["bench", "multiturn", "--preset", "tiny", "--groups", "1",
                   "--conversations", "1", "--turns", "1", "--system-tokens", "32",
                   "--answer-tokens", "8", "--configs", "L1", "--json", "-", "--workdir", "w"],
                  tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["setup"]["name"] == "L1"
    assert not (tmp_path / "-").exists()
    assert "\r" not in result.stderr  # stderr is a pipe here: plain lines, no redraws
