"""Writing a benchmark's section into BENCHMARKS.md (shared by the bench scripts)."""

from __future__ import annotations

from pathlib import Path


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
