"""``hicache-store doctor``: stored namespaces, the deployment's, what differs, what would hit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_store._sync import run_sync
from hicache_store.backends import _file_site, open_backend
from hicache_store.cli import main

from .conftest import write_jsonl

PROMPT = list(range(1, 31))  # 7 full pages of 4, and 2 tokens never stored


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


@pytest.fixture
def store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    url = f"file://{tmp_path / 'kv'}"
    prompts = write_jsonl(tmp_path / "stored.jsonl", [{"input_ids": PROMPT}])
    code, _, err = cli(["prepopulate", url, "--mini-engine", "tiny", "--model-id", "org/model",
                        "--prompts", str(prompts), "--page-size", "4", "--no-progress"], capsys)
    assert code == 0, err
    return url


def test_lists_the_stored_namespaces(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(["doctor", store, "--json"], capsys)
    assert code == 0
    found = json.loads(out)
    (ns,) = found["namespaces"]
    assert (ns["model"], ns["dtype"], ns["page_size"]) == ("org/model", "float32", 4)
    assert found["deployment"] is None


def test_the_same_deployment_is_found_and_prompts_hit(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = write_jsonl(tmp_path / "ask.jsonl", [
        {"input_ids": [*PROMPT[:17], 500, 501]},  # shares 4 pages with the stored prompt
        {"input_ids": [9, 9, 9, 9, 9, 9, 9, 9]},  # never stored
    ])
    code, out, err = cli(["doctor", store, "--model-id", "org/model", "--page-size", "4",
                          "--dtype", "float32", "--prompts", str(prompts), "--json"], capsys)
    assert code == 0, err
    found = json.loads(out)
    assert found["found"] and found["differences"] == []
    assert [(p["tokens"], p["hit_tokens"]) for p in found["prompts"]] == [(19, 16), (8, 0)]
    assert (found["prompt_tokens"], found["hit_tokens"]) == (27, 16)


def test_a_deployment_that_would_miss_names_the_fields_that_differ(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # SGLang serving the model by its path, with the README's grid and a tenant salt: the
    # three reasons a populated store gives zero hits.
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"url": store, "grid": "1x1", "tenant_salt": "acme"}))
    prompts = write_jsonl(tmp_path / "ask.jsonl", [{"input_ids": PROMPT}])
    code, out, err = cli(["doctor", store, "--extra-config", f"@{extra}", "--model-id",
                          "/models/tiny", "--page-size", "4", "--prompts", str(prompts)], capsys)
    assert code == 1, err
    assert "NOT in the store" in out
    assert "model: deployment /models/tiny, stored org/model" in out
    assert "grid: deployment 1x1, stored 4x2" in out
    assert "tenant_salt: deployment set, stored not set" in out
    assert "dtype" not in out.split("differs in:")[1]  # not given: taken from the store
    assert "0 would hit (0.0%)" in out


def test_another_topology_gets_another_default_grid(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The adapter's default grid is the coarsest the deployment's own topology can write:
    # TP 2 over 2 KV heads gives 4x1, not the 4x2 a TP 1 writer stored.
    code, out, _ = cli(["doctor", store, "--model-id", "org/model", "--topology", "tp=2,pp=1",
                        "--json"], capsys)
    assert code == 1
    (diff,) = json.loads(out)["differences"]
    assert diff["description"] == "grid: deployment 4x1, stored 4x2"


def test_usage_errors(store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    for argv, message in (
        (["doctor", store, "--layers", "4"], "give all of --layers"),
        (["doctor", store, "--prompts", str(text)], "--prompts needs a deployment"),
        (["doctor", store, "--model-id", "m", "--prompts", str(text)], "needs --tokenizer"),
        (["doctor", store, "--extra-config", '{"tenant-salt": 1}'], "did you mean"),
    ):
        code, _, err = cli(argv, capsys)
        assert code == 2, argv
        (line,) = err.strip().splitlines()
        assert message in line


@pytest.fixture
def sealed_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[str, Path]:
    """A store prepopulated for a deployment with a tenant key ring (a sealed namespace)."""
    from hicache_store.tenant import new_ring_text

    ring = tmp_path / "tenant.keys"
    ring.write_text(new_ring_text())
    ring.chmod(0o600)
    url = f"file://{tmp_path / 'sealed-kv'}"
    prompts = write_jsonl(tmp_path / "stored.jsonl", [{"input_ids": PROMPT}])
    code, _, err = cli(["prepopulate", url, "--mini-engine", "tiny", "--model-id", "org/model",
                        "--prompts", str(prompts), "--page-size", "4", "--no-progress",
                        "--tenant-key-file", str(ring)], capsys)
    assert code == 0, err
    return url, ring


def test_a_deployment_with_a_tenant_key_finds_its_sealed_namespace(
    sealed_store: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, ring = sealed_store
    prompts = write_jsonl(tmp_path / "ask.jsonl", [{"input_ids": [*PROMPT[:17], 500, 501]}])
    base = ["doctor", url, "--model-id", "org/model", "--page-size", "4", "--dtype", "float32",
            "--prompts", str(prompts)]
    # The ring from the flag, from the extra-config and from the environment (the adapter's
    # three sources): the sealed namespace is found and the prompt's 4 stored pages hit,
    # probed under the keyed page names.
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"url": url, "tenant_key_file": str(ring)}))
    for argv, env in ((["--tenant-key-file", str(ring)], None),
                      (["--extra-config", f"@{extra}"], None),
                      ([], str(ring))):
        if env is not None:
            monkeypatch.setenv("HICACHE_STORE_TENANT_KEY_FILE", env)
        code, out, err = cli([*base, *argv, "--json"], capsys)
        assert code == 0, (argv, err)
        found = json.loads(out)
        assert found["found"] and found["differences"] == [], argv
        assert found["deployment"]["sealed"] is True
        assert [(p["tokens"], p["hit_tokens"]) for p in found["prompts"]] == [(19, 16)]
    code, out, _ = cli(["doctor", url], capsys)
    assert code == 0 and "  sealed" in out


def test_a_deployment_without_the_tenant_key_is_told_the_store_is_sealed(
    sealed_store: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ring = sealed_store
    prompts = write_jsonl(tmp_path / "ask.jsonl", [{"input_ids": PROMPT}])
    code, out, err = cli(["doctor", url, "--model-id", "org/model", "--page-size", "4",
                          "--prompts", str(prompts)], capsys)
    assert code == 1, err
    assert "NOT in the store" in out
    (line,) = out.split("differs in:")[1].strip().splitlines()[:1]
    assert line.strip() == "sealed: deployment False, stored True"
    assert "0 would hit (0.0%)" in out


def test_an_unreadable_tenant_key_file_is_a_usage_error(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(["doctor", store, "--model-id", "org/model", "--tenant-key-file",
                        str(tmp_path / "missing.keys")], capsys)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "missing.keys" in line


# -- where a file root lives: its filesystem and the host its index records -------------------


def test_reports_the_filesystem_and_the_recorded_host(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    me = _file_site.this_host()
    shown = subprocess.run(["stat", "-f", "-c", "%t", str(tmp_path)], capture_output=True,
                           text=True, check=True).stdout.strip()
    code, out, _ = cli(["doctor", store, "--json"], capsys)
    assert code == 0
    found = json.loads(out)["site"]
    assert found["root"] == str(tmp_path / "kv")
    assert found["filesystem"]["f_type"] == int(shown, 16)
    assert found["filesystem"]["network"] is False
    assert found["index"] == "sqlite"
    assert found["host_record"]["boot_id"] == me.boot_id
    assert found["host_record"]["hostnames"] == [me.hostname]
    assert found["this_host_recorded"] is True
    code, out, _ = cli(["doctor", store], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"root: {tmp_path / 'kv'}"
    assert lines[1].startswith("  filesystem: ") and f"f_type {int(shown, 16):#x}" in lines[1]
    assert f"host recorded: {me.hostname} (boot id {me.boot_id}" in lines[2]
    assert lines[2].endswith("; this host")


def test_a_store_another_host_uses_is_described_and_refused(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run from another host (own host name and boot id, in namespaces of its own), doctor
    names the host its index records, says it is not this one, and exits 1 with the refusal."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "-u", "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("unshare -m -u is not permitted here")
    me = _file_site.this_host()
    boot = tmp_path / "boot_id"
    boot.write_text("0badc0de-0000-4000-8000-000000000002\n")
    done = subprocess.run(
        ["unshare", "-m", "-u", "sh", "-c",
         'mount --bind "$1" /proc/sys/kernel/random/boot_id && hostname far-host && '
         'shift && exec "$@"', "sh", str(boot),
         sys.executable, "-m", "hicache_store", "doctor", store],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    out = done.stdout
    assert f"host recorded: {me.hostname} (boot id {me.boot_id}" in out
    assert "NOT this host: far-host (boot id 0badc0de-0000-4000-8000-000000000002)" in out
    assert "refused:" in out and "index=none" in out


def test_another_host_name_on_this_kernel_is_not_this_host_by_default(
    store: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process of this kernel under another host name (a container): by default not the
    host recorded (doctor says so and exits 1 with the refusal naming index_hosts=kernel);
    with ?index_hosts=kernel it is (the boot id alone is the host)."""
    me = _file_site.this_host()
    pod = _file_site.Host(me.boot_id, me.boot_time, "pod-9")
    monkeypatch.setattr(_file_site, "this_host", lambda: pod)
    code, out, _ = cli(["doctor", store], capsys)
    assert code == 1
    assert f"host recorded: {me.hostname} (boot id {me.boot_id}" in out
    assert f"NOT this host: pod-9 (boot id {me.boot_id})" in out
    assert "refused:" in out and "index=none" in out and "index_hosts=kernel" in out
    code, out, _ = cli(["doctor", store, "--json"], capsys)
    assert code == 1 and json.loads(out)["site"]["this_host_recorded"] is False
    code, out, _ = cli(["doctor", f"{store}?index_hosts=kernel", "--json"], capsys)
    assert code == 0
    found = json.loads(out)["site"]
    assert found["this_host_recorded"] is True
    assert found["host_record"]["hostnames"] == [me.hostname]  # doctor writes nothing
    code, out, _ = cli(["doctor", f"{store}?index_hosts=kernel"], capsys)
    assert code == 0 and out.splitlines()[2].endswith("; this host")


