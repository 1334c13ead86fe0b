"""The README's Python snippets run as written: each ``python`` block is extracted and executed
in its own interpreter (a fresh process, so that what happens at interpreter shutdown counts:
backups still in flight, threads left running), in an empty folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
#: what a snippet's stderr must not contain (errors swallowed at shutdown print these).
SHUTDOWN_NOISE = ("Traceback", "Exception ignored", "cannot schedule new futures")


def test_the_readme_has_python_snippets() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs_as_written(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(BLOCKS[index])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HICACHE_STORE_"))}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"snippet {index}:\n{BLOCKS[index]}\n{result.stderr[-3000:]}"
    for noise in SHUTDOWN_NOISE:
        assert noise not in result.stderr, f"snippet {index}: {result.stderr[-3000:]}"
    assert list(tmp_path.iterdir()) == [script], "a snippet wrote into the working directory"
