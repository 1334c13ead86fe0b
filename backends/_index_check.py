"""An index against its store: the comparison behind ``doctor``, the reconcile behind ``gc``.

``check_index`` walks the store (``ObjectSite.walk``) and the index's listing and counts what
each holds that the other does not. With ``repair`` it settles the differences the way the
contract says they settle: an object the index does not account for is removed
(``delete_unindexed``: it skips keys with a change in flight, so a put between its rename and
its settle is left alone), and a key whose object is gone is unindexed (``repair_missing``).
With ``rebuild`` the index is built anew from the walk instead (``ObjectIndex.rebuild``).
"""

from __future__ import annotations

from .index import IndexCheck, ObjectIndex, ObjectSite

_EXAMPLES = 10
_CHUNK = 1000


def check_index(index: ObjectIndex, site: ObjectSite, kind: str, *, repair: bool = False,
                rebuild: bool = False) -> IndexCheck:
    """The comparison (module docstring); blocking, a walk of the whole store."""
    if rebuild:
        index.rebuild()
    listed = {key: found.charged for key, found in site.walk()}
    indexed = {key for page in index.key_pages("") for key in page}
    unindexed = [key for key in listed if key not in indexed]
    missing = [key for key in indexed if key not in listed]
    removed = repaired = 0
    if repair and not rebuild:
        for start in range(0, len(unindexed), _CHUNK):
            removed += index.delete_unindexed(unindexed[start : start + _CHUNK])
        for key in missing:
            index.repair_missing(key)
            repaired += 1
        if removed or repaired:
            listed = {key: found.charged for key, found in site.walk()}
    total, count = index.totals()
    return IndexCheck(
        kind, total, count, sum(listed.values()), len(listed),
        unindexed=len(unindexed) - removed, missing=len(missing) - repaired,
        examples=(unindexed + missing)[:_EXAMPLES] if not (removed or repaired) else [],
        usage=index.usage(), details=index.details(), removed=removed, repaired=repaired,
        rebuilt=rebuild,
    )


__all__ = ["check_index"]
