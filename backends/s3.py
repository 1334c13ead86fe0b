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
import concurrent.futures
import contextlib
import functools
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import xxhash

from hicache_store.layout.errors import ConfigError, InvalidKeyError
from hicache_store.layout.keys import validate_storage_key

from . import _s3_errors
from ._index_check import check_index
from ._lru import ChainLRU
from ._s3_io import Fetch, ViewReader, parse_content_range, plan_fetches, read_exact
from ._s3_objects import S3Objects
from ._valkey_index import ValkeyIndex
from .base import Backend
from .errors import (
    BackendError,
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    InvalidRangeError,
)
from .index import IndexCheck, Measured, Reservation, fleet_index_url
from .lifetime import CallAbandoned, Handoff, abandonable, until_abandoned
from .retention import DEFAULT_PIN_FRACTION, Retention, pin_budget_bytes
from .types import (
    BackendURL,
    ByteRange,
    Capabilities,
    DeletedUntilHeld,
    ObjectStat,
    convert_options,
    parse_size,
)

if TYPE_CHECKING:
    from .protocols import ChangeFeed

T = TypeVar("T")

#: S3 ``DeleteObjects`` takes at most this many keys per request.
DELETE_BATCH = 1000
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


def _snapshot(view: memoryview, handoff: Handoff) -> memoryview:
    """A copy of the caller's bytes, taken while its call still waits (on a pool thread).

    The upload then reads only the copy, so a request that outlives its call never reads the
    caller's buffer (which the caller may already reuse). ``CallAbandoned`` when the call
    ended before this thread got to it.
    """
    box: list[bytes] = []
    if not handoff.deliver(lambda: box.append(bytes(view))):
        raise CallAbandoned
    return memoryview(box[0])


@dataclass
class S3Stats:
    """Request and wire counters of one S3 backend (monotonic; updated from pool threads
    under the backend's lock). ``bytes_received`` / ``bytes_sent`` count object bodies."""

    requests: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    retries: int = 0
    multipart_uploads: int = 0


