"""Stored objects: the one framed-object I/O path, above ``backends`` and below everything else.

* ``format``: ``ObjectFormat`` (how a payload becomes a stored object: key, header, seal, open),
  ``FRAMED``, this library's format (``layout.framing``), ``PAGE_UNIFIED``, SGLang's bare
  ``page-unified-v1`` objects, and ``format_for`` (which one a namespace uses).
* ``io``: ``ObjectIO``, framed writes in place in the caller's staging and verified reads
  (whole frame, layer range), under byte budgets and a ``Deadline`` (a floor plus a minimum
  bandwidth); ``Frame``, ``IOStats``, ``ByteBudget``.
* ``pages``: ``L3Link``, a rank's host pages to and from the objects its plans name.
* ``arena``: ``Arena``, reused page-aligned staging slots.
* ``sealed``: ``SealedFormat``, the format of a sealed namespace (keyed names, AES-GCM blocks).

Users: the cache tier (pages and component state), the SGLang adapter, ``prepopulate``,
context-parallel restore, and the operator tools (``read_headers`` / ``read_object``).
"""

from __future__ import annotations

from .arena import Arena
from .format import FRAMED, PAGE_UNIFIED, FramedFormat, ObjectFormat, PageUnifiedFormat, format_for
from .io import (
    DEFAULT_IO_TIMEOUT_S,
    DEFAULT_MIN_BANDWIDTH_MIB_S,
    ByteBudget,
    Deadline,
    Frame,
    IOStats,
    ObjectIO,
    PendingFrames,
    PendingFrameWrites,
    start_write_together,
)
from .pages import (
    FrameRows,
    L3Link,
    PageWrite,
    PendingPages,
    PendingPageWrites,
    start_write_links,
)
from .sealed import SealedFormat

__all__ = [
    "DEFAULT_IO_TIMEOUT_S",
    "DEFAULT_MIN_BANDWIDTH_MIB_S",
    "FRAMED",
    "Arena",
    "ByteBudget",
    "Deadline",
    "Frame",
    "FramedFormat",
    "FrameRows",
    "IOStats",
    "L3Link",
    "PendingPageWrites",
    "PendingPages",
    "ObjectFormat",
    "ObjectIO",
    "PAGE_UNIFIED",
    "PageWrite",
    "PendingFrames",
    "PendingFrameWrites",
    "PageUnifiedFormat",
    "format_for",
    "SealedFormat",
    "start_write_links",
    "start_write_together",
]
