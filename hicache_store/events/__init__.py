"""KV events in vLLM's wire format (``kv_events``, vLLM 0.32+ map encoding).

``wire`` encodes events and batches (pure functions, no I/O); ``publisher`` sends them on a
ZMQ PUB socket with a replay ROUTER, as vLLM's ``ZmqEventPublisher`` does (pyzmq: the
``events`` extra, imported only when a publisher is built).
"""

from __future__ import annotations

from hicache_store.events.wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    encode_batch,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "encode_batch",
]
