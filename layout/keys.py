"""Object keys and the storage-key grammar.

An object key names one (page, layer chunk, head group[, component]) object::

    {page_hash}_{namespace_digest}_L{start}-{end}[_H{group}][_C{component}]

``end`` is inclusive (``L30-59``). ``_H`` is present for MHA and absent for MLA. ``_C`` tags a
non-KV cache component (sliding-window KV, recurrent state, draft model); absent means the
full-attention KV. Numbers are canonical decimals (no leading zeros), so ``parse_key`` is the
exact inverse of ``format_key`` and every valid key has exactly one spelling.

Keys of SGLang's unified keyspace (``Namespace.key_scheme == "sglang-ukv1"``) have the same
shape with SGLang's digest and an end-*exclusive* layer range, and never a ``_C`` part::

    {page_hash}_ukv1-{16 hex}_L{start}-{stop}[_H{group}]

The digest names the scheme, so one ``ObjectKey`` type, ``format_key`` and ``parse_key`` serve
both (``key_tail`` is the one place the coordinate is printed).

Every key that reaches a backend, object key or not (manifests, markers), must match the
storage-key grammar: 1-255 characters of lowercase hex digits, ``_``, ``-``, the uppercase
tag letters and the lowercase ``u``, ``k``, ``v`` of SGLang's ``ukv1-`` digest tag, starting
with a hex digit or tag letter. No ``/``, ``.``, NUL or whitespace can
appear, so a key can never traverse a path or inject into a URL.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TypeGuard

import numpy as np
import xxhash

from .errors import InvalidKeyError
from .namespace import DIGEST_HEX_CHARS, UKV1_DIGEST_PREFIX

_accelerated: ModuleType | None
try:  # the optional C accelerator for key batches (layout/_keys.c); same answers, one pass a key
    from . import _keys as _accelerated
except ImportError:  # pragma: no cover - exercised where the extension could not be built
    _accelerated = None

#: the longest storage key (fits one path component of every common filesystem).
MAX_KEY_LENGTH = 255
#: hex length of page hashes: xxh3_128 (32) and sha256 (64).
PAGE_HASH_HEX_LENGTHS: tuple[int, ...] = (32, 64)

_STORAGE_KEY_RE = re.compile(r"[0-9a-fA-Zkuv][0-9a-fA-Zkuv_-]{0,254}")
_NUM = r"0|[1-9][0-9]{0,5}"
_DIGEST_RE = rf"[0-9a-f]{{{DIGEST_HEX_CHARS}}}"
_UKV1_RE = re.escape(UKV1_DIGEST_PREFIX) + _DIGEST_RE
_OBJECT_KEY_RE = re.compile(
    rf"(?P<hash>[0-9a-f]{{32}}|[0-9a-f]{{64}})_(?P<ns>{_DIGEST_RE})"
    rf"_L(?P<start>{_NUM})-(?P<end>{_NUM})"
    rf"(?:_H(?P<group>{_NUM}))?(?:_C(?P<component>[1-9][0-9]{{0,2}}))?"
)
_UKV1_KEY_RE = re.compile(
    rf"(?P<hash>[0-9a-f]{{32}}|[0-9a-f]{{64}})_(?P<ns>{_UKV1_RE})"
    rf"_L(?P<start>{_NUM})-(?P<stop>{_NUM})(?:_H(?P<group>{_NUM}))?"
)
_PAGE_HASH_RE = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")


def validate_storage_key(key: object) -> str:
    """Return ``key`` if it is inside the storage-key grammar, else raise ``InvalidKeyError``.

    The message shows at most 80 characters of the offending key (escaped), never the rest.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"storage key must be a str, got {type(key).__name__}")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(f"storage key is {len(key)} characters long (max {MAX_KEY_LENGTH})")
    if _STORAGE_KEY_RE.fullmatch(key) is None:
        raise InvalidKeyError(
            f"storage key {key[:80]!r} has characters outside [0-9a-fA-Zkuv_-] or is empty"
        )
    return key


