"""``MooncakeTransport``: the P/D data plane on Mooncake's transfer engine.

One ``mooncake.engine.TransferEngine`` per process, initialised with P2P handshake metadata (no
metadata server) and the given protocol: ``tcp`` here (real TCP between processes), ``rdma``
where there are RDMA devices. Memory is registered with ``register_memory``; a batch of writes
is one ``batch_transfer_sync_write`` to the peer's ``host:rpc_port`` segment, which returns
once the data is in the peer's memory (the transfer engine's own acknowledgement).

Bounded waits: the engine reads ``MC_TRANSFER_TIMEOUT`` (seconds, default 30) when it is built;
this class sets it from ``timeout_s`` unless the environment already does. It also sets
``MC_TCP_BIND_ADDRESS`` to ``host`` unless set (Mooncake 0.3.13 still opens some listeners on
the wildcard address: run the processes under the loopback shim of
``hicache_store.backends.mooncake_local`` where that matters, as ``bench pd`` does).
Receiver-side protection: the engine refuses a write whose destination is outside memory the
peer registered (checked in ``tests/pd``), so a wrong address fails rather than corrupts.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from hicache_store.backends.errors import MissingDependencyError

from .transport import Transport, TransportError, WriteOp, coalesce, host_bytes, pop_registered

INSTALL_HINT = "pip install mooncake-transfer-engine-non-cuda (the mooncake extra)"
#: ops per ``batch_transfer_sync_write`` call (the engine refuses very large batches).
_BATCH_OPS = 256


def _engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MissingDependencyError(
            f"the mooncake transport needs Mooncake's transfer engine ({exc})",
            install_hint=INSTALL_HINT,
        ) from exc
    return TransferEngine


class MooncakeTransport(Transport):
    """Mooncake's transfer engine as a ``Transport`` (see the module docstring)."""

    name = "mooncake"

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        device: str = "",
        timeout_s: float = 30.0,
    ) -> None:
        super().__init__(timeout_s=timeout_s)
        engine_class = _engine_class()
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(1, math.ceil(timeout_s))))
        self._engine = engine_class()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransportError(
                f"Mooncake transfer engine failed to initialise ({protocol} on {host}): rc={rc}",
                operation="initialize",
            )
        self._host = host
        self._port = int(self._engine.get_rpc_port())
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"{self._host}:{self._port}"

    def register(self, buffer: torch.Tensor) -> int:
        array = host_bytes(buffer)
        address, nbytes = int(array.ctypes.data), int(array.size)
        with self._lock:
            rc = self._engine.register_memory(address, nbytes)
            if rc != 0:
                raise TransportError(
                    f"Mooncake refused to register {nbytes} bytes at {address:#x}: rc={rc}",
                    operation="register",
                )
            self._registered[address] = nbytes
        return address

    def unregister(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._engine.unregister_memory(pop_registered(self._registered, buffer))

    def write(self, peer: str, ops: Sequence[WriteOp]) -> None:
        ops = coalesce(ops)
        for start in range(0, len(ops), _BATCH_OPS):
            batch = ops[start : start + _BATCH_OPS]
            rc = self._engine.batch_transfer_sync_write(
                peer,
                [op.src for op in batch],
                [op.dst for op in batch],
                [op.nbytes for op in batch],
            )
            if rc != 0:
                raise TransportError(
                    f"Mooncake write of {sum(op.nbytes for op in batch)} bytes in {len(batch)} "
                    f"ops to {peer} failed: rc={rc}",
                    operation="write",
                )

    def close(self) -> None:
        with self._lock:
            for address in list(self._registered):
                self._engine.unregister_memory(address)
            self._registered.clear()
