"""A msgpack decoder written from the msgpack specification, for the KV event tests.

Independent of the encoder in ``hicache_store.events.wire`` and of any msgpack package: what a
router's own decoder would do. Covers the types the spec defines except ext and timestamps
(which the events never use: the decoder raises on them).
"""

from __future__ import annotations

import struct
from typing import Any


def unpack(data: bytes) -> Any:
    """The one value ``data`` encodes; trailing bytes are an error."""
    value, end = _value(data, 0)
    if end != len(data):
        raise ValueError(f"{len(data) - end} bytes after the value")
    return value


def _take(data: bytes, at: int, n: int) -> bytes:
    if at + n > len(data):
        raise ValueError("truncated")
    return data[at:at + n]


def _value(data: bytes, at: int) -> tuple[Any, int]:
    code = _take(data, at, 1)[0]
    at += 1
    if code <= 0x7F:
        return code, at
    if code >= 0xE0:
        return code - 0x100, at
    if 0x80 <= code <= 0x8F:
        return _map(data, at, code & 0x0F)
    if 0x90 <= code <= 0x9F:
        return _array(data, at, code & 0x0F)
    if 0xA0 <= code <= 0xBF:
        n = code & 0x1F
        return _take(data, at, n).decode("utf-8"), at + n
    fixed = {0xC0: None, 0xC2: False, 0xC3: True}
    if code in fixed:
        return fixed[code], at
    ints = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
            0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q", 0xCA: ">f", 0xCB: ">d"}
    if code in ints:
        fmt = ints[code]
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, _take(data, at, size))[0], at + size
    lengths = {0xC4: (1, "bin"), 0xC5: (2, "bin"), 0xC6: (4, "bin"),
               0xD9: (1, "str"), 0xDA: (2, "str"), 0xDB: (4, "str"),
               0xDC: (2, "array"), 0xDD: (4, "array"), 0xDE: (2, "map"), 0xDF: (4, "map")}
    if code not in lengths:
        raise ValueError(f"type byte 0x{code:02x} is not used by KV events")
    width, kind = lengths[code]
    n = int.from_bytes(_take(data, at, width), "big")
    at += width
    if kind == "array":
        return _array(data, at, n)
    if kind == "map":
        return _map(data, at, n)
    raw = _take(data, at, n)
    return (raw if kind == "bin" else raw.decode("utf-8")), at + n


def _array(data: bytes, at: int, n: int) -> tuple[list[Any], int]:
    out = []
    for _ in range(n):
        item, at = _value(data, at)
        out.append(item)
    return out, at


def _map(data: bytes, at: int, n: int) -> tuple[dict[Any, Any], int]:
    out = {}
    for _ in range(n):
        key, at = _value(data, at)
        out[key], at = _value(data, at)
    return out, at
