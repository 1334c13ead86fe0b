"""View rewrites that make the torch reference's index ops stream memory like a copy.

Both rewrites change only how the same elements are described, never which elements: they
apply identically to the pool side and the staging side of a copy, so element ``i`` of one
still pairs with element ``i`` of the other.

* ``widen``: reinterpret the contiguous innermost axis as wider integers (up to 8 bytes), so
  an index op moves a quarter (bf16) or an eighth (fp8) as many elements.
* ``coalesce``: merge neighbouring axes that are contiguous with each other on *both* sides
  (after the leading index axes), so the op iterates over a few long runs instead of many
  short ones; a whole page of one (layer, plane) becomes a single run when the head run spans
  the pool's heads.
"""

from __future__ import annotations

import torch

_WORDS: tuple[tuple[int, torch.dtype], ...] = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def widen(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` viewed with the widest integer word their layouts allow (or unchanged)."""
    item = a.element_size()
    for size, dtype in _WORDS:
        if size <= item:
            break
        if (a.shape[-1] * item) % size:
            continue
        try:
            return a.view(dtype), b.view(dtype)
        except RuntimeError:
            # a stride or offset that is not a multiple of the word: try a narrower one
            continue
    return a, b


def coalesce(
    a: torch.Tensor, b: torch.Tensor, lead_a: int, lead_b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the trailing axes (after ``lead_a`` / ``lead_b`` index axes) where both allow it.

    The trailing shapes of ``a`` and ``b`` must be equal. Axes of size 1 are dropped; axis
    ``i`` merges into axis ``i + 1`` when ``stride[i] == stride[i + 1] * size[i + 1]`` holds
    for both tensors.
    """
    shape = list(a.shape[lead_a:])
    assert shape == list(b.shape[lead_b:])
    sa, sb = list(a.stride()[lead_a:]), list(b.stride()[lead_b:])
    dims = [i for i, n in enumerate(shape) if n != 1] or [len(shape) - 1]
    out_shape, out_a, out_b = [shape[dims[-1]]], [sa[dims[-1]]], [sb[dims[-1]]]
    for i in reversed(dims[:-1]):
        if sa[i] == out_a[0] * out_shape[0] and sb[i] == out_b[0] * out_shape[0]:
            out_shape[0] *= shape[i]
        else:
            out_shape.insert(0, shape[i])
            out_a.insert(0, sa[i])
            out_b.insert(0, sb[i])
    a2 = a.as_strided(
        (*a.shape[:lead_a], *out_shape), (*a.stride()[:lead_a], *out_a), a.storage_offset()
    )
    b2 = b.as_strided(
        (*b.shape[:lead_b], *out_shape), (*b.stride()[:lead_b], *out_b), b.storage_offset()
    )
    return a2, b2
