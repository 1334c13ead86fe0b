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

``weka``
    Agent sessions of the WEKA kv-cache-tester (callanjfox/kv-cache-tester ``traces/``): a
    folder, or a ``.tar.gz`` of one, of JSON files, one session each: ``{"id": ...,
    "block_size": 64, "hash_id_scope": "local", "requests": [...]}``; a request is ``{"t": s,
    "in": n, "out": n, "hash_ids": [...], "stop": reason, "api_time": s, ...}`` (``t`` from the
    session's start; ``hash_ids``: one id per *full* 64-token block, ``in // 64`` of them) or a
    subagent ``{"t": s, "type": "subagent", "agent_id": ..., "requests": [...]}`` whose requests'
    ``t`` count from the subagent's start. Replayed by the tester's rule (``read_weka``):
    sessions sorted by file name, session k starting at k x ``WEKA_SESSION_SPACING_S``; block
    ids made global as local id x sessions + k; requests in time order, ties in session order,
    then file order. Each request carries what an engine serving the sessions would know
    (``SessionFields``).

Reading is strict: a line that is not such an object, a negative length, a ``hash_ids`` list
whose length does not match ``ceil(input_length / block_tokens)``, or timestamps that go
backwards raise ``TraceFormatError`` naming the file and line. A trace must be faithful or be
refused: a silently skipped line would change every hit rate computed from it.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: tokens per block of the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512

#: seconds between the starts of consecutive sessions of a WEKA replay (the tester's rule).
WEKA_SESSION_SPACING_S = 30.0


class TraceFormatError(ValueError):
    """A trace file is not in the format it was read as (names the file and line)."""


@dataclass(frozen=True)
class SessionFields:
    """What an engine knows of a request's session when the request arrives.

    ``session``: the session's id; ``agent``: the subagent's id (None: the main conversation),
    so ``stream`` (``session`` or ``session/agent``) is one conversation whose requests extend
    one another. ``previous_stop`` and ``previous_end_ms``: how and when the previous response
    of the same stream ended (None for its first request); ``subagent_start``: the first
    request of a subagent. ``stop`` and ``end_ms`` are this request's own response: known
    only once it ends (a replay hands them over no earlier than ``end_ms``). The stop reason
    is ``""`` where the trace does not name one.
    """

    session: str
    agent: str | None
    stop: str
    end_ms: int
    previous_stop: str | None = None
    previous_end_ms: int | None = None
    subagent_start: bool = False

    @property
    def kind(self) -> str:
        """``main`` or ``subagent``."""
        return "main" if self.agent is None else "subagent"

    @property
    def stream(self) -> str:
        return self.session if self.agent is None else f"{self.session}/{self.agent}"


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival time, prompt and output lengths, its block-hash chain and, in
    traces of sessions, what the engine knows of its session."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: SessionFields | None = None


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


def _hash_ids_field(record: dict[str, Any], where: str) -> list[int]:
    """``record["hash_ids"]``: a list of non-negative ints (``TraceFormatError`` otherwise)."""
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of non-negative ints")
    return ids


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
            ids = _hash_ids_field(record, where)
            if len(ids) != -(-length // block_tokens):
                raise TraceFormatError(
                    f"{where}: {len(ids)} hash ids for input_length {length} "
                    f"(expected ceil({length}/{block_tokens}))"
                )
            if ts < last_ts:
                raise TraceFormatError(f"{where}: timestamp {ts} is before the previous {last_ts}")
            last_ts = ts
            yield TraceRequest(ts, length, output, tuple(ids))


def read_mooncake(path: Path, *, limit: int | None = None) -> Trace:
    """A Mooncake trace (see ``iter_mooncake``), named after its file: its first ``limit``
    requests (the file is in arrival order: reading stops there), or all of them."""
    name = path.name.removesuffix(".gz").removesuffix(".jsonl")
    return Trace(name, MOONCAKE_BLOCK_TOKENS, tuple(itertools.islice(iter_mooncake(path), limit)))


def _number_field(record: dict[str, Any], name: str, where: str, default: float | None) -> float:
    value = record.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise TraceFormatError(f"{where}: {name!r} must be a non-negative number, got {value!r}")
    return float(value)


def _weka_files(path: Path) -> list[tuple[str, Callable[[], bytes]]]:
    """(name, reader of its bytes) of every ``*.json`` session file of a folder or a tar
    archive, by name. A folder's files are read when asked for; an archive is unpacked whole
    (its order is not the name order)."""
    files: list[tuple[str, Callable[[], bytes]]] = []
    if path.is_dir():
        files = [(p.name, p.read_bytes) for p in path.iterdir() if p.suffix == ".json"]
    elif tarfile.is_tarfile(path):
        with tarfile.open(path) as archive:
            for member in archive.getmembers():
                if member.isfile() and member.name.endswith(".json"):
                    extracted = archive.extractfile(member)
                    if extracted is not None:
                        data = extracted.read()
                        files.append((member.name, lambda data=data: data))  # type: ignore[misc]
    else:
        raise TraceFormatError(f"{path}: not a folder or a tar archive of session files")
    names = [Path(name).name for name, _ in files]
    if len(set(names)) != len(names):
        raise TraceFormatError(f"{path}: two session files have the same name")
    if not files:
        raise TraceFormatError(f"{path}: no session files (*.json)")
    return sorted(files, key=lambda item: Path(item[0]).name)


def _weka_request(
    record: object, where: str, block_tokens: int
) -> tuple[float, int, int, list[int], str, float]:
    """(t, in, out, hash_ids, stop, api_time) of one plain request of a session file."""
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    t = _number_field(record, "t", where, None)
    length = _int_field(record, "in", where)
    output = _int_field(record, "out", where)
    ids = _hash_ids_field(record, where)
    if len(ids) != length // block_tokens:
        raise TraceFormatError(
            f"{where}: {len(ids)} hash ids for 'in' {length} "
            f"(expected {length} // {block_tokens}, one per full block)"
        )
    stop = record.get("stop")
    if stop is None:
        stop = ""
    if not isinstance(stop, str):
        raise TraceFormatError(f"{where}: 'stop' must be a string, got {stop!r}")
    api_time = _number_field(record, "api_time", where, 0.0)
    return t, length, output, ids, stop, api_time


def read_weka(
    path: Path, spacing_s: float = WEKA_SESSION_SPACING_S, *, limit: int | None = None
) -> Trace:
    """The sessions of a WEKA folder or ``.tar.gz`` as one trace, by the tester's rule (the
    module docstring). Every file read must be a session of the same block size with
    ``local`` ids; anything else raises ``TraceFormatError`` naming the file and request.

    ``limit``: only the first ``limit`` requests in arrival order. Session k starts at
    ``k * spacing_s`` and no request comes before its session's start, so reading stops
    after the first session past which ``limit`` requests have arrived (the block ids are
    those of the whole trace: they depend on the number of files, not on what is read)."""
    files = _weka_files(path)
    count = len(files)
    # (arrival s, session k, order in file) -> request; block ids interned per session, so a
    # block referenced by many requests is one int object.
    keyed: list[tuple[float, int, int, TraceRequest]] = []
    block_tokens: int | None = None
    for k, (name, read) in enumerate(files):
        if (limit is not None and len(keyed) >= limit
                and sum(1 for item in keyed if item[0] < k * spacing_s) >= limit):
            break  # every later request arrives after these
        where = f"{path}:{name}"
        try:
            document = json.loads(read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TraceFormatError(f"{where}: not JSON ({exc})") from None
        if not isinstance(document, dict):
            raise TraceFormatError(f"{where}: expected a JSON object")
        session = document.get("id")
        if not isinstance(session, str) or not session:
            raise TraceFormatError(f"{where}: 'id' must be a non-empty string")
        size = _int_field(document, "block_size", where)
        if size < 1 or (block_tokens is not None and size != block_tokens):
            raise TraceFormatError(
                f"{where}: 'block_size' {size} differs from the other sessions' {block_tokens}"
            )
        block_tokens = size
        if document.get("hash_id_scope") != "local":
            raise TraceFormatError(
                f"{where}: 'hash_id_scope' must be 'local', got {document.get('hash_id_scope')!r}"
            )
        requests = document.get("requests")
        if not isinstance(requests, list):
            raise TraceFormatError(f"{where}: 'requests' must be a list")
        start = k * spacing_s
        interned: dict[int, int] = {}
        # (arrival s, agent, start flag, fields of one request) in file order
        flat: list[tuple[float, str | None, bool, tuple[float, int, int, list[int], str, float]]]
        flat = []
        for number, record in enumerate(requests):
            at = f"{where}: request {number}"
            if isinstance(record, dict) and record.get("type") == "subagent":
                agent = record.get("agent_id")
                if not isinstance(agent, str) or not agent:
                    raise TraceFormatError(f"{at}: a subagent needs a non-empty 'agent_id'")
                origin = start + _number_field(record, "t", at, None)
                inner = record.get("requests")
                if not isinstance(inner, list):
                    raise TraceFormatError(f"{at}: a subagent's 'requests' must be a list")
                for sub, item in enumerate(inner):
                    sub_at = f"{at} (subagent {agent}), request {sub}"
                    if isinstance(item, dict) and item.get("type") == "subagent":
                        raise TraceFormatError(f"{sub_at}: subagents do not nest")
                    fields = _weka_request(item, sub_at, size)
                    flat.append((origin + fields[0], agent, sub == 0, fields))
            else:
                fields = _weka_request(record, at, size)
                flat.append((start + fields[0], None, False, fields))
        previous: dict[str | None, tuple[str, int]] = {}
        for order, (arrival, agent, first, fields) in enumerate(flat):
            _t, length, output, ids, stop, api_time = fields
            chain = tuple(
                interned.setdefault(i, i * count + k) for i in ids
            )
            arrival_ms = round(arrival * 1000)
            end_ms = round((arrival + api_time) * 1000)
            before = previous.get(agent)
            info = SessionFields(
                session, agent, stop, end_ms,
                previous_stop=None if before is None else before[0],
                previous_end_ms=None if before is None else before[1],
                subagent_start=first,
            )
            previous[agent] = (stop, end_ms)
            keyed.append((arrival, k, order, TraceRequest(arrival_ms, length, output, chain, info)))
    keyed.sort(key=lambda item: item[:3])
    name = path.name.removesuffix(".gz").removesuffix(".tar")
    assert block_tokens is not None  # at least one file was read
    return Trace(name, block_tokens, tuple(item[3] for item in keyed[:limit]))


#: trace readers by ``--format`` name: ``reader(path, limit=N)`` reads the first N requests
#: (reading only as far as they need), ``limit=None`` all of them.
TRACE_FORMATS: dict[str, Callable[..., Trace]] = {"mooncake": read_mooncake, "weka": read_weka}


def read_trace(path: Path, fmt: str = "mooncake", *, limit: int | None = None) -> Trace:
    """Read ``path`` as ``fmt`` (one of ``TRACE_FORMATS``): its first ``limit`` requests in
    arrival order, or all of them."""
    try:
        reader = TRACE_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"trace format {fmt!r} is not one of {', '.join(TRACE_FORMATS)}") from None
    return reader(path, limit=limit)


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
