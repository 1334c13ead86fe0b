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


def receiver(name: str, conn: Connection) -> None:
    transport = open_transport(name, timeout_s=5.0)
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
