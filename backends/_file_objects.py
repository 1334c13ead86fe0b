"""The file layout's objects as an index sees them: ``FileObjects``, an ``index.ObjectSite``.

An object is the regular file ``objects/ab/cd/<key>``; its size is the file's, and what the
bound charges for it is either that size (``charge="size"``) or the blocks the filesystem
allocated for it (``charge="allocated"``: ``st_blocks`` x 512, what fills the disk: a 100-byte
object takes a 4 KiB block). A writer's unpublished work is its temp files
``tmp/<pid>-<writer>-<n>.tmp`` (``FileBackend._temp_path``).

Foreign files (names outside the key grammar) and anything but a regular file under a key's
name are never objects: a walk skips them and never indexes or removes them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from hicache_store.layout.errors import InvalidKeyError
from hicache_store.layout.keys import validate_storage_key

from .index import Measured

Charge = Literal["size", "allocated"]
CHARGES: tuple[str, ...] = ("size", "allocated")
#: the allocation unit assumed for a reservation's estimate (``charge_of``) where the
#: filesystem reports none; the settled charge is always the file's own.
_BLOCK = 4096


class FileObjects:
    """The objects under ``objects_dir`` (``path_of``: a key's final path), the temp files
    under ``tmp_dir``."""

    def __init__(self, objects_dir: str, tmp_dir: str, path_of: Callable[[str], str], *,
                 charge: Charge = "size") -> None:
        self._objects = objects_dir
        self._tmp = tmp_dir
        self._path_of = path_of
        self.charge: Charge = charge
        block = _BLOCK
        with contextlib.suppress(OSError):
            block = os.statvfs(objects_dir).f_frsize or _BLOCK
        self._block = block

    def _measured(self, st: os.stat_result) -> Measured:
        charged = st.st_blocks * 512 if self.charge == "allocated" else st.st_size
        return Measured(st.st_size, charged, st.st_mtime)

    def measure(self, keys: Sequence[str]) -> list[Measured | None]:
        out: list[Measured | None] = []
        for key in keys:
            try:
                st = os.stat(self._path_of(key))
            except FileNotFoundError:
                out.append(None)
                continue
            out.append(self._measured(st))
        return out

    def remove(self, keys: Sequence[str]) -> list[bool | OSError]:
        out: list[bool | OSError] = []
        for key in keys:
            try:
                os.unlink(self._path_of(key))
            except FileNotFoundError:
                out.append(False)
            except OSError as exc:
                out.append(exc)
            else:
                out.append(True)
        return out

    def walk(self) -> Iterator[tuple[str, Measured]]:
        for top in scandir_dirs(self._objects):
            for sub in scandir_dirs(top.path):
                with contextlib.suppress(FileNotFoundError), os.scandir(sub.path) as entries:
                    for entry in entries:
                        if not is_storage_key(entry.name) or not entry.is_file(
                                follow_symlinks=False):
                            continue
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        yield entry.name, self._measured(st)

    def remove_temps(self, writer: str) -> int:
        removed = 0
        marker = f"-{writer}-"
        with contextlib.suppress(FileNotFoundError), os.scandir(self._tmp) as entries:
            for entry in entries:
                if marker in entry.name and entry.name.endswith(".tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed += 1
        return removed

    def charge_of(self, size: int) -> int:
        if self.charge == "size":
            return size
        return -(-size // self._block) * self._block


def is_storage_key(name: str) -> bool:
    try:
        validate_storage_key(name)
    except InvalidKeyError:
        return False
    return True


def list_dir(directory: str) -> Iterator[tuple[str, int, float]]:
    """``(key, size, mtime)`` of the object files in one shard directory (foreign files, never
    ours to index or evict, are skipped; so is anything but a regular file under a key's name:
    a directory or a symlink is not an object, and reading it fails instead of missing)."""
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if not is_storage_key(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield entry.name, st.st_size, st.st_mtime


def scandir_dirs(path: str | os.PathLike[str]) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            dirs = [e for e in entries if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return iter(())
    return iter(dirs)


__all__ = ["CHARGES", "Charge", "FileObjects", "is_storage_key", "list_dir", "scandir_dirs"]