class S3Backend(Backend):
    """Objects under ``s3://bucket/prefix/<key>``. See the module docstring for every option
    and guarantee. Build it with ``open_backend("s3://bucket/prefix?...")``."""

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
        self._base = f"{self.prefix}/" if self.prefix else ""
        self.endpoint_url = endpoint_url
        self.max_concurrency = max_concurrency
        self.multipart_threshold = max(parse_size(multipart_threshold), MIN_PART_SIZE)
        self.multipart_chunksize = max(parse_size(multipart_chunksize), MIN_PART_SIZE)
        self.range_coalesce_gap = parse_size(range_coalesce_gap)
        self.request_timeout = (
            DEFAULT_REQUEST_TIMEOUT if request_timeout is None else request_timeout
        )
        self.conditional_put = conditional_put
        self.s3_stats = S3Stats()
        self._lock = threading.Lock()  # guards s3_stats, _lru, _reserved
        self.capacity_bytes = None if capacity_bytes is None else parse_size(capacity_bytes)
        self._lru = ChainLRU()
        caps = type(self).capabilities
        if not conditional_put:
            caps = caps.replace(atomic_put=False)
        if self.capacity_bytes is not None:
            caps = caps.replace(eviction=True)
        if fleet_url is not None:
            caps = caps.replace(retention=True, change_feed=True)
        self.capabilities = caps
        #: the fleet's index (None: the store alone answers; see the module docstring).
        self._index: ValkeyIndex | None = None
        self.pin_budget_bytes = pin_budget_bytes(
            self.capacity_bytes if self.capacity_bytes is not None else 0, float(pin_fraction))
        # The SDK after every option is checked: a bad option is a ConfigError, boto3 or not.
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # the registry turns this into an install hint
            raise ImportError(f"the s3 backend needs boto3 ({exc})", name="boto3") from exc
        # Credentials go into the session and nowhere else.
        session = boto3.session.Session(
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token,
            region_name=region,
            profile_name=profile,
        )
        config = Config(
            max_pool_connections=max_concurrency,
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            tcp_keepalive=True,
            s3={"addressing_style": addressing_style},
        )
        self._client: Any = session.client(
            "s3", endpoint_url=endpoint_url, config=config, verify=verify_ssl
        )
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="hicache-s3")
        try:
            if check_bucket:
                # On a pool thread, bounded like every request: a stopped server fails the
                # open in ``request_timeout``, not in botocore's retries of its timeouts.
                job = self._pool.submit(
                    self._sync_call, "open", None, self._client.head_bucket, Bucket=bucket
                )
                try:
                    job.result(self.request_timeout)
                except concurrent.futures.TimeoutError as exc:
                    raise _s3_errors.translate(
                        TimeoutError(), backend=self.name, operation="open",
                        bucket=self.bucket, key=None,
                    ) from exc
            if fleet_url is not None:
                site = S3Objects(self._head, self._delete_objects, self._list_page)
                self._index = ValkeyIndex(
                    fleet_url, xxhash.xxh3_64_hexdigest(f"s3:{bucket}/{self.prefix}".encode()), site,
                    writer=secrets.token_hex(8), lease_s=index_lease_s,
                    timeout_s=index_timeout_s, clock=clock,
                    connections=max(16, 2 * max_concurrency))
            elif self.capacity_bytes is not None:
                self._scan_prefix()
        except BaseException:
            self._pool.shutdown(wait=False)
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
        endpoint = _s3_errors.scrub(self.endpoint_url) if self.endpoint_url else "aws"
        return f"S3Backend(s3://{self.bucket}/{self.prefix}, endpoint={endpoint})"

    # -- plumbing -----------------------------------------------------------------------------

    def _object_name(self, key: str) -> str:
        return self._base + key

    def _count(self, response: Any, *, received: int = 0, sent: int = 0) -> None:
        retries = 0
        if isinstance(response, dict):
            retries = int(response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)
        with self._lock:
            self.s3_stats.requests += 1 + retries
            self.s3_stats.retries += retries
            self.s3_stats.bytes_received += received
            self.s3_stats.bytes_sent += sent

    def _sync_call(self, operation: str, key: str | None, fn: Callable[..., T], **kwargs: Any) -> T:
        """Call the SDK, translating any failure at this edge (on a pool thread, or at open)."""
        try:
            result = fn(**kwargs)
        except BackendError:
            raise
        except Exception as exc:
            raise _s3_errors.translate(
                exc, backend=self.name, operation=operation, bucket=self.bucket, key=key
            ) from exc
        self._count(result)
        return result

    async def _run(self, operation: str, key: str | None, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking function on the pool, bounded by ``request_timeout``."""
        # The pool threads touch caller memory only through a ``Handoff`` (see "Buffer
        # lifetime"): the caller may stop waiting at the deadline or when it gives up.
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, abandonable(fn), *args)
        try:
            return await until_abandoned(asyncio.wait_for(future, self.request_timeout))
        except asyncio.TimeoutError as exc:
            # The pool thread carries on under botocore's own timeouts; the caller moves on.
            raise _s3_errors.translate(
                TimeoutError(), backend=self.name, operation=operation, bucket=self.bucket, key=key
            ) from exc

    # -- exists / stat --------------------------------------------------------------------------

    def _head(self, key: str, operation: str) -> ObjectStat | None:
        try:
            response = self._client.head_object(Bucket=self.bucket, Key=self._object_name(key))
        except Exception as exc:
            if _s3_errors.is_missing(exc):
                self._count(getattr(exc, "response", None))
                return None
            raise _s3_errors.translate(
                exc, backend=self.name, operation=operation, bucket=self.bucket, key=key
            ) from exc
        self._count(response)
        modified = response.get("LastModified")
        mtime = modified.timestamp() if modified is not None else None
        return ObjectStat(key, int(response["ContentLength"]), mtime)

    async def _heads(self, keys: Sequence[str], operation: str) -> list[ObjectStat | None]:
        found = await asyncio.gather(*(self._run(operation, k, self._head, k, operation) for k in keys))
        if self.capacity_bytes is not None:
            with self._lock:
                for st in found:
                    if st is not None:
                        self._lru.add_oldest(st.key, st.size)  # found, not written: first in line
                self._lru.touch_batch([st.key for st in found if st is not None])
        return list(found)

    async def _exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited. With a fleet's index: the index, in one round trip (it asks
        # the store itself when it cannot answer).
        if self._index is not None:
            return await self._index_call(self._index.exists, keys)
        return [st is not None for st in await self._heads(keys, "exists")]

    async def _index_call(self, fn: Callable[..., T], *args: Any) -> T:
        """A call of the fleet's index on the pool (bounded by the index's own timeouts;
        never abandoned: a reservation's settle must run whatever the caller does)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def _stat(self, keys: Sequence[str]) -> list[ObjectStat | None]:
        # docstring inherited
        return await self._heads(keys, "stat")

    # -- reads ----------------------------------------------------------------------------------

    def _fetch(
        self, fetch: Fetch, target: memoryview | None, handoff: Handoff
    ) -> memoryview | int | None:
        """One GET, into memory of its own. With ``target`` (a single-member fetch) the bytes
        are then copied into the caller's buffer through ``handoff`` and the count returned
        (``CallAbandoned`` when the call has ended meanwhile); otherwise the view is returned."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._object_name(fetch.key)}
        if fetch.rng is not None:
            kwargs["Range"] = f"bytes={fetch.rng.start}-{fetch.rng.end - 1}"
        try:
            response = self._client.get_object(**kwargs)
        except Exception as exc:
            if _s3_errors.is_missing(exc) and _s3_errors.error_code(exc) != "NoSuchBucket":
                self._count(getattr(exc, "response", None))
                return None
            raise _s3_errors.translate(
                exc, backend=self.name, operation="get_into", bucket=self.bucket, key=fetch.key
            ) from exc
        body = response["Body"]
        try:
            length = int(response["ContentLength"])
            if fetch.rng is not None:
                self._check_range_answer(fetch, response, length)
            elif target is not None and length > len(target):
                raise InvalidRangeError(
                    f"object of {length} bytes does not fit a {len(target)}-byte buffer",
                    backend=self.name, operation="get_into", key=fetch.key,
                )
            dest = memoryview(bytearray(length))
            try:
                read_exact(body, dest)
            except Exception as exc:
                raise _s3_errors.translate(
                    exc, backend=self.name, operation="get_into", bucket=self.bucket,
                    key=fetch.key,
                ) from exc
        finally:
            body.close()  # an unread body drops its connection instead of reusing it
        self._count(response, received=length)
        if target is None:
            return dest

        def copy() -> None:
            target[:length] = dest

        if not handoff.deliver(copy):
            raise CallAbandoned  # the call ended while this request ran: drop the answer
        return length

    def _check_range_answer(self, fetch: Fetch, response: Any, length: int) -> None:
        assert fetch.rng is not None
        answered = parse_content_range(response.get("ContentRange"))
        if answered is None:
            raise BackendIOError(
                "the server ignored the Range header (no Content-Range in the answer)",
                backend=self.name, operation="get_into", key=fetch.key,
            )
        first, end, total = answered
        if first != fetch.rng.start or end != fetch.rng.end or length != fetch.rng.length:
            # S3 clamps a range reaching past the end: never hand out a short read.
            raise InvalidRangeError(
                f"range [{fetch.rng.start}, {fetch.rng.end}) reaches past the end of a "
                f"{total if total is not None else '?'}-byte object",
                backend=self.name, operation="get_into", key=fetch.key,
            )

    async def _get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        ranges: Sequence[ByteRange | None],
    ) -> list[int | None]:
        # docstring inherited
        fetches = plan_fetches(keys, ranges, self.range_coalesce_gap)
        handoff = Handoff()

        async def one(fetch: Fetch) -> None:
            if len(fetch.members) == 1:
                index = fetch.members[0][0]
                got = await self._run(
                    "get_into", fetch.key, self._fetch, fetch, buffers[index], handoff
                )
                results[index] = got if isinstance(got, int) else None
                return
            data = await self._run("get_into", fetch.key, self._fetch, fetch, None, handoff)
            for index, offset, length in fetch.members:
                if isinstance(data, memoryview):
                    buffers[index][:length] = data[offset : offset + length]  # on the loop
                    results[index] = length

        results: list[int | None] = [None] * len(keys)
        try:
            await asyncio.gather(*(one(f) for f in fetches))
        finally:
            handoff.close()  # requests still running (past a deadline) deliver nothing now
        if self.capacity_bytes is not None:
            with self._lock:
                self._lru.touch_batch([k for k, n in zip(keys, results, strict=True) if n is not None])
        return results

    # -- writes ---------------------------------------------------------------------------------

    def _put_single(self, key: str, view: memoryview, if_absent: bool, handoff: Handoff) -> bool:
        body = _snapshot(view, handoff)
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket, "Key": self._object_name(key),
            "Body": ViewReader(body), "ContentLength": len(body),
        }
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        try:
            response = self._client.put_object(**kwargs)
        except Exception as exc:
            if if_absent and _s3_errors.is_precondition_failed(exc):
                self._count(getattr(exc, "response", None))
                return False
            raise _s3_errors.translate(
                exc, backend=self.name, operation="put", bucket=self.bucket, key=key
            ) from exc
        self._count(response, sent=len(view))
        return True

    async def _put_multipart(self, key: str, view: memoryview, handoff: Handoff) -> None:
        # Parts go through the same pool as everything else; the orchestration stays on the
        # loop, so a full pool can never deadlock on parts waiting behind their parent.
        name = self._object_name(key)
        created = await self._run(
            "put", key, lambda: self._sync_call(
                "put", key, self._client.create_multipart_upload, Bucket=self.bucket, Key=name
            ),
        )
        upload_id = created["UploadId"]
        size = self.multipart_chunksize

        def part(number: int, start: int) -> dict[str, Any]:
            chunk = _snapshot(view[start : start + size], handoff)
            answer = self._sync_call(
                "put", key, self._client.upload_part, Bucket=self.bucket, Key=name,
                UploadId=upload_id, PartNumber=number, Body=ViewReader(chunk),
                ContentLength=len(chunk),
            )
            with self._lock:
                self.s3_stats.bytes_sent += len(chunk)
            return {"PartNumber": number, "ETag": answer["ETag"]}

        try:
            parts = await asyncio.gather(*(
                self._run("put", key, part, n + 1, start)
                for n, start in enumerate(range(0, len(view), size))
            ))
            await self._run("put", key, lambda: self._sync_call(
                "put", key, self._client.complete_multipart_upload, Bucket=self.bucket,
                Key=name, UploadId=upload_id, MultipartUpload={"Parts": list(parts)},
            ))
        except BaseException:
            # Best effort: a lifecycle rule removes uploads an abort could not.
            loop = asyncio.get_running_loop()
            abort = loop.run_in_executor(self._pool, self._abort_quietly, name, upload_id)
            await asyncio.shield(abort)
            raise
        with self._lock:
            self.s3_stats.multipart_uploads += 1

    def _abort_quietly(self, name: str, upload_id: str) -> None:
        # The original failure is what the caller must see, not the abort's.
        with contextlib.suppress(Exception):
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)

    async def _put_one(self, key: str, view: memoryview, handoff: Handoff) -> None:
        if len(view) >= self.multipart_threshold:
            await self._put_multipart(key, view, handoff)
        else:
            await self._run("put", key, self._put_single, key, view, False, handoff)

    async def _put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> None:
        # docstring inherited. Each object is one atomic PUT (or completed multipart upload),
        # so on failure every object of the batch is whole or absent.
        latest = dict(zip(keys, buffers, strict=True))  # a key repeated: the last one wins
        if self._index is not None:
            await self._put_indexed(latest, if_absent=False)
            return
        if self.capacity_bytes is not None:
            await self._reserve(latest)
        handoff = Handoff()
        try:
            results = await asyncio.gather(
                *(self._put_one(k, v, handoff) for k, v in latest.items()),
                return_exceptions=True,
            )
        finally:
            handoff.close()  # a request past its deadline reads the caller's bytes no more
        if self.capacity_bytes is not None:
            with self._lock:
                self._lru.add_batch([
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
        if self.capacity_bytes is not None:
            await self._reserve({key: buffer})
        handoff = Handoff()
        try:
            wrote = await self._run(
                "put_if_absent", key, self._put_single, key, buffer, True, handoff
            )
        finally:
            handoff.close()
        if wrote and self.capacity_bytes is not None:
            with self._lock:
                self._lru.add(key, len(buffer))
        return wrote

    async def _put_indexed(self, latest: dict[str, memoryview], *, if_absent: bool) -> bool:
        """A put through the fleet's index: reserve (with its room), evict, upload, settle
        from what the uploads stored (module docstring). ``if_absent``: one conditional PUT;
        whether it stored."""
        assert self._index is not None
        index = self._index
        capacity = self.capacity_bytes if self.capacity_bytes is not None else 1 << 62
        keys = list(latest)
        try:
            reservation: Reservation = await self._index_call(
                index.reserve, keys, [len(v) for v in latest.values()], capacity,
                self.pin_budget_bytes if self.capacity_bytes is not None else None)
        except BackendUnavailableError as exc:
            if exc.backend == "index":
                with self._lock:
                    self.stats.index_refusals += 1
            raise
        results: list[Any] = []
        try:
            counts = await self._index_call(index.make_room, capacity, reservation)
            with self._lock:
                self.stats.evictions += counts.evicted
                self.stats.eviction_failures += counts.failed
            handoff = Handoff()
            try:
                if if_absent:
                    (key, view), = latest.items()
                    results = [await self._run("put_if_absent", key, self._put_single, key, view,
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
            await asyncio.shield(self._index_call(index.settle_put, reservation))
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return bool(results) and results[0] is not False

    # -- retention, the change feed, the index (a fleet's index only) ----------------------------

    async def _retain(self, keys: Sequence[str], retention: Retention) -> None:
        # docstring inherited
        assert self._index is not None  # (the capability is declared with an index only)
        await self._index_call(self._index.retain, keys, retention, self.pin_budget_bytes)

    async def _release(self, keys: Sequence[str], owner: str) -> None:
        # docstring inherited
        assert self._index is not None
        await self._index_call(self._index.release, keys, owner)

    async def _retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        # docstring inherited
        assert self._index is not None
        return await self._index_call(self._index.retention_of, keys)

    async def _delete_until_held(self, groups: list[list[str]]) -> DeletedUntilHeld:
        # docstring inherited. The index reads the holds in the step that takes the keys out.
        assert self._index is not None
        done, removed = await self._index_call(self._index.delete_until_held, groups)
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
        return await self._index_call(functools.partial(
            check_index, self._index, self._index._site, "valkey", repair=repair,
            rebuild=rebuild))

    # -- delete / list ----------------------------------------------------------------------------

    def _delete_objects(self, keys: Sequence[str], operation: str) -> list[str]:
        """``DeleteObjects`` in batches of 1000; returns the keys the store refused to delete."""
        failed: list[str] = []
        for start in range(0, len(keys), DELETE_BATCH):
            chunk = keys[start : start + DELETE_BATCH]
            response = self._sync_call(
                operation, None, self._client.delete_objects, Bucket=self.bucket,
                Delete={"Objects": [{"Key": self._object_name(k)} for k in chunk], "Quiet": True},
            )
            for error in response.get("Errors", []):
                name = str(error.get("Key", ""))
                failed.append(name[len(self._base):] if name.startswith(self._base) else name)
        return failed

    async def _delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited. HEAD first: DeleteObjects reports absent keys as deleted too.
        if self._index is not None:  # (the index removes through the same two calls)
            unique_keys = list(dict.fromkeys(keys))
            done = dict(zip(unique_keys, await self._index_call(self._index.delete, unique_keys),
                            strict=True))
            first: set[str] = set()
            out: list[bool] = []
            for key in keys:
                out.append(done[key] and key not in first)
                first.add(key)
            return out
        unique = list(dict.fromkeys(keys))
        present = [st.key for st in await self._heads(unique, "delete") if st is not None]
        failed = []
        if present:
            failed = await self._run("delete", None, self._delete_objects, present, "delete")
        if failed:
            raise BackendIOError(
                f"the store refused to delete {len(failed)} object(s), e.g. {failed[0]}",
                backend=self.name, operation="delete", key=failed[0],
            )
        with self._lock:
            for key in present:
                self._lru.discard(key)
        gone = set(present)
        seen: set[str] = set()
        removed = []
        for key in keys:  # a key repeated in the batch was removed once: True, then False
            removed.append(key in gone and key not in seen)
            seen.add(key)
        return removed

    def _list_page(self, prefix: str, token: str | None) -> tuple[list[ObjectStat], str | None]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._base + prefix}
        if token:
            kwargs["ContinuationToken"] = token
        response = self._sync_call("list_prefix", None, self._client.list_objects_v2, **kwargs)
        entries = []
        for item in response.get("Contents", []):
            key = str(item["Key"])[len(self._base):]
            try:
                validate_storage_key(key)
            except InvalidKeyError:
                continue  # a foreign object (or one in a sub-"directory"): not ours
            modified = item.get("LastModified")
            mtime = modified.timestamp() if modified is not None else None
            entries.append(ObjectStat(key, int(item.get("Size", 0)), mtime))
        next_token = response.get("NextContinuationToken") if response.get("IsTruncated") else None
        return entries, next_token

    async def _list_entries(self, prefix: str) -> AsyncIterator[ObjectStat]:
        # docstring inherited. One listing request per 1000 objects, no HEADs: the listing
        # carries size and mtime. Pages are fetched one at a time: memory stays one page.
        token: str | None = None
        while True:
            entries, token = await self._run("list_prefix", None, self._list_page, prefix, token)
            for entry in entries:
                yield entry
            if token is None:
                return

    async def _list_prefix(self, prefix: str) -> AsyncIterator[str]:
        # docstring inherited. S3 listings are consistent and each key appears once.
        async for entry in self._list_entries(prefix):
            yield entry.key

    # -- capacity -------------------------------------------------------------------------------

    def _scan_prefix(self) -> None:
        """At open (capacity_bytes set): learn every object under the prefix, oldest first."""
        token: str | None = None
        found: list[ObjectStat] = []
        while True:
            entries, token = self._list_page("", token)
            found.extend(entries)
            if token is None:
                break
        # add_oldest puts each key first in line: add the newest first so the oldest leads.
        for st in sorted(found, key=lambda e: e.mtime or 0.0, reverse=True):
            self._lru.add_oldest(st.key, st.size)

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects this backend accounts for (capacity mode; with a fleet's
        index, every writer's)."""
        if self._index is not None:
            return self._index.totals()[0]
        with self._lock:
            return self._lru.total_bytes

    async def _reserve(self, batch: dict[str, memoryview]) -> None:
        """Delete chain-aware-LRU victims until ``batch`` fits under ``capacity_bytes``.

        Victims are chosen under the lock and deleted with one ``DeleteObjects`` per round;
        an object the store refuses to delete is counted, moved to the back of the line and
        skipped, so one stuck object never blocks writes.
        """
        assert self.capacity_bytes is not None
        incoming = sum(len(v) for v in batch.values())
        if incoming > self.capacity_bytes:
            raise CapacityError(
                f"a batch of {incoming} bytes exceeds the capacity of {self.capacity_bytes}",
                backend=self.name, operation="put",
            )
        for _round in range(64):
            with self._lock:
                rewritten = sum(self._lru.size_of(k) or 0 for k in batch)
                excess = self._lru.total_bytes - rewritten + incoming - self.capacity_bytes
                victims: list[str] = []
                for key, size in self._lru.victims():
                    if excess <= 0:
                        break
                    if key in batch:
                        continue
                    victims.append(key)
                    excess -= size
                if not victims:
                    if excess > 0:
                        raise CapacityError(
                            f"cannot make room for {incoming} bytes under {self.capacity_bytes}",
                            backend=self.name, operation="put",
                        )
                    return
                sizes = {key: self._lru.discard(key) or 0 for key in victims}
            failed = await self._run("evict", None, self._delete_objects, victims, "evict")
            with self._lock:
                self.stats.evictions += len(victims) - len(failed)
                self.stats.eviction_failures += len(failed)
                for key in failed:
                    # Still stored and still counted, but last in line: the next round picks
                    # other victims, so one undeletable object never blocks writes.
                    self._lru.add(key, sizes[key])
        raise CapacityError("eviction made no progress", backend=self.name, operation="put")

    async def _close(self) -> None:
        # docstring inherited
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        if self._index is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._index.close)
        self._client.close()
