"""Publishing KV event batches on ZMQ the way vLLM's ``ZmqEventPublisher`` does (vLLM 0.32).

Sockets and frames, so that vLLM's subscribers and the routers built on them (llm-d, Dynamo)
read us unchanged:

- **PUB** at ``endpoint``: each batch is one message of three frames, ``topic`` (UTF-8, may
  be empty), the batch's sequence number (8 bytes big-endian) and the msgpack ``KVEventBatch``
  (``wire.encode_batch``). Sequence numbers count the batches sent, from 0, with no gap.
  vLLM's rule decides bind or connect: an address with ``*`` or ``::``, or an ``ipc://`` /
  ``inproc://`` one, is bound; any other (``tcp://host:port``) is connected to (a subscriber
  that binds); ``bind=True`` binds whatever the address.
- **ROUTER** at ``replay_endpoint`` (always bound; optional): a client (``DEALER``, or
  ``REQ``) sends the first sequence number it wants as 8 bytes big-endian and receives, one
  message per batch, ``topic, seq, payload`` for every batch still held from that number on,
  then the end marker: an empty topic, ``seq = -1`` and an empty payload. The last
  ``history`` batches are held.

The caller never waits: ``publish`` puts the batch on a bounded queue and returns; one thread
encodes, numbers, sends and serves replays. When the queue is full the batch is dropped whole
and counted (``dropped_batches``); it never gets a number, so subscribers see no gap for it
(the count is the only trace: size ``max_queue`` for the burst the engine may produce).
``close`` sends what is queued (within its timeout) and closes the sockets; a second call is
harmless.

``pyzmq`` is the ``events`` extra (``pip install pyzmq``); importing this
module without it is fine, constructing a publisher raises ``ImportError`` with that hint.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .wire import Event, encode_batch, encode_seq

log = logging.getLogger(__name__)

INSTALL_HINT = "KV events need pyzmq: pip install pyzmq (the events extra)"
#: the replay's end marker: empty topic, sequence -1, empty payload.
END_SEQ = encode_seq(-1)
#: how long the publisher thread waits for a batch before it looks at the replay socket again.
_POLL_S = 0.02


@dataclass(frozen=True)
class PublisherConfig:
    """Where and how a publisher sends: ``endpoint`` (PUB), ``replay_endpoint`` (ROUTER, or
    None for no replay), ``topic``, ``history`` (batches held for replay), ``max_queue``
    (batches waiting to be sent before new ones are dropped), ``hwm`` (the PUB socket's high
    water mark), ``dp_rank`` (written into each batch when set)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    history: int = 10_000
    max_queue: int = 100_000
    hwm: int = 100_000
    dp_rank: int | None = None
    bind: bool | None = None

    def __post_init__(self) -> None:
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv events {name}: {value!r} is not a tcp://, ipc:// or "
                                 "inproc:// address")
        if self.history < 0 or self.max_queue < 1 or self.hwm < 0:
            raise ValueError("kv events: history >= 0, max_queue >= 1 and hwm >= 0 are needed")


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard and ipc/inproc addresses are bound, the rest connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return zmq


class EventPublisher:
    """One PUB socket (and optional replay ROUTER) fed from a bounded queue by one thread.
    See the module docstring for the sockets and the frames."""

    def __init__(self, config: PublisherConfig) -> None:
        zmq = _zmq()
        self.config = config
        self._zmq = zmq
        self._queue: queue.Queue[tuple[float, tuple[Event, ...]]] = queue.Queue(config.max_queue)
        self._history: deque[tuple[int, bytes]] = deque(maxlen=config.history)
        self._topic = config.topic.encode("utf-8")
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.dropped_batches = 0
        self.accepted_batches = 0
        self.sent_batches = 0
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            bind = binds(config.endpoint) if config.bind is None else config.bind
            self.endpoint = _open(self._pub, config.endpoint, bind=bind)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _open(self._replay, config.replay_endpoint, bind=True)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"kv events: cannot open {config.endpoint} / "
                          f"{config.replay_endpoint}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------

    def publish(self, events: Sequence[Event], ts: float | None = None) -> bool:
        """Queue one batch (nothing for an empty one); False when it was dropped (queue full,
        or the publisher closed). Never blocks."""
        if not events:
            return True
        if self._closing.is_set():
            return False
        try:
            with self._lock:
                self._queue.put_nowait((time.time() if ts is None else ts, tuple(events)))
                self.accepted_batches += 1
        except queue.Full:
            with self._lock:
                self.dropped_batches += 1
                first = self.dropped_batches == 1
            if first:
                log.warning("kv events: the queue is full (%d batches); dropping whole batches",
                            self.config.max_queue)
            return False
        return True

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every batch accepted so far is sent; False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.sent_batches < self.accepted_batches:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then close the sockets."""
        if self._closing.is_set():
            self._thread.join(timeout)
            return
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kv events: %d batches unsent at close", self._queue.qsize())

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        seq = 0
        try:
            while not (self._closing.is_set() and self._queue.empty()):
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    ts, events = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                payload = encode_batch(ts, list(events), self.config.dp_rank)
                self._pub.send_multipart((self._topic, encode_seq(seq), payload))
                self._history.append((seq, payload))
                seq += 1
                self.sent_batches = seq
        except Exception:
            log.exception("kv events: the publisher thread stopped")
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        """Answer one replay request (malformed ones are logged and get the end marker only
        when the client can be addressed)."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        if len(start) == 8:
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._history):
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, encode_seq(seq),
                                                 payload))
        else:
            log.warning("kv events: a replay request with a %d-byte sequence number", len(start))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=500)


def _open(sock: Any, endpoint: str, *, bind: bool) -> str:
    """Bind (returning the address bound, port 0 resolved) or connect ``sock``."""
    if not bind:
        sock.connect(endpoint)
        return endpoint
    sock.bind(endpoint)
    bound: str = sock.getsockopt_string(_zmq().LAST_ENDPOINT)
    return bound
