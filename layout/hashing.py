"""Page hashes: a chain over full token pages.

``h_0 = H(tokens_0)``, ``h_i = H(h_{i-1} || tokens_i)``, where ``tokens_i`` are the page's
token ids as uint32 little-endian and ``h_{i-1}`` the previous page's raw digest. ``H`` is
sha256 by default, which makes the chain identical to SGLang's
``get_hash_str(tokens, prior_hash)`` applied page by page, so hashes an engine passes in can be
used as they are; ``xxh3_128`` is an opt-in for speed. Hashes are lowercase hex.

Only *full* pages are hashed: a partial last page gets no hash (its KV is incomplete and changes
as the sequence grows, so it is never stored). ``prior_hash`` continues a chain: hashing pages
``k..n`` with the hash of page ``k-1`` gives the same hashes as hashing ``0..n`` at once.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import xxhash

_accelerated: ModuleType | None
try:  # the optional C accelerator of the sha256 chain (setup.py); same results, ~3x faster
    from . import _chain as _accelerated
except ImportError:  # pragma: no cover - exercised where the extension could not be built
    _accelerated = None

_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "xxh3_128": xxhash.xxh3_128_digest,
}


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray[Any, Any] | array.array[int]) -> bytes:
    """Token ids as contiguous uint32 little-endian bytes; ids outside uint32 raise ValueError."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D array, got shape {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
            raise ValueError("tokens: ids must fit in uint32")
        return np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    # array('I') converts a list of Python ints about 3x faster than numpy does, and checks
    # the range for us (OverflowError on negative or too large ids).
    try:
        packed = array.array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"tokens: ids must be integers in uint32 range ({exc})") from None
    if packed.itemsize != 4:  # pragma: no cover - no supported platform has a 2- or 8-byte uint
        return np.asarray(tokens, dtype="<u4").tobytes()
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def page_hashes_raw(
    tokens: Sequence[int] | np.ndarray[Any, Any] | array.array[int] | bytes,
    page_size: int,
    *,
    algo: str = "sha256",
    prior_hash: str | None = None,
    accelerate: bool = True,
) -> list[bytes]:
    """Raw digests of every full page (see the module docstring for the chain).

    ``accelerate=False`` forces the pure-Python loop (the tests compare both paths).
    """
    if page_size < 1:
        raise ValueError(f"page_size: must be positive, got {page_size}")
    try:
        digest = _DIGESTS[algo]
    except KeyError:
        raise ValueError(f"algo: {algo!r} is not one of {', '.join(_DIGESTS)}") from None
    if algo == "sha256" and _accelerated is not None and accelerate:
        prior = None if prior_hash is None else bytes.fromhex(prior_hash)
        if isinstance(tokens, np.ndarray):
            tokens = tokens_to_bytes(tokens)
        if isinstance(tokens, (list, bytes)):
            joined: bytes = _accelerated.chain_sha256(tokens, page_size, prior)
            return [joined[i : i + 32] for i in range(0, len(joined), 32)]
    data = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
    step = 4 * page_size
    stop = len(data) // step * step
    prev = b"" if prior_hash is None else bytes.fromhex(prior_hash)
    out: list[bytes] = []
    append = out.append
    # The chain is inherently sequential; this loop is the whole cost (about 0.55 us per
    # 64-token sha256 page here), so it is kept free of any per-page work but the hash.
    for start in range(0, stop, step):
        prev = digest(prev + data[start : start + step])
        append(prev)
    return out


def page_hashes(
    tokens: Sequence[int] | np.ndarray[Any, Any] | array.array[int] | bytes,
    page_size: int,
    *,
    algo: str = "sha256",
    prior_hash: str | None = None,
    accelerate: bool = True,
) -> list[str]:
    """Hex page hashes of every full page of ``tokens`` (a partial last page gets none).

    ``tokens`` may be a list of ints, a 1-D numpy array, an ``array('I')`` or already-packed
    uint32 little-endian bytes.
    """
    raw = page_hashes_raw(
        tokens, page_size, algo=algo, prior_hash=prior_hash, accelerate=accelerate
    )
    if not raw:
        return []
    width = 2 * len(raw[0])
    joined = b"".join(raw).hex()  # one hex() call instead of one per page
    return [joined[i : i + width] for i in range(0, len(joined), width)]
