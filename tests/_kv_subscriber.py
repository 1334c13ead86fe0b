"""A KV event subscriber as a router would write one, for the tests: a SUB socket for live
batches and a DEALER for replay, decoding with ``_plain_msgpack`` (never with our encoder)."""

from __future__ import annotations

import time
from typing import Any

import zmq
from _plain_msgpack import unpack

Batch = tuple[int, list[Any]]  # (seq, [ts, events(, dp_rank)])


class Subscriber:
    """Connects to ``endpoint`` (or binds it with ``bind=True``) and ``replay`` (if given)."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "",
                 *, bind: bool = False) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind:
            self.sub.bind(endpoint)
            self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sub.connect(endpoint)
            self.endpoint = endpoint
        self.replay_endpoint = replay
        self.topic = topic.encode()

    def recv(self, timeout_s: float) -> Batch | None:
        """The next live batch, or None after ``timeout_s``."""
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic
        return int.from_bytes(seq, "big", signed=True), unpack(payload)

    def replay(self, start: int, timeout_s: float = 10.0) -> list[Batch]:
        """Every batch the publisher still holds from ``start`` on, up to its end marker."""
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            out: list[Batch] = []
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000)):
                    raise TimeoutError(f"no end marker after {len(out)} replayed batches")
                empty, topic, seq_raw, payload = dealer.recv_multipart()
                assert empty == b""
                seq = int.from_bytes(seq_raw, "big", signed=True)
                if seq == -1:
                    assert (topic, payload) == (b"", b"")
                    return out
                assert topic == self.topic
                out.append((seq, unpack(payload)))
        finally:
            dealer.close(linger=0)

    def catch_up(self, until_seq: int, timeout_s: float = 20.0) -> list[Batch]:
        """Every batch from 0 through ``until_seq``, in order: live ones, and the ones sent
        before this subscriber joined from the replay socket (as a late router does)."""
        live: dict[int, list[Any]] = {}
        first: int | None = None
        deadline = time.monotonic() + timeout_s
        while until_seq not in live:
            got = self.recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise TimeoutError(f"live batches stopped at {sorted(live)[-1:]}")
            seq, batch = got
            if first is None:
                first = seq
                for old_seq, old in self.replay(0):
                    live.setdefault(old_seq, old)
            live[seq] = batch
        return [(s, live[s]) for s in sorted(live) if s <= until_seq]

    def close(self) -> None:
        self.sub.close(linger=0)
