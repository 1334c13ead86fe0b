"""``SealedFormat``: the object format of a sealed namespace (one tenant key of a key ring).

It is ``FRAMED`` with three differences, each in the one place ``ObjectFormat`` gives it:

* **names** (``stored_hash`` / ``storage_key``): the page hash an engine or the tier passes in
  (public: anyone can compute it from tokens) is keyed with the tenant key's ``page_key``
  (``layout.sealing.key_page_hash``) before it names an object or goes into a header, parent
  links included, so the store holds no key anyone without the secret can compute or probe;
* **seal**: the payload, already in place behind the reserved header in the caller's staging,
  is encrypted block by block in place (AES-256-GCM, key and header as associated data) and
  the sealed header (key id, salt, one tag per layer block) written in front of it;
* **open**: the header must be a sealed one for exactly the keyed key asked for and name this
  format's key; each layer block read is authenticated and decrypted in place. Any failure is
  a ``CorruptObjectError`` (``TamperedObjectError`` for authentication), never bytes.

One format is one key. Readers of a rotated ring try each readable key's format in ring order
(``objects.pages.L3Link``); writers use the active key's.
"""

from __future__ import annotations

from hicache_store.layout.errors import TamperedObjectError
from hicache_store.layout.framing import (
    ObjectHeader,
    decode_header,
    encode_header,
    payload_offset,
    verify_blocks,
)
from hicache_store.layout.keys import ObjectKey, format_key, validate_page_hash
from hicache_store.layout.sealing import TenantKey, key_page_hash, require_sealing


class SealedFormat:
    """Format version 2 of ``layout.framing``, sealed with one tenant key (module docstring)."""

    name = "sealed-v1"
    sealed = True

    def __init__(self, key: TenantKey) -> None:
        require_sealing()  # a missing ``cryptography`` fails here, at configuration, not per write
        self.key = key

    def __repr__(self) -> str:
        return f"SealedFormat(key_id={self.key.key_id})"

    def stored_hash(self, page_hash: str) -> str:
        return key_page_hash(self.key.page_key, validate_page_hash(page_hash))

    def stored_key(self, key: ObjectKey) -> ObjectKey:
        """``key`` with its page hash keyed: what the store and the header hold."""
        return ObjectKey(self.stored_hash(key.page_hash), key.namespace_digest, key.coords)

    def storage_key(self, key: ObjectKey) -> str:
        return format_key(self.stored_key(key))

    def header_bytes(self, num_layers: int) -> int:
        return payload_offset(num_layers, sealed=True)

    def seal(
        self, key: ObjectKey, frame: memoryview, *, kv_planes: int, parent_hash: str | None
    ) -> None:
        size = self.header_bytes(key.coords.num_layers)
        parent = None if parent_hash is None else self.stored_hash(parent_hash)
        # Encrypts frame[size:] in place, then the header goes in front of the ciphertext.
        frame[:size] = encode_header(
            self.stored_key(key), frame[size:], kv_planes, parent_hash=parent, seal=self.key
        )

    def open_header(self, key: ObjectKey, header: memoryview, *, payload_bytes: int) -> ObjectHeader:
        size = self.header_bytes(key.coords.num_layers)
        decoded = decode_header(
            header, expected=self.stored_key(key), object_length=size + payload_bytes, sealed=True
        )
        if decoded.key_id != self.key.key_id:
            # Stored under this key's names, so sealed with it: anything else was planted.
            raise TamperedObjectError(
                f"{format_key(decoded.key())}: sealed with key {decoded.key_id}, "
                f"stored under key {self.key.key_id}'s names"
            )
        return decoded

    def open_blocks(
        self, header: ObjectHeader, data: memoryview, layer_start: int, layer_stop: int
    ) -> None:
        verify_blocks(header, data, layer_start, layer_stop, key=self.key)
