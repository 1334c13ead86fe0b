"""The S3 backend's wire: one boto3 client, its bounded pool, deadlines, counters and requests.

``S3Requests`` holds what every request shares: the client (built by ``open_client`` from the
options; credentials go into its session and nowhere else), a pool of ``max_concurrency``
threads, ``request_timeout`` from the caller's side, native errors translated once at this
edge (``_s3_errors``), and ``S3Stats``. Its blocking requests (``head``, ``fetch``,
``put_single``, ``delete_objects``, ``list_page``) run on the pool, through ``run``; the
backend (``s3.S3Backend``) decides which to send.

Buffer lifetime: a pool thread touches caller memory only inside a ``Handoff``, while the call
still waits: a GET lands in the thread's own memory and is copied through the handoff; a PUT
copies the caller's bytes first (``_snapshot``) and uploads the copy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from hicache_store.layout.errors import InvalidKeyError
from hicache_store.layout.keys import validate_storage_key

from . import _s3_errors
from ._s3_io import Fetch, ViewReader, parse_content_range, read_exact
from .errors import BackendError, BackendIOError, InvalidRangeError
from .lifetime import CallAbandoned, Handoff, abandonable, until_abandoned
from .types import ObjectStat

T = TypeVar("T")

#: S3 ``DeleteObjects`` takes at most this many keys per request.
DELETE_BATCH = 1000
#: the backend's name in errors.
NAME = "s3"


@dataclass
class S3Stats:
    """Request and wire counters of one S3 backend (monotonic; updated from pool threads
    under the requests' lock). ``bytes_received`` / ``bytes_sent`` count object bodies."""

    requests: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    retries: int = 0
    multipart_uploads: int = 0


def open_client(
    *,
    endpoint_url: str | None,
    region: str | None,
    profile: str | None,
    aws_access_key_id: str | None,
    aws_secret_access_key: str | None,
    aws_session_token: str | None,
    max_concurrency: int,
    connect_timeout: float,
    read_timeout: float,
    max_attempts: int,
    addressing_style: str,
    verify_ssl: bool,
) -> Any:
    """A boto3 S3 client: botocore retries in *standard* mode (``max_attempts`` in all) within
    ``connect_timeout`` / ``read_timeout``, ``max_concurrency`` pooled connections.

    ``ImportError`` (with ``name="boto3"``, for the registry's install hint) without boto3.
    """
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
    return session.client("s3", endpoint_url=endpoint_url, config=config, verify=verify_ssl)


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


class S3Requests:
    """The requests of one ``s3://bucket/prefix``: keys are named under ``base`` (the prefix
    with its trailing ``/``, or empty); every request goes through the pool and is counted."""

    def __init__(self, client: Any, bucket: str, base: str, *, max_concurrency: int,
                 request_timeout: float) -> None:
        self.client = client
        self.bucket = bucket
        self.base = base
        self.request_timeout = request_timeout
        self.stats = S3Stats()
        self._lock = threading.Lock()  # guards stats
        self.pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="hicache-s3")

    def object_name(self, key: str) -> str:
        return self.base + key

    def _translate(self, exc: BaseException, operation: str, key: str | None) -> BackendError:
        return _s3_errors.translate(exc, backend=NAME, operation=operation, bucket=self.bucket,
                                    key=key)

    def count(self, response: Any, *, received: int = 0, sent: int = 0) -> None:
        retries = 0
        if isinstance(response, dict):
            retries = int(response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)
        with self._lock:
            self.stats.requests += 1 + retries
            self.stats.retries += retries
            self.stats.bytes_received += received
            self.stats.bytes_sent += sent

    def sync_call(self, operation: str, key: str | None, fn: Callable[..., T], **kwargs: Any) -> T:
        """Call the SDK, translating any failure at this edge (on a pool thread, or at open)."""
        try:
            result = fn(**kwargs)
        except BackendError:
            raise
        except Exception as exc:
            raise self._translate(exc, operation, key) from exc
        self.count(result)
        return result

    def check_bucket(self) -> None:
        """``HEAD bucket`` on a pool thread, bounded like every request: a stopped server fails
        the open in ``request_timeout``, not in botocore's retries of its timeouts."""
        job = self.pool.submit(
            self.sync_call, "open", None, self.client.head_bucket, Bucket=self.bucket
        )
        try:
            job.result(self.request_timeout)
        except concurrent.futures.TimeoutError as exc:
            raise self._translate(TimeoutError(), "open", None) from exc

    async def run(self, operation: str, key: str | None, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking function on the pool, bounded by ``request_timeout``."""
        # The pool threads touch caller memory only through a ``Handoff``: the caller may stop
        # waiting at the deadline or when it gives up.
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.pool, abandonable(fn), *args)
        try:
            return await until_abandoned(asyncio.wait_for(future, self.request_timeout))
        except asyncio.TimeoutError as exc:
            # The pool thread carries on under botocore's own timeouts; the caller moves on.
            raise self._translate(TimeoutError(), operation, key) from exc

    async def run_unbounded(self, fn: Callable[..., T], *args: Any) -> T:
        """A call on the pool with no deadline of this edge's and never abandoned (the fleet
        index's calls: bounded by the index's own timeouts; a settle must always run)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- the blocking requests (on pool threads) ------------------------------------------------

    def head(self, key: str, operation: str) -> ObjectStat | None:
        """``HEAD`` one key: its stat, or None when absent."""
        try:
            response = self.client.head_object(Bucket=self.bucket, Key=self.object_name(key))
        except Exception as exc:
            if _s3_errors.is_missing(exc):
                self.count(getattr(exc, "response", None))
                return None
            raise self._translate(exc, operation, key) from exc
        self.count(response)
        modified = response.get("LastModified")
        mtime = modified.timestamp() if modified is not None else None
        return ObjectStat(key, int(response["ContentLength"]), mtime)

    def fetch(
        self, fetch: Fetch, target: memoryview | None, handoff: Handoff
    ) -> memoryview | int | None:
        """One GET, into memory of its own. With ``target`` (a single-member fetch) the bytes
        are then copied into the caller's buffer through ``handoff`` and the count returned
        (``CallAbandoned`` when the call has ended meanwhile); otherwise the view is returned.
        None when the key is absent."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.object_name(fetch.key)}
        if fetch.rng is not None:
            kwargs["Range"] = f"bytes={fetch.rng.start}-{fetch.rng.end - 1}"
        try:
            response = self.client.get_object(**kwargs)
        except Exception as exc:
            if _s3_errors.is_missing(exc) and _s3_errors.error_code(exc) != "NoSuchBucket":
                self.count(getattr(exc, "response", None))
                return None
            raise self._translate(exc, "get_into", fetch.key) from exc
        body = response["Body"]
        try:
            length = int(response["ContentLength"])
            if fetch.rng is not None:
                _check_range_answer(fetch, response, length)
            elif target is not None and length > len(target):
                raise InvalidRangeError(
                    f"object of {length} bytes does not fit a {len(target)}-byte buffer",
                    backend=NAME, operation="get_into", key=fetch.key,
                )
            dest = memoryview(bytearray(length))
            try:
                read_exact(body, dest)
            except Exception as exc:
                raise self._translate(exc, "get_into", fetch.key) from exc
        finally:
            body.close()  # an unread body drops its connection instead of reusing it
        self.count(response, received=length)
        if target is None:
            return dest

        def copy() -> None:
            target[:length] = dest

        if not handoff.deliver(copy):
            raise CallAbandoned  # the call ended while this request ran: drop the answer
        return length

    def put_single(self, key: str, view: memoryview, if_absent: bool, handoff: Handoff) -> bool:
        """One ``PUT`` of a copy of ``view``; ``if_absent``: with ``If-None-Match: *``, False
        when the key was there (412)."""
        body = _snapshot(view, handoff)
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket, "Key": self.object_name(key),
            "Body": ViewReader(body), "ContentLength": len(body),
        }
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        try:
            response = self.client.put_object(**kwargs)
        except Exception as exc:
            if if_absent and _s3_errors.is_precondition_failed(exc):
                self.count(getattr(exc, "response", None))
                return False
            raise self._translate(exc, "put", key) from exc
        self.count(response, sent=len(view))
        return True

    async def put_multipart(self, key: str, view: memoryview, handoff: Handoff,
                            part_size: int) -> None:
        """A multipart upload of ``view`` in parts of ``part_size``; aborted (best effort) when
        it fails, so the object is the old one, the new one, or nothing."""
        # Parts go through the same pool as everything else; the orchestration stays on the
        # loop, so a full pool can never deadlock on parts waiting behind their parent.
        name = self.object_name(key)
        created = await self.run(
            "put", key, lambda: self.sync_call(
                "put", key, self.client.create_multipart_upload, Bucket=self.bucket, Key=name
            ),
        )
        upload_id = created["UploadId"]

        def part(number: int, start: int) -> dict[str, Any]:
            chunk = _snapshot(view[start : start + part_size], handoff)
            answer = self.sync_call(
                "put", key, self.client.upload_part, Bucket=self.bucket, Key=name,
                UploadId=upload_id, PartNumber=number, Body=ViewReader(chunk),
                ContentLength=len(chunk),
            )
            with self._lock:
                self.stats.bytes_sent += len(chunk)
            return {"PartNumber": number, "ETag": answer["ETag"]}

        try:
            parts = await asyncio.gather(*(
                self.run("put", key, part, n + 1, start)
                for n, start in enumerate(range(0, len(view), part_size))
            ))
            await self.run("put", key, lambda: self.sync_call(
                "put", key, self.client.complete_multipart_upload, Bucket=self.bucket,
                Key=name, UploadId=upload_id, MultipartUpload={"Parts": list(parts)},
            ))
        except BaseException:
            # Best effort: a lifecycle rule removes uploads an abort could not.
            abort = self.run_unbounded(self._abort_quietly, name, upload_id)
            await asyncio.shield(abort)
            raise
        with self._lock:
            self.stats.multipart_uploads += 1

    def _abort_quietly(self, name: str, upload_id: str) -> None:
        # The original failure is what the caller must see, not the abort's.
        with contextlib.suppress(Exception):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)

    def delete_objects(self, keys: Sequence[str], operation: str) -> list[str]:
        """``DeleteObjects`` in batches of 1000; returns the keys the store refused to delete."""
        failed: list[str] = []
        for start in range(0, len(keys), DELETE_BATCH):
            chunk = keys[start : start + DELETE_BATCH]
            response = self.sync_call(
                operation, None, self.client.delete_objects, Bucket=self.bucket,
                Delete={"Objects": [{"Key": self.object_name(k)} for k in chunk], "Quiet": True},
            )
            for error in response.get("Errors", []):
                name = str(error.get("Key", ""))
                failed.append(name[len(self.base):] if name.startswith(self.base) else name)
        return failed

    def list_page(self, prefix: str, token: str | None) -> tuple[list[ObjectStat], str | None]:
        """One listing request (up to 1,000 objects) under ``prefix``: our keys' stats (foreign
        objects skipped) and the next page's token (None: the last page)."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.base + prefix}
        if token:
            kwargs["ContinuationToken"] = token
        response = self.sync_call("list_prefix", None, self.client.list_objects_v2, **kwargs)
        entries = []
        for item in response.get("Contents", []):
            key = str(item["Key"])[len(self.base):]
            try:
                validate_storage_key(key)
            except InvalidKeyError:
                continue  # a foreign object (or one in a sub-"directory"): not ours
            modified = item.get("LastModified")
            mtime = modified.timestamp() if modified is not None else None
            entries.append(ObjectStat(key, int(item.get("Size", 0)), mtime))
        next_token = response.get("NextContinuationToken") if response.get("IsTruncated") else None
        return entries, next_token

    def list_all(self) -> list[ObjectStat]:
        """Every object under the prefix (blocking; page after page)."""
        token: str | None = None
        found: list[ObjectStat] = []
        while True:
            entries, token = self.list_page("", token)
            found.extend(entries)
            if token is None:
                return found

    async def drain(self) -> None:
        """Wait for every request on the pool to end; no new one may start after."""
        await asyncio.get_running_loop().run_in_executor(None, self.pool.shutdown, True)

    def close(self) -> None:
        """Close the client (after ``drain``)."""
        self.client.close()


def _check_range_answer(fetch: Fetch, response: Any, length: int) -> None:
    """A ranged GET's answer must be exactly the range asked for (S3 clamps a range reaching
    past the end: never hand out a short read)."""
    assert fetch.rng is not None
    answered = parse_content_range(response.get("ContentRange"))
    if answered is None:
        raise BackendIOError(
            "the server ignored the Range header (no Content-Range in the answer)",
            backend=NAME, operation="get_into", key=fetch.key,
        )
    first, end, total = answered
    if first != fetch.rng.start or end != fetch.rng.end or length != fetch.rng.length:
        raise InvalidRangeError(
            f"range [{fetch.rng.start}, {fetch.rng.end}) reaches past the end of a "
            f"{total if total is not None else '?'}-byte object",
            backend=NAME, operation="get_into", key=fetch.key,
        )


__all__ = ["DELETE_BATCH", "S3Requests", "S3Stats", "open_client"]
