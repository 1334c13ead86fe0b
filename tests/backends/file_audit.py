"""An oracle for the file backend's index: the database and the files, read around the API.

``audit(root)`` lists every way the index and the files under ``objects/`` disagree. It opens
the SQLite file read-only and walks the directories itself, so a bug in the backend's index
code cannot hide behind the same bug here.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Audit:
    rows: dict[str, int]
    files: dict[str, int]
    total_bytes: int
    count: int
    pending: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def audit(root: Path) -> Audit:
    db = sqlite3.connect(f"file:{root / 'index' / 'index.sqlite3'}?mode=ro", uri=True)
    try:
        rows = dict(db.execute("SELECT key, size FROM objects"))
        meta = dict(db.execute("SELECT name, value FROM meta"))
        pending = db.execute("SELECT COUNT(*) FROM pending").fetchone()[0]
    finally:
        db.close()
    files: dict[str, int] = {}
    for path in (root / "objects").glob("*/*/*"):
        if path.is_file():
            files[path.name] = path.stat().st_size
    report = Audit(rows, files, meta["total_bytes"], meta["count"], pending)
    for key in sorted(set(files) - set(rows)):
        report.problems.append(f"lost: {key} is stored but not indexed")
    for key in sorted(set(rows) - set(files)):
        report.problems.append(f"invented: {key} is indexed but not stored")
    for key in sorted(set(rows) & set(files)):
        if rows[key] != files[key]:
            report.problems.append(f"{key}: indexed {rows[key]} bytes, stored {files[key]}")
    if meta["total_bytes"] != sum(rows.values()):
        report.problems.append(f"total_bytes {meta['total_bytes']} != {sum(rows.values())}")
    if meta["count"] != len(rows):
        report.problems.append(f"count {meta['count']} != {len(rows)}")
    if pending:
        report.problems.append(f"{pending} pending rows left")
    tmp = [p.name for p in (root / "tmp").iterdir()] if (root / "tmp").is_dir() else []
    if tmp:
        report.problems.append(f"temp files left: {tmp[:5]}")
    return report


def snapshot_files(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root / "index") if n.startswith("fp-"))
