"""The KV event publisher with real ZMQ subscribers on loopback: frames, gap-free numbering,
replay for late subscribers, a bounded history, whole-batch drops that never block, shutdown."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import zmq
from _kv_subscriber import Subscriber

from hicache_store.events import publisher as publisher_module
from hicache_store.events.publisher import EventPublisher, PublisherConfig, binds
from hicache_store.events.wire import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)


def _batch(i: int) -> list[Event]:
    """A distinct batch per ``i``: a store of two pages, a removal, now and then a clear."""
    events: list[Event] = [
        BlockStored((2 * i, 2 * i + 1), None if i == 0 else 2 * i - 1,
                    tuple(range(i, i + 8)), 4, MEDIUM_STORAGE),
        BlockRemoved((bytes([i % 256]) * 32,), MEDIUM_CPU),
    ]
    if i % 7 == 3:
        events.append(AllBlocksCleared())
    return events


def _expected(i: int) -> list[dict[str, object]]:
    stored = {"type": "BlockStored", "block_hashes": [2 * i, 2 * i + 1],
              "parent_block_hash": None if i == 0 else 2 * i - 1,
              "token_ids": list(range(i, i + 8)), "block_size": 4, "lora_id": None,
              "medium": "STORAGE", "lora_name": None}
    out: list[dict[str, object]] = [
        stored, {"type": "BlockRemoved", "block_hashes": [bytes([i % 256]) * 32], "medium": "CPU"}]
    if i % 7 == 3:
        out.append({"type": "AllBlocksCleared"})
    return out


def _wait_sent(pub: EventPublisher, count: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pub.sent_batches < count:
        assert time.monotonic() < deadline, f"{pub.sent_batches} of {count} batches sent"
        time.sleep(0.005)


@pytest.fixture
def ipc(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


def test_every_batch_arrives_numbered_without_gaps_and_decodes(ipc: tuple[str, str]) -> None:
    pub = EventPublisher(PublisherConfig(ipc[0], ipc[1], topic="kv@a", dp_rank=2))
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv@a")
    try:
        for i in range(400):
            assert pub.publish(_batch(i), ts=float(i))
        got = sub.catch_up(399)  # the subscription may miss the first ones: replay has them
    finally:
        pub.close()
        sub.close()
    assert [seq for seq, _ in got] == list(range(400))
    for seq, (ts, events, rank) in got:
        assert (ts, rank) == (float(seq), 2)
        assert events == _expected(seq)
    assert (pub.sent_batches, pub.dropped_batches) == (400, 0)


def test_a_late_subscriber_gets_missed_batches_by_replay_then_live(
        tmp_path: Path) -> None:
    # Loopback TCP for the replay socket (port 0: the publisher reports the port bound).
    pub = EventPublisher(PublisherConfig(f"ipc://{tmp_path}/p", "tcp://127.0.0.1:0"))
    assert pub.replay_endpoint is not None and pub.replay_endpoint.startswith("tcp://127.0.0.1:")
    try:
        for i in range(50):
            pub.publish(_batch(i))
        _wait_sent(pub, 50)
        late = Subscriber(pub.endpoint, pub.replay_endpoint)
        replayed = late.replay(0)
        assert [s for s, _ in replayed] == list(range(50))
        assert [b[1] for _, b in replayed] == [_expected(i) for i in range(50)]
        assert [s for s, _ in late.replay(45)] == [45, 46, 47, 48, 49]
        assert late.replay(50) == []  # nothing held from there on: the end marker alone
        time.sleep(0.2)  # the subscription reaches the publisher
        for i in range(50, 60):
            pub.publish(_batch(i))
        live = [late.recv(10.0) for _ in range(10)]
        assert [b[0] for b in live if b] == list(range(50, 60))
        late.close()
    finally:
        pub.close()


def test_history_is_bounded_to_the_newest_batches(ipc: tuple[str, str]) -> None:
    pub = EventPublisher(PublisherConfig(ipc[0], ipc[1], history=10))
    try:
        for i in range(30):
            pub.publish(_batch(i))
        _wait_sent(pub, 30)
        sub = Subscriber(pub.endpoint, pub.replay_endpoint)
        assert [s for s, _ in sub.replay(0)] == list(range(20, 30))
        sub.close()
    finally:
        pub.close()


def test_a_full_queue_drops_whole_batches_counts_them_and_never_blocks(
        ipc: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = publisher_module.encode_batch

    def held(*args: object, **kwargs: object) -> bytes:
        assert gate.wait(30)  # the publisher thread is stuck sending: the queue fills up
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(publisher_module, "encode_batch", held)
    pub = EventPublisher(PublisherConfig(ipc[0], ipc[1], max_queue=3))
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    try:
        assert pub.publish(_batch(0))
        deadline = time.monotonic() + 10
        while pub._queue.qsize():  # the thread took batch 0 and waits at the gate
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert [pub.publish(_batch(i)) for i in range(1, 9)] == [True] * 3 + [False] * 5
        assert pub.dropped_batches == 5
        gate.set()
        _wait_sent(pub, 4)  # the queue has room again
        assert pub.publish(_batch(9))
        _wait_sent(pub, 5)
        replayed = sub.replay(0)
    finally:
        gate.set()
        pub.close()
        sub.close()
    # Numbered as sent: no gap where batches 4..8 were dropped, and none of them sent.
    assert [s for s, _ in replayed] == [0, 1, 2, 3, 4]
    assert [b[1] for _, b in replayed] == [_expected(i) for i in (0, 1, 2, 3, 9)]
    assert (pub.sent_batches, pub.dropped_batches) == (5, 5)


def test_close_sends_what_is_queued_and_frees_the_addresses(ipc: tuple[str, str]) -> None:
    pub = EventPublisher(PublisherConfig(ipc[0], ipc[1]))
    sub = Subscriber(pub.endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher
    for i in range(20):
        pub.publish(_batch(i))
    pub.close()
    assert pub.publish(_batch(99)) is False  # closed: refused, never queued
    pub.close()  # harmless
    got = []
    while (batch := sub.recv(2.0)) is not None:
        got.append(batch[0])
    assert got == list(range(20))
    sub.close()
    again = EventPublisher(PublisherConfig(*ipc))  # both addresses are free again
    again.close()


def test_replay_requests_that_are_malformed_get_the_end_marker_only(
        ipc: tuple[str, str]) -> None:
    pub = EventPublisher(PublisherConfig(ipc[0], ipc[1]))
    try:
        pub.publish(_batch(0))
        _wait_sent(pub, 1)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(ipc[1])
        dealer.send_multipart((b"", b"\x00\x01"))  # a 2-byte sequence number
        assert dealer.poll(10_000)
        assert dealer.recv_multipart() == [b"", b"", b"\xff" * 8, b""]
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # the socket still serves
        assert dealer.poll(10_000)
        assert dealer.recv_multipart()[2] == (0).to_bytes(8, "big")
        dealer.close(linger=0)
    finally:
        pub.close()


def test_bad_configuration_is_refused_clearly(ipc: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match="not a tcp://"):
        PublisherConfig("http://127.0.0.1:5557")
    with pytest.raises(ValueError, match="max_queue"):
        PublisherConfig(ipc[0], max_queue=0)
    first = EventPublisher(PublisherConfig(ipc[0], "tcp://127.0.0.1:0"))
    try:
        assert first.replay_endpoint is not None
        with pytest.raises(OSError, match="cannot open"):
            EventPublisher(PublisherConfig(f"{ipc[0]}2", first.replay_endpoint))
    finally:
        first.close()


def test_bind_or_connect_follows_vllms_rule() -> None:
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and binds("inproc://a")
    assert binds("tcp://[::]:5557")
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://router:5557")
