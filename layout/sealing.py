"""Sealing: what a tenant secret derives, keyed page hashes, and per-layer-block AEAD.

A *sealed* namespace (``Namespace.sealed``) protects a tenant's KV in a store that others can
read or write. Everything here is pure computation on bytes the caller passes in; reading key
files and choosing the key ring live above (``hicache_store.tenant``). The AEAD lives in this
layer, next to the framing that carries its tags, because writer and reader must agree on
every byte of it (nonces, associated data, tag placement) and the format's round-trip tests
need no I/O.

**Derivation.** A tenant secret is 32 random bytes. Each secret derives, by HMAC-SHA256 with
distinct labels (a PRF, so the outputs are independent)::

    key_id    = HMAC(secret, "hicache-store/v1/key-id")[:8]    public: named in every header
    page_key  = HMAC(secret, "hicache-store/v1/page-hash")     keys the page hashes
    seal_key  = HMAC(secret, "hicache-store/v1/seal")          derives each object's AES key

**Keyed page hashes.** ``keyed = HMAC-SHA256(page_key, h)[:len(h)]`` for each raw chain hash
``h`` (``layout.hashing``). The engine's hash (SGLang's sha256 chain) and the tier's are the
same ``h``, so both are keyed the same way, and since ``h_i`` commits to the whole prefix the
keyed hashes keep the chain's prefix property. Without ``page_key`` no one can compute a
tenant's object keys from tokens, nor test offline whether a prompt is cached.

**Encryption.** Each object gets 16 random bytes of salt (in its header) and its own AES-256
key ``HMAC(seal_key, "object" || salt)``; layer block ``i`` is AES-256-GCM with the 96-bit
nonce ``i`` (big-endian) under that key, so nonces never repeat under one key whatever the
number of objects (a fresh key per object; salts collide after ~2**64 objects). Each block
has its own 16-byte tag in the header, so a range of layers is decrypted and authenticated
without reading the others. The associated data of every block is ``AAD_LABEL || object key
|| 0 || the header's fixed part`` (namespace, page hash, parent, layer range, head group,
component, payload length, key id, salt): an object moved to another key, a header edited, a
block moved to another index or another object, or a block of another tenant all fail
authentication. Ciphertext has the plaintext's length, so offsets, alignment and range reads
are those of plain objects.

Encryption and decryption work in place (the caller's staging buffer; no copy) through the
``cryptography`` package, which releases the GIL for large buffers. Decryption writes the
plaintext before the tag is checked: after ``TamperedObjectError`` the buffer holds garbage
and must not be used (readers already drop a buffer whose read failed).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from functools import lru_cache
from types import ModuleType
from typing import Any

from .errors import MissingKeyError, SealingUnavailableError, TamperedObjectError

_accelerated: ModuleType | None
try:  # the optional C accelerator (layout/_chain.c): the same HMAC, without a call per page
    from . import _chain as _accelerated
except ImportError:  # pragma: no cover - exercised where the extension could not be built
    _accelerated = None
#: whether the built accelerator has the keyed functions (a stale build may not).
_KEYED = _accelerated is not None and hasattr(_accelerated, "key_digests")

#: bytes of a tenant secret.
SECRET_BYTES = 32
#: bytes of a key id (16 hex characters in headers, reports and key files).
KEY_ID_BYTES = 8
#: bytes of an object's salt, and of one block's GCM tag.
SALT_BYTES = 16
TAG_BYTES = 16
#: prefix of every block's associated data (a domain separator, and the format's version).
AAD_LABEL = b"hicache-store/v1/sealed-object\x00"
INSTALL_HINT = "pip install cryptography (the tenant extra)"

_LABEL_KEY_ID = b"hicache-store/v1/key-id"
_LABEL_PAGE = b"hicache-store/v1/page-hash"
_LABEL_SEAL = b"hicache-store/v1/seal"
_LABEL_OBJECT = b"object"


def _mac(key: bytes, message: bytes) -> bytes:
    return hmac.digest(key, message, "sha256")


class TenantKey:
    """One tenant secret and what derives from it (see the module docstring).

    ``key_id`` is public. The secret and the derived keys are never part of ``repr`` or
    ``str`` (so a key in a log line or a traceback shows only its id).
    """

    __slots__ = ("_seal_key", "key_id", "page_key")

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
            raise MissingKeyError(f"a tenant secret is exactly {SECRET_BYTES} bytes")
        self.key_id: str = _mac(secret, _LABEL_KEY_ID)[:KEY_ID_BYTES].hex()
        self.page_key: bytes = _mac(secret, _LABEL_PAGE)
        self._seal_key: bytes = _mac(secret, _LABEL_SEAL)

    @classmethod
    def generate(cls) -> tuple[TenantKey, bytes]:
        """A new random key and its secret (for key files; the caller stores the secret)."""
        secret = os.urandom(SECRET_BYTES)
        return cls(secret), secret

    def object_cipher_key(self, salt: bytes) -> bytes:
        """The AES-256 key of the object with ``salt``."""
        if len(salt) != SALT_BYTES:
            raise ValueError(f"salt: expected {SALT_BYTES} bytes, got {len(salt)}")
        return _mac(self._seal_key, _LABEL_OBJECT + salt)

    def __repr__(self) -> str:
        return f"TenantKey(key_id={self.key_id})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TenantKey) and hmac.compare_digest(
            self._seal_key, other._seal_key
        )

    def __hash__(self) -> int:
        return hash(self.key_id)


# -- keyed page hashes -------------------------------------------------------------------


def key_digest(page_key: bytes, raw: bytes) -> bytes:
    """The keyed form of one raw chain digest: ``HMAC-SHA256(page_key, raw)[:len(raw)]``.

    The one definition of a keyed page hash; ``key_digests`` and the C chain
    (``hashing.page_hashes_raw(key=...)``) compute exactly this (the tests compare them).
    """
    return _mac(page_key, raw)[: len(raw)]


def key_digests(page_key: bytes, raws: Sequence[bytes], *, accelerate: bool = True) -> list[bytes]:
    """``key_digest`` of each raw digest (all of one length, 16 or 32 bytes), in order."""
    if not raws:
        return []
    width = len(raws[0])
    if (
        accelerate
        and _KEYED
        and _accelerated is not None
        and width in (16, 32)
        and all(len(r) == width for r in raws)
    ):
        joined: bytes = _accelerated.key_digests(page_key, b"".join(raws), width)
        return [joined[i : i + width] for i in range(0, len(joined), width)]
    return [key_digest(page_key, r) for r in raws]


def key_page_hash(page_key: bytes, page_hash: str) -> str:
    """The keyed form of one hex page hash (same length, lowercase hex)."""
    return key_digest(page_key, bytes.fromhex(page_hash)).hex()


def key_page_hashes(page_key: bytes, page_hashes: Sequence[str]) -> list[str]:
    """``key_page_hash`` of each hash, in order (one C call for the batch where built)."""
    return [d.hex() for d in key_digests(page_key, [bytes.fromhex(h) for h in page_hashes])]


# -- authenticated encryption of layer blocks --------------------------------------------


def block_nonce(index: int) -> bytes:
    """The GCM nonce of layer block ``index`` of an object (unique per object key)."""
    return index.to_bytes(12, "big")


def associated_data(object_key: str, header_fixed: bytes) -> bytes:
    """What every block of an object authenticates besides its own bytes."""
    return AAD_LABEL + object_key.encode("ascii") + b"\x00" + header_fixed


@lru_cache(maxsize=1)
def _cipher_api() -> tuple[Any, Any, Any, Any, bool]:
    """``(Cipher, AES, GCM, InvalidTag, in_place)`` from ``cryptography``, imported once.

    ``in_place`` says whether this version encrypts into the input buffer itself (recent
    releases do, for stream modes such as GCM); older ones get a copy per block instead.
    """
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError as exc:
        raise SealingUnavailableError(
            f"sealed namespaces need the 'cryptography' package ({exc}); install it with: "
            f"{INSTALL_HINT}"
        ) from exc
    probe = bytearray(range(64))
    key, nonce = bytes(32), bytes(12)
    expected = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor().update(bytes(probe))
    try:
        enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        enc.update_into(memoryview(probe), memoryview(probe))
        in_place = bytes(probe) == expected
    except (ValueError, TypeError):
        in_place = False
    return Cipher, algorithms.AES, modes.GCM, InvalidTag, in_place


def require_sealing() -> None:
    """Raise ``SealingUnavailableError`` (with the install hint) unless ``cryptography`` loads."""
    _cipher_api()


def sealing_available() -> bool:
    """Whether ``cryptography`` can be imported (tests and ``doctor`` ask)."""
    try:
        _cipher_api()
    except SealingUnavailableError:
        return False
    return True


def _blocks(view: memoryview, count: int) -> tuple[memoryview, int]:
    flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if count <= 0 or flat.nbytes % count:
        raise ValueError(f"{flat.nbytes} bytes cannot be split into {count} blocks")
    return flat, flat.nbytes // count


def seal_blocks(
    cipher_key: bytes, aad: bytes, payload: memoryview, num_blocks: int, *, first_block: int = 0
) -> list[bytes]:
    """Encrypt ``payload`` (``num_blocks`` equal layer blocks) in place; return their tags.

    Block ``j`` of ``payload`` is the object's block ``first_block + j`` (its nonce).
    ``payload`` must be writable.
    """
    cipher, aes, gcm, _invalid, in_place = _cipher_api()
    flat, step = _blocks(payload, num_blocks)
    if flat.readonly:
        raise ValueError("seal_blocks encrypts in place: the payload must be writable")
    algorithm = aes(cipher_key)
    tags: list[bytes] = []
    for j in range(num_blocks):
        block = flat[j * step : (j + 1) * step]
        enc = cipher(algorithm, gcm(block_nonce(first_block + j))).encryptor()
        enc.authenticate_additional_data(aad)
        if in_place:
            enc.update_into(block, block)
        else:
            block[:] = enc.update(block)
        enc.finalize()
        tags.append(enc.tag)
    return tags


def open_blocks(
    cipher_key: bytes,
    aad: bytes,
    data: memoryview,
    tags: Sequence[bytes],
    *,
    first_block: int,
    first_layer: int = 0,
) -> None:
    """Authenticate and decrypt ``len(tags)`` consecutive blocks in place.

    ``data`` holds the object's blocks ``first_block ..`` (equal lengths), ``tags`` their
    tags. Raises ``TamperedObjectError`` naming the first layer (``first_layer + j``) that
    fails; the buffer then holds garbage.
    """
    cipher, aes, gcm, invalid_tag, in_place = _cipher_api()
    flat, step = _blocks(data, len(tags))
    algorithm = aes(cipher_key)
    for j, tag in enumerate(tags):
        block = flat[j * step : (j + 1) * step]
        dec = cipher(algorithm, gcm(block_nonce(first_block + j), tag)).decryptor()
        dec.authenticate_additional_data(aad)
        if in_place and not flat.readonly:
            dec.update_into(block, block)
        else:
            plain = dec.update(block)
            if not flat.readonly:
                block[:] = plain
        try:
            dec.finalize()
        except invalid_tag:
            raise TamperedObjectError(
                f"layer {first_layer + j} failed authentication (forged, altered, moved "
                "or sealed with another key)"
            ) from None
