"""Block-hash request traces: the record type and the readers of published formats.

A trace is a list of requests in arrival order. Each request names its prompt by one integer id
per block of ``block_tokens`` tokens (the last block may be partial); an id identifies the block
*and everything before it*, so two requests whose id lists start alike share that token prefix,
exactly like a page-hash chain with ``block_tokens``-token pages. No token content is published;
``trace_tokens`` synthesizes tokens that reproduce the sharing.

Formats (``TRACE_FORMATS``):

``mooncake``
    The Mooncake FAST'25 traces (kvcache-ai/Mooncake ``FAST25-release/traces``): JSON lines,
    optionally gzipped, each ``{"timestamp": ms, "input_length": n, "output_length": n,
    "hash_ids": [...]}``, with 512-token blocks.

Reading is strict: a line that is not such an object, a negative length, a ``hash_ids`` list
whose length does not match ``ceil(input_length / block_tokens)``, or timestamps that go
backwards raise ``TraceFormatError`` naming the file and line. A trace must be faithful or be
refused: a silently skipped line would change every hit rate computed from it.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: tokens per block of the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """A trace file is not in the format it was read as (names the file and line)."""


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival time, prompt and output lengths, and its block-hash chain."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    """A named trace: ``requests`` in arrival order, over blocks of ``block_tokens`` tokens."""

    name: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def block_accesses(self) -> int:
        return sum(len(r.hash_ids) for r in self.requests)

    @property
    def longest_blocks(self) -> int:
        """Blocks of the longest prompt (a cache must hold at least this to serve it)."""
        return max((len(r.hash_ids) for r in self.requests), default=0)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000


def _open_text(path: Path) -> io.TextIOBase:
    with path.open("rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    if gzipped:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return io.TextIOWrapper(path.open("rb"), encoding="utf-8")


def _int_field(record: dict[str, Any], name: str, where: str) -> int:
    value = record.get(name)
    # bool is an int subclass: a JSON true is not a length.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceFormatError(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def iter_mooncake(path: Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Iterator[TraceRequest]:
    """The requests of a Mooncake trace file (gzipped or plain JSON lines), checked as read."""
    last_ts = 0
    with _open_text(path) as lines:
        for number, line in enumerate(lines, 1):
            where = f"{path}:{number}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise TraceFormatError(f"{where}: expected a JSON object")
            ts = _int_field(record, "timestamp", where)
            length = _int_field(record, "input_length", where)
            output = _int_field(record, "output_length", where)
            ids = record.get("hash_ids")
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
            ):
                raise TraceFormatError(f"{where}: 'hash_ids' must be a list of non-negative ints")
            if len(ids) != -(-length // block_tokens):
                raise TraceFormatError(
                    f"{where}: {len(ids)} hash ids for input_length {length} "
                    f"(expected ceil({length}/{block_tokens}))"
                )
            if ts < last_ts:
                raise TraceFormatError(f"{where}: timestamp {ts} is before the previous {last_ts}")
            last_ts = ts
            yield TraceRequest(ts, length, output, tuple(ids))


def read_mooncake(path: Path) -> Trace:
    """A whole Mooncake trace (see ``iter_mooncake``), named after its file."""
    name = path.name.removesuffix(".gz").removesuffix(".jsonl")
    return Trace(name, MOONCAKE_BLOCK_TOKENS, tuple(iter_mooncake(path)))


#: trace readers by ``--format`` name.
TRACE_FORMATS: dict[str, Callable[[Path], Trace]] = {"mooncake": read_mooncake}


def read_trace(path: Path, fmt: str = "mooncake") -> Trace:
    """Read ``path`` as ``fmt`` (one of ``TRACE_FORMATS``)."""
    try:
        reader = TRACE_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"trace format {fmt!r} is not one of {', '.join(TRACE_FORMATS)}") from None
    return reader(path)


def check_chains(trace: Trace) -> None:
    """Raise ``TraceFormatError`` unless every hash id always follows the same id.

    That is what "an id identifies the block and everything before it" means; a trace that
    breaks it cannot be replayed faithfully (synthesized tokens would share a block the trace
    counts as shared, but the page-hash chain, which covers the whole prefix, would not).
    """
    parent: dict[int, int] = {}
    for number, request in enumerate(trace.requests, 1):
        previous = -1
        for block in request.hash_ids:
            known = parent.setdefault(block, previous)
            if known != previous:
                raise TraceFormatError(
                    f"{trace.name}: request {number}: hash id {block} follows {previous}, "
                    f"but {known} elsewhere"
                )
            previous = block
