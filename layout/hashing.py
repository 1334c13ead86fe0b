"""Page hashes: a chain over full token pages.

``h_0 = H(page_0)``, ``h_i = H(h_{i-1} || page_i)``, where ``h_{i-1}`` is the previous page's
raw digest and ``page_i`` the page's token ids encoded by ``encode_page``: uint32
little-endian, or, for a page holding an id of ``2**32`` or more, the byte ``0xff`` followed by
the ids as uint64 little-endian (SGLang 0.5.23's wide encoding; the odd byte count keeps the
two encodings apart). Ids must lie in ``[0, 2**63)``, as in SGLang. ``H`` is sha256 by default,
which makes the chain identical to SGLang's ``get_hash_str(tokens, prior_hash, page_size)``
on full pages, so hashes an engine passes in can be used as they are; ``xxh3_128`` is an
opt-in for speed. Hashes are lowercase hex.

Only *full* pages are hashed: a partial last page gets no hash (its KV is incomplete and changes
as the sequence grows, so it is never stored). ``prior_hash`` continues a chain: hashing pages
``k..n`` with the hash of page ``k-1`` gives the same hashes as hashing ``0..n`` at once;
``None`` and ``""`` both mean "no prior" (SGLang treats an empty prior as absent).

Token ids may come as a list of ints or of numpy integers, a 1-D numpy integer array, an
``array('I')`` or already-packed uint32 little-endian bytes; every form hashes the same.
"""

from __future__ import annotations

import array
import hashlib
import operator
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeAlias

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
_DIGEST_BYTES = {"sha256": 32, "xxh3_128": 16}
_UINT32_MAX = 0xFFFFFFFF
#: ids must be below this (SGLang keeps token ids in int64).
TOKEN_ID_LIMIT = 1 << 63
#: the first byte of a page that holds an id >= 2**32 (then encoded as uint64).
WIDE_PAGE_TAG = b"\xff"
_RANGE_MESSAGE = "tokens: ids must be integers in [0, 2**63)"

Tokens: TypeAlias = "Sequence[int] | np.ndarray[Any, Any] | array.array[int] | bytes"


def encode_page(ids: Sequence[int]) -> bytes:
    """The bytes one page contributes to the chain (see the module docstring).

    The single source of the page encoding: the C accelerator mirrors it and the tests hold
    both to SGLang's ``get_hash_str``.
    """
    if ids and max(ids) > _UINT32_MAX:
        return WIDE_PAGE_TAG + np.asarray(ids, dtype="<u8").tobytes()
    return np.asarray(ids, dtype="<u4").tobytes()


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray[Any, Any] | array.array[int]) -> bytes:
    """Token ids as contiguous uint32 little-endian bytes; an id outside uint32 raises
    ValueError (such ids need the wide page encoding, which ``page_hashes`` applies)."""
    packed = _as_uint32_bytes(tokens)
    if packed is None:
        raise ValueError("tokens: ids must fit in uint32 for a packed uint32 buffer")
    return packed


