"""The bench scripts' ``--write-md``: a run is appended to the run log, dated, and never
replaces an earlier one's record; a subject page's section is replaced in place; no script
writes into the retired BENCHMARKS.md map."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from _markdown import RUN_LOG, log_run, replace_section  # noqa: E402


def test_a_section_is_replaced_in_place_and_the_others_kept(tmp_path: Path) -> None:
    log = tmp_path / "log.md"
    log.write_text("# Run log\n\n## A\n\nold a\n\n## B\n\nold b\n\n## C\n\nc\n")
    replace_section(log, "## B\n\nnew b\n")
    assert log.read_text() == "# Run log\n\n## A\n\nold a\n\n## B\n\nnew b\n\n## C\n\nc\n"
    replace_section(log, "## D\n\nd\n")
    assert log.read_text().endswith("## C\n\nc\n\n## D\n\nd\n")


def test_a_run_is_appended_to_the_log_dated_and_earlier_runs_kept(tmp_path: Path) -> None:
    log = tmp_path / "log.md"
    log.write_text("# Run log\n\n## Backends\n\nthe first run\n")
    log_run("## Backends\n\nthe second run\n", log)
    text = log.read_text()
    assert "the first run" in text
    assert re.search(r"\n## Backends \(\d{4}-\d\d-\d\d\)\n\nthe second run\n$", text), text


def test_the_run_log_is_the_docs_site_page() -> None:
    assert BENCH.parent / "docs" / "benchmarks" / "log.md" == RUN_LOG
    assert RUN_LOG.is_file()


@pytest.mark.parametrize("script", sorted(BENCH.glob("bench_*.py")), ids=lambda p: p.name)
def test_no_script_writes_the_retired_benchmarks_file(script: Path) -> None:
    text = script.read_text()
    assert not re.search(r'"BENCHMARKS\.md"', text), (
        f"{script.name} writes BENCHMARKS.md, which is now a map of the docs site: "
        "write RUN_LOG (bench/_markdown.py)")
