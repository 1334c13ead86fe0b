"""The data plane of P/D: one-sided writes into memory the peer registered.

The decode worker registers the memory its incoming KV lands in and tells the prefill worker
where it is (over the control channel, ``hicache_store.pd.protocol``); the prefill worker
registers the memory it sends from and writes. That is RDMA's model (and Mooncake's
``TransferEngine``), so an RDMA transport fits the same interface::

    transport.register(buffer)            # both sides: host memory the transport may touch
    transport.endpoint                    # "host:port" a peer writes to (sent in the handshake)
    transport.write(peer, [WriteOp(src, dst, nbytes), ...])   # sender: all land, or raise
    transport.unregister(buffer); transport.close()

Contract of ``write``: every op copies ``nbytes`` from local address ``src`` (inside memory this
side registered) to the peer's address ``dst`` (inside memory the peer registered). It returns
only once every byte is in the peer's memory, so a completion message sent after it returns
(the control channel) can never overtake the data; it raises ``TransportError`` otherwise
(the peer's memory may then hold part of the data: the receiver must treat the whole request as
failed). Every wait is bounded by the transport's ``timeout_s``. A write outside the peer's
registered memory is refused by the receiver, never performed.

Implementations: ``TcpTransport`` (here; Python sockets, no dependency) and
``MooncakeTransport`` (``hicache_store.pd.mooncake``: Mooncake's transfer engine, protocol
``tcp`` on this machine, ``rdma`` where there is hardware). ``open_transport(name)`` builds
either.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import select
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from hicache_store.layout.errors import HiCacheStoreError

log = logging.getLogger(__name__)


class TransportError(HiCacheStoreError):
    """A write did not complete (peer gone, refused, timed out). The request it belonged to has
    failed; the receiver's memory may hold part of its data."""


@dataclass(frozen=True)
class WriteOp:
    """Copy ``nbytes`` from local address ``src`` to the peer's address ``dst``."""

    src: int
    dst: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.src < 0 or self.dst < 0 or self.nbytes < 1:
            raise ValueError(f"write op: src={self.src} dst={self.dst} nbytes={self.nbytes}")


def coalesce(ops: Sequence[WriteOp]) -> list[WriteOp]:
    """``ops`` with each run of ops contiguous on both sides merged into one (order kept).

    Transfers pay per op (a TCP round of headers, an RDMA work request), so neighbouring pages
    of a request move as one op."""
    merged: list[WriteOp] = []
    for op in ops:
        last = merged[-1] if merged else None
        if last is not None and last.src + last.nbytes == op.src and last.dst + last.nbytes == op.dst:
            merged[-1] = WriteOp(last.src, last.dst, last.nbytes + op.nbytes)
        else:
            merged.append(op)
    return merged


def host_bytes(buffer: torch.Tensor) -> npt.NDArray[np.uint8]:
    """``buffer``'s memory as a flat writable uint8 array (shared, not copied).

    ``ValueError`` unless it is a contiguous CPU tensor: what the socket transport can read and
    write, and what this machine registers with Mooncake."""
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError(
            f"transport memory must be a contiguous CPU tensor, got {buffer.device} "
            f"contiguous={buffer.is_contiguous()}"
        )
    array: npt.NDArray[np.uint8] = buffer.view(torch.uint8).reshape(-1).numpy()
    return array


def pop_registered(registered: dict[int, Any], buffer: torch.Tensor) -> int:
    """Forget ``buffer``'s registration in ``registered`` (keyed by start address); returns
    the address. ``ValueError`` when the buffer was not registered (as it starts)."""
    address = int(host_bytes(buffer).ctypes.data)
    if registered.pop(address, None) is None:
        raise ValueError(f"memory at {address:#x} is not registered")
    return address


