"""The prefill worker of P/D: compute a prompt with its own cache, send the decode side the KV
after the boundary it names.

For each ``PrefillRequest`` (``hicache_store.pd.protocol``), on the worker's thread:

1. validate it: the boundary is page aligned and leaves a token to send, it names exactly one
   landing row per suffix page, every row exists and none twice, and the page hash at the
   boundary equals this side's (both workers mean the same tokens by it). A bad request gets
   ``Failed`` and nothing is computed or written.
2. ``tier.match`` / ``prepare`` / compute / ``complete``: the worker's own prefix cache decides
   how much it computes, independently of the decode side's boundary.
3. before ``complete`` (the request's pages are still locked in L1), pack the pages from the
   boundary on into registered send rows and write them into the landing rows, in chunks of at
   most ``send_rows`` pages; then answer ``PrefillDone``. The answer is sent after the last write
   returned, so the decode worker never reads a landing row the data has not reached.

The worker serves one decode connection at a time (``serve``), one request at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hicache_store.kernels.pools import DevicePool
from hicache_store.tier.cache import HiCache

from .pages import PageRows, pack_into
from .protocol import (
    PROTOCOL_VERSION,
    Bye,
    Channel,
    ChannelClosed,
    Failed,
    Hello,
    PrefillDone,
    PrefillRequest,
    ProtocolError,
    Welcome,
    suffix_pages,
)
from .state import StateCodec
from .transport import Transport, WriteOp

log = logging.getLogger(__name__)

#: ``compute(suffix tokens, start, slots, wait_layer, state, components)`` -> logits of the last
#: prompt position (``[vocab]`` or ``[1, vocab]``). ``state`` is the request's ``StateCodec``
#: handle (None for a plain KV model): the compute fills it with what the decode side needs
#: beyond KV. ``components``: ``Prepared.components`` of the worker's tier (empty without
#: components): the slots a model with state resumes from and fills.
Compute = Callable[..., torch.Tensor]


@dataclass
class _Peer:
    endpoint: str
    landing_address: int
    landing_rows: int


class PrefillWorker:
    """Serves ``PrefillRequest`` s with ``tier`` (its device pool holds the model's KV),
    ``compute`` (the engine), ``transport`` (registered send rows) and optionally a model
    ``state`` codec (extra per-request state, e.g. a hybrid model's window tail)."""

    def __init__(
        self,
        tier: HiCache,
        compute: Compute,
        transport: Transport,
        *,
        send_rows: int = 64,
        state: StateCodec | None = None,
    ) -> None:
        self.tier = tier
        self.compute = compute
        self.transport = transport
        self.state = state
        self.layout = tier.layout
        self.page_size = tier.namespace.page_size
        self.device = DevicePool.mha(tier.pool.k_buffers, tier.pool.v_buffers)
        self.send = PageRows(transport, send_rows, self.layout.page_bytes)
        self._peer: _Peer | None = None
        self.requests = 0
        self.bytes_sent = 0

    # -- handshake ------------------------------------------------------------------------------

    def welcome(self, hello: Hello) -> Welcome:
        """Accept a decode worker's ``Hello`` (``ProtocolError`` naming the mismatch if its
        namespace, page geometry, transport or model state differ from this side's)."""
        ns = self.tier.namespace
        mine = {
            "version": PROTOCOL_VERSION,
            "namespace": ns.digest,
            "page_size": self.page_size,
            "page_bytes": self.layout.page_bytes,
            "transport": self.transport.name,
            "state": self.state.describe() if self.state is not None else {},
        }
        theirs = {name: getattr(hello, name) for name in mine}
        for name, value in mine.items():
            if theirs[name] != value:
                raise ProtocolError(
                    f"the decode worker's {name} is {theirs[name]!r}, this prefill worker's is "
                    f"{value!r}: they cannot share KV"
                )
        if hello.landing_rows < 1 or hello.landing_address < 1:
            raise ProtocolError("the decode worker announced no landing memory")
        self._peer = _Peer(hello.endpoint, hello.landing_address, hello.landing_rows)
        return Welcome(PROTOCOL_VERSION, ns.digest)

    # -- one request ----------------------------------------------------------------------------

    def handle(self, msg: PrefillRequest) -> PrefillDone:
        """Compute ``msg``'s prompt and send its suffix (see the module docstring).

        Raises ``ProtocolError`` for a bad request (nothing computed or written),
        ``TransportError`` if the data could not be delivered."""
        peer = self._peer
        if peer is None:
            raise ProtocolError("prefill request before the handshake")
        n, page = len(msg.tokens), self.page_size
        pages = suffix_pages(n, msg.boundary, page)
        if len(msg.landing) != pages:
            raise ProtocolError(
                f"request {msg.rid}: {len(msg.landing)} landing rows for {pages} suffix pages"
            )
        state_rows = self.state.rows(self.layout.page_bytes) if self.state is not None else 0
        if len(msg.state_rows) != state_rows:
            raise ProtocolError(
                f"request {msg.rid}: {len(msg.state_rows)} state rows, the model needs {state_rows}"
            )
        rows = [*msg.landing, *msg.state_rows]
        if len(set(rows)) != len(rows) or any(r >= peer.landing_rows for r in rows):
            raise ProtocolError(
                f"request {msg.rid}: landing rows must be distinct and below {peer.landing_rows}"
            )
        started = time.perf_counter()
        req = self.tier.match(msg.tokens)
        expected = req.hashes[msg.boundary // page - 1] if msg.boundary else ""
        if msg.boundary_hash != expected:
            self.tier.abort(req)
            raise ProtocolError(
                f"request {msg.rid}: the page hash at decode_prefix_len {msg.boundary} differs "
                "between the workers (different tokens or namespace)"
            )
        try:
            prep = self.tier.prepare(req)
            handle = self.state.begin(n) if self.state is not None else None
            logits = self.compute(
                torch.as_tensor(msg.tokens[prep.start :], dtype=torch.int64),
                prep.start,
                prep.slots,
                prep.wait_layer,
                handle,
                prep.components,
            )
            first_token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
            computed = time.perf_counter()
            device_pages = (prep.slots[msg.boundary :: page] // page).tolist()
            sent = self._send(peer, device_pages, msg.landing, n - msg.boundary)
            if handle is not None:
                assert self.state is not None
                sent += self._send_state(peer, self.state.encode(handle), msg.state_rows)
        except BaseException:
            self.tier.abort(req)
            raise
        self.tier.complete(req)
        self.requests += 1
        self.bytes_sent += sent
        return PrefillDone(
            rid=msg.rid,
            boundary=msg.boundary,
            pages=pages,
            bytes=sent,
            prefill_cached=prep.start,
            first_token=first_token,
            prefill_s=computed - started,
            transfer_s=time.perf_counter() - computed,
        )

    def _send(
        self, peer: _Peer, device_pages: Sequence[int], landing: Sequence[int], tokens: int
    ) -> int:
        """Pack and write ``device_pages`` into ``landing`` rows, ``send_rows`` at a time."""
        sent = 0
        chunk = self.send.num_rows
        row_bytes = self.layout.page_bytes
        for start in range(0, len(device_pages), chunk):
            part = device_pages[start : start + chunk]
            rows = self.send.alloc(len(part))
            assert rows is not None, "send rows are only used here, one chunk at a time"
            try:
                valid = min(self.page_size, tokens - (start + len(part) - 1) * self.page_size)
                pack_into(
                    self.device,
                    part,
                    self.send.rows(rows),
                    self.layout,
                    valid_tokens=valid,
                    backend=self.tier.kernel_backend,
                )
                ops = [
                    WriteOp(
                        self.send.address(row),
                        peer.landing_address + dst * row_bytes,
                        row_bytes,
                    )
                    for row, dst in zip(rows, landing[start : start + chunk], strict=True)
                ]
                self.transport.write(peer.endpoint, ops)
            finally:
                self.send.free(rows)
            sent += len(part) * row_bytes
        return sent

    def _send_state(self, peer: _Peer, payload: torch.Tensor, rows: Sequence[int]) -> int:
        """Write the model state bytes ``payload`` into the landing ``rows`` (in order)."""
        row_bytes = self.layout.page_bytes
        data = payload.reshape(-1).view(torch.uint8)
        sent = 0
        for i, dst in enumerate(rows):
            piece = data[i * row_bytes : (i + 1) * row_bytes]
            staged = self.send.alloc(1)
            assert staged is not None
            try:
                self.send.rows(staged)[0, : piece.numel()] = piece
                self.transport.write(
                    peer.endpoint,
                    [WriteOp(self.send.address(staged[0]), peer.landing_address + dst * row_bytes,
                             piece.numel())],
                )
            finally:
                self.send.free(staged)
            sent += piece.numel()
        return sent

    # -- the connection -------------------------------------------------------------------------

    def serve(self, channel: Channel, *, idle_timeout_s: float = 3600.0) -> None:
        """Serve one decode worker until it says ``Bye`` or goes away.

        A bad message or a failed request is answered with ``Failed`` and the worker carries on;
        a broken channel ends ``serve``."""
        while True:
            try:
                msg = channel.recv(idle_timeout_s)
            except (ChannelClosed, TimeoutError):
                return
            except ProtocolError as exc:
                channel.send(Failed(-1, str(exc)))
                continue
            if isinstance(msg, Bye):
                return
            try:
                if isinstance(msg, Hello):
                    channel.send(self.welcome(msg))
                elif isinstance(msg, PrefillRequest):
                    channel.send(self.handle(msg))
                else:
                    raise ProtocolError(f"unexpected {msg.kind!r} message at the prefill worker")
            except Exception as exc:  # one request's failure is its own, not the worker's
                rid = msg.rid if isinstance(msg, PrefillRequest) else -1
                log.warning("prefill request %s failed: %s", rid, exc)
                channel.send(Failed(rid, f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        self.send.close()
