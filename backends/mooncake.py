"""``mooncake://``: Mooncake Store, the distributed memory pool SGLang and vLLM use as L3.

URL and options (see ``_mooncake_config`` for the JSON file and ``MOONCAKE_*`` variables)::

    mooncake://127.0.0.1:50051?protocol=tcp&metadata=P2PHANDSHAKE&segment=0&buffer=16MiB
    mooncake://                      # everything from SGLang's JSON config / MOONCAKE_* env

How our contract maps onto Mooncake:

- **Writes** use ``batch_upsert_from``, so a rewrite replaces (Mooncake's ``put`` keeps the old
  value); an object is published only once its transfer completed, so no reader sees a part.
  ``put_if_absent`` checks, then ``batch_put_from``: two racers may both return True
  (``atomic_put`` is False; harmless for equal bytes).
- **Empty objects**: Mooncake cannot store 0 bytes, so an empty object is a one-byte marker
  under ``key + "~empty"`` (a name no valid storage key can take). A non-empty write does not
  remove a stale marker; readers prefer the real key, and ``delete`` removes both.
- **Reads** use ``batch_get_into`` (whole objects) and ``get_into_ranges`` (byte ranges,
  native: ``capabilities.ranged_reads``). Misses (-704, a replica not ready or gone) are
  ``None``; a buffer too small / a range past the end raises ``InvalidRangeError``.
- **Deletes** use ``batch_remove(force=True)``: without force, an object a reader recently
  leased cannot be removed for the lease period (-706).
- **Errors**: -800 (transfer failure, e.g. the segment holder died), -706/-707 (lease), -200
  (no segment space, e.g. no holder mounted), RPC failures -> ``BackendUnavailableError``
  with ``retryable=True``. A call that exceeds ``timeout`` raises ``BackendTimeoutError``.
  When a holder dies its objects are gone: reads turn into misses once the master unmounts
  it (``client_ttl``); a restarted holder serves new writes with no action on our side.
- **Eviction** is the master's (high watermark): evicted objects are misses.
- **Calls on one key** are ordered in the process (``KeyLocks`` in ``_mooncake_client``): a
  write or delete of a key runs alone, reads share. Mooncake's master lets two racing upserts
  of a key from one client mark the later one's buffer complete before its bytes arrived (a
  reader gets the new length and stale memory), rewrites same-size objects in place and frees
  force-removed ones under a reader. Between processes it cannot be ordered from here: those
  races stay Mooncake's, and the framed-object checksums reject their bytes at the tier.

Zero-copy and buffer ownership: memory registered with ``host_buffers().register`` (the cache
tier's host pool) is handed to the transfer engine directly. Any other caller buffer is
copied through registered staging slabs (``bounce`` bytes in all), so callers never need to
register anything for correctness. A registered buffer must stay alive and unmodified by
its owner while a call on it is in flight; ``host_buffers().unregister`` waits for in-flight
calls that use it.

Deadlines and buffer lifetime: a call that touches only staged memory gives up at ``timeout``
(default 15 s) with a retryable ``BackendTimeoutError``, and its worker touches the caller's
buffers only through a ``Handoff`` (a late read's bytes are dropped; a late put's keys are
force-removed). A call into registered caller memory is awaited to its end, past ``timeout`` if
need be; Mooncake's RPC and transfer timeouts are lowered to 10 s at setup
(``MOONCAKE_TIMEOUT_ENV``) so it still ends within about ``timeout`` (why:
docs/design/mooncake.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._aligned import address_of
from ._mooncake_client import (
    INVALID_PARAMS,
    MISS_CODES,
    OK,
    SharedClient,
    acquire,
    as_uint8,
    check_capacity,
    code_error,
    release,
)
from ._mooncake_config import MooncakeConfig
from .aio import wait_for
from .base import Backend, ReadCounts, ReadRanges
from .errors import BackendTimeoutError, InvalidRangeError
from .lifetime import CallAbandoned, Handoff, until_abandoned
from .types import BackendURL, ByteRange, Capabilities, ObjectStat
from .views import as_byte_view

log = logging.getLogger(__name__)
T = TypeVar("T")

#: suffix of the marker key that stands for an empty object (never part of a storage key).
EMPTY_SUFFIX = "~empty"
_MARKER = b"\x00"


class MooncakeBackend(Backend):
    """A ``Backend`` on ``MooncakeDistributedStore``; see the module docstring.

    Build with ``open_backend("mooncake://host:port", **options)`` or ``MooncakeBackend(
    MooncakeConfig(...))``. Construction is lazy: the process-wide client is acquired by the
    first call (or ``await backend.connect()``), on a worker thread.
    """

    name = "mooncake"
    capabilities = Capabilities(ranged_reads=True, eviction=True, shared=True, host_buffers=True)

    def __init__(self, config: MooncakeConfig) -> None:
        super().__init__()
        self.config = config
        self._client: SharedClient | None = None
        self._connect_lock = threading.Lock()
        self._host_regions: dict[int, int] = {}  # start -> length, registered by this backend
        self._pending: set[concurrent.futures.Future[Any]] = set()

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> MooncakeBackend:
        # docstring inherited
        if url.path not in ("", "/"):
            raise ValueError(f"mooncake:// takes host:port only, got path {url.path!r}")
        return cls(MooncakeConfig.resolve(url.netloc, options))

    # -- client and worker threads ----------------------------------------------------------

    def _client_sync(self) -> SharedClient:
        with self._connect_lock:
            if self._client is None:
                self._client = acquire(self.config)
            return self._client

    async def connect(self) -> None:
        """Set up (or join) the process's Mooncake client now instead of on the first call."""
        await asyncio.to_thread(self._client_sync)

    async def _run(
        self, fn: Callable[[SharedClient], T], *, operation: str,
        caller_memory: Sequence[memoryview] = (), handoff: Handoff | None = None,
        on_late: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``fn(client)`` on the client's worker pool with the configured deadline.

        ``caller_memory``: the caller's buffers the call reads or writes. When one lies in
        registered memory the transfer engine touches it directly and nothing can stop it: the
        call is awaited to its end, past the deadline if need be (Mooncake's own timeouts end
        it, see the module docstring). Otherwise ``fn`` touches caller memory only through
        ``handoff``, and on a timeout (or when the caller gives up) the handoff is closed (a
        copy in progress finishes first), ``on_late(result)`` runs when the call finishes
        (cleanup), and ``BackendTimeoutError`` (retryable) is raised now. ``handoff`` is
        closed whenever this returns or raises.
        """
        try:
            client = self._client if self._client is not None else await asyncio.to_thread(
                self._client_sync)
            zero_copy = any(len(b) and client.is_registered(address_of(b), len(b))
                            for b in caller_memory)
            future = client.executor.submit(client.call, fn, client)
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)
            running = asyncio.wrap_future(future)
            timeout = self.config.timeout or None
            if zero_copy:
                try:
                    return await wait_for(asyncio.shield(running), timeout)
                except TimeoutError:
                    log.warning("mooncake %s past its %ss deadline, into registered memory: "
                                "waiting for it to end", operation, self.config.timeout)
                    return await running
            try:
                # Nothing here touches the caller's memory outside ``handoff``: the caller may
                # stop waiting at the deadline or whenever it gives up (``until_abandoned``).
                return await until_abandoned(wait_for(asyncio.shield(running), timeout))
            except (TimeoutError, CallAbandoned) as exc:
                if handoff is not None:  # first: no copy starts once the call is given up
                    handoff.close()
                if not future.cancel() and on_late is not None:
                    cleanup = on_late

                    def finished_late(done: concurrent.futures.Future[T]) -> None:
                        if not done.cancelled() and done.exception() is None:
                            cleanup(done.result())
                    future.add_done_callback(finished_late)
                if isinstance(exc, CallAbandoned):
                    raise
                raise BackendTimeoutError(
                    f"{operation} took longer than {self.config.timeout}s",
                    backend=self.name, operation=operation,
                ) from None
        finally:
            if handoff is not None:
                handoff.close()

    async def drain(self) -> None:
        """Wait until every Mooncake call this backend started has returned (also the ones
        whose callers already got a ``BackendTimeoutError``)."""
        while self._pending:
            await asyncio.wrap_future(next(iter(self._pending)))

    # -- registration of host memory (zero-copy: ``capabilities.host_buffers``) ---------------

    async def _register_host_buffer(self, buffer: Any) -> bool:
        # docstring inherited. The buffer must stay alive until unregistered (the client keeps
        # a reference to it); reads into and writes from any slice of it then skip the staging
        # copy.
        view = as_byte_view(buffer, writable=True, what="host buffer")
        client = await asyncio.to_thread(self._client_sync)
        region = await asyncio.to_thread(client.register, view, buffer)
        self._host_regions[region.start] = region.end - region.start
        return True

    async def _unregister_host_buffer(self, buffer: Any) -> None:
        # docstring inherited. After waiting for in-flight calls.
        view = as_byte_view(buffer, writable=True, what="host buffer")
        start = address_of(view)
        if self._client is None or self._host_regions.pop(start, None) is None:
            return
        await self.drain()
        await asyncio.to_thread(self._client.unregister, start)

    # -- core ---------------------------------------------------------------------------------

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited. One RPC for real keys and empty-object markers together.
        probe = [*keys, *(k + EMPTY_SUFFIX for k in keys)]
        codes: list[int] = await self._run(
            lambda c: c.store.batch_is_exist(probe), operation="exists")
        n = len(keys)
        for code in codes:
            if code < 0:
                raise code_error(code, operation="exists")
        return [codes[i] == 1 or codes[n + i] == 1 for i in range(n)]

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        # docstring inherited
        await self._write(keys, buffers, upsert=True)

    async def _put_if_absent(self, key: str, buffer: memoryview) -> bool:
        # Check, then a non-replacing put: racers may both return True (equal bytes).
        if (await self._exists([key]))[0]:
            return False
        await self._write([key], [buffer], upsert=False)
        return True

    async def _write(
        self, keys: Sequence[str], buffers: Sequence[memoryview], *, upsert: bool
    ) -> None:
        empty = [k for k, b in zip(keys, buffers, strict=True) if len(b) == 0]
        items = [(k, b) for k, b in zip(keys, buffers, strict=True) if len(b) > 0]

        handoff = Handoff()

        def work(c: SharedClient) -> list[int]:
            # Runs on a worker thread. Staged buffers are copied into a slab here (through the
            # handoff: never once the call has ended) and the slab is returned only after
            # Mooncake has read it.
            put = c.store.batch_upsert_from if upsert else c.store.batch_put_from
            codes: dict[str, int] = {}
            direct = [(k, b, address_of(b)) for k, b in items]
            direct_ok = [(k, b, a) for k, b, a in direct if c.is_registered(a, len(b))]
            if direct_ok:
                with c.keys.hold(exclusive=[k for k, _, _ in direct_ok]):
                    got = put([k for k, _, _ in direct_ok], [a for _, _, a in direct_ok],
                              [len(b) for _, b, _ in direct_ok])
                codes.update(zip([k for k, _, _ in direct_ok], got, strict=True))
            staged = [(k, b) for k, b, a in direct if not c.is_registered(a, len(b))]
            for chunk in _chunks(staged, c.slab_bytes):
                with c.staging(sum(len(b) for _, b in chunk)) as (slab, base):
                    arr, offsets, off = as_uint8(slab), [], 0
                    for _, b in chunk:
                        offsets.append(base + off)
                        off += len(b)

                    def fill(chunk: list[tuple[Any, memoryview]] = chunk,
                             arr: Any = arr, base: int = base, offsets: list[int] = offsets) -> None:
                        for (_, b), at in zip(chunk, offsets, strict=True):
                            arr[at - base : at - base + len(b)] = as_uint8(b)

                    if not handoff.deliver(fill):
                        raise CallAbandoned  # the call ended: its buffers are not ours to read
                    # Key locks are taken last (slab first) and only around Mooncake calls:
                    # nobody waits for a slab while holding a key.
                    with c.keys.hold(exclusive=[k for k, _ in chunk]):
                        got = put([k for k, _ in chunk], offsets, [len(b) for _, b in chunk])
                codes.update(zip([k for k, _ in chunk], got, strict=True))
            if empty:
                # An empty object: drop the real key, write the one-byte marker.
                with c.staging(1) as (slab, base):
                    slab[0:1] = _MARKER
                    with c.keys.hold(exclusive=[*empty, *(k + EMPTY_SUFFIX for k in empty)]):
                        c.store.batch_remove(list(empty), True)
                        got = put([k + EMPTY_SUFFIX for k in empty], [base] * len(empty),
                                  [1] * len(empty))
                codes.update(zip(empty, got, strict=True))
            return [codes[k] for k in keys]

        def undo(_codes: list[int]) -> None:
            # A put that outlived its deadline: its source bytes may have been reused, so the
            # objects it wrote cannot be trusted. Remove them (best effort).
            client = self._client
            if client is not None and client.store is not None:
                written = [*keys, *(k + EMPTY_SUFFIX for k in empty)]
                with client.keys.hold(exclusive=written):
                    client.store.batch_remove(written, True)

        codes = await self._run(work, operation="put", caller_memory=buffers,
                                handoff=handoff, on_late=undo)
        for key, code in zip(keys, codes, strict=True):
            check_capacity(code, key)

    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: ReadRanges
    ) -> ReadCounts:
        # docstring inherited
        whole = [i for i, r in enumerate(ranges) if r is None]
        ranged = [i for i, r in enumerate(ranges) if r is not None]
        results: ReadCounts = [None] * len(keys)
        if whole:
            got = await self._read_whole([keys[i] for i in whole], [buffers[i] for i in whole])
            for i, n in zip(whole, got, strict=True):
                results[i] = n
        if ranged:
            got = await self._read_ranges(
                [keys[i] for i in ranged], [buffers[i] for i in ranged],
                [r for i in ranged if (r := ranges[i]) is not None])
            for i, n in zip(ranged, got, strict=True):
                results[i] = n
        return results

    async def _read_whole(
        self, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        handoff = Handoff()

        def work(c: SharedClient) -> list[int]:
            codes = [0] * len(keys)
            addrs = [address_of(b) for b in buffers]
            direct = [i for i in range(len(keys)) if c.is_registered(addrs[i], len(buffers[i]))]
            if direct:
                with c.keys.hold(shared=[keys[i] for i in direct]):
                    got = c.store.batch_get_into([keys[i] for i in direct],
                                                 [addrs[i] for i in direct],
                                                 [len(buffers[i]) for i in direct])
                for i, code in zip(direct, got, strict=True):
                    codes[i] = code
            chosen = set(direct)
            staged = [(i, buffers[i]) for i in range(len(keys)) if i not in chosen]
            for chunk in _chunks(staged, c.slab_bytes):
                # One slab at a time (no call holds two: no deadlock between callers). The
                # copy out to the caller goes through the handoff: none once the call ended.
                with c.staging(sum(len(b) for _, b in chunk)) as (slab, base):
                    offsets, off = [], 0
                    for _, b in chunk:
                        offsets.append(off)
                        off += len(b)
                    with c.keys.hold(shared=[keys[i] for i, _ in chunk]):
                        got = c.store.batch_get_into([keys[i] for i, _ in chunk],
                                                     [base + o for o in offsets],
                                                     [len(b) for _, b in chunk])
                    for (i, _b), code in zip(chunk, got, strict=True):
                        codes[i] = code

                    def out(chunk: list[tuple[int, memoryview]] = chunk, slab: memoryview = slab,
                            offsets: list[int] = offsets, got: list[int] = got) -> None:
                        for (_, b), o, code in zip(chunk, offsets, got, strict=True):
                            if code > 0:
                                as_uint8(b)[:code] = as_uint8(slab[o : o + code])

                    if not handoff.deliver(out):
                        raise CallAbandoned
            return codes

        codes = await self._run(work, operation="get_into", caller_memory=buffers,
                                handoff=handoff)
        return await self._finish_reads(keys, buffers, codes)

    async def _finish_reads(
        self, keys: Sequence[str], buffers: Sequence[memoryview], codes: list[int]
    ) -> list[int | None]:
        results: list[int | None] = []
        missing: list[int] = []
        for i, (key, code) in enumerate(zip(keys, codes, strict=True)):
            if code >= 0:
                results.append(code)
            elif code in MISS_CODES:
                results.append(None)
                missing.append(i)
            elif code == INVALID_PARAMS:
                (size,) = await self._sizes([key])
                if size is not None and size > len(buffers[i]):
                    raise InvalidRangeError(
                        f"object of {size} bytes does not fit a {len(buffers[i])}-byte buffer",
                        backend=self.name, operation="get_into", key=key)
                raise code_error(code, operation="get_into", key=key)
            else:
                raise code_error(code, operation="get_into", key=key)
        for i in await self._empty_objects(keys, missing):
            results[i] = 0
        return results

    async def _read_ranges(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: Sequence[ByteRange]
    ) -> list[int | None]:
        # ``get_into_ranges`` needs registered destinations even over TCP: registered buffers
        # are used directly, the others go through a slab (one at a time, as above).
        handoff = Handoff()

        def work(c: SharedClient) -> list[int]:
            codes = [0] * len(keys)
            for i, (key, rng, buf) in enumerate(zip(keys, ranges, buffers, strict=True)):
                addr = address_of(buf)
                if c.is_registered(addr, rng.length):
                    with c.keys.hold(shared=[key]):
                        out = c.store.get_into_ranges(
                            [addr], [[key]], [[[0]]], [[[rng.start]]], [[[rng.length]]])
                    codes[i] = out[0][0][0]
                    continue
                with c.staging(rng.length) as (slab, base):
                    with c.keys.hold(shared=[key]):
                        out = c.store.get_into_ranges(
                            [base], [[key]], [[[0]]], [[[rng.start]]], [[[rng.length]]])
                    codes[i] = out[0][0][0]

                    def copy(buf: memoryview = buf, slab: memoryview = slab,
                             n: int = rng.length) -> None:
                        as_uint8(buf)[:n] = as_uint8(slab[:n])

                    if codes[i] > 0 and not handoff.deliver(copy):
                        raise CallAbandoned
            return codes

        codes = await self._run(work, operation="get_into", caller_memory=buffers,
                                handoff=handoff)
        results: list[int | None] = []
        missing: list[int] = []
        for i, (key, rng, code) in enumerate(zip(keys, ranges, codes, strict=True)):
            if code >= 0:
                results.append(rng.length)
            elif code in MISS_CODES:
                results.append(None)
                missing.append(i)
            elif code == INVALID_PARAMS:
                (size,) = await self._sizes([key])
                if size is None:
                    results.append(None)
                    continue
                rng.check_within(size, backend=self.name, key=key)
                raise code_error(code, operation="get_into", key=key)
            else:
                raise code_error(code, operation="get_into", key=key)
        for i in await self._empty_objects(keys, missing):
            # An empty object has no bytes: any range of it reaches past its end.
            ranges[i].check_within(0, backend=self.name, key=keys[i])
        return results

    async def _empty_objects(self, keys: Sequence[str], missing: list[int]) -> list[int]:
        """Those of ``missing`` (indices of read misses in ``keys``) that are empty objects:
        the store holds no zero-byte value, so an empty object is a marker key beside it."""
        if not missing:
            return []
        probe = [keys[i] + EMPTY_SUFFIX for i in missing]
        markers = await self._run(lambda c: c.store.batch_is_exist(probe), operation="get_into")
        return [i for i, hit in zip(missing, markers, strict=True) if hit == 1]

    async def _sizes(self, keys: Sequence[str]) -> list[int | None]:
        def work(c: SharedClient) -> list[int]:
            sizes = []
            for key in keys:
                size = c.store.get_size(key)
                if size in MISS_CODES and c.store.is_exist(key + EMPTY_SUFFIX) == 1:
                    size = 0  # an empty object's marker
                sizes.append(size)
            return sizes

        sizes = await self._run(work, operation="stat")
        out: list[int | None] = []
        for key, size in zip(keys, sizes, strict=True):
            if size >= 0:
                out.append(size)
            elif size in MISS_CODES:
                out.append(None)
            else:
                raise code_error(size, operation="stat", key=key)
        return out

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        # docstring inherited
        sizes = await self._sizes(keys)
        return [None if s is None else ObjectStat(k, s) for k, s in zip(keys, sizes, strict=True)]

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited. Forced: a reader's lease must not keep a deleted object alive.
        probe = [*keys, *(k + EMPTY_SUFFIX for k in keys)]

        def remove(c: SharedClient) -> list[int]:
            with c.keys.hold(exclusive=probe):  # a read in flight finishes on the old bytes
                result: list[int] = c.store.batch_remove(probe, True)
                return result

        codes = await self._run(remove, operation="delete")
        n = len(keys)
        for code in codes:
            if code != OK and code not in MISS_CODES:
                raise code_error(code, operation="delete")
        return [codes[i] == OK or codes[n + i] == OK for i in range(n)]

    async def _close(self) -> None:
        # docstring inherited. Waits for calls still running, then drops our reference to
        # the shared client (the last backend using it closes it).
        await self.drain()
        client, self._client = self._client, None
        if client is None:
            return
        for start in list(self._host_regions):
            await asyncio.to_thread(client.unregister, start)
        self._host_regions.clear()
        await asyncio.to_thread(release, client)


def _chunks(
    items: Sequence[tuple[Any, memoryview]], limit: int
) -> list[list[tuple[Any, memoryview]]]:
    """Group items into runs whose byte total fits ``limit`` (an oversized item goes alone)."""
    chunks: list[list[tuple[Any, memoryview]]] = []
    current: list[tuple[Any, memoryview]] = []
    size = 0
    for item in items:
        n = len(item[1])
        if current and size + n > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        chunks.append(current)
    return chunks
