"""Object framing: round trips, and one named test per way a header can be wrong."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_store.layout import framing
from hicache_store.layout.errors import (
    BadMagicError,
    CorruptObjectError,
    HeaderChecksumError,
    HeaderFieldError,
    KeyMismatchError,
    PayloadChecksumError,
    TruncatedObjectError,
    UnsupportedVersionError,
)
from hicache_store.layout.framing import (
    PAYLOAD_ALIGNMENT,
    decode_header,
    decode_object,
    encode_header,
    encode_object,
    payload_offset,
    verify_blocks,
)
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key

KEY = ObjectKey("0f" * 32, "0123456789abcdef", ObjectCoords(30, 34, 2))
PAYLOAD = bytes(range(256)) * 16  # 4096 bytes = 4 layer blocks of 1024


def reseal(header: bytearray, num_blocks: int) -> bytearray:
    """Recompute the header checksum after a deliberate field edit (a *coherent* bad header)."""
    used = framing.header_bytes_used(num_blocks)
    struct.pack_into("<Q", header, used - 8, xxhash.xxh3_64_intdigest(bytes(header[: used - 8])))
    return header


def edited(offset: int, fmt: str, value: int) -> bytes:
    obj = bytearray(encode_object(KEY, PAYLOAD, 2))
    struct.pack_into(fmt, obj, offset, value)
    return bytes(reseal(obj, 4))


def test_round_trip() -> None:
    obj = encode_object(KEY, PAYLOAD, 2)
    header, payload = decode_object(obj, expected=KEY)
    assert header.key() == KEY
    assert bytes(payload) == PAYLOAD
    assert header.payload_offset == PAYLOAD_ALIGNMENT
    assert header.block_length == 1024
    assert header.object_length == len(obj)


def test_payload_offset_is_aligned_for_many_layers() -> None:
    assert payload_offset(1) == 4096
    assert payload_offset(1024) % 4096 == 0
    assert payload_offset(1024) >= framing.header_bytes_used(1024)


def test_range_of_layers_verifies_without_the_rest() -> None:
    obj = bytearray(encode_object(KEY, PAYLOAD, 2))
    header = decode_header(obj[:4096], expected=KEY)
    start, stop = header.block_range(32, 34)
    obj[4096 + 10] ^= 1  # corrupt layer 30 only
    verify_blocks(header, obj[start:stop], 32, 34)
    with pytest.raises(PayloadChecksumError, match="layer 30") as info:
        verify_blocks(header, obj[4096 : 4096 + 1024], 30, 31)
    assert info.value.layer == 30


def test_bad_magic() -> None:
    obj = bytearray(encode_object(KEY, PAYLOAD, 2))
    obj[0:8] = b"NOTMAGIC"
    with pytest.raises(BadMagicError):
        decode_header(obj)


def test_unknown_version() -> None:
    with pytest.raises(UnsupportedVersionError, match="version 3"):
        decode_header(edited(8, "<H", 3))


def test_truncated_before_magic_end() -> None:
    with pytest.raises(TruncatedObjectError):
        decode_header(b"HCST")


def test_truncated_fixed_header() -> None:
    with pytest.raises(TruncatedObjectError, match="header truncated"):
        decode_header(encode_object(KEY, PAYLOAD, 2)[:50])


def test_truncated_checksum_table() -> None:
    with pytest.raises(TruncatedObjectError, match="header truncated"):
        decode_header(encode_object(KEY, PAYLOAD, 2)[:100])


def test_truncated_payload() -> None:
    obj = encode_object(KEY, PAYLOAD, 2)
    with pytest.raises(TruncatedObjectError, match="header says"):
        decode_object(obj[:-1])


def test_trailing_bytes() -> None:
    obj = encode_object(KEY, PAYLOAD, 2) + b"x"
    with pytest.raises(HeaderFieldError, match="header says"):
        decode_object(obj)


def test_header_checksum_mismatch() -> None:
    obj = bytearray(encode_object(KEY, PAYLOAD, 2))
    obj[40] ^= 0x01  # last layer, without resealing
    with pytest.raises(HeaderChecksumError):
        decode_header(obj)


def test_block_count_overflow() -> None:
    obj = bytearray(encode_object(KEY, PAYLOAD, 2))
    struct.pack_into("<I", obj, 48, 0xFFFFFFFF)
    with pytest.raises(HeaderFieldError, match="block count"):
        decode_header(obj)


def test_zero_blocks() -> None:
    obj = bytearray(encode_object(KEY, PAYLOAD, 2))
    struct.pack_into("<I", obj, 48, 0)
    with pytest.raises(HeaderFieldError, match="block count"):
        decode_header(obj)


def test_payload_length_overflow() -> None:
    with pytest.raises(HeaderFieldError, match="payload length"):
        decode_header(edited(16, "<Q", 2**64 - 4))


def test_payload_length_not_divisible_by_blocks() -> None:
    with pytest.raises(HeaderFieldError, match="payload length"):
        decode_header(edited(16, "<Q", 4097))


def test_payload_offset_points_elsewhere() -> None:
    with pytest.raises(HeaderFieldError, match="payload offset"):
        decode_header(edited(12, "<I", 0))


def test_payload_pointing_outside_object() -> None:
    obj = edited(16, "<Q", 8192)  # header claims twice the payload that is there
    with pytest.raises(TruncatedObjectError):
        decode_header(obj, object_length=len(obj))


def test_layer_range_inconsistent_with_blocks() -> None:
    with pytest.raises(HeaderFieldError, match="do not match"):
        decode_header(edited(40, "<I", 40))


def test_bad_kv_planes() -> None:
    with pytest.raises(HeaderFieldError, match="kv planes"):
        decode_header(edited(10, "<H", 3))


def test_bad_hash_length() -> None:
    with pytest.raises(HeaderFieldError, match="page hash length"):
        decode_header(edited(32, "<B", 20))


def test_reserved_not_zero() -> None:
    with pytest.raises(HeaderFieldError, match="reserved"):
        decode_header(edited(52, "<I", 1))


def test_key_mismatch_page_hash() -> None:
    other = ObjectKey("1f" * 32, KEY.namespace_digest, KEY.coords)
    with pytest.raises(KeyMismatchError, match="asked for"):
        decode_header(encode_object(KEY, PAYLOAD, 2), expected=other)


def test_key_mismatch_namespace() -> None:
    other = ObjectKey(KEY.page_hash, "fedcba9876543210", KEY.coords)
    with pytest.raises(KeyMismatchError):
        decode_header(encode_object(KEY, PAYLOAD, 2), expected=other)


def test_key_mismatch_coordinates() -> None:
    other = ObjectKey(KEY.page_hash, KEY.namespace_digest, ObjectCoords(30, 34, 3))
    with pytest.raises(KeyMismatchError):
        decode_header(encode_object(KEY, PAYLOAD, 2), expected=other)


@pytest.mark.parametrize("other", [
    ObjectKey("1f" * 32, KEY.namespace_digest, KEY.coords),
    ObjectKey(KEY.page_hash, "fedcba9876543210", KEY.coords),
    ObjectKey(KEY.page_hash, KEY.namespace_digest, ObjectCoords(30, 34, 3)),
])
def test_a_storage_key_is_matched_as_its_parsed_key(other: ObjectKey) -> None:
    # Tools pass the storage key itself (no parse per object): the same verdicts.
    data = encode_object(KEY, PAYLOAD, 2)
    assert decode_header(data, expected=format_key(KEY)).key() == KEY
    with pytest.raises(KeyMismatchError, match="asked for"):
        decode_header(data, expected=format_key(other))
    assert decode_header(data).storage_key() == format_key(KEY)


def test_payload_bit_flip() -> None:
    obj = bytearray(encode_object(KEY, PAYLOAD, 2))
    obj[-1] ^= 0x80
    with pytest.raises(PayloadChecksumError, match="layer 33"):
        decode_object(obj, expected=KEY)


def test_every_corruption_is_a_corrupt_object_error() -> None:
    obj = encode_object(KEY, PAYLOAD, 2)
    for i in range(0, 200, 3):
        damaged = bytearray(obj)
        damaged[i] ^= 0xFF
        with pytest.raises(CorruptObjectError):
            decode_object(damaged, expected=KEY)


def test_encode_rejects_payload_not_splitting_into_layers() -> None:
    with pytest.raises(ValueError, match="layer blocks"):
        encode_header(KEY, b"x" * 4097, 2)


@settings(max_examples=60, deadline=None)
@given(
    page_hash=st.sampled_from(["00" * 16, "ab" * 16, "cd" * 32, "ff" * 32]),
    layer_start=st.integers(0, 2000),
    num_layers=st.integers(1, 40),
    group=st.one_of(st.none(), st.integers(0, 1000)),
    component=st.integers(0, 999),
    block=st.integers(1, 64),
    kv_planes=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_round_trip_property(
    page_hash: str,
    layer_start: int,
    num_layers: int,
    group: int | None,
    component: int,
    block: int,
    kv_planes: int,
    data: st.DataObject,
) -> None:
    key = ObjectKey(
        page_hash,
        "00ff00ff00ff00ff",
        ObjectCoords(layer_start, layer_start + num_layers, group, component),
    )
    payload = data.draw(st.binary(min_size=block * num_layers, max_size=block * num_layers))
    obj = encode_object(key, payload, kv_planes)
    header, body = decode_object(obj, expected=key)
    assert header.key() == key
    assert header.kv_planes == kv_planes
    assert bytes(body) == payload
    assert encode_header(key, payload, kv_planes) == obj[: header.payload_offset]


def test_nonzero_padding() -> None:
    obj = bytearray(encode_object(KEY, PAYLOAD, 2))
    obj[4000] = 1
    with pytest.raises(HeaderFieldError, match="padding"):
        decode_header(obj)


def test_header_without_its_padding_is_truncated() -> None:
    with pytest.raises(TruncatedObjectError, match="of 4096 bytes"):
        decode_header(encode_object(KEY, PAYLOAD, 2)[:200])


def test_parent_link_round_trip() -> None:
    parent = "1e" * 32
    header, _ = decode_object(encode_object(KEY, PAYLOAD, 2, parent_hash=parent), expected=KEY)
    assert header.parent_hash == parent
    assert decode_object(encode_object(KEY, PAYLOAD, 2))[0].parent_hash is None


def test_bad_parent_hash_length() -> None:
    with pytest.raises(HeaderFieldError, match="parent hash length"):
        decode_header(edited(33, "<B", 7))


def test_parent_hash_must_be_a_page_hash() -> None:
    with pytest.raises(ValueError, match="page hash"):
        encode_header(KEY, PAYLOAD, 2, parent_hash="../x")
