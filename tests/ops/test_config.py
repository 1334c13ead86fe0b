"""Settings precedence: flags > HICACHE_STORE_* environment > TOML config file > defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hicache_store.cli import UsageError
from hicache_store.ops.config import config_path, env_names, layered, require, resolve


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("url", nargs="?", default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32"])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--prompts", action="append", default=[])
    return layered(p, section="prepopulate")


def parse(argv: list[str], env: dict[str, str]) -> tuple[argparse.Namespace, dict[str, str]]:
    args = parser().parse_args(argv)
    return args, resolve(args, env)


def test_defaults_when_nothing_is_given(tmp_path: Path) -> None:
    args, sources = parse([], {"XDG_CONFIG_HOME": str(tmp_path)})
    assert (args.url, args.batch_size, args.dtype, args.dry_run, args.prompts) == (
        None, 8, "auto", False, [])
    assert set(sources.values()) == {"default"}
    with pytest.raises(UsageError, match="HICACHE_STORE_URL"):
        require(args, "url", "a backend URL")


def test_each_layer_beats_the_next(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('url = "file:///top"\nbatch-size = 2\ndry_run = true\n'
                   '[prepopulate]\nbatch_size = 3\nprompts = ["a.jsonl", "b.txt"]\n'
                   '[inspect]\nurl = "file:///other-command"\n')
    env = {"HICACHE_STORE_CONFIG": str(cfg)}
    args, src = parse([], env)
    assert (args.url, args.batch_size, args.dry_run, args.prompts) == (
        "file:///top", 3, True, ["a.jsonl", "b.txt"])
    assert src["batch_size"].endswith("[prepopulate] batch_size")
    env |= {"HICACHE_STORE_BATCH_SIZE": "4", "HICACHE_STORE_DRY_RUN": "no",
            "HICACHE_STORE_PROMPTS": "x.jsonl, y.jsonl"}
    args, src = parse([], env)
    assert (args.batch_size, args.dry_run, args.prompts) == (4, False, ["x.jsonl", "y.jsonl"])
    assert src["batch_size"] == "HICACHE_STORE_BATCH_SIZE"
    env["HICACHE_STORE_PREPOPULATE_BATCH_SIZE"] = "5"  # command-specific beats global
    assert parse([], env)[0].batch_size == 5
    args, src = parse(["file:///flag", "--batch-size", "6", "--prompts", "p", "--dry-run"], env)
    assert (args.url, args.batch_size, args.prompts, args.dry_run) == (
        "file:///flag", 6, ["p"], True)
    assert src["url"] == src["batch_size"] == "flag"
    # --config beats HICACHE_STORE_CONFIG.
    other = tmp_path / "o.toml"
    other.write_text("[prepopulate]\ndtype = 'float32'\n")
    assert parse(["--config", str(other)], {"HICACHE_STORE_CONFIG": str(cfg)})[0].dtype == (
        "float32")


def test_default_config_location(tmp_path: Path) -> None:
    assert config_path(None, {"XDG_CONFIG_HOME": str(tmp_path)}) == (None, "none")
    default = tmp_path / "hicache-store" / "config.toml"
    default.parent.mkdir()
    default.write_text("batch_size = 9\n")
    assert parse([], {"XDG_CONFIG_HOME": str(tmp_path)})[0].batch_size == 9
    assert env_names("inspect", "url") == ("HICACHE_STORE_INSPECT_URL", "HICACHE_STORE_URL")


@pytest.mark.parametrize(
    ("env", "toml", "message"),
    [
        ({"HICACHE_STORE_BATCH_SIZE": "many"}, "", "HICACHE_STORE_BATCH_SIZE: invalid literal"),
        ({"HICACHE_STORE_DTYPE": "int4"}, "", "'int4' is not one of auto, float32"),
        ({"HICACHE_STORE_DRY_RUN": "maybe"}, "", "expected true or false"),
        ({}, "[prepopulate]\nbatch_sise = 3\n", "unknown key(s) batch_sise in [prepopulate]"),
        ({}, "[prepopulate]\nbatch_size = [1]\n", "expected a single value"),
        ({}, "batch_size = \n", "c.toml"),
    ],
)
def test_bad_values_are_usage_errors_naming_their_source(
    tmp_path: Path, env: dict[str, str], toml: str, message: str
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    with pytest.raises(UsageError) as info:
        parse([], {**env, "HICACHE_STORE_CONFIG": str(cfg)})
    assert message in str(info.value)


def test_missing_explicit_config_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        parse(["--config", str(tmp_path / "nope.toml")], {})
