"""An S3 prefix's objects as an index sees them: ``S3Objects``, an ``index.ObjectSite``.

Sizes and times come from ``HEAD`` (one key) and the listing (a walk: 1,000 keys a request);
an object is charged its length (the store bills logical bytes). Removal is ``HEAD`` then
``DeleteObjects`` (the answer of ``DeleteObjects`` names every key it was given, present or
not). A put is one atomic request, so a writer leaves nothing unpublished behind: there are
no temp files to remove.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from .index import Measured
from .types import ObjectStat


class S3Objects:
    """The objects of one S3 prefix, through the backend's own blocking calls: ``head`` (a
    key's ``ObjectStat`` or None), ``delete_objects`` (the keys the store refused to
    delete), ``list_page`` (a page of ``ObjectStat`` and the next token)."""

    def __init__(self, head: Callable[[str, str], ObjectStat | None],
                 delete_objects: Callable[[Sequence[str], str], list[str]],
                 list_page: Callable[[str, str | None], tuple[list[ObjectStat], str | None]]
                 ) -> None:
        self._head = head
        self._delete_objects = delete_objects
        self._list_page = list_page

    @staticmethod
    def _measured(st: ObjectStat) -> Measured:
        return Measured(st.size, st.size, st.mtime or 0.0)

    def measure(self, keys: Sequence[str]) -> list[Measured | None]:
        out: list[Measured | None] = []
        for key in keys:
            st = self._head(key, "index")
            out.append(None if st is None else self._measured(st))
        return out

    def remove(self, keys: Sequence[str]) -> list[bool | OSError]:
        present = [key for key, found in zip(keys, self.measure(keys), strict=True)
                   if found is not None]
        refused = set(self._delete_objects(present, "evict")) if present else set()
        out: list[bool | OSError] = []
        for key in keys:
            if key in refused:
                out.append(_refused(key))
            else:
                out.append(key in present)
        return out

    def walk(self) -> Iterator[tuple[str, Measured]]:
        token: str | None = None
        while True:
            entries, token = self._list_page("", token)
            for st in entries:
                yield st.key, self._measured(st)
            if token is None:
                return

    def remove_temps(self, writer: str) -> int:
        return 0  # every write is one atomic request: nothing is left unpublished

    def charge_of(self, size: int) -> int:
        return size


def _refused(key: str) -> OSError:
    return PermissionError(13, "the store refused to delete it", key)



__all__ = ["S3Objects"]
