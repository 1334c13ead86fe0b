"""The README and the docs site (``docs/``, ``mkdocs.yml``): every code block runs as written
(``blocks.py`` says how, and how a block that cannot run here is marked), no internal link is
dead, the strict site build fails on one that is, and the README stays a front page."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .blocks import DOCS, ROOT, Block, BlockError, blocks_of, pages, run_page
from .links import dead_links

PAGES = pages()
README_MAX_LINES = 200


def _blocks() -> list[Block]:
    out: list[Block] = []
    for page in PAGES:
        with contextlib.suppress(BlockError):  # test_every_block_is_run_parsed_or_marked names it
            out += blocks_of(page)
    return out


BLOCKS = _blocks()
RUNNABLE_PAGES = sorted({b.page for b in BLOCKS if b.runs})
MARKED = [b for b in BLOCKS if b.skip is not None]


def test_every_block_is_run_parsed_or_marked() -> None:
    errors = []
    for page in PAGES:
        try:
            blocks_of(page)
        except BlockError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)
    assert len([b for b in BLOCKS if b.runs]) >= 25, "the pages have lost their examples"


@pytest.mark.parametrize(("text", "message"), [
    ("```\nx = 1\n```\n", "got 'none'"),
    ("```py\nx = 1\n```\n", "got 'py'"),
    ("<!-- docs-test: skip -->\n```python\nx = 1\n```\n", "a marker is"),
    ("<!-- docs-test: ignore because -->\n```python\nx = 1\n```\n", "a marker is"),
    ("<!-- docs-test: file ../x.py -->\n```python\nx = 1\n```\n", "plain file name"),
    ("```python\nx = 1\n", "never closed"),
])
def test_a_block_the_tests_cannot_place_is_an_error(text: str, message: str) -> None:
    with pytest.raises(BlockError, match=message):
        blocks_of(DOCS / "planted.md", text)


def test_markers_are_read() -> None:
    text = ("<!-- docs-test: skip needs a GPU -->\n```python\nimport torch\n```\n\n"
            "<!-- docs-test: file m.py -->\n```python\nX = 1\n```\n\n"
            "```text\nout\n```\n\n  ```bash\n  echo hi\n  ```\n")
    skip, file, text_block, bash = blocks_of(DOCS / "planted.md", text)
    assert (skip.skip, skip.runs) == ("needs a GPU", False)
    assert (file.file, file.runs, file.body) == ("m.py", False, "X = 1\n")
    assert (text_block.runs, text_block.not_run_because) == (False, "text: not code")
    assert (bash.runs, bash.body, bash.line) == (True, "echo hi\n", 15)


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_blocks_of_a_page_run_as_written(page: Path, tmp_path: Path) -> None:
    assert run_page(page, tmp_path) >= 1


@pytest.mark.parametrize("block", MARKED, ids=lambda b: b.where)
def test_a_block_marked_not_to_run(block: Block) -> None:
    """Lists each block that is not run here, with its reason (shown as a skip)."""
    assert block.skip and len(block.skip) >= 10, f"{block.where}: say why it cannot run"
    pytest.skip(f"{block.where} ({block.language}): {block.skip}")


def test_a_failing_block_fails_its_page(tmp_path: Path) -> None:
    page = DOCS / "planted.md"
    text = "```python\nprint('ok')\n```\n\n```bash\nfalse\n```\n"
    page_copy = tmp_path / "page.md"
    page_copy.write_text(text)
    with pytest.raises(AssertionError, match="exited 1"):
        run_page(page_copy, tmp_path)
    assert [b.language for b in blocks_of(page, text)] == ["python", "bash"]


def test_no_internal_link_is_dead() -> None:
    dead = [d for page in PAGES for d in dead_links(page)]
    assert not dead, "\n".join(dead)


@pytest.mark.parametrize(("link", "reason"), [
    ("[x](no-such-page.md)", "no such file"),
    ("[x](index.md#no-such-heading)", "no heading with the anchor"),
    ("[x](#no-such-heading)", "no heading with the anchor"),
    ("[x](../README.md)", "outside docs/"),
    ("[x](guide)", "a folder, not a page"),
])
def test_a_planted_dead_link_is_found(link: str, reason: str) -> None:
    page = DOCS / "index.md"
    planted = page.read_text() + f"\nSee {link}.\n"
    dead = dead_links(page, planted)
    assert len(dead) == 1 and reason in dead[0], dead
    assert dead_links(page) == []


def test_links_in_code_are_not_links() -> None:
    page = DOCS / "index.md"
    text = "`[x](missing.md)`\n\n```text\n[x](missing.md)\n```\n"
    assert dead_links(page, text) == []


def _site_copy(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("mkdocs.yml", "ARCHITECTURE.md", "README.md"):
        shutil.copy2(ROOT / name, tmp_path / name)
    shutil.copytree(DOCS, tmp_path / "docs")
    return tmp_path


def _build(root: Path) -> subprocess.CompletedProcess[str]:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (the docs extra: make setup)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's banner, not a build warning
    return subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(root / "site")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600,
                          check=False)


@pytest.mark.slow
def test_the_strict_site_build_passes_and_fails_on_a_planted_dead_link(tmp_path: Path) -> None:
    good = _build(_site_copy(tmp_path / "good"))
    assert good.returncode == 0, good.stderr[-4000:]
    bad_root = _site_copy(tmp_path / "bad")
    page = bad_root / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [the missing page](guide/missing.md).\n")
    bad = _build(bad_root)
    assert bad.returncode != 0
    assert "guide/missing.md" in bad.stderr, bad.stderr[-4000:]


@pytest.mark.slow
def test_a_page_missing_from_the_nav_fails_the_strict_build(tmp_path: Path) -> None:
    root = _site_copy(tmp_path)
    (root / "docs" / "orphan.md").write_text("# Orphan\n")
    result = _build(root)
    assert result.returncode != 0
    assert "orphan.md" in result.stderr, result.stderr[-4000:]


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
