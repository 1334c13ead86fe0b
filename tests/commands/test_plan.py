"""``hicache-store plan``: tables, JSON, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_store.cli import main

SEED = [
    "plan",
    "--layers",
    "60",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--dtype",
    "bfloat16",
    "--page-size",
    "64",
    "--layer-partition",
    "30",
    "--head-partition",
    "2",
    "--writer",
    "tp=4,pp=2",
    "--reader",
    "tp=2,pp=1",
]


def test_seed_plan_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SEED, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"namespace", "grid", "writers", "readers"}
    assert report["grid"]["objects_per_page"] == 8
    (writer,) = report["writers"]
    assert writer["topology"] == "tp=4,pp=2"
    assert [len(r["objects"]) for r in writer["ranks"]] == [1] * 8
    rank6 = writer["ranks"][6]
    assert (rank6["rank"], rank6["tp_rank"], rank6["pp_rank"]) == (6, 2, 1)
    assert rank6["objects"][0]["suffix"] == "L30-59_H2"
    object_bytes = 30 * 2 * 64 * 2 * 128 * 2
    assert rank6["objects"][0]["byte_range"] == [0, object_bytes]
    (reader,) = report["readers"]
    tp1 = reader["ranks"][1]
    assert sorted(o["suffix"] for o in tp1["objects"]) == [
        "L0-29_H2",
        "L0-29_H3",
        "L30-59_H2",
        "L30-59_H3",
    ]
    assert tp1["read_amplification"] == 1.0


def test_layer_subrange_reader_reports_range_reads(capsys: pytest.CaptureFixture[str]) -> None:
    args = [a for a in SEED if a not in ("--reader", "tp=2,pp=1")] + ["--reader", "tp=2,pp=3"]
    assert main([*args, "--json"]) == 0
    reader = json.loads(capsys.readouterr().out)["readers"][0]
    middle = reader["ranks"][2]  # pp 1: layers 20-39 straddle both chunks
    ranges = {o["suffix"]: o["byte_range"] for o in middle["objects"]}
    block = 2 * 64 * 2 * 128 * 2
    assert ranges["L0-29_H0"] == [20 * block, 30 * block]
    assert ranges["L30-59_H0"] == [0, 10 * block]


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SEED) == 0
    out = capsys.readouterr().out
    assert "grid 30 layers x 2 heads: 8 objects per page" in out
    assert "L30-59_H3" in out


def test_suggest_grid(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--layers",
        "61",
        "--mla",
        "--kv-dim",
        "576",
        "--suggest-grid",
        "--writer",
        "tp=8,pp=2",
        "--reader",
        "tp=1",
        "--json",
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["grid"]["layers_per_chunk"] == 31
    assert [len(r["objects"]) for r in report["writers"][0]["ranks"]] == [1] + [0] * 7 + [1] + [
        0
    ] * 7


def run_cli(args: list[str]) -> int:
    """``main`` as a shell sees it: argparse's own errors exit through SystemExit."""
    try:
        return main(args)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--layers", "60"], "needs --kv-heads"),
        ([*SEED[:-4], "--writer", "tp=16"], "cannot write grid 30x2"),
        ([*SEED, "--suggest-grid"], "replaces"),
        ([*SEED[:-2], "--reader", "tp=three"], "topology"),
        (
            [
                "plan",
                "--layers",
                "60",
                "--kv-heads",
                "8",
                "--head-dim",
                "0",
                "--layer-partition",
                "30",
                "--writer",
                "tp=1",
            ],
            "head_dim",
        ),
        (["plan", "--layers", "x"], "invalid int"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_console_script() -> None:
    script = Path(sys.executable).with_name("hicache-store")
    assert script.exists(), "the package's console script is not installed"
    out = subprocess.run([str(script), *SEED, "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["grid"]["objects_per_page"] == 8
