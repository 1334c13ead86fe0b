"""Sealed objects (format version 2): round trips, layer-range opening, and one named tamper
test per way a forger (who can write the store but has no tenant secret) could try."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_store.layout import framing, sealing
from hicache_store.layout.errors import (
    KeyMismatchError,
    MissingKeyError,
    TamperedObjectError,
    UnsupportedVersionError,
)
from hicache_store.layout.framing import (
    PAYLOAD_ALIGNMENT,
    decode_header,
    decode_object,
    encode_object,
    payload_offset,
    verify_blocks,
)
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key
from hicache_store.layout.sealing import TenantKey, key_page_hash, key_page_hashes

SECRET = bytes(range(32))
KEY = TenantKey(SECRET)
OTHER = TenantKey(bytes(range(1, 33)))
OBJ = ObjectKey("0f" * 32, "0123456789abcdef", ObjectCoords(30, 34, 2))
PAYLOAD = bytes(range(256)) * 16  # 4 layer blocks of 1024 bytes
FIXED = 144  # the sealed header's fixed part: every block's associated data


def sealed(key: TenantKey = KEY, obj: ObjectKey = OBJ, payload: bytes = PAYLOAD) -> bytearray:
    return bytearray(encode_object(obj, payload, 2, seal=key))


def recheck(data: bytearray, num_blocks: int = 4) -> bytearray:
    """Recompute the header checksum after an edit, as a forger would."""
    used = framing.header_bytes_used(num_blocks, sealed=True)
    struct.pack_into("<Q", data, used - 8, xxhash.xxh3_64_intdigest(bytes(data[: used - 8])))
    return data


def open_all(data: bytearray, key: TenantKey = KEY, obj: ObjectKey | None = OBJ) -> bytes:
    _header, payload = decode_object(data, expected=obj, sealed=True, key=key)
    return bytes(payload)


# -- derivation ---------------------------------------------------------------------------


def test_key_ids_are_stable_distinct_and_secret_free() -> None:
    assert TenantKey(SECRET).key_id == KEY.key_id
    assert len(KEY.key_id) == 16 and KEY.key_id != OTHER.key_id
    assert SECRET.hex() not in repr(KEY) and SECRET.hex() not in str(KEY)
    assert KEY.key_id in repr(KEY)
    with pytest.raises(MissingKeyError):
        TenantKey(b"short")


def test_keyed_page_hashes_keep_length_and_depend_on_the_key() -> None:
    chain = page_hashes(list(range(64)), 16)
    keyed = key_page_hashes(KEY.page_key, chain)
    assert [len(h) for h in keyed] == [64] * 4
    assert not set(keyed) & set(chain)
    assert keyed != key_page_hashes(OTHER.page_key, chain)
    assert key_page_hash(KEY.page_key, chain[2]) == keyed[2]
    short = page_hashes(list(range(64)), 16, algo="xxh3_128")
    assert [len(h) for h in key_page_hashes(KEY.page_key, short)] == [32] * 4


# -- round trips --------------------------------------------------------------------------


def test_sealed_round_trip_and_ciphertext_at_rest() -> None:
    data = sealed()
    header = decode_header(data, expected=OBJ, sealed=True)
    assert header.sealed and header.key_id == KEY.key_id and header.block_checksums == ()
    assert len(header.block_tags) == 4 and header.payload_offset == PAYLOAD_ALIGNMENT
    at_rest = bytes(data[PAYLOAD_ALIGNMENT:])
    assert len(at_rest) == len(PAYLOAD) and at_rest != PAYLOAD
    assert all(PAYLOAD[i : i + 64] not in at_rest for i in range(0, len(PAYLOAD), 1024))
    assert open_all(data) == PAYLOAD


def test_sealing_twice_uses_fresh_salts() -> None:
    a, b = sealed(), sealed()
    assert a[PAYLOAD_ALIGNMENT:] != b[PAYLOAD_ALIGNMENT:]
    assert open_all(a) == open_all(b) == PAYLOAD


def test_encode_object_leaves_the_callers_payload_alone() -> None:
    payload = bytearray(PAYLOAD)
    encode_object(OBJ, payload, 2, seal=KEY)
    assert payload == PAYLOAD


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 6),
    block=st.integers(1, 300),
    first=st.integers(0, 5),
    count=st.integers(1, 6),
    seed=st.binary(min_size=1, max_size=8),
)
def test_any_layer_range_opens_alone(
    layers: int, block: int, first: int, count: int, seed: bytes
) -> None:
    payload = (seed * (layers * block))[: layers * block]
    obj = ObjectKey("ab" * 16, "0123456789abcdef", ObjectCoords(10, 10 + layers, None))
    data = sealed(obj=obj, payload=payload)
    header = decode_header(data, expected=obj, sealed=True)
    first = min(first, layers - 1)
    stop = min(first + count, layers)
    start_b, stop_b = header.block_range(10 + first, 10 + stop)
    view = bytearray(data[start_b:stop_b])
    verify_blocks(header, view, 10 + first, 10 + stop, key=KEY)
    assert bytes(view) == payload[first * block : stop * block]


def test_long_sealed_headers_move_the_payload() -> None:
    assert payload_offset(246, sealed=True) == payload_offset(246) == 4096
    assert payload_offset(247, sealed=True) == 8192
    obj = ObjectKey("ab" * 16, "0123456789abcdef", ObjectCoords(0, 300, None))
    data = sealed(obj=obj, payload=bytes(600))
    assert decode_header(data, expected=obj, sealed=True).payload_offset == 8192
    assert open_all(data, obj=obj) == bytes(600)


# -- tamper: what a writer without the secret can try -------------------------------------


def test_tamper_plain_object_in_a_sealed_namespace() -> None:
    plain = encode_object(OBJ, PAYLOAD, 2)  # correctly framed, every checksum valid
    with pytest.raises(TamperedObjectError, match="plain object"):
        decode_header(plain, expected=OBJ, sealed=True)


def test_tamper_sealed_with_another_tenants_key() -> None:
    forged = sealed(key=OTHER)
    header = decode_header(forged, expected=OBJ, sealed=True)
    assert header.key_id == OTHER.key_id  # the reader resolves keys by id: not one of its own
    forged[120:128] = bytes.fromhex(KEY.key_id)  # claims the victim's key id
    header = decode_header(recheck(forged), expected=OBJ, sealed=True)
    with pytest.raises(TamperedObjectError, match="layer 30"):
        verify_blocks(header, forged[PAYLOAD_ALIGNMENT:], 30, 34, key=KEY)


def test_tamper_header_field_edited() -> None:
    data = sealed()
    struct.pack_into("<I", data, 44, 3)  # head group 2 -> 3 ...
    with pytest.raises(KeyMismatchError):  # ... no longer the key asked for
        decode_header(recheck(data), expected=OBJ, sealed=True)
    data = sealed()
    data[88:120] = bytes(range(32))  # the parent link (gc's chains) rewritten
    struct.pack_into("<B", data, 33, 32)
    header = decode_header(recheck(data), expected=OBJ, sealed=True)
    with pytest.raises(TamperedObjectError):
        verify_blocks(header, data[PAYLOAD_ALIGNMENT:], 30, 34, key=KEY)


def test_tamper_ciphertext_bit_flip() -> None:
    data = sealed()
    data[PAYLOAD_ALIGNMENT + 2 * 1024 + 5] ^= 1
    with pytest.raises(TamperedObjectError, match="layer 32"):
        open_all(data)


def test_tamper_tag_replaced() -> None:
    data = sealed()
    data[FIXED : FIXED + 16] = bytes(16)
    with pytest.raises(TamperedObjectError, match="layer 30"):
        open_all(recheck(data))


def test_tamper_blocks_swapped_within_an_object() -> None:
    data = sealed()
    base = PAYLOAD_ALIGNMENT
    b0, b1 = bytes(data[base : base + 1024]), bytes(data[base + 1024 : base + 2048])
    data[base : base + 1024], data[base + 1024 : base + 2048] = b1, b0
    t0, t1 = bytes(data[FIXED : FIXED + 16]), bytes(data[FIXED + 16 : FIXED + 32])
    data[FIXED : FIXED + 16], data[FIXED + 16 : FIXED + 32] = t1, t0
    with pytest.raises(TamperedObjectError):
        open_all(recheck(data))


def test_tamper_object_swapped_to_another_key() -> None:
    """The victim's own valid object for page A, rewritten to claim page B's key."""
    other = ObjectKey("1e" * 32, OBJ.namespace_digest, OBJ.coords)
    data = sealed()
    data[56:88] = bytes.fromhex(other.page_hash)
    header = decode_header(recheck(data), expected=other, sealed=True)
    with pytest.raises(TamperedObjectError):
        verify_blocks(header, data[PAYLOAD_ALIGNMENT:], 30, 34, key=KEY)
    assert sealing.associated_data(format_key(other), b"") != sealing.associated_data(
        format_key(OBJ), b""
    )


def test_tamper_salt_replaced() -> None:
    data = sealed()
    data[128:144] = bytes(16)
    with pytest.raises(TamperedObjectError):
        open_all(recheck(data))


def test_sealed_object_in_a_plain_namespace_is_refused() -> None:
    with pytest.raises(UnsupportedVersionError, match="sealed object"):
        decode_header(sealed(), expected=OBJ, sealed=False)


def test_opening_needs_the_objects_key() -> None:
    data = sealed()
    header = decode_header(data, expected=OBJ, sealed=True)
    with pytest.raises(MissingKeyError):
        verify_blocks(header, data[PAYLOAD_ALIGNMENT:], 30, 34)
    with pytest.raises(ValueError, match="not the object's key"):
        verify_blocks(header, data[PAYLOAD_ALIGNMENT:], 30, 34, key=OTHER)


def test_read_only_data_is_authenticated_without_decrypting() -> None:
    data = bytes(sealed())
    header = decode_header(data, expected=OBJ, sealed=True)
    verify_blocks(header, data[PAYLOAD_ALIGNMENT:], 30, 34, key=KEY)  # no error
    broken = bytearray(data)
    broken[-1] ^= 1
    with pytest.raises(TamperedObjectError, match="layer 33"):
        verify_blocks(header, bytes(broken[PAYLOAD_ALIGNMENT:]), 30, 34, key=KEY)


# -- keyed chains: one definition, C and Python agree -------------------------------------


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
@pytest.mark.parametrize("prior", [None, "ab" * 32])
def test_keyed_chain_is_hmac_of_the_chain_in_c_and_python(algo: str, prior: str | None) -> None:
    if prior is not None and algo == "xxh3_128":
        prior = prior[:32]
    tokens = [*range(4096, 4096 + 48), 2**40, *range(15)]  # one wide page among narrow ones
    chain = page_hashes(tokens, 16, algo=algo, prior_hash=prior)
    expected = [sealing.key_digest(KEY.page_key, bytes.fromhex(h)).hex() for h in chain]
    for accelerate in (True, False):
        assert page_hashes(tokens, 16, algo=algo, prior_hash=prior, key=KEY.page_key,
                           accelerate=accelerate) == expected
    assert key_page_hashes(KEY.page_key, chain) == expected
    raws = [bytes.fromhex(h) for h in chain]
    assert sealing.key_digests(KEY.page_key, raws, accelerate=False) == sealing.key_digests(
        KEY.page_key, raws
    )
    # Engine-given hashes (SGLang's chain) key to the same names as tokens hashed here.
    assert [key_page_hash(KEY.page_key, h) for h in chain] == expected
