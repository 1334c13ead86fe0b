"""The weights in ``prepopulate``'s and ``doctor``'s namespaces, through the commands.

The tiny Llama of ``conftest`` and a copy with one weight changed (same name, same config,
same tokenizer): what ``prepopulate --model`` stored for one is never present for the other,
and present for the same files copied elsewhere; an explicit ``--model-revision`` wins.
``doctor --model-path`` names the weights as the difference.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from hicache_store.cli import main
from hicache_store.weights import weights_identity

from .conftest import sentence, write_jsonl

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(autouse=True)
def _clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in [n for n in os.environ if n.startswith("HICACHE_STORE_")]:
        monkeypatch.delenv(name)


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def other_weights(model: Path, folder: Path) -> Path:
    """``model`` copied to ``folder`` (config, tokenizer) with one tensor changed."""
    shutil.copytree(model, folder)
    weights = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(str(weights))
    name = sorted(n for n in tensors if n.endswith("q_proj.weight"))[0]
    tensors[name] = tensors[name] * 1.5
    safetensors_torch.save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


@pytest.fixture
def models(tiny_llama: Path, tmp_path: Path) -> dict[str, Path]:
    return {"a": tiny_llama, "b": other_weights(tiny_llama, tmp_path / "b" / "llama"),
            "a_copy": Path(shutil.copytree(tiny_llama, tmp_path / "elsewhere" / "llama"))}


def prepopulate(url: str, model: Path, prompts: Path, capsys: pytest.CaptureFixture[str],
                *extra: str) -> dict[str, object]:
    code, out, err = cli(["prepopulate", url, "--model", str(model), "--model-id", "llama",
                          "--prompts", str(prompts), "--page-size", "4", "--no-progress",
                          "--json", *extra], capsys)
    assert code == 0, err
    found: dict[str, object] = json.loads(out)
    return found


def test_prepopulate_keeps_other_weights_apart(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path / 'kv'}"
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"text": sentence(0, 40)}])
    first = prepopulate(url, models["a"], prompts, capsys)
    assert first["pages_written"] and first["pages_present"] == 0
    # the same name, config and tokenizer, other weights: nothing of it is there
    other = prepopulate(url, models["b"], prompts, capsys, "--dry-run")
    assert other["pages_present"] == 0 and other["pages_written"] == first["pages_written"]
    assert other["namespace"] != first["namespace"]
    revision = first["namespace_json"]["model_revision"]  # type: ignore[index]
    assert revision == weights_identity(models["a"]).value  # type: ignore[union-attr]
    # the same files at another path: all of it is there
    copy = prepopulate(url, models["a_copy"], prompts, capsys, "--dry-run")
    assert copy["pages_present"] == first["pages_written"] and copy["pages_written"] == 0
    # an explicit revision wins over the files
    pinned = prepopulate(url, models["b"], prompts, capsys, "--dry-run",
                         "--model-revision", str(revision))
    assert pinned["pages_present"] == first["pages_written"]


def test_doctor_names_the_weights(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path / 'kv'}"
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"text": sentence(3, 40)}])
    prepopulate(url, models["a"], prompts, capsys)
    stored = weights_identity(models["a"]).value  # type: ignore[union-attr]
    deployment = ["doctor", url, "--model-id", "llama", "--page-size", "4"]

    code, out, _ = cli([*deployment, "--model-path", str(models["b"])], capsys)
    assert code == 1 and "NOT in the store" in out
    other = weights_identity(models["b"]).value  # type: ignore[union-attr]
    assert f"model_revision: deployment {other}, stored {stored}" in out
    assert f"weights {stored}" in out  # the stored namespace's line
    assert "weights: fp-" in out and "fingerprint of 1 weights file" in out

    code, out, _ = cli([*deployment, "--model-path", str(models["a_copy"])], capsys)
    assert code == 0 and ", stored" in out

    # unknown weights: taken from the store (no difference), and said so
    code, out, _ = cli(deployment, capsys)
    assert code == 0 and "weights: unknown" in out
    code, out, _ = cli([*deployment, "--json"], capsys)
    assert json.loads(out)["weights"]["revision"] is None

    code, _, err = cli([*deployment, "--model-path", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "no weights files" in err
