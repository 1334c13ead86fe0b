"""The request path's records: what ``HiCache.match`` returns and ``prepare`` hands the
engine, the engine pool the tier allocates L1 pages from, and the slots of a request's pages."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .hints import RequestHints
from .pools import LayerLoad
from .radix import PageNode
from .transfers import Prefetch


def page_slots(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """Token slots of device ``pages`` in order: page ``p`` holds slots
    ``p * page_size .. p * page_size + page_size - 1``."""
    return (
        torch.tensor(list(pages), dtype=torch.int64).repeat_interleave(page_size) * page_size
        + torch.arange(page_size, dtype=torch.int64).repeat(len(pages))
    )


class TierCapacityError(RuntimeError):
    """L1 cannot hold what one request needs, even after evicting everything unlocked."""


class DevicePagePool(Protocol):
    """What the tier needs from an engine's KV pool (L1): paged K/V buffers and an allocator."""

    page_size: int
    num_pages: int

    @property
    def k_buffers(self) -> Sequence[torch.Tensor]: ...

    @property
    def v_buffers(self) -> Sequence[torch.Tensor]: ...

    @property
    def num_free_pages(self) -> int: ...

    def alloc(self, count: int) -> list[int]: ...

    def free(self, pages: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class ComponentSlots:
    """A component's L1 slots for one request (page indices count from the prompt's start).

    ``restored``: (page index, slot) of the objects the resume needs, in L1 now (for a
    checkpoint: the snapshot after that page). ``produce``: (page index, slot) the engine fills
    while computing (a checkpoint after that page; a window or draft page).
    """

    restored: tuple[tuple[int, int], ...] = ()
    produce: tuple[tuple[int, int], ...] = ()


@dataclass
class Request:
    """One request's state between ``match`` and ``complete``.

    ``bookkeeping_s``: time the tier spent on the engine thread deciding (matching, planning,
    scheduling), excluding ``io_s``: time spent moving data or waiting for the backend
    (existence checks, L1 <-> L2 copies), and excluding prefetch waits.
    """

    tokens: torch.Tensor
    hashes: list[str]
    nodes: list[PageNode]
    l1_pages: int
    l2_pages: int
    need: tuple[int, ...] = ()
    branches: tuple[int, ...] = ()
    prefetch: Prefetch | None = None
    l3_pages: int = 0
    prefix_pages: int = 0
    new_device_pages: list[int] = field(default_factory=list)
    loading: list[PageNode] = field(default_factory=list)
    host_locked: list[PageNode] = field(default_factory=list)
    load: LayerLoad | None = None
    borrowed: list[tuple[PageNode, LayerLoad]] = field(default_factory=list)
    components: dict[str, ComponentSlots] = field(default_factory=dict)
    held: list[tuple[PageNode, int]] = field(default_factory=list)
    pinned: list[tuple[PageNode, int]] = field(default_factory=list)
    l3_found: dict[int, list[bool]] = field(default_factory=dict)
    l3_kv_pages: int = 0
    rounds: int = 0
    hints: RequestHints | None = None
    pin_reserved: int = 0
    bookkeeping_s: float = 0.0
    io_s: float = 0.0


@dataclass(frozen=True)
class Prepared:
    """What the engine needs to compute a request: where to start, where KV lives, and each
    component's slots."""

    start: int
    slots: torch.Tensor
    wait_layer: Callable[[int], None] | None
    components: Mapping[str, ComponentSlots] = field(default_factory=dict)


def tokens_digest(tokens: torch.Tensor) -> str:
    """A short digest of a request's tokens (an argument of its logged decisions)."""
    data = tokens.to(torch.int64).numpy().astype("<u4").tobytes()
    return hashlib.sha256(data).hexdigest()[:12]


@contextlib.contextmanager
def timed_io(req: Request) -> Iterator[None]:
    """Count the enclosed time as the request's I/O (data movement), not bookkeeping."""
    started = time.perf_counter()
    try:
        yield
    finally:
        req.io_s += time.perf_counter() - started
