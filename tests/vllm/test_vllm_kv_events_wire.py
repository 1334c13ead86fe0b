"""``hicache_store.events.wire`` decodes unchanged with vLLM 0.32's own ``KVEventBatch``.

vLLM's subscribers decode a batch with ``msgspec.msgpack.Decoder(KVEventBatch)``
(``vllm.distributed.kv_events``); whatever they get back must be the events we meant.
"""

from __future__ import annotations

import msgspec
from vllm.distributed import kv_events as vk

from hicache_store.events.wire import (
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
    encode_seq,
)


def test_a_batch_of_every_event_type_decodes_with_vllms_classes() -> None:
    stored = BlockStored(block_hashes=(11, 12), parent_block_hash=10, token_ids=tuple(range(8)),
                         block_size=4, medium=MEDIUM_STORAGE)
    removed = BlockRemoved(block_hashes=(12,), medium=MEDIUM_STORAGE)
    raw = encode_batch(1234.5, [stored, removed, AllBlocksCleared()], dp_rank=0)
    batch = msgspec.msgpack.Decoder(vk.KVEventBatch).decode(raw)
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 0
    got_stored, got_removed, got_cleared = batch.events
    assert isinstance(got_stored, vk.BlockStored)
    assert list(got_stored.block_hashes) == [11, 12] and got_stored.parent_block_hash == 10
    assert list(got_stored.token_ids) == list(range(8)) and got_stored.block_size == 4
    assert got_stored.medium == MEDIUM_STORAGE
    assert isinstance(got_removed, vk.BlockRemoved)
    assert list(got_removed.block_hashes) == [12] and got_removed.medium == MEDIUM_STORAGE
    assert isinstance(got_cleared, vk.AllBlocksCleared)


def test_byte_hashes_and_no_rank_decode_too() -> None:
    digest = bytes(range(32))
    raw = encode_batch(1.0, [BlockRemoved(block_hashes=(digest,), medium=None)])
    batch = msgspec.msgpack.Decoder(vk.KVEventBatch).decode(raw)
    assert batch.data_parallel_rank is None
    (event,) = batch.events
    assert list(event.block_hashes) == [digest]


def test_the_sequence_frame_is_eight_big_endian_bytes() -> None:
    assert encode_seq(5) == (5).to_bytes(8, "big", signed=True)
    assert int.from_bytes(encode_seq(-1), "big", signed=True) == -1
