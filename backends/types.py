"""Small value types shared by every backend: byte ranges, capabilities, stats, URLs.

They are data, not behaviour: frozen where a caller could otherwise mutate a contract.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import urllib.parse
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from hicache_store.layout.errors import ConfigError, InvalidKeyError

from .errors import InvalidRangeError

_PREFIX_RE = re.compile(r"[0-9a-fA-Z_-]{0,255}")


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, end)`` of an object: ``end`` is exclusive, the range is never empty.

    Construction validates (``InvalidRangeError``, a ``ValueError``): integers (not bools),
    ``0 <= start < end``. Whether the range fits a particular object is checked by the
    backend when it reads; a range past the object's end is an error, never clamped.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRangeError(f"ByteRange.{name} must be an int, got {value!r}")
        if self.start < 0 or self.end <= self.start:
            raise InvalidRangeError(
                f"ByteRange [{self.start}, {self.end}) is empty or negative (end is exclusive)"
            )

    @classmethod
    def of(cls, start: int, length: int) -> ByteRange:
        """The range of ``length`` bytes starting at ``start``."""
        return cls(start, start + length)

    @property
    def length(self) -> int:
        return self.end - self.start

    def check_within(self, size: int, *, backend: str, key: str) -> None:
        """Raise ``InvalidRangeError`` unless the range lies inside an object of ``size`` bytes."""
        if self.end > size:
            raise InvalidRangeError(
                f"range [{self.start}, {self.end}) reaches past the end of a {size}-byte object",
                backend=backend,
                operation="get_into",
                key=key,
            )


#: ``get_into``'s ranges: per key, the ``ByteRange`` to read, or None for the whole object.
ReadRanges: TypeAlias = Sequence[ByteRange | None]
#: ``get_into``'s result: per key, the bytes read into its buffer, or None for a miss.
ReadCounts: TypeAlias = list[int | None]


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers, as positive flags (absent = not offered).

    Every backend, whatever its flags, guarantees whole-object visibility (no reader ever
    observes a partially written object), accepts byte ranges in ``get_into`` (the base class
    emulates them when ``ranged_reads`` is false) and treats a miss as a result.

    - ``ranged_reads``: a byte range is fetched natively, without reading the whole object.
    - ``zero_copy_reads``: bytes land in the caller's buffer with no intermediate copy.
    - ``listing``: ``list_prefix`` works (otherwise it raises ``NotSupportedError``).
    - ``atomic_put``: ``put_if_absent`` is atomic: of concurrent calls on one absent key,
      exactly one returns True.
    - ``eviction``: the backend enforces its capacity bound itself by evicting objects.
    - ``persistent``: objects survive ``close`` and a reopen of the same location.
    - ``shared``: objects written by another process using the same location are visible.
    - ``mtime``: ``stat`` reports each object's last write time (``ObjectStat.mtime``, seconds
      since the epoch). Tools that age objects out (``hicache-store gc --max-age``) need it;
      without the flag ``mtime`` may be None.
    - ``retention``: ``retain`` / ``release`` / ``retention_of`` work, eviction honours
      them (``hicache_store.backends.retention``) and ``delete_until_held`` never deletes a
      held object; otherwise the first three raise ``NotSupportedError`` (and nothing is held).
    - ``host_buffers``: ``host_buffers()`` registers host memory that the backend then reads
      into and writes from without a copy (``backends.protocols.HostBuffers``).
    - ``inline_exists``: ``inline_exists()`` answers ``exists`` on the caller's own thread,
      without the library's event loop (``backends.protocols.InlineExists``).
    - ``native_reads``: ``native_reads()`` reads whole objects and checksums spans of them in
      native code, startable without a Python thread (``backends.protocols.NativeReads``).
    - ``native_writes``: ``native_writes()`` starts a ``put`` from the caller's thread without
      the library's event loop, found done by polling (``backends.protocols.NativeWrites``).
    - ``change_feed``: ``change_feed()`` gives the store's feed of every change of presence,
      whoever made it (``backends.protocols.ChangeFeed``; ``backends.feed.FeedFollower``
      follows it).
    - ``capacity_usage``: ``capacity_usage()`` reports the capacity the backend enforces and
      the bytes it holds and has reserved (``backends.protocols.CapacityUsage``).

    The last six are optional abilities with a protocol each; without the flag, their
    accessor raises ``NotSupportedError``.
    """

    ranged_reads: bool = False
    zero_copy_reads: bool = False
    listing: bool = False
    atomic_put: bool = False
    eviction: bool = False
    persistent: bool = False
    shared: bool = False
    mtime: bool = False
    retention: bool = False
    host_buffers: bool = False
    inline_exists: bool = False
    native_reads: bool = False
    native_writes: bool = False
    change_feed: bool = False
    capacity_usage: bool = False

    def replace(self, **changes: bool) -> Capabilities:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class ObjectStat:
    """What ``stat`` knows of a stored object: its size in bytes and, if known, its mtime."""

    key: str
    size: int
    mtime: float | None = None


@dataclass(frozen=True)
class DeletedUntilHeld:
    """What ``Backend.delete_until_held`` did: ``groups``, how many leading groups it deleted
    (the group after them, if any, is the first one that holds a key); ``removed``, for the
    keys of those groups in order, True where an object was removed (False: it was absent)."""

    groups: int
    removed: tuple[bool, ...]


