"""Prefill-decode disaggregation with decode-side prefix reuse.

A prefill worker computes prompts; a decode worker generates from their KV. Without decode-side
reuse every turn of a conversation ships its whole history's KV to decode again. Here the decode
worker keeps a cache tier of its own (``hicache_store.tier``: L1 + L2, L3 spans once their
prefetch is accepted), matches each incoming prompt against it, restores what it holds and asks
prefill only for the KV after that page-aligned boundary (``decode_prefix_len``). Decoding starts
once both the local restore and the remote reception are done; a prefix it promised and could
not restore fails the request, which is retried without reuse.

* ``transport``: the data plane, one-sided writes into memory the peer registered
  (``Transport``; ``TcpTransport`` here, ``MooncakeTransport`` in ``mooncake``).
* ``protocol``: the control plane (handshake, per-request messages, the boundary arithmetic,
  the ``Channel`` they travel on).
* ``pages``: registered page rows (send staging, landing) and packing into them.
* ``prefill``: ``PrefillWorker``. ``decode``: ``DecodeWorker`` and ``Served``.
* ``state``: ``StateCodec``, model state beyond KV pages sent with each request (a hybrid
  model's fresh sliding-window tail).

``hicache-store bench pd`` (``hicache_store.demo.bench.pd``) runs both workers as processes with the
mini engine.
"""

from __future__ import annotations

from .decode import DecodeFailed, DecodeMetrics, DecodeWorker, Served
from .prefill import PrefillWorker
from .protocol import (
    Channel,
    ChannelClosed,
    ChannelListener,
    ProtocolError,
    check_boundary,
    suffix_pages,
)
from .state import StateCodec
from .transport import TcpTransport, Transport, TransportError, WriteOp, open_transport

__all__ = [
    "Channel",
    "ChannelClosed",
    "ChannelListener",
    "DecodeFailed",
    "DecodeMetrics",
    "DecodeWorker",
    "PrefillWorker",
    "ProtocolError",
    "Served",
    "StateCodec",
    "TcpTransport",
    "Transport",
    "TransportError",
    "WriteOp",
    "check_boundary",
    "open_transport",
    "suffix_pages",
]
