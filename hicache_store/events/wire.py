"""The bytes of vLLM's KV events (vLLM 0.32+, tagged-map encoding), written from its spec.

A batch is the msgpack array ``[ts, events]`` (``[ts, events, dp_rank]`` when a rank is set);
each event is a msgpack map whose first key ``"type"`` names it (``"BlockStored"``,
``"BlockRemoved"``, ``"AllBlocksCleared"``) followed by its fields by name. Fields without a
default in vLLM's classes are always present (``None`` encodes as nil); optional ones are
omitted when unset, which is what vLLM's own decoder expects. A block hash is an unsigned int
(< 2**64) or bytes, as vLLM's ``ExternalBlockHash``.

The encoder is a small msgpack writer of our own (maps, arrays, ints, floats, str, bytes, nil,
bools) so the ``events`` extra needs only pyzmq. Its inverse is any msgpack decoder;
``tests/events`` holds one written from the msgpack spec and checks the round trip.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TypeAlias

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

BlockHash: TypeAlias = int | bytes
Packable: TypeAlias = (bool | int | float | str | bytes | list["Packable"]
                       | tuple["Packable", ...] | dict[str, "Packable"] | None)


@dataclass(frozen=True)
class BlockStored:
    """Pages now held at ``medium``: ``block_hashes[i]`` holds ``token_ids[i*block_size:
    (i+1)*block_size]``; ``parent_block_hash`` is the page before the first (None at the root).
    ``token_ids`` may be empty when the publisher must not reveal them (sealed namespaces)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Packable, ...] | None, ...] | None = None
    locality: str | None = None
    ownership: str | None = None

    def to_wire(self) -> dict[str, Packable]:
        out: dict[str, Packable] = {
            "type": "BlockStored",
            "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash,
            "token_ids": list(self.token_ids),
            "block_size": self.block_size,
            "lora_id": None,  # deprecated in vLLM, still a required field of its class
            "medium": self.medium,
            "lora_name": self.lora_name,
        }
        if self.extra_keys is not None:
            out["extra_keys"] = [None if k is None else list(k) for k in self.extra_keys]
        _optional(out, locality=self.locality, ownership=self.ownership)
        return out


@dataclass(frozen=True)
class BlockRemoved:
    """Pages no longer held at ``medium``."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    locality: str | None = None
    ownership: str | None = None

    def to_wire(self) -> dict[str, Packable]:
        out: dict[str, Packable] = {
            "type": "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium}
        _optional(out, locality=self.locality, ownership=self.ownership)
        return out


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every page the publisher reported is gone (vLLM's event has no medium)."""

    def to_wire(self) -> dict[str, Packable]:
        return {"type": "AllBlocksCleared"}


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


def _optional(out: dict[str, Packable], **fields: str | None) -> None:
    for name, value in fields.items():
        if value is not None:
            out[name] = value


def encode_batch(ts: float, events: list[Event], dp_rank: int | None = None) -> bytes:
    """The msgpack bytes of one ``KVEventBatch`` (the third frame of a published message)."""
    body: list[Packable] = [ts, [e.to_wire() for e in events]]
    if dp_rank is not None:
        body.append(dp_rank)
    out = bytearray()
    pack(body, out)
    return bytes(out)


def encode_seq(seq: int) -> bytes:
    """The second frame: the batch's sequence number, 8 bytes big-endian (-1: end of replay)."""
    return seq.to_bytes(8, "big", signed=True)


def pack(value: Packable, out: bytearray) -> None:
    """Append the msgpack encoding of ``value`` (smallest form of each int, float as float64)."""
    if value is None:
        out.append(0xC0)
    elif value is True:
        out.append(0xC3)
    elif value is False:
        out.append(0xC2)
    elif isinstance(value, int):
        _pack_int(value, out)
    elif isinstance(value, float):
        out += b"\xcb" + struct.pack(">d", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        n = len(raw)
        if n < 32:
            out.append(0xA0 | n)
        else:
            _pack_len(n, out, 0xD9, 0xDA, 0xDB)
        out += raw
    elif isinstance(value, bytes):
        _pack_len(len(value), out, 0xC4, 0xC5, 0xC6)
        out += value
    elif isinstance(value, (list, tuple)):
        n = len(value)
        if n < 16:
            out.append(0x90 | n)
        else:
            _pack_len(n, out, None, 0xDC, 0xDD)
        for item in value:
            pack(item, out)
    elif isinstance(value, dict):
        n = len(value)
        if n < 16:
            out.append(0x80 | n)
        else:
            _pack_len(n, out, None, 0xDE, 0xDF)
        for key, item in value.items():
            pack(key, out)
            pack(item, out)
    else:
        raise TypeError(f"kv events: cannot encode {type(value).__name__}")


def _pack_int(v: int, out: bytearray) -> None:
    if 0 <= v < 0x80:
        out.append(v)
    elif -32 <= v < 0:
        out.append(v & 0xFF)
    elif v >= 0:
        for code, fmt, bound in ((0xCC, ">B", 1 << 8), (0xCD, ">H", 1 << 16),
                                 (0xCE, ">I", 1 << 32), (0xCF, ">Q", 1 << 64)):
            if v < bound:
                out.append(code)
                out += struct.pack(fmt, v)
                return
        raise OverflowError(f"kv events: int {v} does not fit in 64 bits")
    else:
        for code, fmt, bound in ((0xD0, ">b", 1 << 7), (0xD1, ">h", 1 << 15),
                                 (0xD2, ">i", 1 << 31), (0xD3, ">q", 1 << 63)):
            if v >= -bound:
                out.append(code)
                out += struct.pack(fmt, v)
                return
        raise OverflowError(f"kv events: int {v} does not fit in 64 bits")


def _pack_len(n: int, out: bytearray, c8: int | None, c16: int, c32: int) -> None:
    if c8 is not None and n < 1 << 8:
        out.append(c8)
        out.append(n)
    elif n < 1 << 16:
        out.append(c16)
        out += struct.pack(">H", n)
    elif n < 1 << 32:
        out.append(c32)
        out += struct.pack(">I", n)
    else:
        raise OverflowError("kv events: a value longer than 2**32 cannot be encoded")
