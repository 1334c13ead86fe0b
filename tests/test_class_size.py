"""No class in the storage layer, the cache tier or the object I/O is over 600 lines.

A class past that holds more than one job (the file backend once held two I/O engines, the S3
backend its wire, its capacity bound and its calls): its parts become collaborators of their
own, each a small module (``backends/_s3_client.py``, ``backends/_file_writes.py``). Measured
on the source (AST: from a ``class`` line to its last line, nested classes included in their
owner), over every class in the folders of ``SIZED``, wherever it stands in a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the folders held to the bound (the storage layer, the tier, the object I/O).
SIZED = ("backends", "hicache_store/tier", "hicache_store/objects")
MAX_CLASS_LINES = 600


def class_sizes(root: Path) -> list[tuple[int, str]]:
    """``(lines, "path:line Class")`` of every class under ``root``'s ``SIZED`` folders,
    largest first."""
    found: list[tuple[int, str]] = []
    for folder in SIZED:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    assert node.end_lineno is not None
                    found.append((node.end_lineno - node.lineno + 1,
                                  f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def oversized(root: Path) -> list[str]:
    return [f"{where}: {lines} lines" for lines, where in class_sizes(root)
            if lines > MAX_CLASS_LINES]


def test_no_class_is_over_the_bound() -> None:
    sizes = class_sizes(ROOT)
    # the walk sees the packages, or an empty result would prove nothing
    names = {where.split(" ")[1] for _, where in sizes}
    assert {"FileBackend", "S3Backend", "Backend", "HiCache", "ObjectIO"} <= names
    assert oversized(ROOT) == [], f"split by responsibility (the biggest: {sizes[:3]})"


def _class_of(lines: int) -> str:
    """A class of exactly ``lines`` lines."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    return f"class Big:\n{body}"


def test_the_check_catches_a_class_one_line_over(tmp_path: Path) -> None:
    for folder in SIZED:
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "backends" / "fits.py").write_text(_class_of(MAX_CLASS_LINES))
    assert oversized(tmp_path) == []
    (tmp_path / "hicache_store" / "objects" / "big.py").write_text(
        "def f():\n    pass\n\n\n" + _class_of(MAX_CLASS_LINES + 1))
    assert oversized(tmp_path) == ["hicache_store/objects/big.py:5 Big: 601 lines"]
    (tmp_path / "hicache_store" / "tier" / "nested.py").write_text(
        "def f():\n" + "".join(f"    {line}\n" for line in
                               _class_of(MAX_CLASS_LINES + 1).splitlines()))
    assert "hicache_store/tier/nested.py:2 Big: 601 lines" in oversized(tmp_path)