_KEY_CHARACTERS = b"0123456789abcdefkuvABCDEFGHIJKLMNOPQRSTUVWXYZ_-"


def validate_storage_keys(keys: Sequence[object]) -> list[str]:
    """``validate_storage_key`` for a whole batch, returning the keys as a list.

    Same rules and errors as the per-key check (the first offending key is reported). The
    common all-valid case costs no regex per key: with the C accelerator one pass over each
    key's characters; without it, one generator pass and one ``translate`` over the joined
    keys (their costs: BENCHMARKS.md, "File backend at scale").
    """
    batch = list(keys)
    if _accelerated is not None:
        if _accelerated.storage_keys_valid(batch):
            return batch  # type: ignore[return-value]
    elif all(type(k) is str and 0 < len(k) <= MAX_KEY_LENGTH for k in batch):
        texts: list[str] = batch  # type: ignore[assignment]
        joined = "".join(texts)
        if (
            joined.isascii()
            and not joined.encode("ascii").translate(None, _KEY_CHARACTERS)
            and not any(k[0] in "_-" for k in texts)
        ):
            return texts
    return [validate_storage_key(k) for k in batch]  # raises for the first bad key


def xxh3_64_each(keys: Sequence[str]) -> np.ndarray:
    """The xxh3_64 of each key's UTF-8 bytes (``xxhash.xxh3_64_intdigest(key.encode())``), as a
    uint64 array (read-only). With the C accelerator one call for the batch: a call per key
    would cost more in its ``encode`` and the int it returns than in the hash."""
    batch = keys if type(keys) is list else list(keys)
    if _accelerated is not None:
        packed = _accelerated.xxh3_64_each(batch)
        if packed is not None:  # None: some key it does not hash (over 240 UTF-8 bytes)
            return np.frombuffer(packed, dtype=np.uint64)
    digest, encode = xxhash.xxh3_64_intdigest, str.encode
    return np.fromiter(map(digest, map(encode, batch)), dtype=np.uint64, count=len(batch))


def is_page_hash(text: object) -> TypeGuard[str]:
    """Whether ``text`` is a page hash (32 or 64 lowercase hex characters)."""
    return isinstance(text, str) and _PAGE_HASH_RE.fullmatch(text) is not None


def validate_page_hash(page_hash: object) -> str:
    """Return a page hash (32 or 64 lowercase hex characters) or raise ``InvalidKeyError``."""
    if not is_page_hash(page_hash):
        raise InvalidKeyError(
            f"page hash {str(page_hash)[:80]!r} is not 32 or 64 lowercase hex characters"
        )
    return page_hash


@dataclass(frozen=True, order=True)
class ObjectCoords:
    """Where an object sits inside a page: its layer range, head group and component.

    ``layer_stop`` is exclusive here (the key prints ``layer_stop - 1``); ``head_group`` is
    ``None`` for MLA; ``component`` 0 is full-attention KV.
    """

    layer_start: int
    layer_stop: int
    head_group: int | None
    component: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_stop:
            raise InvalidKeyError(
                f"layer range [{self.layer_start}, {self.layer_stop}) is empty or negative"
            )
        if self.head_group is not None and self.head_group < 0:
            raise InvalidKeyError(f"head group {self.head_group} is negative")
        if not 0 <= self.component <= 999:
            raise InvalidKeyError(f"component {self.component} outside [0, 999]")

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def suffix(self) -> str:
        """The coordinate part of the key, e.g. ``L30-59_H2``."""
        text = f"L{self.layer_start}-{self.layer_stop - 1}"
        if self.head_group is not None:
            text += f"_H{self.head_group}"
        if self.component:
            text += f"_C{self.component}"
        return text


