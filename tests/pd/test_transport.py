"""The P/D data plane between two real processes, for each transport."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _pd_peer import HANG_S, SIZE, receiver
from _pd_support import TRANSPORTS

from hicache_store.pd.transport import (
    Transport,
    TransportError,
    WriteOp,
    coalesce,
    open_transport,
)


def _available(name: str) -> None:
    if name == "mooncake":
        pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is not installed")


class Peer:
    """A receiver process: its endpoint, registered address and a digest of its memory."""

    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver, args=(name, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("the receiver process did not start")
        self.endpoint, self.address, self.size = self.conn.recv()

    def zero(self) -> None:
        self.conn.send("zero")
        self.conn.recv()

    def digest(self) -> str:
        self.conn.send("digest")
        return str(self.conn.recv())

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("stop")
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


@pytest.fixture(scope="module", params=TRANSPORTS)
def peer(request: pytest.FixtureRequest) -> Iterator[Peer]:
    """One receiver process per transport for the module (starting one takes seconds)."""
    _available(request.param)
    receiving = Peer(request.param)
    try:
        yield receiving
    finally:
        receiving.stop()


@pytest.fixture
def pair(peer: Peer, request: pytest.FixtureRequest) -> Iterator[tuple[Transport, Peer, torch.Tensor]]:
    """A sender of the peer's transport, a registered source with a known pattern, and the
    peer with its memory zeroed."""
    peer.zero()
    name = request.node.callspec.params["peer"]
    sender = open_transport(name, timeout_s=HANG_S)
    source = torch.arange(SIZE, dtype=torch.int64).to(torch.uint8)
    sender.register(source)
    try:
        yield sender, peer, source
    finally:
        sender.unregister(source)
        sender.close()


def expected_digest(writes: list[tuple[int, int, int]], source: torch.Tensor) -> str:
    memory = torch.zeros(SIZE, dtype=torch.uint8)
    for src, dst, n in writes:
        memory[dst : dst + n] = source[src : src + n]
    return hashlib.sha256(memory.numpy().tobytes()).hexdigest()


def test_writes_land_in_the_peers_registered_memory(pair: Any) -> None:
    sender, peer, source = pair
    base = source.data_ptr()
    writes = [(0, 4096, 8192), (8192, 12288, 4096), (100_000, 500_000, 70_000), (7, SIZE - 9, 9)]
    sender.write(peer.endpoint, [WriteOp(base + s, peer.address + d, n) for s, d, n in writes])
    assert peer.digest() == expected_digest(writes, source)


def test_a_write_outside_the_peers_memory_is_refused_and_lands_nowhere(pair: Any) -> None:
    sender, peer, source = pair
    base = source.data_ptr()
    before = peer.digest()
    for dst, n in ((SIZE - 100, 200), (SIZE, 16), (-4096, 4096)):
        with pytest.raises(TransportError):
            sender.write(peer.endpoint, [WriteOp(base, peer.address + dst, n)])
    assert peer.digest() == before
    # The transport still works afterwards.
    sender.write(peer.endpoint, [WriteOp(base, peer.address, 64)])
    assert peer.digest() == expected_digest([(0, 0, 64)], source)


def test_a_source_outside_registered_memory_is_refused(pair: Any) -> None:
    sender, peer, _source = pair
    if sender.name != "tcp":
        pytest.skip("Mooncake's TCP transport reads any local address")
    stray = torch.ones(64, dtype=torch.uint8)
    with pytest.raises(TransportError, match="source"):
        sender.write(peer.endpoint, [WriteOp(stray.data_ptr(), peer.address, 64)])


def test_a_peer_that_is_not_there_fails_the_write_in_bounded_time(pair: Any) -> None:
    sender, peer, source = pair
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{probe.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(TransportError):
        sender.write(nobody, [WriteOp(source.data_ptr(), peer.address, 4096)])
    assert time.monotonic() - started < 30


def test_coalesce_merges_runs_contiguous_on_both_sides() -> None:
    ops = [WriteOp(0, 100, 10), WriteOp(10, 110, 10), WriteOp(20, 200, 10), WriteOp(30, 210, 5)]
    assert coalesce(ops) == [WriteOp(0, 100, 20), WriteOp(20, 200, 15)]
    assert coalesce([WriteOp(0, 0, 4), WriteOp(8, 4, 4)]) == [WriteOp(0, 0, 4), WriteOp(8, 4, 4)]
    with pytest.raises(ValueError):
        WriteOp(0, 0, 0)


def test_unknown_transport_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="mooncake, tcp"):
        open_transport("rdma-magic")
