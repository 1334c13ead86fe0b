"""The plugin template works where a backend author uses it: copied out of this repository,
installed with its README's command into a fresh virtual environment, its tests passing under
its own pytest configuration (not this repository's ``asyncio_mode = "auto"``).

hicache-store itself is installed into that environment from a copy of this checkout (a
regular, non-editable install, as from PyPI); everything else comes from the package index
pip is configured with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "tests" / "plugins" / "example_backend"
_NOT_SOURCE = shutil.ignore_patterns(
    ".venv", ".git", ".build", ".run", "build", "*.egg-info", "__pycache__", ".mypy_cache",
    ".ruff_cache", ".pytest_cache", ".hypothesis", "*.so", "tests",
)


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900,
                            check=False)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_the_template_installs_and_passes_in_a_fresh_venv(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "VIRTUAL_ENV", "PYTHON"))}
    base = getattr(sys, "_base_executable", sys.executable)
    venv = tmp_path / "venv"
    _run([base, "-m", "venv", str(venv)], tmp_path, env)
    python = str(venv / "bin" / "python")
    source = tmp_path / "hicache-store"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    _run([python, "-m", "pip", "install", "-q", str(source)], tmp_path, env)
    plugin = tmp_path / "my-backend"
    shutil.copytree(TEMPLATE, plugin, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__"))
    _run([python, "-m", "pip", "install", "-q", "-e", ".[test]"], plugin, env)  # the README's
    result = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], plugin, env)
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    # The plugin is found through its entry point in that environment.
    found = _run([python, "-c", "from hicache_store.backends import open_backend; "
                  "print(type(open_backend('example://x')).__name__)"], plugin, env)
    assert found.stdout.strip() == "ExampleBackend"