def test_a_root_on_a_network_filesystem_is_described_and_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_file_site, "statfs_type", lambda path: 0x6969)  # as on NFS
    code, out, _ = cli(["doctor", f"file://{tmp_path / 'kv'}"], capsys)
    assert code == 1
    assert "  filesystem: nfs (f_type 0x6969, network or FUSE filesystem)" in out
    assert "warning: the default index on a network or FUSE filesystem" in out
    assert "refused:" in out and "index=none" in out
    # a store made as the refusal says (doctor itself never creates one)
    run_sync(open_backend(f"file://{tmp_path / 'kv'}?index=none").close())
    code, out, _ = cli(["doctor", f"file://{tmp_path / 'kv'}?index=none", "--json"], capsys)
    assert code == 0
    found = json.loads(out)["site"]
    assert found["filesystem"] == {"name": "nfs", "f_type": 0x6969, "network": True}
    assert found["index"] == "none" and found["host_record"] is None


def test_a_store_that_does_not_exist_is_said_and_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "nowhere" / "kv"
    code, out, err = cli(["doctor", f"file://{root}"], capsys)
    assert code == 1
    assert out == ""
    assert "no hicache-store store at" in err and str(root) in err
    assert "nothing was created" in err
    assert not root.exists() and not root.parent.exists()
