"""``prepopulate`` writes what the target deployment reads, or refuses on one line.

The mini engine's ``tiny`` preset (4 layers, 2 KV heads of 16, float32) keeps these fast; the
Hugging Face case checks the default model id against what SGLang uses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hicache_store.cli import main

from .conftest import sentence, write_jsonl


@pytest.fixture(autouse=True)
def _clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in [n for n in os.environ if n.startswith("HICACHE_STORE_")]:
        monkeypatch.delenv(name)


def ids_prompts(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "p.jsonl", [{"input_ids": list(range(1, 53))},
                                               {"input_ids": list(range(7, 40))}])


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def stored_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.parametrize(
    ("topology", "grid_flags"),
    [
        # 2 KV heads over TP 2: one head per rank, but objects of 2 heads: no rank can write.
        ("tp=2,pp=1", ["--head-partition", "2"]),
        # Stage 0 holds layers 0-1 (a whole chunk of 2), stages 1 and 2 half a chunk each:
        # only the L0-1 half of every page could be written, which no reader can use.
        ("tp=1,pp=3,layers=2/1/1", ["--layer-partition", "2"]),
    ],
)
def test_a_writer_topology_that_does_not_fit_the_grid_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], topology: str, grid_flags: list[str]
) -> None:
    store = tmp_path / "store"
    code, out, err = cli(["prepopulate", f"file://{store}", "--mini-engine", "tiny",
                          "--prompts", str(ids_prompts(tmp_path)), "--page-size", "4",
                          "--topology", topology, *grid_flags, "--no-progress"], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "cannot write grid" in lines[0] and "Grids it can write" in lines[0]
    assert out == ""
    assert [f for f in stored_files(store) if f != "layout.json"] == []


def test_the_default_grid_is_the_sglang_adapters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The adapter's default: the coarsest grid the deployment's topology and every share_with
    # topology can write. For 4 layers x 2 KV heads: TP 2 alone -> 4x1; shared with PP 2 -> 2x1.
    base = ["prepopulate", "memory://", "--mini-engine", "tiny", "--prompts",
            str(ids_prompts(tmp_path)), "--page-size", "4", "--dry-run", "--json",
            "--no-progress", "--topology", "tp=2,pp=1"]
    grids = {}
    for extra in ([], ["--share-with", "tp=1,pp=2"],
                  ["--extra-config", json.dumps({"share_with": ["tp=1,pp=2"]})],
                  ["--extra-config", json.dumps({"grid": "1x1", "tenant_salt": "t"})]):
        code, out, err = cli([*base, *extra], capsys)
        assert code == 0, err
        ns = json.loads(out)["namespace_json"]
        grids[" ".join(extra)[:20]] = (ns["layers_per_chunk"], ns["heads_per_group"])
    assert list(grids.values()) == [(4, 1), (2, 1), (2, 1), (1, 1)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--extra-config", '{"tenant-salt": "a"}'], "did you mean 'tenant_salt'"),
        (["--extra-config", '{"tenant_salt": "a"}', "--tenant-salt", "b"],
         "--tenant-salt 'b' differs from the extra-config's tenant_salt"),
        (["--extra-config", '{"grid": "1x1"}', "--layer-partition", "2"], "not both"),
        (["--extra-config", "{nope"], "extra-config is not JSON"),
        (["--extra-config", '{"kv_dtype": "bfloat16"}'], "kv_dtype bfloat16 differs"),
    ],
)
def test_extra_config_mistakes_are_one_line_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code, _, err = cli(["prepopulate", "memory://", "--mini-engine", "tiny", "--prompts",
                        str(ids_prompts(tmp_path)), "--dry-run", "--no-progress", *extra], capsys)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert message in line


def test_the_default_model_id_is_the_path_as_sglang_names_it(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # SGLang's model_name is its served model name, by default --model-path exactly as typed.
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"text": sentence(0, 20)}])
    base = ["prepopulate", "memory://", "--model", str(tiny_llama), "--prompts", str(prompts),
            "--page-size", "4", "--dry-run", "--json", "--no-progress"]
    code, out, err = cli(base, capsys)
    assert code == 0, err
    assert json.loads(out)["namespace_json"]["model"] == str(tiny_llama)
    code, out, err = cli([*base, "--model-id", "meta-llama/Llama-3.1-8B"], capsys)
    assert code == 0, err
    assert json.loads(out)["namespace_json"]["model"] == "meta-llama/Llama-3.1-8B"
