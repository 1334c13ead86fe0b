"""``s3://bucket/prefix``: objects in an S3-compatible object store, through boto3.

URL and options (URL query values are strings; keyword options override them)::

    s3://bucket/prefix?endpoint_url=http://127.0.0.1:8333&region=us-east-1&max_concurrency=32

Options (defaults in brackets; each explained in docs/guide/backends/s3.md): ``endpoint_url``
[AWS], ``region``, ``profile``, ``max_concurrency`` [16], ``multipart_threshold`` [64MiB],
``multipart_chunksize`` [16MiB], ``connect_timeout`` / ``read_timeout`` [2 / 5 s],
``max_attempts`` [3, botocore *standard* mode], ``request_timeout`` [15 s: one request of a call
from the caller's side, queueing and retries included], ``conditional_put`` [true: ``put_if_absent``
is one ``PUT`` with ``If-None-Match: *``], ``check_bucket`` [true: ``HEAD bucket`` at open],
``range_coalesce_gap`` [0], ``capacity_bytes`` [none], ``addressing_style``, ``verify_ssl``.

**Credentials**: boto3's standard chain or the options ``aws_access_key_id`` /
``aws_secret_access_key`` / ``aws_session_token``; handed to the boto3 session, never kept on
the backend, logged or put in an error text.

**Event loop, deadlines and retries.** Every SDK call runs on a bounded pool of
``max_concurrency`` threads (as many pooled connections). botocore retries throttling, 5xx and connection errors itself
(standard mode, ``max_attempts`` in all) within ``connect_timeout`` / ``read_timeout``; each
request awaits at most ``request_timeout``, so a dead, stopped or wedged server is a retryable
``BackendTimeoutError`` (or ``BackendUnavailableError``) within it, never a hang. A request that
overran its deadline ends in the background under botocore's own timeouts (about 25 s by
default).

**Buffer lifetime** (the ``Backend`` contract): threads touch caller memory only inside a
``Handoff``, while the call still waits: a GET lands in the thread's own memory and is copied
into the caller's buffer then; a PUT copies the caller's bytes first and uploads the copy. Once
the call has ended a late answer is dropped (why: docs/design/object-stores.md).

**Visibility.** A single ``PUT`` and a completed multipart upload are atomic (the old object,
the new one, or nothing); a failed multipart upload is aborted (best effort).

**Reads.** Whole objects are read into the request's own memory (a size that does not fit is
refused from ``Content-Length``); a range is a ``Range`` GET whose clamped answer or 416 is an
``InvalidRangeError``; ranges of one key within ``range_coalesce_gap`` bytes are one GET.

**Delete** asks ``HEAD`` which keys exist (``DeleteObjects`` answers for every key given),
then removes them, 1000 a request; a key written in between is kept and reported absent.

**Capacity.** Object stores have no useful capacity of their own. Three tools, from coarse to
fine: a bucket lifecycle rule (age-based expiry: docs/guide/backends/s3.md), ``hicache-store gc`` (size
budget and age, prefix-aware), and the optional ``capacity_bytes`` bound enforced here: the
backend lists its prefix at open and, before each write, deletes objects in chain-aware LRU
order (``_lru.ChainLRU``) until the batch fits. That bound covers what this process knows
(objects it listed at open, wrote, or found); several writers sharing a prefix each enforce
their own view, so give each a share, or use ``gc`` from one place.

**A fleet's index** (``index=valkey://host:port/N`` or ``redis://...``: ``backends.index``,
``_valkey_index``). Every process and host that writes the prefix shares one index on that
server: one ``capacity_bytes`` bound with chain-aware, page-whole eviction for all of them
(without ``capacity_bytes``: no bound, the rest as below), pins and retention
(``pin_fraction``, default 0.25; ``clock``), the change feed (``hicache-store events``,
``capabilities.change_feed``), ``exists`` in one round trip per batch (no ``HEAD`` per key),
the writers' leases and their recovery (``index_lease_s``, default 10), and calls to the
server bounded by ``index_timeout_s`` (default 2; unreachable: writes refused, ``exists``
falls back to ``HEAD``). Reads, ``stat`` and listings still ask the store. The prefix's name
in the index is its bucket and prefix (one index server per S3 service).
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import xxhash

from hicache_store.layout.errors import ConfigError

from ._index_check import check_index
from ._s3_capacity import LocalBound
from ._s3_client import S3Requests, S3Stats, open_client
from ._s3_errors import scrub
from ._s3_io import Fetch, plan_fetches
from ._s3_objects import S3Objects
from ._valkey_index import ValkeyIndex
from .base import Backend, ReadCounts, ReadRanges, removed_once
from .errors import BackendIOError, BackendUnavailableError
from .index import IndexCheck, Measured, Reservation, fleet_index_url, settle_or_unpublish
from .lifetime import Handoff
from .retention import DEFAULT_PIN_FRACTION, Retention, pin_budget_bytes
from .types import (
    BackendURL,
    Capabilities,
    DeletedUntilHeld,
    ObjectStat,
    convert_options,
    parse_size,
)

if TYPE_CHECKING:
    from .protocols import ChangeFeed

T = TypeVar("T")

#: S3's multipart floor (every part but the last must be at least this big).
MIN_PART_SIZE = 5 << 20
#: default deadlines (seconds): connecting, the longest silence on a connection, and one
#: request from the caller's side (retries included). A stopped server fails a call in
#: ``DEFAULT_REQUEST_TIMEOUT``; docs/guide/backends/deadlines.md has every backend's bounds in one table.
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_READ_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 15.0

_INT_OPTIONS = ("max_concurrency", "max_attempts")
_FLOAT_OPTIONS = ("connect_timeout", "read_timeout", "request_timeout", "pin_fraction",
                  "index_lease_s", "index_timeout_s")
_SIZE_OPTIONS = ("multipart_threshold", "multipart_chunksize", "capacity_bytes",
                 "range_coalesce_gap")
_BOOL_OPTIONS = ("conditional_put", "check_bucket", "verify_ssl")


class S3Backend(Backend):
    """Objects under ``s3://bucket/prefix/<key>``. See the module docstring for every option
    and guarantee. Build it with ``open_backend("s3://bucket/prefix?...")``.

    The wire (client, pool, deadlines, the requests themselves) is ``_s3_client.S3Requests``;
    the local ``capacity_bytes`` bound is ``_s3_capacity.LocalBound``; a fleet's index is
    ``_valkey_index.ValkeyIndex``. This class chooses which requests each call sends.
    """

    name = "s3"
    capabilities = Capabilities(
        ranged_reads=True, listing=True, atomic_put=True, persistent=True, shared=True,
        mtime=True,
    )

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        max_concurrency: int = 16,
        multipart_threshold: int | str = 64 << 20,
        multipart_chunksize: int | str = 16 << 20,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        max_attempts: int = 3,
        request_timeout: float | None = None,
        conditional_put: bool = True,
        check_bucket: bool = True,
        range_coalesce_gap: int | str = 0,
        capacity_bytes: int | str | None = None,
        addressing_style: str = "auto",
        verify_ssl: bool = True,
        index: str | None = None,
        index_lease_s: float = 10.0,
        index_timeout_s: float = 2.0,
        pin_fraction: float | str = DEFAULT_PIN_FRACTION,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__()
        if not bucket:
            raise ConfigError("s3:// needs a bucket, e.g. s3://my-bucket/kv")
        fleet_url = fleet_index_url(index)
        if index not in (None, "none") and fleet_url is None:
            raise ConfigError(f"index must be none or a server URL (valkey://host:port/N, "
                              f"redis://...), got {index!r}")
        pin_budget_bytes(0, float(pin_fraction))  # checks the fraction
        for name, count in (("max_concurrency", max_concurrency), ("max_attempts", max_attempts)):
            if count < 1:
                raise ConfigError(f"{name} must be >= 1, got {count}")
        if addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(f"addressing_style must be auto, path or virtual, not {addressing_style!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.max_concurrency = max_concurrency
        self.multipart_threshold = max(parse_size(multipart_threshold), MIN_PART_SIZE)
        self.multipart_chunksize = max(parse_size(multipart_chunksize), MIN_PART_SIZE)
        self.range_coalesce_gap = parse_size(range_coalesce_gap)
        self.request_timeout = (
            DEFAULT_REQUEST_TIMEOUT if request_timeout is None else request_timeout
        )
        self.conditional_put = conditional_put
        self.capacity_bytes = None if capacity_bytes is None else parse_size(capacity_bytes)
        #: the local bound (``capacity_bytes`` without a fleet's index), else None.
        self._bound: LocalBound | None = None
        caps = type(self).capabilities
        if not conditional_put:
            caps = caps.replace(atomic_put=False)
        if self.capacity_bytes is not None:
            caps = caps.replace(eviction=True, capacity_usage=True)
        if fleet_url is not None:
            caps = caps.replace(retention=True, change_feed=True)
        self.capabilities = caps
        #: the fleet's index (None: the store alone answers; see the module docstring).
        self._index: ValkeyIndex | None = None
        self.pin_budget_bytes = pin_budget_bytes(
            self.capacity_bytes if self.capacity_bytes is not None else 0, float(pin_fraction))
        # The SDK after every option is checked: a bad option is a ConfigError, boto3 or not.
        client = open_client(
            endpoint_url=endpoint_url, region=region, profile=profile,
            aws_access_key_id=aws_access_key_id, aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token, max_concurrency=max_concurrency,
            connect_timeout=connect_timeout, read_timeout=read_timeout,
            max_attempts=max_attempts, addressing_style=addressing_style, verify_ssl=verify_ssl,
        )
        self._requests = S3Requests(
            client, bucket, f"{self.prefix}/" if self.prefix else "",
            max_concurrency=max_concurrency, request_timeout=self.request_timeout,
        )
        #: request and wire counters (``_s3_client.S3Stats``).
        self.s3_stats: S3Stats = self._requests.stats
        try:
            if check_bucket:
                self._requests.check_bucket()
            if fleet_url is not None:
                req = self._requests
                site = S3Objects(req.head, req.delete_objects, req.list_page)
                self._index = ValkeyIndex(
                    fleet_url, xxhash.xxh3_64_hexdigest(f"s3:{bucket}/{self.prefix}".encode()), site,
                    writer=secrets.token_hex(8), lease_s=index_lease_s,
                    timeout_s=index_timeout_s, clock=clock,
                    connections=max(16, 2 * max_concurrency))
            elif self.capacity_bytes is not None:
                self._bound = LocalBound(self.capacity_bytes, self.stats, name=self.name)
                self._bound.learn(self._requests.list_all())
        except BaseException:
            self._requests.pool.shutdown(wait=False)
            raise

    @classmethod
    def from_url(cls, url: BackendURL, options: dict[str, Any]) -> S3Backend:
        """``s3://bucket[/prefix]`` plus the options of ``__init__`` (``region_name`` is
        accepted for ``region``)."""
        opts = convert_options(
            options, ints=_INT_OPTIONS, floats=_FLOAT_OPTIONS, sizes=_SIZE_OPTIONS,
            bools=_BOOL_OPTIONS,
        )
        if "region_name" in opts:
            opts.setdefault("region", opts.pop("region_name"))
        if not url.netloc:
            raise ConfigError("s3:// needs a bucket, e.g. s3://my-bucket/kv")
        return cls(url.netloc, url.path, **opts)

    def __repr__(self) -> str:
        endpoint = scrub(self.endpoint_url) if self.endpoint_url else "aws"
        return f"S3Backend(s3://{self.bucket}/{self.prefix}, endpoint={endpoint})"

    # -- exists / stat --------------------------------------------------------------------------

    async def _heads(self, keys: Sequence[str], operation: str) -> list[ObjectStat | None]:
        req = self._requests
        found = await asyncio.gather(*(req.run(operation, k, req.head, k, operation) for k in keys))
        if self._bound is not None:
            self._bound.found(found)
        return list(found)

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited. With a fleet's index: the index, in one round trip (it asks
        # the store itself when it cannot answer).
        if self._index is not None:
            return await self._requests.run_unbounded(self._index.exists, keys)
        return [st is not None for st in await self._heads(keys, "exists")]

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        # docstring inherited
        return await self._heads(keys, "stat")

    # -- reads ----------------------------------------------------------------------------------

    async def _get_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], ranges: ReadRanges
    ) -> ReadCounts:
        # docstring inherited
        fetches = plan_fetches(keys, ranges, self.range_coalesce_gap)
        handoff = Handoff()
        req = self._requests

        async def one(fetch: Fetch) -> None:
            if len(fetch.members) == 1:
                index = fetch.members[0][0]
                got = await req.run("get_into", fetch.key, req.fetch, fetch, buffers[index],
                                    handoff)
                results[index] = got if isinstance(got, int) else None
                return
            data = await req.run("get_into", fetch.key, req.fetch, fetch, None, handoff)
            for index, offset, length in fetch.members:
                if isinstance(data, memoryview):
                    buffers[index][:length] = data[offset : offset + length]  # on the loop
                    results[index] = length

        results: ReadCounts = [None] * len(keys)
        try:
            await asyncio.gather(*(one(f) for f in fetches))
        finally:
            handoff.close()  # requests still running (past a deadline) deliver nothing now
        if self._bound is not None:
            self._bound.touched([k for k, n in zip(keys, results, strict=True) if n is not None])
        return results

    # -- writes ---------------------------------------------------------------------------------

    async def _put_one(self, key: str, view: memoryview, handoff: Handoff) -> None:
        req = self._requests
        if len(view) >= self.multipart_threshold:
            await req.put_multipart(key, view, handoff, self.multipart_chunksize)
        else:
            await req.run("put", key, req.put_single, key, view, False, handoff)

    async def _evict(self, victims: list[str]) -> list[str]:
        return await self._requests.run("evict", None, self._requests.delete_objects, victims,
                                        "evict")

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        # docstring inherited. Each object is one atomic PUT (or completed multipart upload),
        # so on failure every object of the batch is whole or absent.
        latest = dict(zip(keys, buffers, strict=True))  # a key repeated: the last one wins
        if self._index is not None:
            await self._put_indexed(latest, if_absent=False)
            return
        if self._bound is not None:
            await self._bound.reserve({k: len(v) for k, v in latest.items()}, self._evict)
        handoff = Handoff()
        try:
            results = await asyncio.gather(
                *(self._put_one(k, v, handoff) for k, v in latest.items()),
                return_exceptions=True,
            )
        finally:
            handoff.close()  # a request past its deadline reads the caller's bytes no more
        if self._bound is not None:
            self._bound.added([
                (k, len(v)) for (k, v), r in zip(latest.items(), results, strict=True)
                if not isinstance(r, BaseException)
            ])
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _put_if_absent(self, key: str, buffer: memoryview) -> bool:
        # Atomic in the store: of racing conditional PUTs exactly one gets 200, the others 412.
        if not self.conditional_put:
            return await super()._put_if_absent(key, buffer)
        if self._index is not None:
            return await self._put_indexed({key: buffer}, if_absent=True)
        if self._bound is not None:
            await self._bound.reserve({key: len(buffer)}, self._evict)
        handoff = Handoff()
        req = self._requests
        try:
            wrote = await req.run("put_if_absent", key, req.put_single, key, buffer, True, handoff)
        finally:
            handoff.close()
        if wrote and self._bound is not None:
            self._bound.added([(key, len(buffer))])
        return wrote

    async def _put_indexed(self, latest: dict[str, memoryview], *, if_absent: bool) -> bool:
        """A put through the fleet's index: reserve (with its room), evict, upload, settle
        from what the uploads stored (module docstring). ``if_absent``: one conditional PUT;
        whether it stored."""
        assert self._index is not None
        index = self._index
        req = self._requests
        capacity = self.capacity_bytes if self.capacity_bytes is not None else 1 << 62
        keys = list(latest)
        try:
            reservation: Reservation = await req.run_unbounded(
                index.reserve, keys, [len(v) for v in latest.values()], capacity,
                self.pin_budget_bytes if self.capacity_bytes is not None else None)
        except BackendUnavailableError as exc:
            if exc.backend == "index":
                self.stats.index_refusals += 1
            raise
        results: list[Any] = []
        try:
            counts = await req.run_unbounded(index.make_room, capacity, reservation)
            self.stats.evictions += counts.evicted
            self.stats.eviction_failures += counts.failed
            handoff = Handoff()
            try:
                if if_absent:
                    (key, view), = latest.items()
                    results = [await req.run("put_if_absent", key, req.put_single, key, view,
                                             True, handoff)]
                else:
                    results = await asyncio.gather(
                        *(self._put_one(k, v, handoff) for k, v in latest.items()),
                        return_exceptions=True)
            finally:
                handoff.close()
            now = time.time()
            reservation.stored = {
                key: Measured(len(view), len(view), now)
                for (key, view), result in zip(latest.items(), results, strict=True)
                if not isinstance(result, BaseException) and result is not False}
        finally:
            await asyncio.shield(req.run_unbounded(settle_or_unpublish, index, reservation,
                                                   list(reservation.stored)))
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return bool(results) and results[0] is not False

    # -- retention, the change feed, the index (a fleet's index only) ----------------------------

    async def _retain(self, keys: Sequence[str], retention: Retention) -> None:
        # docstring inherited
        assert self._index is not None  # (the capability is declared with an index only)
        await self._requests.run_unbounded(self._index.retain, keys, retention,
                                           self.pin_budget_bytes)

    async def _release(self, keys: Sequence[str], owner: str) -> None:
        # docstring inherited
        assert self._index is not None
        await self._requests.run_unbounded(self._index.release, keys, owner)

    async def _retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        # docstring inherited
        assert self._index is not None
        return await self._requests.run_unbounded(self._index.retention_of, keys)

    async def _delete_until_held(self, groups: list[list[str]]) -> DeletedUntilHeld:
        # docstring inherited. The index reads the holds in the step that takes the keys out.
        assert self._index is not None
        done, removed = await self._requests.run_unbounded(self._index.delete_until_held, groups)
        return DeletedUntilHeld(done, tuple(removed))

    def _change_feed(self) -> ChangeFeed:
        assert self._index is not None
        return self._index

    async def check_index(self, *, repair: bool = False,
                          rebuild: bool = False) -> IndexCheck | None:
        # docstring inherited
        self._check_open("check_index")
        if self._index is None:
            return None
        return await self._requests.run_unbounded(functools.partial(
            check_index, self._index, self._index._site, "valkey", repair=repair,
            rebuild=rebuild))

    # -- delete / list ----------------------------------------------------------------------------

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited. HEAD first: DeleteObjects reports absent keys as deleted too.
        if self._index is not None:  # (the index removes through the same two calls)
            unique_keys = list(dict.fromkeys(keys))
            done = dict(zip(unique_keys,
                            await self._requests.run_unbounded(self._index.delete, unique_keys),
                            strict=True))
            return removed_once(keys, {k for k, ok in done.items() if ok})
        unique = list(dict.fromkeys(keys))
        present = [st.key for st in await self._heads(unique, "delete") if st is not None]
        failed = []
        if present:
            failed = await self._requests.run(
                "delete", None, self._requests.delete_objects, present, "delete")
        if failed:
            raise BackendIOError(
                f"the store refused to delete {len(failed)} object(s), e.g. {failed[0]}",
                backend=self.name, operation="delete", key=failed[0],
            )
        if self._bound is not None:
            self._bound.removed(present)
        return removed_once(keys, set(present))

    async def _list_entries(self, prefix: str) -> AsyncIterator[ObjectStat]:
        # docstring inherited. One listing request per 1000 objects, no HEADs: the listing
        # carries size and mtime. Pages are fetched one at a time: memory stays one page.
        token: str | None = None
        while True:
            entries, token = await self._requests.run(
                "list_prefix", None, self._requests.list_page, prefix, token)
            for entry in entries:
                yield entry
            if token is None:
                return

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        # docstring inherited. S3 listings are consistent and each key appears once.
        async for entry in self._list_entries(prefix):
            yield entry.key

    # -- capacity -------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects this backend accounts for (capacity mode; with a fleet's
        index, every writer's)."""
        if self._index is not None:
            return self._index.totals()[0]
        return self._bound.used_bytes if self._bound is not None else 0

    def _usage(self) -> tuple[int, int]:
        # docstring inherited: the fleet's index counters (a round trip each), else the local
        # bound's (in memory; a put is counted once its uploads are done)
        assert self.capacity_bytes is not None  # (declared only with capacity_bytes)
        if self._index is not None:
            return self.capacity_bytes, self._index.totals()[0] + self._index.reserved_bytes()
        return self.capacity_bytes, self.used_bytes

    async def _close(self) -> None:
        # docstring inherited
        await self._requests.drain()
        if self._index is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._index.close)
        self._requests.close()



__all__ = ["DEFAULT_REQUEST_TIMEOUT", "MIN_PART_SIZE", "S3Backend", "S3Stats"]
