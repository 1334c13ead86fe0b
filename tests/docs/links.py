"""Internal links of the README and the docs pages, checked without building the site.

A link is internal when it has no scheme (``https:``, ``mailto:``). Its path is resolved from
the page that holds it and must name a file of the checkout (from a page under ``docs/``: a
file under ``docs/``, since the site holds nothing else); its ``#fragment`` must be the anchor
of a heading of the target page, made as the site makes anchors (Python-Markdown's ``toc``
slugs). Links inside code (fenced blocks, inline spans) are not links.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from .blocks import DOCS, ROOT

_FENCED = re.compile(r"^ *(`{3,}|~{3,})[^\n]*\n.*?^ *\1[ \t]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_ATTR_ID = re.compile(r"\{\s*#([\w-]+)[^}]*\}\s*$")


def slug(heading: str) -> str:
    """The anchor the site gives a heading (Python-Markdown's default ``toc`` slugify, after
    the heading's inline markup is reduced to its text)."""
    parts = re.split(r"(`[^`]*`)", heading)  # emphasis marks count only outside code spans
    text = "".join(part[1:-1] if part.startswith("`") else
                   re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1",
                          re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", part))
                   for part in parts)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def prose(text: str) -> str:
    """``text`` without code: fenced blocks and inline spans blanked, line numbers kept."""
    text = _FENCED.sub(lambda m: "\n" * m[0].count("\n"), text)
    return _INLINE_CODE.sub(lambda m: " " * len(m[0].replace("\n", "")) + "\n" * m[0].count("\n"),
                            text)


_SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$', re.M)


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (an explicit ``{#id}`` where one is given), with the
    files it includes (``--8<-- "FILE"``, a path from the repository root) in place."""
    text = _SNIPPET.sub(lambda m: (ROOT / m[1]).read_text(), page.read_text())
    out: set[str] = set()
    for m in _HEADING.finditer(_FENCED.sub(lambda m: "\n" * m[0].count("\n"), text)):
        title = m[2]
        if explicit := _ATTR_ID.search(title):
            out.add(explicit[1])
        else:
            out.add(slug(title))
    return out


def dead_links(page: Path, text: str | None = None) -> list[str]:
    """Every internal link of ``page`` (or of ``text`` as if it were that page) that names no
    file, a file outside what the page may link, or no heading of its target."""
    text = page.read_text() if text is None else text
    under_docs = page.resolve().is_relative_to(DOCS)
    dead: list[str] = []
    body = prose(text)
    for m in _LINK.finditer(body):
        target = m[1]
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # https:, mailto:, ...
        line = body.count("\n", 0, m.start()) + 1
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page.resolve()
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        if not dest.exists():
            dead.append(f"{where}: no such file")
            continue
        if under_docs and not dest.is_relative_to(DOCS):
            dead.append(f"{where}: outside docs/ (the site does not hold it)")
            continue
        if dest.is_dir():
            if under_docs:
                dead.append(f"{where}: a folder, not a page")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            dead.append(f"{where}: no heading with the anchor #{fragment}")
    return dead
