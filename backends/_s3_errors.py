"""Translation of botocore errors into the backend error hierarchy, at the S3 backend's edge.

One function, ``translate``, is the single place where an S3 failure becomes a
``hicache_store.backends.errors`` exception. Callers handle the *expected* outcomes first
(a 404 on a read is a miss, a 412 on a conditional put means "already there") and hand
everything else here, then ``raise translate(...) from exc``.

Secrets: messages are built only from the error code, the HTTP status, the operation, the
bucket and the key, never from ``str(exc)`` of a transport error (whose text can carry an
endpoint URL with user info) and never from request headers, so no credential can reach a
message or a log line.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import (
    BackendError,
    BackendIOError,
    BackendTimeoutError,
    BackendUnavailableError,
    InvalidRangeError,
)

#: codes meaning "this object is not there" (HEAD answers with the bare status).
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
#: codes meaning the caller's identity was refused: retrying cannot help.
ACCESS_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AuthorizationHeaderMalformed", "403",
    "InvalidClientTokenId", "UnrecognizedClientException", "AccountProblem",
})
#: codes the store uses when it is overloaded or briefly unable to answer.
THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequests", "RequestThrottled", "ServiceUnavailable", "InternalError",
    "RequestTimeout", "RequestTimeTooSkewed", "503", "500", "502", "504", "429",
})
#: codes for a conditional request whose precondition did not hold.
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})

_USERINFO_RE = re.compile(r"//[^/@\s]*@")


class S3AccessDeniedError(BackendUnavailableError):
    """The S3 service refused this identity (bad or expired credentials, no permission on the
    bucket, or no credentials at all). Never retryable: fix the credentials or the policy."""

    def __init__(self, message: str, *, backend: str | None = None,
                 operation: str | None = None, key: str | None = None) -> None:
        super().__init__(message, retryable=False, backend=backend, operation=operation, key=key)


def error_code(exc: BaseException) -> str:
    """The S3 error code of a ``ClientError`` (``NoSuchKey``, ``403``, ...), else ''."""
    response: Any = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def http_status(exc: BaseException) -> int | None:
    response: Any = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if isinstance(status, int) else None


def is_missing(exc: BaseException) -> bool:
    """True when ``exc`` says the object does not exist (a miss, not an error)."""
    return error_code(exc) in MISSING_CODES or (
        http_status(exc) == 404 and error_code(exc) not in {"NoSuchBucket"}
    )


def is_precondition_failed(exc: BaseException) -> bool:
    return error_code(exc) in PRECONDITION_CODES or http_status(exc) == 412


def scrub(text: str) -> str:
    """Remove URL user info (``//user:secret@``) from a text."""
    return _USERINFO_RE.sub("//", text)


def translate(
    exc: BaseException, *, backend: str, operation: str, bucket: str, key: str | None = None
) -> BackendError:
    """The backend error for a botocore exception (the caller raises it ``from exc``).

    - 416 / ``InvalidRange`` -> ``InvalidRangeError``;
    - 403 and the credential codes, or no credentials found -> ``S3AccessDeniedError``
      (not retryable);
    - ``NoSuchBucket`` -> ``BackendUnavailableError(retryable=False)``;
    - throttling, 5xx -> ``BackendUnavailableError(retryable=True)``;
    - connect / read timeouts -> ``BackendTimeoutError``; other connection failures ->
      retryable ``BackendUnavailableError``;
    - anything else -> ``BackendIOError`` (not retryable).
    """
    # Imported here so this module stays importable (for its constants) without botocore.
    from botocore import exceptions as bexc

    where: dict[str, Any] = {"backend": backend, "operation": operation, "key": key}
    target = f"s3://{bucket}" + (f" key {key}" if key else "")
    if isinstance(exc, bexc.ClientError):
        code, status = error_code(exc), http_status(exc)
        label = f"{code or 'error'} (HTTP {status})" if status else code or "error"
        if code == "InvalidRange" or status == 416:
            return InvalidRangeError(f"{operation} on {target}: range not satisfiable", **where)
        if code in ACCESS_CODES or status in (401, 403):
            return S3AccessDeniedError(
                f"{operation} on {target}: access denied: {label}; check the credentials "
                "(boto3's chain, or aws_access_key_id/aws_secret_access_key options) and the "
                "bucket policy",
                **where,
            )
        if code == "NoSuchBucket" or (key is None and status == 404):
            # HEAD bucket answers a bare 404; calls without a key only miss on the bucket.
            return BackendUnavailableError(
                f"{operation} on {target}: the bucket does not exist", retryable=False, **where
            )
        if code in THROTTLE_CODES or (status is not None and status >= 500):
            return BackendUnavailableError(
                f"{operation} on {target}: store busy or failing: {label}", retryable=True, **where
            )
        return BackendIOError(f"{operation} on {target}: {label}", retryable=False, **where)
    if isinstance(exc, bexc.NoCredentialsError | bexc.PartialCredentialsError):
        return S3AccessDeniedError(
            f"{operation} on {target}: no usable AWS credentials found ({type(exc).__name__})",
            **where,
        )
    if isinstance(exc, bexc.ConnectTimeoutError | bexc.ReadTimeoutError):
        return BackendTimeoutError(
            f"{operation} on {target}: timed out ({type(exc).__name__})", retryable=True, **where
        )
    if isinstance(
        exc,
        bexc.EndpointConnectionError | bexc.ConnectionClosedError | bexc.ConnectionError
        | bexc.ResponseStreamingError | bexc.IncompleteReadError,
    ):
        return BackendUnavailableError(
            f"{operation} on {target}: cannot reach the S3 endpoint ({type(exc).__name__})",
            retryable=True, **where,
        )
    if isinstance(exc, TimeoutError):
        return BackendTimeoutError(f"{operation} on {target}: timed out", retryable=True, **where)
    if isinstance(exc, OSError):
        return BackendUnavailableError(
            f"{operation} on {target}: network error ({type(exc).__name__}: "
            f"{scrub(exc.strerror or '')})",
            retryable=True, **where,
        )
    return BackendIOError(
        f"{operation} on {target}: {type(exc).__name__}: {scrub(str(exc))[:200]}",
        retryable=False, **where,
    )