def _as_uint32_bytes(
    tokens: Sequence[int] | np.ndarray[Any, Any] | array.array[int],
) -> bytes | None:
    """uint32 LE bytes of the ids, or None when an id in ``[2**32, 2**63)`` needs the wide
    encoding. Negative, too large or non-integer ids raise ValueError."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D array, got shape {tokens.shape}")
        if tokens.size and tokens.dtype.kind not in "iu":
            raise ValueError(_RANGE_MESSAGE)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= TOKEN_ID_LIMIT):
            raise ValueError(_RANGE_MESSAGE)
        if tokens.size and tokens.max() > _UINT32_MAX:
            return None
        return np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    # array('I') converts a list of Python ints (or numpy integers) about 3x faster than
    # numpy does, and checks the range for us (OverflowError on negative or too large ids).
    try:
        packed = array.array("I", tokens)
    except (OverflowError, TypeError):
        _checked_ids(tokens)  # raises for ids no encoding takes
        return None
    if packed.itemsize != 4:  # pragma: no cover - no supported platform has a 2- or 8-byte uint
        return np.asarray(tokens, dtype="<u4").tobytes()
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _checked_ids(tokens: Sequence[int] | np.ndarray[Any, Any] | array.array[int]) -> list[int]:
    """The ids as Python ints, each checked to lie in ``[0, 2**63)``."""
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError:
        raise ValueError(_RANGE_MESSAGE) from None
    if ids and (min(ids) < 0 or max(ids) >= TOKEN_ID_LIMIT):
        raise ValueError(_RANGE_MESSAGE)
    return ids


def _prior_digest(prior_hash: str | None, algo: str) -> bytes | None:
    """The raw prior digest; ``None`` and ``""`` are no prior (as in SGLang)."""
    if not prior_hash:
        return None
    try:
        raw = bytes.fromhex(prior_hash)
    except (TypeError, ValueError):
        raise ValueError(f"prior_hash: {str(prior_hash)[:80]!r} is not hex") from None
    if len(raw) != _DIGEST_BYTES[algo]:
        raise ValueError(
            f"prior_hash: {len(raw)} bytes, a {algo} digest has {_DIGEST_BYTES[algo]}"
        )
    return raw


def page_hashes_raw(
    tokens: Tokens,
    page_size: int,
    *,
    algo: str = "sha256",
    prior_hash: str | None = None,
    accelerate: bool = True,
    key: bytes | None = None,
) -> list[bytes]:
    """Raw digests of every full page (see the module docstring for the chain).

    ``accelerate=False`` forces the pure-Python loop (the tests compare both paths). ``key``
    (a tenant's page key, ``layout.sealing``) returns the keyed hashes
    ``sealing.key_digest(key, h_i)`` instead; ``prior_hash`` is still the unkeyed ``h_{k-1}``.
    """
    if page_size < 1:
        raise ValueError(f"page_size: must be positive, got {page_size}")
    try:
        digest = _DIGESTS[algo]
    except KeyError:
        raise ValueError(f"algo: {algo!r} is not one of {', '.join(_DIGESTS)}") from None
    prior = _prior_digest(prior_hash, algo)
    accelerator = _accelerated if algo == "sha256" and accelerate else None
    if key is not None and not hasattr(accelerator, "key_digests"):
        accelerator = None  # a build without keyed chains: the Python loop, then HMAC
    # The C loop takes a list as it is (converting and checking each id itself, the fastest
    # way from Python ints). Otherwise narrow ids (the common case) become one uint32 buffer
    # and a prompt with an id of 2**32 or more a list of ints, encoded page by page.
    data: bytes | list[int]
    if isinstance(tokens, bytes) or (accelerator is not None and isinstance(tokens, list)):
        data = tokens
    else:
        packed = _as_uint32_bytes(tokens)
        data = _checked_ids(tokens) if packed is None else packed
    if accelerator is not None:
        joined: bytes = (
            accelerator.chain_sha256(data, page_size, prior)
            if key is None
            else accelerator.chain_sha256(data, page_size, prior, key)
        )
        return [joined[i : i + 32] for i in range(0, len(joined), 32)]
    if key is not None:
        from .sealing import key_digests

        unkeyed = page_hashes_raw(data, page_size, algo=algo, prior_hash=prior_hash,
                                  accelerate=False)
        return key_digests(key, unkeyed, accelerate=accelerate)
    prev = prior or b""
    out: list[bytes] = []
    append = out.append
    if isinstance(data, list):
        for start in range(0, len(data) - page_size + 1, page_size):
            prev = digest(prev + encode_page(data[start : start + page_size]))
            append(prev)
        return out
    step = 4 * page_size
    stop = len(data) // step * step
    # The chain is inherently sequential; this loop is the whole cost (about 0.55 us per
    # 64-token sha256 page here), so it is kept free of any per-page work but the hash.
    for start in range(0, stop, step):
        prev = digest(prev + data[start : start + step])
        append(prev)
    return out


def page_hashes(
    tokens: Tokens,
    page_size: int,
    *,
    algo: str = "sha256",
    prior_hash: str | None = None,
    accelerate: bool = True,
    key: bytes | None = None,
) -> list[str]:
    """Hex page hashes of every full page of ``tokens`` (a partial last page gets none).

    ``tokens`` may be a list of ints or numpy integers, a 1-D numpy integer array, an
    ``array('I')`` or already-packed uint32 little-endian bytes. Ids outside ``[0, 2**63)``
    and a ``prior_hash`` that is not a digest of ``algo`` raise ``ValueError``.
    """
    raw = page_hashes_raw(
        tokens, page_size, algo=algo, prior_hash=prior_hash, accelerate=accelerate, key=key
    )
    if not raw:
        return []
    width = 2 * len(raw[0])
    joined = b"".join(raw).hex()  # one hex() call instead of one per page
    return [joined[i : i + width] for i in range(0, len(joined), width)]
