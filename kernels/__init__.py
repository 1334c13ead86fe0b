"""Pack / unpack kernels between an engine's KV pools and the unified page layout.

Public API (contracts in ``reference``, the torch specification):

* ``DevicePool.mha(k_buffers, v_buffers)`` / ``DevicePool.mla(kv_buffers)``: an engine's
  per-layer device buffers ``[num_slots, local_kv_heads, head_dim]`` (MLA ``[num_slots, 1,
  kv_dim]``) for one shard.
* ``HostPool(buffer, PoolLayout)``: an SGLang host pool (``layer_first``, ``page_first``,
  ``page_first_direct``, ``page_head``; MHA and MLA).
* ``pack_pages(pool, pages, staging, layout)`` / ``unpack_pages(staging, pool, pages, layout,
  layers=...)``: device pool <-> unified pages in a caller-owned staging buffer.
* ``host_to_unified(host, pages, staging, layout)`` / ``unified_to_host(staging, host, pages,
  layout)``: SGLang host layouts <-> unified pages.

Every op takes ``backend="auto" | "torch" | "triton"``; ``reference`` and ``triton_ops`` hold
the two implementations with identical signatures. Importing this package needs torch but not
triton and not CUDA.
"""

from __future__ import annotations

from .ops import Backend, host_to_unified, pack_pages, unified_to_host, unpack_pages
from .pools import SUPPORTED_DTYPES, DevicePool, HostPool

__all__ = [
    "SUPPORTED_DTYPES",
    "Backend",
    "DevicePool",
    "HostPool",
    "host_to_unified",
    "pack_pages",
    "unified_to_host",
    "unpack_pages",
]
