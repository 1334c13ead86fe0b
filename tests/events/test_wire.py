"""The encoder's bytes decode with an independent msgpack decoder to the documented maps."""

from __future__ import annotations

import msgpack

from hicache_store.events.wire import (
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
    encode_seq,
)


def test_batch_round_trip() -> None:
    stored = BlockStored((1, 2**64 - 1, b"\x01" * 32), None, tuple(range(300)), 100, MEDIUM_STORAGE)
    raw = encode_batch(1.5, [stored, BlockRemoved((7,), "CPU"), AllBlocksCleared()], dp_rank=3)
    ts, events, rank = msgpack.unpackb(raw, raw=False)
    assert (ts, rank) == (1.5, 3)
    assert events[0] == {"type": "BlockStored", "block_hashes": [1, 2**64 - 1, b"\x01" * 32],
                         "parent_block_hash": None, "token_ids": list(range(300)),
                         "block_size": 100, "lora_id": None, "medium": "STORAGE",
                         "lora_name": None}
    assert next(iter(events[0])) == "type"
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_ints_and_lengths_at_every_boundary() -> None:
    values = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, -1, -32, -33, -128, -129,
              -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]
    strings = ["a" * n for n in (0, 31, 32, 255, 256, 65536)]
    raw = encode_batch(0.0, [BlockStored(tuple(v for v in values if v >= 0), None,
                                         tuple(values), 1, "x" * 40, lora_name=strings[-1])])
    event = msgpack.unpackb(raw, raw=False)[1][0]
    assert event["token_ids"] == values and event["lora_name"] == strings[-1]
    assert len(msgpack.unpackb(raw)) == 2  # no rank: a two-element batch


def test_seq_frame() -> None:
    assert encode_seq(5) == (5).to_bytes(8, "big")
    assert encode_seq(-1) == b"\xff" * 8
