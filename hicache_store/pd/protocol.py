"""The control plane of P/D: the handshake and per-request messages, and the channel they use.

One connection from the decode worker to the prefill worker (``Channel``: length-framed JSON over
``multiprocessing.connection`` with an HMAC handshake on a shared key, every wait bounded)::

    decode -> prefill   Hello(namespace, page geometry, transport, endpoint, landing memory)
    prefill -> decode   Welcome(namespace)                       or Failed(rid=-1, error)
    decode -> prefill   PrefillRequest(rid, tokens, boundary, boundary_hash, landing rows)
    prefill -> decode   PrefillDone(rid, boundary, pages, bytes, ...)   after the data landed
                        or Failed(rid, error)                    nothing further is written
    decode -> prefill   Bye

**The boundary** (``decode_prefix_len``) is the number of prompt tokens the decode worker
already holds (restored from its own cache); the prefill worker sends the KV of every token from
there on, page by page into the landing rows the request names: page ``j`` of the suffix (tokens
``boundary + j*page .. +page``) into row ``landing[j]``. It is page aligned and leaves at least
one prompt token to send (``check_boundary``), and ``boundary_hash`` is the page hash of the
page that ends at it (the namespace's hash chain; ``""`` for 0), so the prefill worker can
verify that both sides mean the same tokens by it before writing anything. Every number in a
message is validated on receipt (``decode``): a malformed message is one ``ProtocolError``.

Bytes per page are the unified page layout's (``layout.host.UnifiedPageLayout``), the same rows
the tier's host pool holds; the suffix moves as whole pages (the last one may be partial: its
tail is whatever the sender's page held and is never read, the decode worker writes its own
tokens there).

Model state beyond the KV pages that resuming at the end of the prompt needs (a hybrid model's
fresh sliding-window tail and recurrent state) travels in ``state`` rows: ``state_rows`` more
landing rows, filled from byte 0 with ``state_bytes`` bytes, whose layout the model's adapter on
both sides defines (``hicache_store.pd.state``).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import multiprocessing.connection as mpc
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar

from hicache_store.layout.errors import HiCacheStoreError

PROTOCOL_VERSION = 1
#: largest control message accepted (a 4M-token prompt as JSON stays well below).
MAX_MESSAGE_BYTES = 64 << 20


class ProtocolError(HiCacheStoreError, ValueError):
    """A control message that is malformed, out of range or unexpected here."""


def check_boundary(prompt_tokens: int, boundary: int, page_size: int) -> None:
    """``ProtocolError`` unless ``boundary`` is a valid ``decode_prefix_len`` for a prompt of
    ``prompt_tokens`` tokens: page aligned, ``0 <= boundary < prompt_tokens``."""
    if prompt_tokens < 1:
        raise ProtocolError("the prompt is empty")
    if boundary % page_size or not 0 <= boundary < prompt_tokens:
        raise ProtocolError(
            f"decode_prefix_len {boundary} is not a page-aligned ({page_size}) prefix of a "
            f"{prompt_tokens}-token prompt that leaves a token to send"
        )


def suffix_pages(prompt_tokens: int, boundary: int, page_size: int) -> int:
    """Pages the suffix ``[boundary, prompt_tokens)`` occupies (the one page arithmetic both
    sides use: the landing rows a request names, the pages the prefill worker sends)."""
    check_boundary(prompt_tokens, boundary, page_size)
    return math.ceil((prompt_tokens - boundary) / page_size)


# -- messages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """Base of the control messages; ``kind`` is the wire tag."""

    kind: ClassVar[str] = ""

    def encode(self) -> bytes:
        return json.dumps({"type": self.kind, **asdict(self)}, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Hello(Message):
    """The decode worker's handshake: who it is and where its landing memory is."""

    kind: ClassVar[str] = "hello"
    version: int
    namespace: str
    page_size: int
    page_bytes: int
    transport: str
    endpoint: str
    landing_address: int
    landing_rows: int
    #: model state the decode side expects per request (``pd.state``); empty for plain KV.
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Welcome(Message):
    kind: ClassVar[str] = "welcome"
    version: int
    namespace: str


