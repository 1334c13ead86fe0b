"""Writing a benchmark's section into a page of the docs site (shared by the bench scripts).

``--write-md`` runs are appended to the run log (``RUN_LOG``, a dated notebook: ``log_run``);
the subject pages under ``docs/benchmarks/`` carry the current figures (``replace_section``
where a script owns a section of one)."""

from __future__ import annotations

import datetime
from pathlib import Path

#: the dated run log of the docs site, whose sections keep the bench scripts' headings
RUN_LOG = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "log.md"


def replace_section(path: Path, section: str) -> None:
    """Replace (or append) the ``## ...`` section whose heading is ``section``'s first line,
    leaving every other section alone."""
    heading = section.splitlines()[0]
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(f"\n{heading}\n")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        rest = text[end:] if end != -1 else ""
        text = text[: start + 1] + section + rest
    path.write_text(text)


def log_run(section: str, path: Path = RUN_LOG) -> None:
    """Append ``section`` to the run log, its heading dated (today, UTC): a run never
    replaces an earlier one's record."""
    heading, _, body = section.partition("\n")
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    text = path.read_text() if path.exists() else "# Run log\n"
    path.write_text(text.rstrip("\n") + f"\n\n{heading} ({day})\n{body}".rstrip("\n") + "\n")
