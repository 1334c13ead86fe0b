"""Stores of framed page chains, for testing what walks a whole store (``gc``, ``inspect``).

``write_chains(backend, chains, length)`` stores ``chains`` chains of ``length`` pages, each
page two valid framed objects whose headers name the page's parent (as the cache tier and
``prepopulate`` write them), so gc can rebuild the chains from the store alone.
``chains_are_prefixes`` is the property gc keeps: of every chain, what is left is a prefix.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from hicache_store.backends.base import Backend
from hicache_store.layout.framing import encode_object
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key

#: the namespace digest of every object written here.
CHAIN_NAMESPACE = "0123456789abcdef"
#: bytes of each object: a 4 KiB header and two 512-byte layer blocks.
CHAIN_OBJECT_BYTES = 4096 + 1024


def chain_objects(hashes: Sequence[str], objects_per_page: int = 2) -> dict[str, bytes]:
    """The framed objects of one chain of page ``hashes`` (32 or 64 hex characters each):
    ``objects_per_page`` head groups per page, each header naming the previous page."""
    out = {}
    for i, page in enumerate(hashes):
        for group in range(objects_per_page):
            key = ObjectKey(page, CHAIN_NAMESPACE, ObjectCoords(0, 2, group))
            out[format_key(key)] = encode_object(key, bytes([i % 251]) * 1024, 2,
                                                 parent_hash=hashes[i - 1] if i else None)
    return out


async def write_chains(backend: Backend, chains: int, length: int, *,
                       batch: int = 2000) -> list[list[str]]:
    """Store ``chains`` chains of ``length`` pages, chain by chain, each parent first;
    return each chain's page hashes (chain ``c``'s start with ``c`` in hex)."""
    out = []
    for c in range(chains):
        hashes = [f"{c:08x}{i:024x}" for i in range(length)]
        objects = list(chain_objects(hashes).items())
        for start in range(0, len(objects), batch):
            part = objects[start : start + batch]
            await backend.put([k for k, _ in part], [v for _, v in part])
        out.append(hashes)
    return out


def chains_are_prefixes(present: Collection[str], chains: Sequence[Sequence[str]]) -> bool:
    """Whether, of every chain, the pages in ``present`` are a prefix (no page after a gap)."""
    for chain in chains:
        kept = [page in present for page in chain]
        if kept != sorted(kept, reverse=True):
            return False
    return True