@dataclass(frozen=True)
class PrefillRequest(Message):
    kind: ClassVar[str] = "prefill"
    rid: int
    tokens: list[int]
    boundary: int
    boundary_hash: str
    landing: list[int]
    state_rows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PrefillDone(Message):
    """Every page (and state row) of request ``rid`` is in the decode worker's memory."""

    kind: ClassVar[str] = "done"
    rid: int
    boundary: int
    pages: int
    bytes: int
    #: prompt tokens the prefill worker's own cache supplied (it computed the rest).
    prefill_cached: int
    first_token: int
    prefill_s: float
    transfer_s: float


@dataclass(frozen=True)
class Failed(Message):
    """Request ``rid`` (``-1``: the handshake) failed; nothing more is written for it."""

    kind: ClassVar[str] = "failed"
    rid: int
    error: str


@dataclass(frozen=True)
class Bye(Message):
    kind: ClassVar[str] = "bye"


MESSAGES: dict[str, type[Message]] = {
    cls.kind: cls for cls in (Hello, Welcome, PrefillRequest, PrefillDone, Failed, Bye)
}


def _check_field(kind: str, name: str, value: Any, annotation: str) -> None:
    def bad(why: str) -> ProtocolError:
        return ProtocolError(f"{kind}.{name}: {why}, got {value!r:.80}")

    if annotation == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad("expected an integer")
        if value < -1:
            raise bad("out of range")
    elif annotation == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise bad("expected a non-negative number")
    elif annotation == "str":
        if not isinstance(value, str):
            raise bad("expected a string")
    elif annotation == "list[int]":
        if not isinstance(value, list) or any(
            not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in value
        ):
            raise bad("expected a list of non-negative integers")
    elif annotation == "dict[str, Any]" and not isinstance(value, dict):
        raise bad("expected an object")


def decode(raw: bytes) -> Message:
    """The message ``raw`` encodes; ``ProtocolError`` if it is not exactly one of ``MESSAGES``
    with every field present, of its type and in range (ids ``>= -1``, lists of ids ``>= 0``)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"control message is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("control message is not a JSON object")
    kind = data.pop("type", None)
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown control message type {kind!r}")
    declared = {f.name: str(f.type) for f in fields(cls)}
    unknown = set(data) - set(declared)
    if unknown:
        raise ProtocolError(f"{kind}: unknown fields {sorted(unknown)}")
    for f in fields(cls):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError(f"{kind}: missing field {f.name!r}")
            continue
        _check_field(kind, f.name, data[f.name], declared[f.name])
    return cls(**data)


# -- the channel -------------------------------------------------------------------------------


class ChannelClosed(HiCacheStoreError, ConnectionError):
    """The peer closed the control channel (or it broke)."""


class Channel:
    """One end of the control connection: ``send(message)``, ``recv(timeout) -> Message``."""

    def __init__(self, conn: mpc.Connection) -> None:
        self._conn = conn

    @classmethod
    def connect(cls, address: tuple[str, int], authkey: bytes) -> Channel:
        try:
            return cls(mpc.Client(address, authkey=authkey))
        except (OSError, multiprocessing.AuthenticationError) as exc:
            raise ChannelClosed(f"cannot reach the prefill worker at {address}: {exc}") from exc

    def send(self, message: Message) -> None:
        try:
            self._conn.send_bytes(message.encode())
        except OSError as exc:
            raise ChannelClosed(f"control channel broke: {exc}") from exc

    def recv(self, timeout: float) -> Message:
        """The next message; ``TimeoutError`` after ``timeout`` seconds without one,
        ``ChannelClosed`` if the peer went away, ``ProtocolError`` if it is malformed."""
        try:
            ready = self._conn.poll(timeout)
            raw = self._conn.recv_bytes(MAX_MESSAGE_BYTES) if ready else b""
        except (EOFError, OSError) as exc:
            raise ChannelClosed(f"control channel closed: {exc}") from exc
        if not ready:  # (TimeoutError is an OSError: raised outside the try on purpose)
            raise TimeoutError(f"no control message within {timeout:.1f}s")
        return decode(raw)

    def close(self) -> None:
        self._conn.close()


class ChannelListener:
    """The prefill worker's listening end (loopback by default)."""

    def __init__(self, authkey: bytes, host: str = "127.0.0.1") -> None:
        self._listener = mpc.Listener((host, 0), authkey=authkey)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.address
        return str(host), int(port)

    def accept(self) -> Channel:
        try:
            return Channel(self._listener.accept())
        except (OSError, multiprocessing.AuthenticationError) as exc:
            raise ChannelClosed(f"control connection refused: {exc}") from exc

    def close(self) -> None:
        self._listener.close()
