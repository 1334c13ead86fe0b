"""``faulty://``: a wrapper that injects faults into any backend, at seeded rates.

Used by the tests of every layer above the backends (the cache tier must degrade to
recomputation, never hang or serve wrong bytes). With every rate at zero it is transparent:
it forwards each call unchanged and passes the conformance suite like the backend it wraps.

Faults (``FaultConfig``; rates are probabilities in [0, 1], drawn from one seeded RNG so a run
is reproducible for a given sequence of calls):

- ``error_rate`` / ``read_error_rate`` / ``write_error_rate``: the call raises a retryable
  ``BackendUnavailableError`` before reaching the wrapped backend (per call).
- ``timeout_rate``: the call sleeps ``timeout_s`` and raises ``BackendTimeoutError``.
- ``latency_s`` (+ uniform ``latency_jitter_s``): added before every call.
- ``inflight_latency_s``: reads whose I/O keeps running after the caller gives up. Each read
  (a ``get_into`` batch or a ``get_scatter``) fetches the bytes from the wrapped backend into
  memory of its own at once, and they land in the caller's buffers ``inflight_latency_s``
  later, from an event-loop timer that neither cancelling the call nor a ``wait_for``
  deadline stops: a slow device or a remote store still transferring into memory the caller
  has stopped waiting for. Under the ``Backend`` contract the public call still ends only
  after the bytes landed (its cancellation waits for them); code that bypasses the contract
  (calling the core directly) sees them land after it gave up. That is the hazard of an L3
  slower than the tier's ``io_timeout_s``, reproduced without root or a slow disk.
  ``inflight_jitter_s`` adds a uniform random part per read, so that against a deadline in
  between some reads make it and others are abandoned in flight.
- ``out_of_space_rate``: a ``put`` raises ``OutOfSpaceError`` (1.0 = a full disk); reads go on.
- ``torn_write_rate``: per object, only a random prefix is stored and the put reports success:
  a store that breaks the all-or-nothing contract, for testing the framing layer's defence.
- ``bit_flip_rate``: per object read (a key of ``get_into``, or a ``get_scatter``), one random
  bit of the bytes delivered to the caller is flipped (the stored copy stays intact): silent
  media or transfer corruption.

``faults`` may be replaced at any time (``store.faults = FaultConfig(...)``); ``injected``
counts what was injected, by kind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_store.layout.errors import ConfigError

from .base import Backend, ReadCounts, ReadRanges
from .errors import BackendTimeoutError, BackendUnavailableError, OutOfSpaceError
from .lifetime import until_abandoned
from .protocols import ChangeFeed
from .retention import Retention
from .types import (
    BackendURL,
    ByteRange,
    Capabilities,
    DeletedUntilHeld,
    ObjectStat,
    convert_options,
    unknown_options_error,
)


@dataclass(frozen=True)
class FaultConfig:
    """What to inject; all zero (the default) means nothing."""

    seed: int = 0
    error_rate: float = 0.0
    read_error_rate: float = 0.0
    write_error_rate: float = 0.0
    timeout_rate: float = 0.0
    timeout_s: float = 0.05
    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    inflight_latency_s: float = 0.0
    inflight_jitter_s: float = 0.0
    out_of_space_rate: float = 0.0
    torn_write_rate: float = 0.0
    bit_flip_rate: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_rate") and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{f.name} must be in [0, 1], got {value}")
            if f.name.endswith("_s") and value < 0:
                raise ConfigError(f"{f.name} must be >= 0, got {value}")

    @property
    def reads_in_flight(self) -> bool:
        """Whether reads land late (``inflight_latency_s`` / ``inflight_jitter_s``)."""
        return self.inflight_latency_s > 0 or self.inflight_jitter_s > 0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> FaultConfig:
        """Build from string or typed options (URL query values are strings)."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = set(options) - set(names)
        if unknown:
            raise unknown_options_error("fault", unknown, names)
        floats = [name for name in names if name != "seed"]
        return cls(**convert_options(options, ints=("seed",), floats=floats))


