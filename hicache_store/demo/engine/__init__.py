"""The mini engine the cache tier drives: a seeded Llama-style decoder over a paged KV pool.

* ``MiniLlamaConfig`` (``config``): hyper-parameters and presets (``tiny``, ``bench``).
* ``DeviceKVPool`` (``kv_pool``): per-layer K/V buffers ``[num_slots, kv_heads, head_dim]`` in the
  kernels' device-pool format, with a page allocator.
* ``MiniLlama`` (``model``): ``forward_full`` (reference) and ``prefill`` over a cached prefix,
  bit-exact with each other; sliding-window layers keep their KV in a ``WindowKV``.
"""

from __future__ import annotations

from hicache_store.demo.engine.config import PRESETS, MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool, PoolExhaustedError
from hicache_store.demo.engine.model import MiniLlama, WaitLayer, WindowKV

__all__ = [
    "PRESETS",
    "DeviceKVPool",
    "MiniLlama",
    "MiniLlamaConfig",
    "PoolExhaustedError",
    "WaitLayer",
    "WindowKV",
]
