"""Opening a file-layout root: its folders, its layout marker, the temp files dead writers left.

A root holds ``layout.json`` (the marker: format, version, shard levels and the index every
process of the root uses), ``objects/`` (the objects, ``file_layout``), ``tmp/`` (files being
written) and, with the shared index, ``index/``. Opening makes or checks the folders, refuses a
root marked for another layout or another index, and removes temp files whose writer is gone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import time
from pathlib import Path

from ._file_index import pid_alive
from .errors import BackendError

LAYOUT_FORMAT = "hicache-store/file"
#: 2: objects plus the shared index in ``index/``. A version-1 root (objects only) is upgraded
#: at its first open by building the index.
LAYOUT_VERSION = 2
_LAYOUT_V1 = {"format": LAYOUT_FORMAT, "version": 1, "shard_levels": 2}
#: temp files older than this are stale whoever wrote them (no write lasts an hour).
STALE_TEMP_SECONDS = 3600.0


def layout_marker(index: str) -> dict[str, object]:
    """The marker of a version-2 root: every process of a root must use the same index. A
    root indexed by a fleet's server also records its ``index_id`` (``index_id``)."""
    return {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "shard_levels": 2, "index": index}


def _without_id(found: object) -> object:
    return {k: v for k, v in found.items() if k != "index_id"} if isinstance(found, dict) else found


def prepare_root(root: Path, *, create: bool, read_only: bool, index: str, backend: str) -> bool:
    """Make (or check) the root's folders; True when its layout marker is to be written once
    the index is ready (a new root, or a version-1 root being upgraded). A root marked for the
    other index is refused: processes that disagree would each miss the other's objects.
    ``FileNotFoundError`` without ``create`` where no layout is."""
    objects, tmp = root / "objects", root / "tmp"
    if create:
        objects.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(exist_ok=True)
    elif not objects.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no hicache-store file layout here", str(root))
    if not read_only:
        tmp.mkdir(exist_ok=True)
    marker = root / "layout.json"
    try:
        found = json.loads(marker.read_text())
    except FileNotFoundError:
        return True
    except ValueError:
        found = None
    if _without_id(found) == layout_marker(index):
        return False
    if found == _LAYOUT_V1:
        return True
    if isinstance(found, dict) and _without_id(found) == {
            **layout_marker(index), "index": found.get("index")}:
        raise BackendError(
            f"{root} is used with index={found['index']}; open it with that index "
            f"(every process of a root must use the same one), not index={index}",
            backend=backend, operation="open",
        )
    raise BackendError(
        f"{marker} describes another layout ({found!r}); refusing to use {root}",
        backend=backend, operation="open",
    )


def write_layout(root: Path, temp_name: str, index: str) -> None:
    """Write the root's marker (through the temp file ``temp_name`` in ``tmp/``)."""
    tmp = root / "tmp" / temp_name
    tmp.write_text(json.dumps(layout_marker(index)))
    os.replace(tmp, root / "layout.json")  # racing openers write the same content


def index_id(root: Path, temp_name: str) -> str:
    """The root's name in a fleet's index (``layout.json``'s ``index_id``, the same for every
    host whatever path it mounts the root at): read, or made by the first opener (``link``: of
    openers racing on a new root exactly one writes it, and all use its id)."""
    marker = root / "layout.json"
    for _ in range(3):
        with contextlib.suppress(FileNotFoundError, ValueError):
            found = json.loads(marker.read_text())
            if isinstance(found, dict) and isinstance(found.get("index_id"), str):
                return str(found["index_id"])
        tmp = root / "tmp" / temp_name
        tmp.write_text(json.dumps({**layout_marker("valkey"), "index_id": secrets.token_hex(8)}))
        try:
            if marker.exists():  # a version-1 root, upgraded: its marker is replaced
                os.replace(tmp, marker)
            else:
                os.link(tmp, marker)
        except FileExistsError:
            pass  # another opener's id: read it above
        finally:
            tmp.unlink(missing_ok=True)
    raise BackendError(f"{marker} names no index_id", backend="file", operation="open")


def remove_stale_temps(tmp: Path, *, by_pid: bool = True) -> int:
    """Delete the temp files under ``tmp`` left by dead writers (``by_pid``: named
    ``<pid>-...`` by a writer of this host, whose pids tell) or older than
    ``STALE_TEMP_SECONDS``; return how many. Live writers' stay."""
    removed = 0
    now = time.time()
    with os.scandir(tmp) as entries:
        for entry in entries:
            owner = entry.name.split("-", 1)[0]
            alive = not by_pid or (owner.isdigit() and pid_alive(int(owner)))
            try:
                fresh = now - entry.stat(follow_symlinks=False).st_mtime < STALE_TEMP_SECONDS
            except FileNotFoundError:
                continue  # its writer published or removed it meanwhile
            if alive and fresh:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed


__all__ = [
    "LAYOUT_FORMAT",
    "LAYOUT_VERSION",
    "index_id",
    "STALE_TEMP_SECONDS",
    "layout_marker",
    "prepare_root",
    "remove_stale_temps",
    "write_layout",
]