class FaultyBackend(Backend):
    """Wraps ``inner`` and injects the faults of ``faults``. Closing it closes ``inner``."""

    name = "faulty"

    def __init__(self, inner: Backend, faults: FaultConfig | None = None) -> None:
        super().__init__()
        self.inner = inner
        # The optional abilities bypass the injected faults (their own paths, never wrapped):
        # not offered here.
        self.capabilities: Capabilities = inner.capabilities.replace(
            host_buffers=False, inline_exists=False, native_reads=False,
            native_writes=False)
        self.injected: Counter[str] = Counter()
        self._faults = FaultConfig()
        self._rng = random.Random(0)
        self.faults = faults or FaultConfig()

    @property
    def faults(self) -> FaultConfig:
        return self._faults

    @faults.setter
    def faults(self, config: FaultConfig) -> None:
        self._faults = config
        self._rng = random.Random(config.seed)

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> FaultyBackend:
        """``faulty://?inner=memory://&error_rate=0.1``: ``inner`` is a URL, a config dict or a
        ``Backend``; every other option is a ``FaultConfig`` field."""
        from .registry import open_backend

        opts = dict(options)
        inner = opts.pop("inner", None)
        if url.location and inner is None:
            inner = url.location if "://" in url.location else None
        if inner is None:
            raise ConfigError("faulty:// needs an inner backend: faulty://?inner=memory://")
        faults = FaultConfig.from_options(opts)  # validated before the inner store is opened
        backend = inner if isinstance(inner, Backend) else open_backend(inner)
        return cls(backend, faults)

    def _chance(self, rate: float) -> bool:
        return rate > 0.0 and self._rng.random() < rate

    async def _before(self, operation: str, *, writing: bool) -> None:
        f = self._faults
        delay = f.latency_s + (self._rng.uniform(0.0, f.latency_jitter_s) if f.latency_jitter_s else 0.0)
        # Injected waits touch no caller memory: a caller that gives up ends them at once.
        if delay:
            await until_abandoned(asyncio.sleep(delay))
        if self._chance(f.timeout_rate):
            self.injected["timeout"] += 1
            await until_abandoned(asyncio.sleep(f.timeout_s))
            raise BackendTimeoutError(
                f"injected timeout after {f.timeout_s}s", backend=self.name, operation=operation
            )
        specific = f.write_error_rate if writing else f.read_error_rate
        if self._chance(f.error_rate) or self._chance(specific):
            self.injected["error"] += 1
            raise BackendUnavailableError(
                "injected failure", retryable=True, backend=self.name, operation=operation
            )
        if writing and self._chance(f.out_of_space_rate):
            self.injected["out_of_space"] += 1
            raise OutOfSpaceError(
                "injected: no space left on device", backend=self.name, operation=operation
            )

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        await self._before("exists", writing=False)
        return await self.inner.exists(keys)

    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: ReadRanges
    ) -> ReadCounts:
        await self._before("get_into", writing=False)
        if self._faults.reads_in_flight:
            staged = [bytearray(len(buf)) for buf in buffers]
            results = await self.inner.get_into(keys, staged, ranges)
            await self._land_late(
                [(buf, memoryview(st), n) for buf, st, n in zip(buffers, staged, results, strict=True)]
            )
        else:
            results = await self.inner.get_into(keys, buffers, ranges)
        for buf, n in zip(buffers, results, strict=True):
            if n and self._chance(self._faults.bit_flip_rate):
                self.injected["bit_flip"] += 1
                bit = self._rng.randrange(n * 8)
                buf[bit // 8] ^= 1 << (bit % 8)
        return results

    async def _get_scatter(
        self, key: str, buffers: Sequence[memoryview], byte_range: ByteRange | None
    ) -> int | None:
        # Forwarded to the inner backend's own scatter read (its one-request path, if it has
        # one), with the same faults as a read: errors, timeouts, latency, one flipped bit.
        await self._before("get_scatter", writing=False)
        if self._faults.reads_in_flight:
            staged = [bytearray(len(buf)) for buf in buffers]
            n = await self.inner.get_scatter(key, staged, byte_range)
            left = n or 0  # a whole object may fill the buffers only partly
            copies: list[tuple[memoryview, memoryview, int | None]] = []
            for buf, st in zip(buffers, staged, strict=True):
                copies.append((buf, memoryview(st), None if n is None else min(left, len(buf))))
                left -= min(left, len(buf))
            await self._land_late(copies)
        else:
            n = await self.inner.get_scatter(key, buffers, byte_range)
        if n and self._chance(self._faults.bit_flip_rate):
            self.injected["bit_flip"] += 1
            bit = self._rng.randrange(n * 8)
            for buf in buffers:  # the public method gave exactly n bytes of buffers
                if bit < len(buf) * 8:
                    buf[bit // 8] ^= 1 << (bit % 8)
                    break
                bit -= len(buf) * 8
        return n

    async def _land_late(self, copies: Sequence[tuple[memoryview, memoryview, int | None]]) -> None:
        """Copy each ``(dest, staged, n)`` (the first ``n`` bytes; ``None``: nothing) into the
        caller's memory ``inflight_latency_s`` from now, whatever happens to this call."""
        loop = asyncio.get_running_loop()
        landed = loop.create_future()

        def land() -> None:
            # An armed timer is not cancelled with the call: the "device" finishes regardless.
            for dest, staged, n in copies:
                if n:
                    dest[:n] = staged[:n]
            self.injected["inflight_read"] += 1
            if not landed.done():
                landed.set_result(None)

        f = self._faults
        jitter = self._rng.uniform(0.0, f.inflight_jitter_s) if f.inflight_jitter_s else 0.0
        loop.call_later(f.inflight_latency_s + jitter, land)
        await landed

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        await self._before("put", writing=True)
        stored: list[memoryview] = []
        for buf in buffers:
            if len(buf) and self._chance(self._faults.torn_write_rate):
                self.injected["torn_write"] += 1
                stored.append(buf[: self._rng.randrange(len(buf))])
            else:
                stored.append(buf)
        await self.inner.put(keys, stored)

    async def _put_if_absent(self, key: str, buffer: memoryview) -> bool:
        await self._before("put_if_absent", writing=True)
        return await self.inner.put_if_absent(key, buffer)

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        await self._before("delete", writing=True)
        return await self.inner.delete(keys)

    async def _delete_until_held(self, groups: list[list[str]]) -> DeletedUntilHeld:
        await self._before("delete", writing=True)
        return await self.inner.delete_until_held(groups)

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        await self._before("stat", writing=False)
        return await self.inner.stat(keys)

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        await self._before("list_prefix", writing=False)
        async for key in self.inner.list_prefix(prefix):
            yield key

    async def _retain(self, keys: Sequence[str], retention: Retention) -> None:
        await self._before("retain", writing=False)  # latency, timeouts, errors; no ENOSPC
        await self.inner.retain(keys, retention)

    async def _release(self, keys: Sequence[str], owner: str) -> None:
        await self._before("release", writing=False)
        await self.inner.release(keys, owner)

    async def _retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        await self._before("retention_of", writing=False)
        return await self.inner.retention_of(keys)

    def _change_feed(self) -> ChangeFeed:
        # docstring inherited: the inner store's feed (no fault: a feed read moves no object),
        # which names the puts and deletes made through this wrapper as the inner made them
        return self.inner.change_feed()

    def _usage(self) -> tuple[int, int]:
        # docstring inherited: the inner store's counters (no fault: nothing is moved)
        return self.inner.capacity_usage().usage()

    async def _close(self) -> None:
        await self.inner.close()
