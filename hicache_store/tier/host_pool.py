"""The L2 host pool: whole pages in the ``page_unified`` layout, one row per page.

Each row holds one page of the rank's shard exactly as ``UnifiedPageLayout`` lays it out, so
every stored object of the page is one contiguous slice of a row and moves to or from L3
without a relayout. Rows are pinned when CUDA is available (fast, asynchronous H2D/D2H).

The pool only allocates; the tier decides what lives where. ``used`` is what the leak checks
compare against the tree's references.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch


class HostPagePool:
    """``num_pages`` rows of ``page_bytes`` bytes, with an all-or-nothing allocator."""

    def __init__(self, num_pages: int, page_bytes: int, *, pin: bool | None = None) -> None:
        if num_pages < 0 or page_bytes < 1:
            raise ValueError(f"host pool: {num_pages} pages of {page_bytes} bytes")
        pin = torch.cuda.is_available() if pin is None else pin
        self.page_bytes = page_bytes
        self.data = torch.empty((num_pages, page_bytes), dtype=torch.uint8, pin_memory=pin)
        self._array: npt.NDArray[np.uint8] = self.data.numpy()
        self._free = list(range(num_pages - 1, -1, -1))
        self._in_use: set[int] = set()

    @property
    def num_pages(self) -> int:
        return int(self.data.shape[0])

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._in_use)

    def alloc(self, count: int) -> list[int] | None:
        """``count`` free rows, or None (and nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        pages = sorted(self._free.pop() for _ in range(count))  # ascending: runs of rows
        self._in_use.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._in_use:
                raise ValueError(f"host page {page} freed twice or never allocated")
            self._in_use.remove(page)
            self._free.append(page)

    def row(self, page: int) -> npt.NDArray[np.uint8]:
        """A writable numpy view of one row (shares memory with ``data``)."""
        row: npt.NDArray[np.uint8] = self._array[page]
        return row