@dataclass
class BackendStats:
    """Counters a backend keeps; the base class updates the read/write ones.

    Monotonic counters only (never reset by the library), safe to export as metrics. Updated
    from the event loop thread, so plain integers suffice.
    """

    reads: int = 0
    read_hits: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    deletes: int = 0
    evictions: int = 0
    eviction_failures: int = 0
    #: writes refused because the store's shared index could not be reached
    index_refusals: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BackendURL:
    """A parsed backend URL: ``scheme://netloc/path?query``.

    ``location`` is what the backend addresses: for ``file:///var/kv`` the path ``/var/kv``,
    for ``s3://bucket/prefix`` ``bucket/prefix``, for ``mooncake://127.0.0.1:50051`` the host
    and port. ``query`` holds the options given in the URL (strings; later keys win).
    """

    scheme: str
    netloc: str = ""
    path: str = ""
    query: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> BackendURL:
        """Split ``url``; the scheme must be present (``name://...``)."""
        parts = urllib.parse.urlsplit(url)
        if not parts.scheme or "://" not in url:
            raise ConfigError(f"backend URL {url!r} has no scheme (expected name://...)")
        query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
        return cls(parts.scheme.lower(), parts.netloc, urllib.parse.unquote(parts.path), query)

    def local_path(self) -> str:
        """The absolute directory a local-path URL names: ``file:///var/kv`` -> ``/var/kv``.

        Only the three-slash form (or ``file://localhost/var/kv``) is a path: in
        ``file://tmp/kv`` the ``tmp`` is a host part, and taking it as a relative directory would
        write somewhere the user did not mean, so it is refused, as is a relative or empty path.
        Raises ``ConfigError`` naming the form that works.
        """
        example = f"{self.scheme}:///var/cache/hicache"
        if self.netloc not in ("", "localhost"):
            raise ConfigError(
                f"{self.scheme}://{self.netloc}{self.path}: {self.netloc!r} is a host part, not a "
                f"directory; write an absolute path with three slashes "
                f"({self.scheme}:///{(self.netloc + self.path).lstrip('/')} for /"
                f"{(self.netloc + self.path).lstrip('/')})"
            )
        if not self.path.startswith("/"):
            raise ConfigError(f"{self.scheme}:// needs an absolute directory, e.g. {example}")
        return self.path

    @property
    def location(self) -> str:
        if self.netloc and self.path:
            return f"{self.netloc}{self.path}"
        return self.netloc or self.path

    def __str__(self) -> str:
        query = urllib.parse.urlencode(self.query)
        return urllib.parse.urlunsplit((self.scheme, self.netloc, self.path, query, "")) or (
            f"{self.scheme}://"
        )


def validate_prefix(prefix: object) -> str:
    """Return a listing prefix if it could start a storage key ('' lists everything)."""
    if not isinstance(prefix, str) or _PREFIX_RE.fullmatch(prefix) is None:
        raise InvalidKeyError(f"listing prefix {str(prefix)[:80]!r} is outside [0-9a-fA-Z_-]")
    return prefix


def parse_bool(value: Any) -> bool:
    """Options from URLs are strings: accept the usual spellings of a boolean."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"expected a boolean, got {value!r}")


_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?)b?\s*", re.IGNORECASE)


def parse_size(value: Any, *, option: str | None = None) -> int:
    """Bytes from an int or a string like ``8MiB``, ``512k``, ``2GB`` (KiB/MiB/... are 1024-based,
    kB/MB/... 1000-based; a bare suffix ``k``/``m``/``g`` is 1024-based). ``ConfigError``
    otherwise, naming ``option`` when given."""
    if option is not None:
        try:
            return parse_size(value)
        except ConfigError as exc:
            raise ConfigError(f"option {option}: {exc}") from None
    if isinstance(value, bool):
        raise ConfigError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size {value} is negative")
        return value
    match = _SIZE_RE.fullmatch(str(value))
    if match is None:
        raise ConfigError(f"expected a size like 8MiB or 512k, got {value!r}")
    number, unit, binary = match.groups()
    text = str(value).strip()
    decimal = bool(unit) and not binary and text.lower().endswith("b")
    base = 1000 if decimal else 1024
    power = "kmgtp".find(unit.lower()) + 1 if unit else 0
    return int(float(number) * base**power)


def _parse_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"expected an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected an integer, got {value!r}") from None


def _parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected a number, got {value!r}") from None


def convert_options(
    options: Mapping[str, Any],
    *,
    ints: Collection[str] = (),
    floats: Collection[str] = (),
    sizes: Collection[str] = (),
    bools: Collection[str] = (),
) -> dict[str, Any]:
    """``options`` with the named ones converted from URL-query strings to their types.

    The one place a backend's ``from_url`` turns option text into values: a value that does
    not convert is a ``ConfigError`` naming the option and the value. ``None`` stays ``None``
    (the constructor's default applies).
    """
    out = dict(options)
    for names, parse in ((ints, _parse_int), (floats, _parse_float), (sizes, parse_size),
                         (bools, parse_bool)):
        for name in names:
            value = out.get(name)
            if value is None:
                continue
            try:
                out[name] = parse(value)
            except ConfigError as exc:
                raise ConfigError(f"option {name}: {exc}") from None
    return out


def unknown_options_error(what: str, unknown: Collection[str], known: Collection[str]) -> ConfigError:
    """The error for misspelled or unsupported options: each one with its close spellings
    among ``known`` (``what`` names whose options they are, e.g. "file backend")."""
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, list(known), n=1)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    plural = "s" if len(parts) > 1 else ""
    return ConfigError(
        f"unknown {what} option{plural} {', '.join(parts)}; known: {', '.join(sorted(known))}"
    )
