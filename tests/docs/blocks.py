"""The code blocks of the README and of every page under ``docs/``, and how each one is run.

Every fenced block carries a language. What the tests do with it:

| language | what runs |
|---|---|
| ``python`` | the block as a script, in a fresh interpreter (so what happens at interpreter shutdown counts: backups still in flight, threads left running) |
| ``bash`` | the block under ``bash -euo pipefail``, with this environment's ``bin`` first on ``PATH`` (``hicache-store`` is the checkout's) |
| ``json``, ``toml`` | parsed |
| ``text`` | nothing: program output, file formats, grammar (listed as not run) |

The blocks of one page run in order, in one empty folder of their own, with ``HOME`` inside it
(nothing reaches the user's home). An HTML comment on the line just before a fence changes that
block (it does not show on the site):

* ``<!-- docs-test: skip REASON -->``: the block is not run; the tests list it with REASON
  (a GPU, a vLLM or SGLang engine, a model directory, a server this machine cannot start).
* ``<!-- docs-test: file NAME -->``: the block is written to NAME in the page's folder instead
  of being run, for later blocks of the page to use (a module, a test file, a config).

Any other language, a block without one, or a marker without its reason or name is an error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the settings parser's dependency on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUN = ("python", "bash")
PARSE = ("json", "toml")
TEXT = ("text",)
LANGUAGES = RUN + PARSE + TEXT
#: a fence opening (any indent: fences nest in list items; 3+ backticks or tildes, an info string).
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
_MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>\S+)(?:\s+(?P<arg>.*?))?\s*-->\s*$")
#: what a python block's stderr must not contain (errors swallowed at shutdown print these).
SHUTDOWN_NOISE = ("Traceback", "Exception ignored", "cannot schedule new futures")


class BlockError(ValueError):
    """A block or marker the tests cannot place; names the page and line."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  #: 1-based line of the opening fence
    language: str
    body: str
    skip: str | None = None  #: the reason it is not run (a ``skip`` marker)
    file: str | None = None  #: the name it is written to (a ``file`` marker)

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in RUN and self.skip is None and self.file is None

    @property
    def not_run_because(self) -> str | None:
        """Why the block is not executed (None: it is, or it is parsed)."""
        if self.skip is not None:
            return self.skip
        if self.language in TEXT:
            return "text: not code"
        return None


def pages() -> list[Path]:
    """The README and every Markdown page of the site."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks_of(page: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of ``page`` with its marker; raises ``BlockError`` on a block without
    a known language or a malformed marker."""
    lines = (page.read_text() if text is None else text).split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m["fence"], m["info"].strip(), i
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and lines[j].strip().strip(fence[0]) == ""):
            j += 1
        if j == len(lines):
            raise BlockError(f"{page}:{start + 1}: a fence that is never closed")
        indent = len(m["indent"])
        body = "\n".join(line[indent:] if line[:indent].strip() == "" else line
                         for line in lines[start + 1 : j]) + "\n"
        language = info.split()[0] if info else ""
        where = f"{page}:{start + 1}"
        if language not in LANGUAGES:
            raise BlockError(f"{where}: a block must name one of {', '.join(LANGUAGES)} "
                             f"(got {language or 'none'!r})")
        skip = file = None
        prev = lines[start - 1] if start else ""
        if "docs-test" in prev:
            mk = _MARKER.search(prev)
            if not mk or mk["kind"] not in ("skip", "file") or not mk["arg"]:
                raise BlockError(f"{where}: a marker is '<!-- docs-test: skip REASON -->' or "
                                 f"'<!-- docs-test: file NAME -->', got {prev.strip()!r}")
            if mk["kind"] == "skip":
                skip = mk["arg"]
            else:
                file = mk["arg"]
                if "/" in file or file.startswith("."):
                    raise BlockError(f"{where}: a file marker names a plain file name: {file!r}")
        out.append(Block(page, start + 1, language, body, skip, file))
        i = j + 1
    return out


def environment(folder: Path) -> dict[str, str]:
    """The environment a page's blocks run in: this one, less the test runner's, the library's
    and the XDG base-directory variables, with this Python's ``bin`` first on ``PATH`` and
    ``HOME`` in the page's folder (so configs and caches are the page's own)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "HICACHE_STORE_", "XDG_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    home = folder / ".home"
    home.mkdir(exist_ok=True)
    env["HOME"] = str(home)
    return env


def run_page(page: Path, folder: Path, *, timeout: float = 600) -> int:
    """Runs (and parses) the blocks of ``page`` in order in ``folder``; returns how many ran.
    Raises ``AssertionError`` naming the block that failed, with its output. ``timeout`` is a
    hang detector for one block, not a speed limit."""
    env = environment(folder)
    ran = 0
    for n, block in enumerate(blocks_of(page)):
        if block.file is not None:
            (folder / block.file).write_text(block.body)
            continue
        if block.skip is not None or block.language in TEXT:
            continue
        if block.language == "json":
            json.loads(block.body)
            continue
        if block.language == "toml":
            tomllib.loads(block.body)
            continue
        if block.language == "python":
            script = folder / f".block_{n}.py"
            script.write_text(block.body)
            cmd = [sys.executable, str(script)]
        else:
            cmd = ["bash", "-euo", "pipefail", "-c", block.body]
        result = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True,
                                timeout=timeout, check=False)
        output = f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        assert result.returncode == 0, f"{block.where} exited {result.returncode}:\n{output}"
        if block.language == "python":
            for noise in SHUTDOWN_NOISE:
                assert noise not in result.stderr, f"{block.where}: {output}"
        ran += 1
    return ran
