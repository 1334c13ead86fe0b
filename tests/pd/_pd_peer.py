"""Child-process side of the transport tests: a receiver that registers memory and reports it.

Run through ``multiprocessing`` (spawn): ``receiver(name, conn)`` opens transport ``name``,
registers a zeroed 1 MiB buffer, sends ``(endpoint, address, size)`` and then answers
``"digest"`` with the sha256 of its buffer and ``"zero"`` by zeroing it, until ``"stop"``.
"""

from __future__ import annotations

import hashlib
from multiprocessing.connection import Connection

import torch

from hicache_store.pd.transport import open_transport

SIZE = 1 << 20
#: a transport's socket timeout: a hang detector (a 1 MiB transfer on loopback needs far
#: less even on a loaded machine), not a speed limit.
HANG_S = 120.0


def receiver(name: str, conn: Connection) -> None:
    transport = open_transport(name, timeout_s=HANG_S)
    buffer = torch.zeros(SIZE, dtype=torch.uint8)
    address = transport.register(buffer)
    conn.send((transport.endpoint, address, SIZE))
    try:
        while True:
            command = conn.recv()
            if command == "stop":
                return
            if command == "zero":
                buffer.zero_()
                conn.send("ok")
            else:
                conn.send(hashlib.sha256(buffer.numpy().tobytes()).hexdigest())
    finally:
        transport.unregister(buffer)
        transport.close()