@dataclass(frozen=True)
class ObjectKey:
    """A parsed object key: page hash, namespace digest and coordinates."""

    page_hash: str
    namespace_digest: str
    coords: ObjectCoords

    def __post_init__(self) -> None:
        validate_page_hash(self.page_hash)
        if is_ukv1_digest(self.namespace_digest):
            if self.coords.component:
                raise InvalidKeyError("SGLang's ukv1 keys have no component part")
        elif not re.fullmatch(_DIGEST_RE, self.namespace_digest):
            raise InvalidKeyError(
                f"namespace digest {self.namespace_digest[:80]!r} is not "
                f"{DIGEST_HEX_CHARS} lowercase hex characters or {UKV1_DIGEST_PREFIX}<"
                f"{DIGEST_HEX_CHARS} hex>"
            )

    def __str__(self) -> str:
        return format_key(self)


def is_ukv1_digest(digest: object) -> bool:
    """Whether ``digest`` is one of SGLang's unified-keyspace digests (``ukv1-<16 hex>``)."""
    return isinstance(digest, str) and re.fullmatch(_UKV1_RE, digest) is not None


def key_tail(namespace_digest: str, coords: ObjectCoords) -> str:
    """``_{digest}_{coordinates}``: everything of a key after the page hash.

    The one place a coordinate is printed: end-inclusive for this library's digests,
    end-exclusive for SGLang's ``ukv1-`` digests.
    """
    if namespace_digest.startswith(UKV1_DIGEST_PREFIX):
        text = f"L{coords.layer_start}-{coords.layer_stop}"
        if coords.head_group is not None:
            text += f"_H{coords.head_group}"
        return f"_{namespace_digest}_{text}"
    return f"_{namespace_digest}_{coords.suffix}"


def format_key(key: ObjectKey) -> str:
    """The storage key of an object; ``parse_key`` is its inverse."""
    return key.page_hash + key_tail(key.namespace_digest, key.coords)


def object_key(page_hash: str, namespace_digest: str, coords: ObjectCoords) -> str:
    """Shortcut: validate the parts and format the key in one call."""
    return format_key(ObjectKey(page_hash, namespace_digest, coords))


def parse_key(text: str) -> ObjectKey:
    """Parse an object key strictly; raise ``InvalidKeyError`` for anything else.

    ``format_key(parse_key(k)) == k`` for every valid ``k``.
    """
    validate_storage_key(text)
    ukv1 = _UKV1_KEY_RE.fullmatch(text)
    if ukv1 is not None:
        start, stop = int(ukv1["start"]), int(ukv1["stop"])
        if stop <= start:
            raise InvalidKeyError(f"{text[:80]!r}: layer range [{start}, {stop}) is empty")
        group = ukv1["group"]
        coords = ObjectCoords(start, stop, None if group is None else int(group))
        return ObjectKey(ukv1["hash"], ukv1["ns"], coords)
    match = _OBJECT_KEY_RE.fullmatch(text)
    if match is None:
        raise InvalidKeyError(f"{text[:80]!r} is not an object key")
    start, end = int(match["start"]), int(match["end"])
    if end < start:
        raise InvalidKeyError(f"{text[:80]!r}: layer range end {end} < start {start}")
    group = match["group"]
    component = match["component"]
    coords = ObjectCoords(
        start, end + 1, None if group is None else int(group), int(component or 0)
    )
    return ObjectKey(match["hash"], match["ns"], coords)


def object_key_parts(text: str) -> tuple[str, str] | None:
    """``(page_hash, namespace_digest)`` of an object key; None for any other string.

    The same grammar as ``parse_key`` (``parse_key(k)`` succeeds exactly when this is not
    None, for a ``k`` inside the storage-key grammar), for tools that classify millions of
    listed keys: it builds no ``ObjectKey``.
    """
    ukv1 = _UKV1_KEY_RE.fullmatch(text)
    if ukv1 is not None:
        return (ukv1["hash"], ukv1["ns"]) if int(ukv1["stop"]) > int(ukv1["start"]) else None
    match = _OBJECT_KEY_RE.fullmatch(text)
    if match is None or int(match["end"]) < int(match["start"]):
        return None
    return match["hash"], match["ns"]


def namespace_prefix(page_hash: str, namespace_digest: str) -> str:
    """The common prefix of every object of one page in one namespace (for listing)."""
    return f"{validate_page_hash(page_hash)}_{namespace_digest}_"
