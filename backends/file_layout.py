"""Where an object lives in the file layout (``file://`` and ``hf3fs://`` roots).

Under a root, the object ``key`` is the file ``objects/ab/cd/<key>``, where ``ab`` and ``cd``
are the first four hex digits of the key's xxh3_64: two levels of 256 directories chosen by a
hash of the key (not by its own characters, so any key spreads evenly). The one source of that
arithmetic, for the backends and for tools that look at a root's files (benchmarks that evict
their own files from the page cache).
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from hicache_store.layout.keys import validate_storage_key


def shard_of(key: str) -> tuple[str, str]:
    """The two shard directory names of a key (4 hex digits of xxh3_64(key))."""
    digest = xxhash.xxh3_64_hexdigest(key.encode())
    return digest[:2], digest[2:4]


def object_path(root: str | os.PathLike[str], key: str) -> Path:
    """Where the object ``key`` lives under ``root``. ``InvalidKeyError`` for an invalid key."""
    return Path(root, "objects", *shard_of(validate_storage_key(key)), key)


__all__ = ["object_path", "shard_of"]
