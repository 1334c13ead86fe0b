"""``Deadline``: a call's or batch's time is a floor plus its bytes at a minimum bandwidth, and a
``put`` batch that runs out of it keeps (and reports) the leading objects it stored."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_store.backends import open_backend
from hicache_store.backends.faulty import FaultConfig, FaultyBackend
from hicache_store.layout.errors import ConfigError
from hicache_store.layout.keys import ObjectCoords, ObjectKey
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.objects import (
    DEFAULT_IO_TIMEOUT_S,
    DEFAULT_MIN_BANDWIDTH_MIB_S,
    Deadline,
    Frame,
    ObjectIO,
)
from hicache_store.sglang_config import AdapterConfig

MiB = 1 << 20
NS = Namespace.create("m", ModelShape.mha(4, 2, 8), "float16", 4, Grid(4, 2))
COORDS = ObjectCoords(0, 4, 0)
PAYLOAD = 4 * 2 * 4 * 2 * 8 * 2  # layers x K/V x tokens x heads x dim x 2 bytes


def test_the_deadline_is_a_floor_plus_the_bytes_at_the_minimum_bandwidth() -> None:
    d = Deadline(2.0, 8.0)
    assert d.seconds(0) == 2.0
    assert d.seconds(8 * MiB) == 3.0
    assert d.seconds(100 * MiB) == 2.0 + 100 / 8
    assert Deadline().seconds(0) == DEFAULT_IO_TIMEOUT_S
    assert Deadline().seconds(MiB) == DEFAULT_IO_TIMEOUT_S + 1 / DEFAULT_MIN_BANDWIDTH_MIB_S
    with pytest.raises(ValueError, match="io_timeout_s"):
        Deadline(0.0, 8.0)
    with pytest.raises(ValueError, match="min_bandwidth_mib_s"):
        Deadline(1.0, 0.0)
    with pytest.raises(ValueError, match="-1 bytes"):
        d.seconds(-1)


def test_object_io_and_the_adapter_config_share_the_rule() -> None:
    io = ObjectIO(open_backend("memory://"), NS, io_timeout_s=3.0, min_bandwidth_mib_s=4.0)
    assert io.deadline == Deadline(3.0, 4.0) and io.io_timeout_s == 3.0
    cfg = AdapterConfig.from_extra_config({"url": "memory://", "min_bandwidth_mib_s": 2.5})
    assert cfg.min_bandwidth_mib_s == 2.5
    assert AdapterConfig.from_extra_config({"url": "memory://"}).min_bandwidth_mib_s == (
        DEFAULT_MIN_BANDWIDTH_MIB_S)
    with pytest.raises(ConfigError, match="min_bandwidth_mib_s must be > 0"):
        AdapterConfig.from_extra_config({"url": "memory://", "min_bandwidth_mib_s": 0})


async def test_a_batch_out_of_time_keeps_and_reports_its_leading_objects() -> None:
    # One frame in flight at a time (the byte budget), each put 0.3 s: 12 frames need 3.6 s.
    # The bandwidth buys 0.25 s per frame, so the batch gets 0.25 + 12 x 0.25 = 3.25 s: the
    # last frame cannot be reached however fast the machine is (puts only get slower), and
    # a started put has 0.25 + 0.25 s for its 0.3 s (a margin of 0.2 s for a busy machine),
    # where a deadline of the floor alone (0.25 s) would fail every put.
    store = FaultyBackend(open_backend("memory://"))
    probe = ObjectIO(store, NS)
    header = probe.header_bytes(COORDS.num_layers)
    frame_bytes = header + PAYLOAD
    n = 12
    io = ObjectIO(store, NS, max_inflight_bytes=frame_bytes, io_timeout_s=0.25,
                  min_bandwidth_mib_s=frame_bytes / 0.25 / MiB)
    hashes = [f"{i + 1:064x}" for i in range(n)]
    frames = []
    for i, h in enumerate(hashes):
        buf = memoryview(bytearray(frame_bytes))
        np.frombuffer(buf, dtype=np.uint8)[header:] = i + 1
        frames.append(Frame(ObjectKey(h, NS.digest, COORDS), buf))
    store.faults = FaultConfig(latency_s=0.3)
    done = await io.put(frames)
    store.faults = FaultConfig()
    stored = done.index(False) if False in done else n
    assert 0 < stored < n, done
    assert done == [True] * stored + [False] * (n - stored), "a leading run, then nothing"
    keys = [io.storage_key(f.key) for f in frames]
    there = await store.exists(keys)
    assert there[:stored] == [True] * stored, "every object reported stored is stored"
    # The frame cut in flight at the deadline may still have landed (``put``'s contract: the
    # backend's write cannot be called back); none after it was started.
    assert there[stored + 1 :] == [False] * (n - stored - 1), "nothing after the cut one"
    for i in range(stored):
        out = np.zeros(PAYLOAD, dtype=np.uint8)
        assert await io.read_blocks(frames[i].key, out.data, payload_bytes=PAYLOAD) is not None
        assert (out == i + 1).all()
    await store.close()
