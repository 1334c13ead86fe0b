"""The operator commands as a user runs them: subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_store.cli import main

from .conftest import sentence, write_jsonl

# The console script, as a user runs it (``python -m hicache_store.cli`` would load cli.py
# twice, as ``__main__`` and as ``hicache_store.cli``).
CLI = [str(Path(sys.executable).with_name("hicache-store"))]


def run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
                **env}
    for name in list(full_env):
        if name.startswith("HICACHE_STORE_") and name not in env:
            del full_env[name]
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=full_env,
                          timeout=120, check=False)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.slow
def test_prepopulate_inspect_verify_gc(tiny_llama: Path, tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"text": sentence(0, 30)},
        {"messages": [{"role": "system", "content": sentence(4, 20)},
                      {"role": "user", "content": sentence(9, 6)}]},
    ])
    url = f"file://{tmp_path / 'store'}"
    args = ["prepopulate", url, "--model", str(tiny_llama), "--prompts", str(prompts),
            "--page-size", "4", "--topology", "tp=2,pp=2"]
    dry = run([*args, "--dry-run", "--json", "--no-progress"], tmp_path)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert planned["dry_run"] and planned["pages_written"] > 0
    assert not (tmp_path / "store" / "objects").exists() or not any(
        (tmp_path / "store" / "objects").rglob("*_L*"))
    # Settings from the environment: the batch size (flags > env > config > defaults).
    done = run(args, tmp_path, HICACHE_STORE_PREPOPULATE_BATCH_SIZE="1")
    assert done.returncode == 0, done.stderr
    assert "tok/s" in done.stderr and "/s" in done.stderr  # the progress bar
    assert f"wrote {planned['pages_written']} " in done.stdout

    # inspect: the URL from HICACHE_STORE_URL.
    shown = run(["inspect", "--json"], tmp_path, HICACHE_STORE_URL=url)
    assert shown.returncode == 0, shown.stderr
    (ns,) = json.loads(shown.stdout)["namespaces"]
    assert ns["manifest"] and ns["grid"] == "1x1" and ns["objects"] == 4 * ns["pages"]
    assert ns["namespace"]["num_layers"] == 2 and ns["namespace"]["page_size"] == 4

    victim = sorted((tmp_path / "store" / "objects").rglob("*_L1-1_H0"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    verify = run(["inspect", url, "--verify", "--json"], tmp_path)
    assert verify.returncode == 1, verify.stderr
    report = json.loads(verify.stdout)["verify"]
    assert [c["key"] for c in report["corrupt_examples"]] == [victim.name]
    assert (report["corrupt"], report["remaining_corrupt"]) == (1, 1)
    # Progress in a log (stderr is a pipe here): plain lines, never a carriage return.
    assert "verify " in verify.stderr and "objects/s" in verify.stderr
    assert "\r" not in verify.stderr
    kept = run(["inspect", url, "--verify", "--delete-corrupt", "--dry-run"], tmp_path)
    assert kept.returncode == 1 and victim.exists()
    assert f"corrupt {victim.name}" in kept.stdout and "would delete 1" in kept.stdout
    fixed = run(["inspect", url, "--verify", "--delete-corrupt", "--no-progress"], tmp_path)
    assert fixed.returncode == 0 and not victim.exists(), fixed.stdout

    # gc --dry-run deletes nothing.
    before = sorted(p.name for p in (tmp_path / "store" / "objects").rglob("*_*"))
    gc = run(["gc", url, "--max-bytes", "1B", "--dry-run"], tmp_path,
             XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert gc.returncode == 0 and "would delete" in gc.stdout
    assert sorted(p.name for p in (tmp_path / "store" / "objects").rglob("*_*")) == before


def test_bad_flag_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run(["prepopulate", "file:///tmp/x", "--batch-size", "many"], tmp_path)
    assert result.returncode == 2
    assert "invalid int value" in one_line(result.stderr)


# In-process (the same ``main`` the console script calls) to keep the suite fast.
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["prepopulate", "file:///tmp/x", "--bogus"], "unrecognized arguments: --bogus"),
        (["prepopulate", "file:///tmp/x"], "give at least one --prompts FILE"),
        (["inspect"], "a backend URL is required"),
        (["inspect", "memory://", "--delete-corrupt"], "--delete-corrupt needs --verify"),
        (["inspect", "memory://", "--concurrency", "0"], "--concurrency must be positive"),
        (["inspect", "--config", "/nonexistent.toml", "memory://"], "does not exist"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    argv: list[str], message: str,
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name in [n for n in os.environ if n.startswith("HICACHE_STORE_")]:
        monkeypatch.delenv(name)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == 2
    assert message in one_line(capsys.readouterr().err)


def test_bad_env_value_is_usage(tmp_path: Path) -> None:
    result = run(["inspect", "memory://"], tmp_path, HICACHE_STORE_CONCURRENCY="lots")
    assert result.returncode == 2
    assert "HICACHE_STORE_CONCURRENCY" in one_line(result.stderr)


def test_missing_backend_dependency_names_the_extra(tmp_path: Path) -> None:
    blocker = tmp_path / "block" / "boto3"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'boto3'\", name='boto3')\n")
    result = run(["inspect", "s3://bucket/kv"], tmp_path, PYTHONPATH=str(tmp_path / "block"))
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert "pip install boto3 (the s3 extra)" in line and "Traceback" not in line


def test_help_everywhere(tmp_path: Path) -> None:
    for argv in (["prepopulate", "--help"], ["inspect", "--help"]):
        result = run(argv, tmp_path)
        assert result.returncode == 0 and "usage:" in result.stdout
        assert "HICACHE_STORE_URL" in result.stdout and "--config PATH" in result.stdout
