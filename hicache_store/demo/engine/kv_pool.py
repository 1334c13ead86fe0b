"""The mini engine's device KV pool (L1): per-layer K and V buffers plus a page allocator.

Format: for each layer ``l``, ``k_buffers[l]`` and ``v_buffers[l]`` are separate tensors of shape
``[num_slots, num_kv_heads, head_dim]`` with ``num_slots = num_pages * page_size``; token slot
``s`` of page ``p`` is ``p * page_size + s``. This is exactly the MHA device-pool format of
``hicache_store.kernels`` (``DevicePool.mha(pool.k_buffers, pool.v_buffers)``), so the cache tier
packs and unpacks pages of this pool with the kernels as they are.

Allocation is by page. ``alloc(n)`` hands out ``n`` free pages (lowest indices first on a fresh
pool, most recently freed first afterwards) or raises ``PoolExhaustedError`` without allocating
anything; the pool never evicts: making room is the cache tier's job. ``free`` returns pages and
refuses pages that are out of range, duplicated or not allocated. The allocator is thread-safe;
the buffers themselves are not guarded (the tier and the model write disjoint slots).

Buffers are zero-initialised, so a slot that was never written reads as zeros (never garbage
from an earlier process).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from hicache_store.demo.engine.config import SUPPORTED_DTYPES, MiniLlamaConfig
from hicache_store.layout.errors import HiCacheStoreError


class PoolExhaustedError(HiCacheStoreError):
    """``alloc`` asked for more pages than are free; nothing was allocated.

    ``requested`` and ``available`` say by how much; the tier evicts and retries.
    """

    def __init__(self, requested: int, available: int, num_pages: int) -> None:
        self.requested = requested
        self.available = available
        super().__init__(
            f"device KV pool exhausted: requested {requested} pages, "
            f"{available} free of {num_pages}",
            operation="alloc",
        )


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return SUPPORTED_DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype must be a torch.dtype or one of {', '.join(SUPPORTED_DTYPES)}, got {dtype!r}"
        ) from None


class DeviceKVPool:
    """Paged K/V storage for ``num_layers`` layers on one device.

    Attributes: ``k_buffers`` / ``v_buffers`` (lists of ``[num_slots, num_kv_heads, head_dim]``
    tensors, one per layer), ``num_layers``, ``num_kv_heads``, ``head_dim``, ``num_pages``,
    ``page_size``, ``num_slots``, ``dtype``, ``device``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_pages", num_pages),
            ("page_size", page_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.dtype = _as_dtype(dtype)
        self.device = torch.device(device)
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k_buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)
        ]
        self._lock = threading.Lock()
        # A stack: the next page handed out is the last element (page 0 first on a fresh pool).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._allocated = bytearray(num_pages)  # 1 where the page is allocated

    @classmethod
    def for_model(
        cls,
        config: MiniLlamaConfig,
        *,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        num_layers: int | None = None,
    ) -> DeviceKVPool:
        """A pool with the geometry and dtype ``config``'s model reads and writes: its KV heads,
        head dim and dtype, and its full-attention layers (sliding-window layers keep their
        KV elsewhere) unless ``num_layers`` says how many layers of that shape to hold."""
        return cls(
            num_layers=len(config.full_layers) if num_layers is None else num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            num_pages=num_pages,
            page_size=page_size,
            dtype=config.torch_dtype,
            device=device,
        )

    # -- geometry ------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V over all layers for one token slot."""
        itemsize = torch.finfo(self.dtype).bits // 8
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    # -- allocator -----------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free pages, now allocated; ``PoolExhaustedError`` (allocating none) if fewer."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        with self._lock:
            if n > len(self._free):
                raise PoolExhaustedError(n, len(self._free), self.num_pages)
            pages = self._free[len(self._free) - n :][::-1]
            del self._free[len(self._free) - n :]
            for page in pages:
                self._allocated[page] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return allocated pages to the pool.

        All-or-nothing: a page out of range, listed twice, or not currently allocated raises
        ``ValueError`` and frees nothing. The pages' contents are left as they are.
        """
        pages = [int(p) for p in pages]
        with self._lock:
            seen: set[int] = set()
            for page in pages:
                if not 0 <= page < self.num_pages:
                    raise ValueError(f"pages: page {page} out of range [0, {self.num_pages})")
                if page in seen:
                    raise ValueError(f"pages: page {page} listed twice")
                if not self._allocated[page]:
                    raise ValueError(f"pages: page {page} is not allocated (double free?)")
                seen.add(page)
            for page in pages:
                self._allocated[page] = 0
            # Reversed so the first page given is the first handed out again.
            self._free.extend(reversed(pages))

    def is_allocated(self, page: int) -> bool:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} out of range [0, {self.num_pages})")
        return bool(self._allocated[page])

    # -- slots ---------------------------------------------------------------------------------

    def slots_of(self, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token slot indices of ``pages`` in order: an int64 tensor of ``len(pages) * page_size``
        on the pool's device. Page ``p`` contributes ``p*page_size .. p*page_size+page_size-1``.

        A request of ``n`` tokens uses ``slots_of(pages)[:n]``; ``ValueError`` for a page out of
        range.
        """
        pages_t = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
        if pages_t.numel():
            lo, hi = int(pages_t.min()), int(pages_t.max())
            if lo < 0 or hi >= self.num_pages:
                bad = lo if lo < 0 else hi
                raise ValueError(f"pages: page {bad} out of range [0, {self.num_pages})")
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        slots = (pages_t[:, None] * self.page_size + offsets[None, :]).reshape(-1)
        return slots.to(self.device)

    def __repr__(self) -> str:
        return (
            f"DeviceKVPool(layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, pages={self.num_pages}x{self.page_size}, "
            f"dtype={self.dtype}, device={self.device}, free={self.num_free_pages})"
        )
