"""``bench/bench_file_engines.py``: every row is measured the same way, in a process of its own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from bench_file_engines import RAW, SYSTEMS, command  # noqa: E402


def test_no_row_runs_after_the_baseline_in_its_own_process(tmp_path: Path) -> None:
    # A backend measured in the process that had just run the raw baseline read its cold
    # bytes faster than one measured alone: only file:// did, so it alone looked faster.
    args = argparse.Namespace(objects=128, size="8MiB", batch=64)
    argv = {system: command(system, tmp_path, args) for system in SYSTEMS}
    baseline = {system: a[a.index("--baseline") + 1] for system, a in argv.items()}
    assert baseline == {system: "only" if system == RAW else "no" for system in SYSTEMS}
    assert {"file://", "hf3fs:// posix"} <= set(SYSTEMS)
    # the same work for every row: only the URL and which side is measured differ
    shapes = {tuple(a[3:a.index("--baseline")]) for a in argv.values()}
    assert shapes == {("--objects", "128", "--size", "8MiB", "--batch", "64", "--exists-keys",
                       "1000")}
    urls = [a[2] for a in argv.values()]
    assert len(set(urls)) == len(urls) and all(str(tmp_path) in u for u in urls)