class Transport(abc.ABC):
    """One side of a P/D data plane (see the module docstring for the contract)."""

    #: the name ``open_transport`` knows it by and the handshake carries.
    name: str = ""

    def __init__(self, *, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """``host:port`` a peer passes to ``write`` to reach this side."""

    @abc.abstractmethod
    def register(self, buffer: torch.Tensor) -> int:
        """Make ``buffer``'s memory a source or destination of writes; return its address.

        The caller keeps ``buffer`` alive and unchanged in place until ``unregister``."""

    @abc.abstractmethod
    def unregister(self, buffer: torch.Tensor) -> None:
        """Stop using ``buffer``'s memory (writes into it are refused from now on)."""

    @abc.abstractmethod
    def write(self, peer: str, ops: Sequence[WriteOp]) -> None:
        """Perform every op (see the module docstring); ``TransportError`` otherwise."""

    def close(self) -> None:  # noqa: B027 - optional: most transports own something to release
        """Release sockets and threads; the transport is unusable afterwards."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Regions:
    """Registered memory: ``[start, end)`` address ranges and the arrays that own them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_start: dict[int, npt.NDArray[np.uint8]] = {}

    def add(self, buffer: torch.Tensor) -> int:
        array = host_bytes(buffer)
        start = int(array.ctypes.data)
        with self._lock:
            for other, owned in self._by_start.items():
                if start < other + owned.size and other < start + array.size:
                    raise ValueError(f"memory at {start:#x} overlaps a registered region")
            self._by_start[start] = array
        return start

    def remove(self, buffer: torch.Tensor) -> None:
        with self._lock:
            pop_registered(self._by_start, buffer)

    def view(self, address: int, nbytes: int) -> memoryview:
        """The registered bytes ``[address, address + nbytes)``; ``ValueError`` if they are not
        all inside one registered region."""
        with self._lock:
            for start, array in self._by_start.items():
                if start <= address and address + nbytes <= start + array.size:
                    return memoryview(array[address - start : address - start + nbytes])  # type: ignore[arg-type]
        raise ValueError(f"[{address:#x}, +{nbytes}) is not inside registered memory")


# Wire format of TcpTransport, one batch per message:
#   request:  magic u32, op count u32, then per op: dst u64, nbytes u64; then the payloads
#   reply:    status u8 (0 ok, 1 refused), message length u32, message (utf-8)
_MAGIC = 0x48435044  # "HCPD"
_HEAD = struct.Struct("<II")
_OP = struct.Struct("<QQ")
_REPLY = struct.Struct("<BI")
#: bounds what a peer can make the receiver allocate for a batch's op table.
_MAX_OPS = 1 << 16


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return bytes(data)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


class TcpTransport(Transport):
    """The data plane over plain TCP sockets (no dependency): a listening thread applies each
    incoming batch to registered memory, checking every op against it before a byte is
    received; the sender keeps one connection per peer and waits for the receiver's reply.

    ``host`` is where it listens (loopback by default; never a wildcard it would advertise)."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", *, timeout_s: float = 30.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self._regions = _Regions()
        self._server = socket.create_server((host, 0))
        self._server.settimeout(0.2)  # the accept loop checks for close this often
        self._host = host
        self._port = int(self._server.getsockname()[1])
        self._closed = threading.Event()
        self._peers: dict[str, socket.socket] = {}
        self._send_lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, name="pd-tcp-accept", daemon=True)
        self._acceptor.start()

    @property
    def endpoint(self) -> str:
        return f"{self._host}:{self._port}"

    def register(self, buffer: torch.Tensor) -> int:
        return self._regions.add(buffer)

    def unregister(self, buffer: torch.Tensor) -> None:
        self._regions.remove(buffer)

    # -- sender ---------------------------------------------------------------------------------

    def write(self, peer: str, ops: Sequence[WriteOp]) -> None:
        ops = coalesce(ops)
        if not ops:
            return
        with self._send_lock:
            try:
                sources = [self._regions.view(op.src, op.nbytes) for op in ops]
            except ValueError as exc:
                raise TransportError(f"write to {peer}: source {exc}", operation="write") from exc
            for start in range(0, len(ops), _MAX_OPS):
                batch = slice(start, start + _MAX_OPS)
                self._send_batch(peer, ops[batch], sources[batch])

    def _send_batch(self, peer: str, ops: Sequence[WriteOp], sources: list[memoryview]) -> None:
        sock = None
        try:
            sock = self._connection(peer)
            header = _HEAD.pack(_MAGIC, len(ops)) + b"".join(
                _OP.pack(op.dst, op.nbytes) for op in ops
            )
            sock.sendall(header)
            for source in sources:
                sock.sendall(source)
            status, length = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
            message = _recv_exact(sock, min(length, 4096)).decode("utf-8", "replace")
        except (OSError, ConnectionError) as exc:
            self._drop(peer, sock)
            raise TransportError(f"write to {peer} failed: {exc}", operation="write") from exc
        if status != 0:
            self._drop(peer, sock)
            raise TransportError(f"{peer} refused the write: {message}", operation="write")

    def _connection(self, peer: str) -> socket.socket:
        sock = self._peers.get(peer)
        if sock is None:
            host, _, port = peer.rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers[peer] = sock
        return sock

    def _drop(self, peer: str, sock: socket.socket | None) -> None:
        self._peers.pop(peer, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    # -- receiver -------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            conn.settimeout(self.timeout_s)
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="pd-tcp-recv", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                # Idle between batches: wake up now and then to notice close().
                readable, _, _ = select.select([conn], [], [], 0.2)
                if not readable:
                    continue
                first = conn.recv(_HEAD.size)
                if not first:
                    return  # the sender closed the connection
                head = first + _recv_exact(conn, _HEAD.size - len(first))
                magic, count = _HEAD.unpack(head)
                if magic != _MAGIC or not 0 < count <= _MAX_OPS:
                    self._reply(conn, 1, f"bad batch header (magic {magic:#x}, {count} ops)")
                    return
                table = _recv_exact(conn, count * _OP.size)
                ops = [_OP.unpack_from(table, i * _OP.size) for i in range(count)]
                try:
                    views = [self._regions.view(dst, nbytes) for dst, nbytes in ops]
                except ValueError as exc:
                    # Refuse before reading a payload byte; the connection cannot be resynced.
                    self._reply(conn, 1, f"destination {exc}")
                    return
                for view in views:
                    _recv_into(conn, view)
                self._reply(conn, 0, "")
        except (OSError, ConnectionError) as exc:
            if not self._closed.is_set():
                log.warning("P/D tcp transport: a sender's connection failed: %s", exc)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    @staticmethod
    def _reply(conn: socket.socket, status: int, message: str) -> None:
        data = message.encode()
        conn.sendall(_REPLY.pack(status, len(data)) + data)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._server.close()
        self._acceptor.join(timeout=5)
        with self._send_lock:
            for peer, sock in list(self._peers.items()):
                self._drop(peer, sock)
        with self._conns_lock:
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


#: transport name -> "module:Class"; imported on first use (Mooncake is optional).
TRANSPORTS: dict[str, str] = {
    "tcp": "hicache_store.pd.transport:TcpTransport",
    "mooncake": "hicache_store.pd.mooncake:MooncakeTransport",
}


def open_transport(name: str, **options: Any) -> Transport:
    """A transport by name (``tcp``, ``mooncake``) with its options (``timeout_s``, ...)."""
    import importlib

    try:
        target = TRANSPORTS[name]
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; known: {', '.join(sorted(TRANSPORTS))}"
        ) from None
    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    transport: Transport = cls(**options)
    return transport
