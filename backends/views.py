"""Caller buffers as flat byte views: what every backend's core receives.

The public methods of ``Backend`` turn each caller buffer (anything exporting the buffer
protocol: ``bytearray``, ``memoryview``, a numpy array, an ``mmap``) into a flat, C-contiguous
``memoryview`` of unsigned bytes before the core runs, so a core never sees shapes, strides or
item sizes. No copy is made: a read lands in the caller's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    from typing_extensions import Buffer

    #: what callers may pass as a buffer: anything exporting the buffer protocol.
    BufferLike: TypeAlias = Buffer | np.ndarray[Any, Any]


def as_byte_view(buffer: BufferLike, *, writable: bool, what: str = "buffer") -> memoryview:
    """A flat byte view of a caller's buffer (no copy). Refuses non-contiguous memory."""
    view = memoryview(buffer)  # type: ignore[arg-type]  # ndarray exports the buffer protocol
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise ValueError(f"{what} is read-only; reads need writable memory")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def scatter_views(views: Sequence[memoryview], length: int) -> list[memoryview]:
    """The leading ``length`` bytes of ``views`` taken in order, as non-empty views.

    Later views are cut or dropped so the result covers exactly ``length`` bytes (raises
    ``ValueError`` when the views hold fewer). What a scatter read fills, and nothing more.
    """
    parts: list[memoryview] = []
    left = length
    for view in views:
        if left == 0:
            break
        take = min(left, len(view))
        if take:
            parts.append(view[:take])
            left -= take
    if left:
        raise ValueError(f"buffers hold {length - left} of the {length} bytes to scatter")
    return parts


def is_buffer(obj: object) -> bool:
    """Whether ``obj`` itself exports the buffer protocol (a numpy array, an mmap...)."""
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


__all__ = ["as_byte_view", "is_buffer", "scatter_views"]
