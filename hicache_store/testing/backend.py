"""``BackendTests``: the conformance suite every backend runs, built-in or third-party.

Subclass it in a test module (the subclass's name must start with ``Test``) and provide:

- a pytest fixture ``backend`` that yields an open, empty backend with room for at least
  64 MiB (one test stores a 16 MiB object) and closes it afterwards (an async generator
  fixture: ``pytest_asyncio.fixture``, or ``pytest.fixture`` under ``asyncio_mode = "auto"``);
- ``async def oracle_get(self, backend, key) -> bytes | None``: the bytes stored under ``key``,
  read *around* the backend's API (the file on disk, the dict, the S3 object), or None;
- ``async def oracle_set(self, backend, key, data) -> None``: store bytes under ``key`` around
  the API (used to plant corrupt objects);
- ``async def reopen(self, backend) -> Backend | None``: a new backend over the same storage
  (what a restarted process opens). Required: a backend that declares ``persistent`` must
  return one, and its objects must be there; others may return None.
- ``def missing_location(self, backend, path) -> str | Mapping | None``: what
  ``open_backend`` opens to reach a store of ``backend``'s kind at ``path``, a location that does
  not exist, or None (the default) where the backend names no location. Required of a backend
  that declares ``Backend.creates_location``: with it the suite checks that ``create=False``
  creates nothing and raises ``NotFoundError`` (how the read-only tools and ``gc`` open a store),
  and that a backend not declaring it never creates its location at open.
  ``location_exists(self, backend, config)`` says whether that location exists (default: the
  URL's local path); override it where the location is not a local path.

Tests switch on the backend's ``capabilities`` (``mtime`` included: declared, ``stat`` must
report when each object was written).

Every call a test makes is bounded by ``CallBounds`` (a hang fails the test; the bound grows with
the call's bytes and keys and the pace of earlier calls, so it is not a speed limit), and watched
for holding the event loop without yielding (``loop_block_s`` and its per-key and per-MiB
allowances, plus what the machine's load held up every thread meanwhile): blocking calls belong on
an executor, and a thread that writes into a caller's buffer must have finished before the call
returns, raises or is cancelled (``BufferLifetimeTests``). Run the suite under pytest-xdist
(``pytest -n 2``) so that a backend that crashes the interpreter fails the test it crashed in.
The bounds and why the suite is built this way: docs/extending/conformance.md,
docs/design/conformance.md.

A worked backend and its test module: docs/extending/backend.md.

Every test is an ``async def`` marked ``pytest.mark.asyncio`` (pytest-asyncio is required).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import functools
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hicache_store.backends import aligned_buffer
from hicache_store.backends.aio import wait_for
from hicache_store.backends.base import Backend
from hicache_store.backends.errors import (
    BackendClosedError,
    InvalidRangeError,
    NotFoundError,
    NotSupportedError,
)
from hicache_store.backends.registry import open_backend
from hicache_store.backends.types import BackendURL, ByteRange, Capabilities
from hicache_store.layout.errors import CorruptObjectError, HiCacheStoreError, InvalidKeyError
from hicache_store.layout.framing import decode_header, encode_object, verify_blocks
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key
from hicache_store.objects.io import ObjectIO

from .lifetime import BufferLifetimeTests
from .stateful import run_backend_state_machine

#: the optional abilities (``backends.abilities``): each one's ``Capabilities`` flag and accessor.
ABILITIES: dict[str, tuple[Callable[[Capabilities], bool], Callable[[Backend], object]]] = {
    "host_buffers": (lambda c: c.host_buffers, Backend.host_buffers),
    "inline_exists": (lambda c: c.inline_exists, Backend.inline_exists),
    "native_reads": (lambda c: c.native_reads, Backend.native_reads),
    "native_writes": (lambda c: c.native_writes, Backend.native_writes),
    "change_feed": (lambda c: c.change_feed, Backend.change_feed),
    "capacity_usage": (lambda c: c.capacity_usage, Backend.capacity_usage),
}

#: keys every backend must refuse, before touching storage.
INVALID_KEYS: tuple[object, ...] = (
    "",
    "a/b",
    "..",
    "../a0",
    "a0\x00",
    "x" * 10_000,
    "a" * 256,
    "a.b",
    "a b",
    "\u00e9",
    b"a0",
    7,
)
#: object sizes the round trip covers: tiny, around the 4 KiB alignment, and a whole MiB.
ROUNDTRIP_SIZES: tuple[int, ...] = (1, 17, 4095, 4096, 4097, 3 * 4096 + 17, 1 << 20)
#: the largest object the suite stores: real KV objects are 2-16 MiB.
LARGE_OBJECT_BYTES = 16 << 20
#: keys in the large-batch tests: engines ask for hundreds at once (SGLang: 128 per I/O call,
#: a whole prefetch span per exists call). 200 keeps the test at a few seconds on a loopback
#: S3 server, where every key is a request.
LARGE_BATCH = 200
#: the public methods ``bound_calls`` bounds (the other helpers go through them).
BOUNDED_CALLS: tuple[str, ...] = (
    "exists", "get_into", "get_scatter", "put", "delete", "stat", "put_if_absent", "close",
    "exists_prefix_length",
)


def call_keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """How many keys a backend call carries: the length of its batch of keys (its first
    argument), 1 for a call on one key (``get_scatter``, ``put_if_absent``), 0 for none."""
    batch = kwargs.get("keys", kwargs.get("key", args[0] if args else None))
    if batch is None:
        return 0
    if isinstance(batch, (str, bytes)):
        return 1
    try:
        return len(batch)
    except TypeError:
        return 1  # an invalid key: the call must refuse it, one key's worth of time


def call_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """How many bytes of buffers a backend call carries (its second argument: the buffers of
    ``put`` / ``get_into`` / ``get_scatter``, the one buffer of ``put_if_absent``); 0 for
    none, and for anything that is not a buffer (the call must refuse it)."""
    given = kwargs.get("buffers", kwargs.get("buffer", args[1] if len(args) > 1 else None))
    if given is None:
        return 0
    try:
        return memoryview(given).nbytes
    except TypeError:
        pass
    total = 0
    try:
        for buffer in given:
            try:
                total += memoryview(buffer).nbytes
            except TypeError:
                continue
    except TypeError:
        return 0
    return total


@dataclass(frozen=True)
class CallBounds:
    """How long one backend call may take, and how long it may hold the event loop.

    Both are hang detectors scaled to the work, never speed limits.

    **Time.** A call may take ``call_s``, plus ``mib_s`` for each MiB of buffers it carries,
    plus time for each key: ``key_s`` per key the first time a method is called on a backend,
    then ``pace_factor`` times the slowest seconds per key any call of that method took so
    far on it, and at least ``pace_floor_s`` (never more than ``key_s``). A backend that
    answers a small batch, then hangs on a large one, fails in about ``call_s`` instead of
    ``key_s`` per key; one that a loaded machine slows down is slow on both, so the bound
    grows with it.

    **The event loop.** A backend's coroutines run on the caller's event loop, which every
    other call and the engine's own I/O share: a call that holds it without yielding (a
    blocking SDK, file or database call made on the loop) stalls them all. While a call runs, a
    ticker on the loop notes how late it ran (``LoopWatch``), and a thread of its own how late
    any thread ran (``Pulse``: a loaded machine, threads holding the interpreter lock). A call
    during which the loop was held longer than ``loop_block_s``, plus ``loop_key_s`` per key (a
    task or a callback per key is the loop's own work, and contended threads slow it), plus
    ``loop_mib_s`` per MiB of buffers (copying a caller's buffer on the loop is fine), plus
    twice what every thread was held up meanwhile (after a stall of the whole process its
    threads resume in no set order), fails, naming the method. None: not checked.
    """

    call_s: float
    key_s: float = 0.0
    mib_s: float = 0.0
    pace_factor: float = 20.0
    pace_floor_s: float = 0.01
    loop_block_s: float | None = None
    loop_key_s: float = 0.0
    loop_mib_s: float = 0.0

    def time_limit(self, keys: int, nbytes: int, pace: float | None) -> tuple[float, str]:
        """Seconds a call of ``keys`` keys and ``nbytes`` bytes may take, and how that was
        made up (for the failure message). ``pace``: the slowest seconds per key of an
        earlier call of the same method, None before the first."""
        mib = nbytes / (1 << 20)
        parts = [f"{self.call_s:g} s"]
        if self.mib_s and nbytes:
            parts.append(f"{self.mib_s:g} s for each of its {mib:.3g} MiB")
        if pace is None:
            per_key = self.key_s
            parts.append(f"{per_key:g} s for each of its {keys} keys")
        else:
            per_key = min(self.key_s, max(self.pace_floor_s, self.pace_factor * pace))
            parts.append(
                f"{per_key:.3g} s for each of its {keys} keys: {self.pace_factor:g} x the "
                f"{pace:.3g} s per key of the slowest earlier call, at least "
                f"{self.pace_floor_s:g} s, at most {self.key_s:g} s"
            )
        return self.call_s + self.mib_s * mib + per_key * keys, " + ".join(parts)

    def loop_limit(self, keys: int, nbytes: int) -> float | None:
        """Seconds a call of ``keys`` keys and ``nbytes`` bytes may hold the event loop
        (None: unchecked)."""
        if self.loop_block_s is None:
            return None
        return self.loop_block_s + self.loop_key_s * keys + self.loop_mib_s * nbytes / (1 << 20)


class LoopWatch:
    """The longest time the running event loop went without running its callbacks, from this
    object's creation to ``stop`` (a ticker every ``interval`` seconds notes how late it ran;
    ``stop`` counts a stretch still going on, so a call that never yields is measured too)."""

    def __init__(self, interval: float = 0.01) -> None:
        self._loop = asyncio.get_running_loop()
        self._interval = interval
        self.longest = 0.0
        self._due = self._loop.time() + interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        self.longest = max(self.longest, now - self._due)
        self._due = now + self._interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> float:
        self._handle.cancel()
        self.longest = max(self.longest, self._loop.time() - self._due)
        return self.longest


class Pulse:
    """A thread of its own that wakes every ``interval`` seconds and notes how late it woke:
    the hold-ups any Python code of this process sees, whatever the event loop does (a loaded
    machine, other threads taking the interpreter lock). ``LoopWatch`` minus ``Pulse`` is what
    the loop alone was held for. One per process (``shared``)."""

    _shared: Pulse | None = None
    _shared_lock = threading.Lock()

    def __init__(self, interval: float = 0.01) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=60_000)
        self._last = time.monotonic()
        threading.Thread(target=self._run, daemon=True, name="hicache-testing-pulse").start()

    @classmethod
    def shared(cls) -> Pulse:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _run(self) -> None:
        while True:
            due = time.monotonic() + self._interval
            time.sleep(self._interval)
            now = time.monotonic()
            with self._lock:
                self._samples.append((now, max(0.0, now - due)))
                self._last = now

    def lateness(self, since: float) -> float:
        """The longest lateness of a wake-up since ``since`` (``time.monotonic``), including
        one still overdue now."""
        now = time.monotonic()
        with self._lock:
            late = max(0.0, now - self._last - self._interval)
            for at, lag in reversed(self._samples):
                if at < since:
                    break
                late = max(late, lag)
        return late


def bound_calls(
    backend: Backend, limit_s: float | CallBounds, key_limit_s: float = 0.0
) -> Backend:
    """Bound every call of ``backend`` (this instance only) as ``CallBounds`` says
    (``limit_s`` and ``key_limit_s``: ``CallBounds(limit_s, key_limit_s)``, time only).

    A call past its time fails with an ``AssertionError`` naming the call, its bound and how
    it was made up; a call during which the loop was held too long, one naming the call and
    how long the loop was held. Instance attributes shadow the class's methods, so the object
    keeps its type (oracles may check ``isinstance``) and its state; listings are bounded per
    key (``call_s`` for each key yielded).
    """
    bounds = limit_s if isinstance(limit_s, CallBounds) else CallBounds(limit_s, key_limit_s)
    cls = type(backend).__name__
    pace: dict[str, float] = {}

    def limited(name: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        @functools.wraps(call)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            keys, nbytes = call_keys(args, kwargs), call_bytes(args, kwargs)
            bound, made_of = bounds.time_limit(keys, nbytes, pace.get(name))
            loop_limit = bounds.loop_limit(keys, nbytes)
            watch = None if loop_limit is None else LoopWatch()
            pulse = None if loop_limit is None else Pulse.shared()
            started = time.monotonic()

            def blocked() -> str | None:
                """The failure message when the loop alone was held too long, else None."""
                if watch is None or pulse is None or loop_limit is None:
                    return None
                held, everyone = watch.stop(), pulse.lateness(started)
                if held <= loop_limit + 2 * everyone:
                    return None
                return _held_message(cls, name, held, everyone, loop_limit)
            try:
                result = await wait_for(call(*args, **kwargs), bound)
            except TimeoutError as exc:
                blocked()
                if time.monotonic() - started < bound:
                    raise  # the backend's own deadline, not ours
                raise AssertionError(
                    f"{cls}.{name} did not return within {bound:.3g} s ({made_of}): a "
                    "backend call must finish (or fail) in bounded time, never hang"
                ) from exc
            except BaseException as exc:
                message = blocked()
                if message is not None and isinstance(exc, Exception):
                    raise AssertionError(message) from exc
                raise
            message = blocked()
            if message is not None:
                raise AssertionError(message)
            if keys:
                pace[name] = max(pace.get(name, 0.0), (time.monotonic() - started) / keys)
            return result

        return wrapper

    for name in BOUNDED_CALLS:
        setattr(backend, name, limited(name, getattr(backend, name)))
    listing = backend.list_prefix

    async def list_prefix(prefix: str = "") -> AsyncIterator[str]:
        keys = listing(prefix).__aiter__()
        while True:
            try:
                key = await wait_for(keys.__anext__(), bounds.call_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise AssertionError(
                    f"{cls}.list_prefix did not yield within {bounds.call_s} s"
                ) from None
            yield key

    backend.list_prefix = list_prefix  # type: ignore[method-assign]
    return backend


def _held_message(cls: str, name: str, held: float, everyone: float, limit: float) -> str:
    return (
        f"{cls}.{name} held the event loop for {held:.2f} s (more than {limit:.3g} s plus twice "
        f"the {everyone:.2f} s every thread of the process was held up) without yielding: a "
        "backend's coroutines share the library's one event loop with every other "
        "call and the engine's own I/O, so blocking work (a synchronous SDK, file or database "
        "call) must run on an executor (`await loop.run_in_executor(pool, fn, ...)`), never "
        "on the loop"
    )


def pattern(size: int, seed: int) -> bytes:
    """Deterministic bytes where a shifted or mixed copy is always detectable."""
    return random.Random(seed).randbytes(size)


def framed_object(page: int = 1, layers: int = 4, block: int = 1024) -> tuple[ObjectKey, bytes]:
    """A small valid framed object (``layers`` blocks of ``block`` bytes) and its key."""
    key = ObjectKey(
        f"{page:064x}", "0123456789abcdef", ObjectCoords(0, layers, head_group=0)
    )
    payload = b"".join(bytes([i + 1]) * block for i in range(layers))
    return key, encode_object(key, payload, kv_planes=2)


async def assert_corrupt(backend: Backend, key: ObjectKey) -> None:
    """Both verified reads (``ObjectIO``: the whole object, and every layer block) of the object
    stored under ``key`` (one of ``framed_object``'s default size) raise
    ``CorruptObjectError``, and the object stays in place."""
    io = ObjectIO(backend)
    name = format_key(key)
    with pytest.raises(CorruptObjectError):
        await io.read_object(name)
    with pytest.raises(CorruptObjectError):
        await io.read_blocks(key, memoryview(bytearray(4096)), payload_bytes=4096)
    assert await backend.exists([name]) == [True], "a verified read must not delete"


@pytest.mark.asyncio
class BackendTests(BufferLifetimeTests, abc.ABC):
    """The conformance suite. See the module docstring for what a subclass provides."""

    #: Hypothesis budget for the model-based test (keep CI fast).
    stateful_max_examples = 15
    stateful_step_count = 12
    #: how long one backend call may take before the test fails (``CallBounds``):
    #: ``call_timeout_s``, plus ``mib_timeout_s`` per MiB of buffers, plus per key
    #: ``key_timeout_s`` the first time a method is called, then ``pace_factor`` times the
    #: slowest seconds per key of its earlier calls (at least ``pace_floor_s``). Generous per
    #: unit of work (slow servers share 2-core CI machines with the tests), short where the
    #: work is small, so a hang shows in well under a minute.
    call_timeout_s: float = 20.0
    key_timeout_s: float = 1.0
    mib_timeout_s: float = 2.0
    pace_factor: float = 20.0
    pace_floor_s: float = 0.01
    #: how long one call may hold the event loop without yielding (``CallBounds``), plus
    #: ``loop_key_s`` per key and ``loop_mib_s`` per MiB of buffers; None: not checked.
    loop_block_s: float | None = 1.5
    loop_key_s: float = 0.005
    loop_mib_s: float = 0.05

    def call_bounds(self) -> CallBounds:
        """The bounds every backend call of a test runs under (from the class attributes)."""
        return CallBounds(
            self.call_timeout_s, self.key_timeout_s, self.mib_timeout_s, self.pace_factor,
            self.pace_floor_s, self.loop_block_s, self.loop_key_s, self.loop_mib_s,
        )

    @pytest.fixture(autouse=True)
    def _bounded_backend_calls(self, request: pytest.FixtureRequest) -> None:
        if "backend" in request.fixturenames:
            bound_calls(request.getfixturevalue("backend"), self.call_bounds())

    @abc.abstractmethod
    async def oracle_get(self, backend: Backend, key: str) -> bytes | None:
        """The stored bytes of ``key``, bypassing the backend's API (None if absent)."""

    @abc.abstractmethod
    async def oracle_set(self, backend: Backend, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, bypassing the backend's API."""

    @abc.abstractmethod
    async def reopen(self, backend: Backend) -> Backend | None:
        """A new backend over the same storage as ``backend``, as a restarted process would
        open it. None is allowed only for a backend that does not declare ``persistent``."""

    def missing_location(self, backend: Backend, path: Path) -> str | Mapping[str, Any] | None:
        """What ``open_backend`` opens to reach a store of ``backend``'s kind at a location
        that does not exist (``path``, where the location is a path: it does not exist, its
        parent is an empty directory), or None where the backend names no such location."""
        return None

    def location_exists(self, backend: Backend, config: str | Mapping[str, Any]) -> bool:
        """Whether the location ``config`` (from ``missing_location``) exists. The default
        reads the URL's local path (``BackendURL.local_path``): it, or anything in its parent
        directory (the empty directory the suite made), exists."""
        url = config if isinstance(config, str) else str(config["url"])
        path = Path(BackendURL.parse(url).local_path())
        return path.exists() or any(path.parent.iterdir())

    async def _reopened(self, backend: Backend) -> Backend | None:
        again = await self.reopen(backend)
        if again is None:
            return None
        return bound_calls(again, self.call_bounds())

    # -- declarations -------------------------------------------------------------------------

    async def test_declares_capabilities(self, backend: Backend) -> None:
        assert isinstance(backend.capabilities, Capabilities)
        assert isinstance(backend.name, str)
        assert backend.name

    async def test_gives_each_ability_it_declares_and_refuses_the_others(
        self, backend: Backend
    ) -> None:
        # A declared ability whose accessor refuses (a wrapper that copies the flags of the
        # store it wraps without forwarding the hook) is found by the callers that trust the
        # flag, at run time: the accessor answers as the flag says.
        for ability, (declared, accessor) in ABILITIES.items():
            if declared(backend.capabilities):
                assert accessor(backend) is not None, ability
            else:
                with pytest.raises(NotSupportedError):
                    accessor(backend)

    # -- round trips --------------------------------------------------------------------------

    @pytest.mark.parametrize("size", ROUNDTRIP_SIZES)
    async def test_roundtrip(self, backend: Backend, size: int) -> None:
        data = pattern(size, size)
        await backend.put(["a0"], [data])
        assert await backend.exists(["a0"]) == [True]
        buf = bytearray(size)
        assert await backend.get_into(["a0"], [buf]) == [size]
        assert bytes(buf) == data
        assert await self.oracle_get(backend, "a0") == data
        (st,) = await backend.stat(["a0"])
        assert st is not None
        assert st.size == size
        assert st.key == "a0"

    @pytest.mark.parametrize("size", [4096, 3 * 4096 + 17, 1 << 20])
    async def test_roundtrip_aligned_buffers(self, backend: Backend, size: int) -> None:
        # Page-aligned buffers take the zero-copy / O_DIRECT paths where a backend has them.
        src = aligned_buffer(size)
        src[:] = pattern(size, 7)
        await backend.put(["b0"], [src])
        dst = aligned_buffer(size + 4096)
        dst[size:] = b"\xee" * 4096
        assert await backend.get_into(["b0"], [dst]) == [size]
        assert bytes(dst[:size]) == bytes(src)
        assert bytes(dst[size:]) == b"\xee" * 4096, "bytes past the object were written"

    async def test_empty_object(self, backend: Backend) -> None:
        await backend.put(["a0"], [b""])
        assert await backend.exists(["a0"]) == [True]
        assert await backend.get_into(["a0"], [bytearray(4)]) == [0]
        (st,) = await backend.stat(["a0"])
        assert st is not None
        assert st.size == 0

    async def test_batch_roundtrip(self, backend: Backend) -> None:
        keys = [f"c{i:x}" for i in range(24)]
        values = [pattern(100 + 37 * i, i) for i in range(24)]
        await backend.put(keys, values)
        buffers = [bytearray(len(v) + 5) for v in values]
        assert await backend.get_into(keys, buffers) == [len(v) for v in values]
        for buf, value in zip(buffers, values, strict=True):
            assert bytes(buf[: len(value)]) == value
        assert await backend.exists(keys) == [True] * 24

    async def test_empty_batches(self, backend: Backend) -> None:
        await backend.put([], [])
        assert await backend.exists([]) == []
        assert await backend.get_into([], []) == []
        assert await backend.delete([]) == []
        assert await backend.stat([]) == []

    # -- misses -------------------------------------------------------------------------------

    async def test_miss_is_a_result(self, backend: Backend) -> None:
        buf = bytearray(b"\x5a" * 16)
        assert await backend.exists(["d0", "d1"]) == [False, False]
        assert await backend.get_into(["d0"], [buf]) == [None]
        assert await backend.get_into(["d0"], [buf], [ByteRange(0, 4)]) == [None]
        assert bytes(buf) == b"\x5a" * 16, "a miss wrote into the buffer"
        assert await backend.stat(["d0"]) == [None]
        assert await backend.delete(["d0"]) == [False]
        assert await backend.get_bytes("d0") is None
        assert await ObjectIO(backend).read_object(format_key(framed_object()[0])) is None

    async def test_mixed_hits_and_misses(self, backend: Backend) -> None:
        await backend.put(["a0", "a1"], [b"x" * 10, b"y" * 20])
        bufs = [bytearray(32) for _ in range(3)]
        assert await backend.get_into(["a0", "d9", "a1"], bufs) == [10, None, 20]
        assert await backend.exists(["d9", "a1", "a0"]) == [False, True, True]

    # -- buffers ------------------------------------------------------------------------------

    async def test_writes_only_the_returned_prefix(self, backend: Backend) -> None:
        await backend.put(["a0"], [b"\x01" * 100])
        buf = bytearray(b"\xff" * 300)
        assert await backend.get_into(["a0"], [buf]) == [100]
        assert bytes(buf[100:]) == b"\xff" * 200
        buf = bytearray(b"\xff" * 300)
        assert await backend.get_into(["a0"], [buf], [ByteRange(10, 20)]) == [10]
        assert bytes(buf[10:]) == b"\xff" * 290

    async def test_buffer_too_small_is_an_error(self, backend: Backend) -> None:
        await backend.put(["a0"], [b"\x01" * 100])
        with pytest.raises(InvalidRangeError):
            await backend.get_into(["a0"], [bytearray(99)])
        with pytest.raises(InvalidRangeError):
            await backend.get_into(["a0"], [bytearray(5)], [ByteRange(0, 6)])

    async def test_read_only_buffer_is_refused(self, backend: Backend) -> None:
        await backend.put(["a0"], [b"\x01" * 10])
        with pytest.raises(ValueError, match="read-only"):
            await backend.get_into(["a0"], [b"\x00" * 10])

    async def test_put_does_not_keep_the_callers_buffer(self, backend: Backend) -> None:
        src = bytearray(b"\x01" * 64)
        await backend.put(["a0"], [src])
        src[:] = b"\x02" * 64
        assert await backend.get_bytes("a0") == b"\x01" * 64

    async def test_numpy_buffers(self, backend: Backend) -> None:
        np = pytest.importorskip("numpy")
        src = np.arange(1000, dtype=np.float32)
        await backend.put(["a0"], [src])
        dst = np.zeros(1000, dtype=np.float32)
        assert await backend.get_into(["a0"], [dst]) == [4000]
        assert (dst == src).all()

    async def test_length_mismatch_is_an_error(self, backend: Backend) -> None:
        with pytest.raises(ValueError, match="buffers"):
            await backend.put(["a0", "a1"], [b"x"])
        with pytest.raises(ValueError, match="buffers"):
            await backend.get_into(["a0"], [])
        with pytest.raises(ValueError, match="ranges"):
            await backend.get_into(["a0"], [bytearray(1)], [])

    # -- ranges -------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("start", "end"),
        [(0, 10_000), (0, 1), (9_999, 10_000), (4096, 8192), (4095, 4097), (17, 5000), (8192, 10_000)],
    )
    async def test_range_reads_exact_bytes(self, backend: Backend, start: int, end: int) -> None:
        data = pattern(10_000, 3)
        await backend.put(["a0"], [data])
        buf = bytearray(end - start)
        assert await backend.get_into(["a0"], [buf], [ByteRange(start, end)]) == [end - start]
        assert bytes(buf) == data[start:end]

    async def test_range_reads_into_aligned_buffers(self, backend: Backend) -> None:
        data = pattern(5 * 4096 + 100, 4)
        await backend.put(["a0"], [data])
        for rng in (ByteRange(4096, 3 * 4096), ByteRange(4096, 5 * 4096 + 100), ByteRange(0, 4096)):
            buf = aligned_buffer(rng.length + 4096)
            buf[:] = b"\xee" * len(buf)
            assert await backend.get_into(["a0"], [buf], [rng]) == [rng.length]
            assert bytes(buf[: rng.length]) == data[rng.start : rng.end]
            assert bytes(buf[rng.length :]) == b"\xee" * 4096

    @pytest.mark.parametrize(("start", "end"), [(0, 101), (100, 101), (99, 200), (500, 600)])
    async def test_over_long_range_is_an_error(self, backend: Backend, start: int, end: int) -> None:
        await backend.put(["a0"], [b"\x01" * 100])
        with pytest.raises(InvalidRangeError):
            await backend.get_into(["a0"], [bytearray(end - start)], [ByteRange(start, end)])

    @pytest.mark.parametrize(("start", "end"), [(-1, 2), (3, 3), (5, 2), (True, 4), (0, 2.0)])
    async def test_malformed_range_is_refused(self, start: object, end: object) -> None:
        with pytest.raises(InvalidRangeError):
            ByteRange(start, end)  # type: ignore[arg-type]

    async def test_get_ranges_coalesces_and_keeps_order(self, backend: Backend) -> None:
        data = pattern(50_000, 5)
        await backend.put(["a0"], [data])
        ranges = [ByteRange(40_000, 40_010), ByteRange(0, 100), ByteRange(50, 150),
                  ByteRange(30_000, 49_999)]
        got = await backend.get_ranges("a0", ranges, coalesce_bytes=64)
        assert got is not None
        assert [bytes(v) for v in got] == [data[r.start : r.end] for r in ranges]
        assert await backend.get_ranges("d0", ranges) is None
        with pytest.raises(InvalidRangeError):
            await backend.get_ranges("a0", [ByteRange(49_000, 50_001)])

    # -- scatter reads ------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("start", "end", "sizes"),
        [
            (0, 10_000, (4096, 5904)),  # a framed object's header, then its payload
            (0, 10_000, (1, 4095, 5904)),
            (17, 9_000, (100, 8_883)),
            (9_999, 10_000, (1,)),
            (4096, 10_000, (3000, 2904)),
        ],
    )
    async def test_scatter_read_equals_the_contiguous_bytes(
        self, backend: Backend, start: int, end: int, sizes: tuple[int, ...]
    ) -> None:
        data = pattern(10_000, 6)
        await backend.put(["a0"], [data])
        buffers = [bytearray(n) for n in sizes]
        assert await backend.get_scatter("a0", buffers, ByteRange(start, end)) == end - start
        assert b"".join(buffers) == data[start:end]

    async def test_scatter_read_into_aligned_buffers(self, backend: Backend) -> None:
        # Page-aligned header and payload buffers: the one-request / O_DIRECT paths where a
        # backend has them, including a payload whose length is not a whole block.
        size = 4096 + 3 * 4096 + 17
        data = pattern(size, 8)
        await backend.put(["a0"], [data])
        header, payload = aligned_buffer(4096), aligned_buffer(3 * 4096 + 17 + 4096)
        payload[:] = b"\xee" * len(payload)
        assert await backend.get_scatter("a0", [header, payload], ByteRange(0, size)) == size
        assert bytes(header) + bytes(payload[: size - 4096]) == data
        assert bytes(payload[size - 4096 :]) == b"\xee" * 4096, "bytes past the range were written"

    async def test_scatter_read_fills_buffers_in_order_and_no_further(
        self, backend: Backend
    ) -> None:
        data = pattern(1000, 9)
        await backend.put(["a0"], [data])
        buffers = [bytearray(b"\xff" * 300), bytearray(b"\xff" * 300), bytearray(b"\xff" * 300)]
        assert await backend.get_scatter("a0", buffers, ByteRange(100, 600)) == 500
        assert bytes(buffers[0]) == data[100:400]
        assert bytes(buffers[1]) == data[400:600] + b"\xff" * 100
        assert bytes(buffers[2]) == b"\xff" * 300

    async def test_scatter_read_of_a_miss(self, backend: Backend) -> None:
        buffers = [bytearray(b"\x5a" * 8), bytearray(b"\x5a" * 8)]
        assert await backend.get_scatter("d0", buffers, ByteRange(0, 16)) is None
        assert buffers == [bytearray(b"\x5a" * 8)] * 2, "a miss wrote into the buffers"

    @pytest.mark.parametrize(("start", "end"), [(0, 101), (100, 101), (50, 150), (500, 600)])
    async def test_scatter_read_past_the_end_is_an_error(
        self, backend: Backend, start: int, end: int
    ) -> None:
        await backend.put(["a0"], [b"\x01" * 100])
        half = (end - start) // 2
        buffers = [bytearray(half), bytearray(end - start - half)]
        with pytest.raises(InvalidRangeError):
            await backend.get_scatter("a0", buffers, ByteRange(start, end))

    async def test_scatter_read_buffers_too_small_is_an_error(self, backend: Backend) -> None:
        await backend.put(["a0"], [b"\x01" * 100])
        with pytest.raises(InvalidRangeError):
            await backend.get_scatter("a0", [bytearray(40), bytearray(40)], ByteRange(0, 81))
        with pytest.raises(InvalidRangeError):
            await backend.get_scatter("a0", [], ByteRange(0, 1))

    async def test_scatter_read_refuses_bad_arguments(self, backend: Backend) -> None:
        await backend.put(["a0"], [b"\x01" * 10])
        with pytest.raises(ValueError, match="read-only"):
            await backend.get_scatter("a0", [bytearray(5), b"\x00" * 5], ByteRange(0, 10))
        with pytest.raises(TypeError, match="sequence of buffers"):
            await backend.get_scatter("a0", bytearray(10), ByteRange(0, 10))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ByteRange"):
            await backend.get_scatter("a0", [bytearray(10)], (0, 10))  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            await backend.get_scatter("a/../b", [bytearray(10)], ByteRange(0, 10))

    async def test_scatter_read_of_a_framed_object_verifies(self, backend: Backend) -> None:
        # What the cache tier does: header and payload of one object in one scatter read.
        key, blob = framed_object()
        name = format_key(key)
        await backend.put([name], [blob])
        header, payload = bytearray(4096), bytearray(len(blob) - 4096)
        assert await backend.get_scatter(name, [header, payload], ByteRange(0, len(blob))) == len(
            blob
        )
        decoded = decode_header(header, expected=key, object_length=len(blob))
        verify_blocks(decoded, payload, 0, 4)

    async def test_whole_object_scatter_read_returns_the_stored_size(self, backend: Backend) -> None:
        # byte_range=None: the whole object, as get_into without a range. The one scatter read
        # that sees the stored size: a reader that knows it (a framed object's frame) checks
        # the result, so bytes appended to an object cannot pass for a valid one.
        data = pattern(10_000, 10)
        await backend.put(["a0"], [data])
        exact = [bytearray(4096), bytearray(10_000 - 4096)]
        assert await backend.get_scatter("a0", exact, None) == 10_000
        assert b"".join(exact) == data
        roomy = [bytearray(b"\xee" * 4096), bytearray(b"\xee" * 8000)]
        assert await backend.get_scatter("a0", roomy, None) == 10_000
        assert bytes(roomy[0]) + bytes(roomy[1][:5904]) == data
        assert bytes(roomy[1][5904:]) == b"\xee" * 2096, "bytes past the object were written"
        with pytest.raises(InvalidRangeError):
            await backend.get_scatter("a0", [bytearray(4096), bytearray(5903)], None)
        assert await backend.get_scatter("d0", [bytearray(8), bytearray(8)], None) is None

    async def test_scatter_read_counts_one_read(self, backend: Backend) -> None:
        await backend.put(["a0"], [b"x" * 10])
        before = backend.stats.as_dict()
        await backend.get_scatter("a0", [bytearray(4), bytearray(6)], ByteRange(0, 10))
        await backend.get_scatter("d0", [bytearray(4), bytearray(6)], ByteRange(0, 10))
        after = backend.stats.as_dict()
        assert after["reads"] - before["reads"] == 2
        assert after["read_hits"] - before["read_hits"] == 1
        assert after["bytes_read"] - before["bytes_read"] == 10

    # -- rewrites -----------------------------------------------------------------------------

    async def test_rewrite_is_idempotent(self, backend: Backend) -> None:
        data = pattern(5000, 1)
        await backend.put(["a0"], [data])
        await backend.put(["a0"], [data])
        assert await backend.get_bytes("a0") == data

    @pytest.mark.parametrize("sizes", [(5000, 9000), (9000, 5000)])
    async def test_rewrite_replaces_whole_object(self, backend: Backend, sizes: tuple[int, int]) -> None:
        first, second = pattern(sizes[0], 1), pattern(sizes[1], 2)
        await backend.put(["a0"], [first])
        await backend.put(["a0"], [second])
        assert await backend.get_bytes("a0") == second
        (st,) = await backend.stat(["a0"])
        assert st is not None
        assert st.size == sizes[1]

    async def test_key_repeated_in_a_batch(self, backend: Backend) -> None:
        a, b = pattern(3000, 1), pattern(3000, 2)
        await backend.put(["a0", "a0"], [a, b])
        assert await backend.get_bytes("a0") in (a, b)

    async def test_put_if_absent(self, backend: Backend) -> None:
        assert await backend.put_if_absent("a0", b"first") is True
        assert await backend.put_if_absent("a0", b"second") is False
        assert await backend.get_bytes("a0") == b"first"

    async def test_put_if_absent_is_atomic(self, backend: Backend) -> None:
        if not backend.capabilities.atomic_put:
            pytest.skip("backend does not declare atomic_put")
        values = [pattern(2000, i) for i in range(16)]
        wins = await asyncio.gather(*(backend.put_if_absent("a1", v) for v in values))
        assert sum(wins) == 1
        assert await backend.get_bytes("a1") == values[wins.index(True)]

    # -- delete, stat, list -------------------------------------------------------------------

    async def test_delete(self, backend: Backend) -> None:
        await backend.put(["a0", "a1"], [b"x", b"y"])
        assert await backend.delete(["a0", "a0", "d0"]) == [True, False, False]
        assert await backend.exists(["a0", "a1"]) == [False, True]
        assert await backend.get_into(["a0"], [bytearray(1)]) == [None]
        assert await self.oracle_get(backend, "a0") is None

    async def test_list_prefix(self, backend: Backend) -> None:
        if not backend.capabilities.listing:
            with pytest.raises(NotSupportedError):
                [k async for k in backend.list_prefix("")]
            return
        keys = ["a0", "a01", "a1", "b0", "ab"]
        await backend.put(keys, [b"x"] * len(keys))
        assert sorted([k async for k in backend.list_prefix("a0")]) == ["a0", "a01"]
        assert sorted([k async for k in backend.list_prefix("a")]) == ["a0", "a01", "a1", "ab"]
        assert sorted([k async for k in backend.list_prefix()]) == sorted(keys)
        assert [k async for k in backend.list_prefix("c")] == []
        with pytest.raises(InvalidKeyError):
            [k async for k in backend.list_prefix("../")]

    async def test_list_entries(self, backend: Backend) -> None:
        if not backend.capabilities.listing:
            with pytest.raises(NotSupportedError):
                [st async for st in backend.list_entries("")]
            return
        before = time.time()
        keys = ["a0", "a01", "a1", "b0"]
        await backend.put(keys, [b"x" * (10 + i) for i in range(len(keys))])
        got = {st.key: st async for st in backend.list_entries("a")}
        assert sorted(got) == ["a0", "a01", "a1"]
        assert [got[k].size for k in ("a0", "a01", "a1")] == [10, 11, 12]
        for st in got.values():  # None where unknown; never a time before the write
            assert st.mtime is None or st.mtime >= before - 5.0, st
        assert len([st async for st in backend.list_entries()]) == 4
        assert [st async for st in backend.list_entries("c")] == []
        with pytest.raises(InvalidKeyError):
            [st async for st in backend.list_entries("../")]

    async def test_exists_prefix_length(self, backend: Backend) -> None:
        keys = [f"e{i:x}" for i in range(10)]
        await backend.put(keys[:5] + keys[6:], [b"x"] * 9)
        assert await backend.exists_prefix_length(keys) == 5
        assert await backend.exists_prefix_length(keys, chunk=2) == 5
        assert await backend.exists_prefix_length(keys[6:]) == 4
        assert await backend.exists_prefix_length([]) == 0
        assert await backend.exists_prefix_length(["d0", *keys]) == 0

    async def test_exists_prefix_pages(self, backend: Backend) -> None:
        # 40 pages of two objects; 30 stored, and page 12 lost one object.
        def keys_of(page: int) -> list[str]:
            return [f"f{page:02x}_L0-0", f"f{page:02x}_L1-1"]

        stored = [k for page in range(30) for k in keys_of(page)]
        await backend.put(stored, [b"x"] * len(stored))
        assert await backend.exists_prefix_pages(40, keys_of) == 30
        assert await backend.exists_prefix_pages(40, keys_of, ordered=False) == 30
        await backend.delete([keys_of(12)[1]])
        assert await backend.exists_prefix_pages(40, keys_of, ordered=False) == 12
        assert await backend.exists_prefix_pages(40, keys_of) in (12, 30)  # see ``prefix``
        assert await backend.exists_prefix_pages(13, keys_of) == 12  # the last page: probed
        assert await backend.exists_prefix_pages(0, keys_of) == 0

    # -- keys ---------------------------------------------------------------------------------

    @pytest.mark.parametrize("bad", INVALID_KEYS, ids=lambda k: repr(k)[:20])
    async def test_invalid_keys_are_refused(self, backend: Backend, bad: object) -> None:
        calls = (
            lambda: backend.exists([bad]),  # type: ignore[list-item]
            lambda: backend.get_into([bad], [bytearray(4)]),  # type: ignore[list-item]
            lambda: backend.get_scatter(bad, [bytearray(4)], ByteRange(0, 4)),  # type: ignore[arg-type]
            lambda: backend.put([bad], [b"x"]),  # type: ignore[list-item]
            lambda: backend.delete([bad]),  # type: ignore[list-item]
            lambda: backend.stat([bad]),  # type: ignore[list-item]
            lambda: backend.put_if_absent(bad, b"x"),  # type: ignore[arg-type]
        )
        for call in calls:
            with pytest.raises(InvalidKeyError):
                await call()

    async def test_invalid_key_refuses_the_whole_batch(self, backend: Backend) -> None:
        with pytest.raises(InvalidKeyError):
            await backend.put(["a0", "a/../b", "a1"], [b"x", b"y", b"z"])
        assert await self.oracle_get(backend, "a0") is None
        assert await self.oracle_get(backend, "a1") is None

    async def test_a_single_string_is_not_a_batch(self, backend: Backend) -> None:
        with pytest.raises(TypeError):
            await backend.exists("a0")

    # -- concurrency and atomic visibility -----------------------------------------------------

    async def test_concurrent_tasks_on_overlapping_keys(self, backend: Backend) -> None:
        keys = [f"f{i}" for i in range(6)]
        versions = {k: [pattern(20_000 + 512 * v, 10 * i + v) for v in range(4)]
                    for i, k in enumerate(keys)}
        rng = random.Random(11)

        async def worker(seed: int) -> None:
            local = random.Random(seed)
            for _ in range(12):
                key = local.choice(keys)
                if local.random() < 0.5:
                    await backend.put([key], [local.choice(versions[key])])
                else:
                    buf = bytearray(30_000)
                    (n,) = await backend.get_into([key], [buf])
                    assert n is None or bytes(buf[:n]) in versions[key], f"{key}: mixed bytes"
                if local.random() < 0.1:
                    await backend.exists(keys)

        await asyncio.gather(*(worker(rng.randrange(1 << 30)) for _ in range(24)))
        for key in keys:
            value = await backend.get_bytes(key)
            assert value is None or value in versions[key]

    async def test_no_partial_object_is_ever_visible(self, backend: Backend) -> None:
        # The key exists before the readers start, so every read must hit: an overwrite shows
        # the old or the new object, never a partial one and never a miss.
        a, b = b"\xaa" * (1 << 20), b"\xbb" * ((1 << 20) + 4096)
        await backend.put(["a0"], [a])
        done = asyncio.Event()

        async def writer() -> None:
            for i in range(12):
                await backend.put(["a0"], [a if i % 2 else b])
                await asyncio.sleep(0)
            done.set()

        async def reader() -> None:
            hits = 0
            while True:  # at least one read, however fast the writer is
                buf = bytearray(len(b))
                (n,) = await backend.get_into(["a0"], [buf])
                assert n is not None, f"a miss while a0 was being overwritten ({hits} hits before)"
                assert bytes(buf[:n]) in (a, b), f"partial object of {n} bytes observed"
                hits += 1
                if done.is_set():
                    return
                await asyncio.sleep(0)

        await asyncio.gather(writer(), reader(), reader())

    # -- oracle and corruption ----------------------------------------------------------------

    async def test_oracle_agrees_with_the_api(self, backend: Backend) -> None:
        await self.oracle_set(backend, "a0", b"planted")
        assert await backend.exists(["a0"]) == [True]
        assert await backend.get_bytes("a0") == b"planted"
        await backend.put(["a1"], [b"through the api"])
        assert await self.oracle_get(backend, "a1") == b"through the api"

    async def test_verified_read_of_an_intact_object(self, backend: Backend) -> None:
        key, blob = framed_object()
        name = format_key(key)
        await backend.put([name], [blob])
        io = ObjectIO(backend)
        got = await io.read_object(name)
        assert got is not None
        assert bytes(got[1]) == blob[-4096:]
        part = bytearray(2048)
        assert await io.read_blocks(key, memoryview(part), payload_bytes=4096,
                                    layers=(1, 3)) is not None
        assert bytes(part) == b"\x02" * 1024 + b"\x03" * 1024
        into = bytearray(4096)
        assert await io.read_blocks(key, memoryview(into), payload_bytes=4096) is not None
        assert bytes(into) == blob[-4096:]

    @pytest.mark.parametrize(
        "where", ["payload", "last_byte", "header_magic", "header_field", "checksum_table"]
    )
    async def test_flipped_byte_is_a_corrupt_object(self, backend: Backend, where: str) -> None:
        key, blob = framed_object()
        name = format_key(key)
        await backend.put([name], [blob])
        offset = {"payload": len(blob) - 3000, "last_byte": len(blob) - 1, "header_magic": 0,
                  "header_field": 40, "checksum_table": 90}[where]
        raw = await self.oracle_get(backend, name)
        assert raw == blob
        damaged = bytearray(raw)
        damaged[offset] ^= 0x10
        await self.oracle_set(backend, name, bytes(damaged))
        await assert_corrupt(backend, key)

    async def test_range_read_verifies_only_its_layers(self, backend: Backend) -> None:
        key, blob = framed_object()
        name = format_key(key)
        damaged = bytearray(blob)
        damaged[4096 + 3 * 1024 + 5] ^= 0xFF  # layer 3 only
        await self.oracle_set(backend, name, bytes(damaged))
        io = ObjectIO(backend)
        ok = bytearray(2048)
        assert await io.read_blocks(key, memoryview(ok), payload_bytes=4096,
                                    layers=(0, 2)) is not None
        assert bytes(ok) == b"\x01" * 1024 + b"\x02" * 1024
        with pytest.raises(CorruptObjectError):
            await io.read_blocks(key, memoryview(bytearray(2048)), payload_bytes=4096,
                                 layers=(2, 4))

    async def test_verified_read_checks_the_key_it_was_asked_for(self, backend: Backend) -> None:
        # The header is checked against the object key asked for: another page's valid
        # object stored under this key is corrupt, never verified data.
        key, _ = framed_object(page=1)
        _, other_blob = framed_object(page=2)
        name = format_key(key)
        await self.oracle_set(backend, name, other_blob)
        await assert_corrupt(backend, key)
        await backend.put(["a0"], [other_blob])
        with pytest.raises(CorruptObjectError, match="not an object key"):
            await ObjectIO(backend).read_object("a0")  # nothing to check it against

    @pytest.mark.parametrize("damage", ["truncated", "extended", "other_key", "empty", "garbage"])
    async def test_malformed_stored_objects_are_corrupt(self, backend: Backend, damage: str) -> None:
        key, blob = framed_object(page=1)
        _, other_blob = framed_object(page=2)
        name = format_key(key)
        planted = {
            "truncated": blob[:-100],
            "extended": blob + b"\x00" * 10,
            "other_key": other_blob,
            "empty": b"",
            "garbage": pattern(8192, 9),
        }[damage]
        await self.oracle_set(backend, name, planted)
        await assert_corrupt(backend, key)

    # -- lifecycle ----------------------------------------------------------------------------

    async def test_closed_backend_refuses_calls(self, backend: Backend) -> None:
        await backend.close()
        await backend.close()  # idempotent
        assert backend.closed
        with pytest.raises(BackendClosedError) as info:
            await backend.exists(["a0"])
        assert info.value.retryable is False
        with pytest.raises(BackendClosedError):
            await backend.put(["a0"], [b"x"])
        with pytest.raises(BackendClosedError):
            await backend.get_scatter("a0", [bytearray(1)], ByteRange(0, 1))

    async def test_opening_a_missing_location_creates_nothing(
        self, backend: Backend, tmp_path: Path
    ) -> None:
        # What ``inspect`` / ``gc`` / ``doctor`` / ``serve-query`` do with a mistyped location:
        # open it with create=False where the backend declares creates_location, else as is.
        # Either way no store may appear there.
        cls = type(backend)
        path = tmp_path / "missing-location" / "store"
        path.parent.mkdir()
        config = self.missing_location(backend, path)
        if config is None:
            assert not cls.creates_location, (
                f"{cls.__name__} declares creates_location: missing_location() must say how "
                "to open it at a location that does not exist, so the suite can check create=False"
            )
            pytest.skip("missing_location() gives no location (the backend names none)")
        assert not self.location_exists(backend, config), (
            f"missing_location() named a location that exists (or is not empty): {config}")
        if cls.creates_location:
            try:
                opened = open_backend(config, create=False)
            except NotFoundError:
                raised = True
            else:
                raised = False
                await opened.close()
            created = self.location_exists(backend, config)
            if not raised or created:
                pytest.fail(
                    f"{cls.__name__} declares creates_location; opened with create=False at a "
                    f"location that does not exist it {'raised' if raised else 'did not raise'} "
                    f"NotFoundError and {'created' if created else 'did not create'} the "
                    "location: it must create nothing and raise NotFoundError"
                )
            return
        try:
            opened = open_backend(config)
        except HiCacheStoreError:
            pass  # refusing is fine: the tools report it
        else:
            await opened.close()
        assert not self.location_exists(backend, config), (
            f"opening {cls.__name__} at a location that does not exist created it "
            f"({config}), so the read-only tools would "
            "create an empty store at a mistyped path. A backend that may create its location "
            "at open declares `creates_location = True` and takes the option `create` "
            "(with create=False: create nothing, raise NotFoundError)"
        )

    async def test_objects_survive_a_reopen(self, backend: Backend) -> None:
        if not backend.capabilities.persistent:
            pytest.skip("backend is not persistent")
        await backend.put(["a0", "a1"], [b"kept", pattern(10_000, 2)])
        again = await self._reopened(backend)
        assert again is not None, (
            "the backend declares persistent: reopen() must return a backend over the same "
            "storage (a backend that wipes its data when opened would pass otherwise)"
        )
        try:
            assert await again.exists(["a0", "a1", "d0"]) == [True, True, False]
            assert await again.get_bytes("a1") == pattern(10_000, 2)
        finally:
            await again.close()

    async def test_stats_count_reads_and_writes(self, backend: Backend) -> None:
        before = backend.stats.as_dict()
        await backend.put(["a0"], [b"x" * 10])
        await backend.get_into(["a0", "d0"], [bytearray(10), bytearray(10)])
        after = backend.stats.as_dict()
        assert after["writes"] - before["writes"] == 1
        assert after["bytes_written"] - before["bytes_written"] == 10
        assert after["reads"] - before["reads"] == 2
        assert after["read_hits"] - before["read_hits"] == 1

    # -- scale, key identity, caches, metadata -------------------------------------------------
    # Each of these once let a broken backend through: batches past 32/64 keys answered for the
    # wrong key or filled the wrong buffer, objects over 2 MiB were cut short, keys compared
    # without case, listings treated ``_`` as a wildcard, reads served a stale cache.

    async def test_large_batches_map_every_key_to_its_own_buffer(self, backend: Backend) -> None:
        # A small batch of every call first: the large calls' bounds then follow this
        # backend's own pace (``CallBounds``), so one that hangs on a large batch fails fast.
        small = [f"b{i:x}" for i in range(8)]
        await backend.put(small, [b"s"] * len(small))
        assert await backend.exists(small) == [True] * len(small)
        assert await backend.get_into(small, [bytearray(1) for _ in small]) == [1] * len(small)
        assert [st and st.size for st in await backend.stat(small)] == [1] * len(small)
        assert await backend.exists_prefix_length(small) == len(small)
        assert await backend.delete(small) == [True] * len(small)
        keys = [f"c{i:03x}" for i in range(LARGE_BATCH)]
        values = [pattern(50 + (37 * i) % 700, 1000 + i) for i in range(LARGE_BATCH)]
        await backend.put(keys, values)
        # Present keys interleaved with absent ones, in one exists call.
        probe = [k for i, key in enumerate(keys) for k in ((f"d{i:03x}", key) if i % 3 else (key,))]
        assert await backend.exists(probe) == [k.startswith("c") for k in probe]
        # Reads ask in a shuffled order: a backend answering in storage (sorted) order would
        # fill the wrong buffers and still look right for sorted requests.
        order = random.Random(5).sample(range(LARGE_BATCH), LARGE_BATCH)
        asked = [keys[i] for i in order]
        buffers = [bytearray(b"\xee" * (len(values[i]) + 8)) for i in order]
        assert await backend.get_into(asked, buffers) == [len(values[i]) for i in order]
        for pos, (buf, i) in enumerate(zip(buffers, order, strict=True)):
            assert bytes(buf) == values[i] + b"\xee" * 8, f"batch position {pos}: wrong bytes"
        some = order[:64]  # ranged reads: a batch past 32 keys, in shuffled order too
        ranges = [ByteRange(i % 10, len(values[i]) - i % 7) for i in some]
        buffers = [bytearray(r.length) for r in ranges]
        assert await backend.get_into([keys[i] for i in some], buffers, ranges) == [
            r.length for r in ranges]
        for pos, (buf, i, rng) in enumerate(zip(buffers, some, ranges, strict=True)):
            assert bytes(buf) == values[i][rng.start : rng.end], f"batch position {pos}: wrong range"
        sizes = [None if st is None else st.size for st in await backend.stat(keys)]
        assert sizes == [len(v) for v in values]
        assert await backend.exists_prefix_length(keys) == LARGE_BATCH
        assert await backend.delete(keys[::2]) == [True] * len(keys[::2])
        assert await backend.exists(keys) == [i % 2 == 1 for i in range(LARGE_BATCH)]

    async def test_a_16_mib_object(self, backend: Backend) -> None:
        size = LARGE_OBJECT_BYTES
        data = pattern(size, 16)
        src = aligned_buffer(size)
        src[:] = data
        await backend.put(["a16"], [src])
        del src
        dst = aligned_buffer(size + 4096)
        dst[size:] = b"\xee" * 4096
        assert await backend.get_into(["a16"], [dst]) == [size]
        assert bytes(dst[:size]) == data, "the object came back different (truncated?)"
        assert bytes(dst[size:]) == b"\xee" * 4096
        tail = ByteRange(size - 5000, size)
        buf = bytearray(tail.length)
        assert await backend.get_into(["a16"], [buf], [tail]) == [tail.length]
        assert bytes(buf) == data[tail.start :]
        (st,) = await backend.stat(["a16"])
        assert st is not None
        assert st.size == size

    async def test_keys_differing_only_in_case_are_distinct(self, backend: Backend) -> None:
        keys = ["aB0", "ab0", "AB0", "Ab0"]
        values = [pattern(100 + i, 40 + i) for i in range(len(keys))]
        for key, value in zip(keys, values, strict=True):  # one by one: each could overwrite
            await backend.put([key], [value])
        for key, value in zip(keys, values, strict=True):
            assert await backend.get_bytes(key) == value, f"{key}: another key's bytes"
        assert await backend.exists(["AB0", "aB0", "ABB", "abb"]) == [True, True, False, False]
        assert await backend.delete(["AB0"]) == [True]
        assert await backend.exists(keys) == [True, True, False, True]
        if backend.capabilities.listing:
            assert sorted([k async for k in backend.list_prefix("A")]) == ["Ab0"]
            assert sorted([k async for k in backend.list_prefix("ab")]) == ["ab0"]

    async def test_listing_prefixes_are_literal(self, backend: Backend) -> None:
        if not backend.capabilities.listing:
            pytest.skip("backend does not declare listing")
        keys = ["a_0", "a_1", "a__0", "ab0", "aA0", "a-0", "a0_", "b_0"]
        await backend.put(keys, [b"x"] * len(keys))
        assert sorted([k async for k in backend.list_prefix("a_")]) == ["a_0", "a_1", "a__0"]
        assert sorted([k async for k in backend.list_prefix("a__")]) == ["a__0"]
        assert sorted([k async for k in backend.list_prefix("a-")]) == ["a-0"]
        assert sorted([k async for k in backend.list_prefix("a0")]) == ["a0_"]
        for bad in ("a%", "%", "a*", "a?", "a["):  # outside the key alphabet: refused
            with pytest.raises(InvalidKeyError):
                [k async for k in backend.list_prefix(bad)]

    async def test_reads_after_a_rewrite_or_delete_are_never_stale(self, backend: Backend) -> None:
        first, second, third = pattern(6000, 1), pattern(6000, 2), pattern(9000, 3)
        rng = ByteRange(100, 5000)

        async def read_all(expected: bytes) -> None:
            assert await backend.get_bytes("a0") == expected
            buf = bytearray(rng.length)
            assert await backend.get_into(["a0"], [buf], [rng]) == [rng.length]
            assert bytes(buf) == expected[rng.start : rng.end]
            head, body = bytearray(10), bytearray(len(expected) - 10)
            assert await backend.get_scatter("a0", [head, body], ByteRange(0, len(expected)))
            assert bytes(head + body) == expected
            (st,) = await backend.stat(["a0"])
            assert st is not None
            assert st.size == len(expected)

        await backend.put(["a0"], [first])
        await read_all(first)
        await read_all(first)  # a second read: served from a cache where there is one
        await backend.put(["a0"], [second])  # same size: only the bytes change
        await read_all(second)
        await backend.put(["a0"], [third])
        await read_all(third)
        assert await backend.delete(["a0"]) == [True]
        assert await backend.get_bytes("a0") is None
        assert await backend.exists(["a0"]) == [False]
        assert await backend.stat(["a0"]) == [None]
        await backend.put(["a0"], [first])
        await read_all(first)

    async def test_stat_reports_the_write_time_when_declared(self, backend: Backend) -> None:
        before = time.time()
        await backend.put(["a0"], [b"x" * 10])
        (st,) = await backend.stat(["a0"])
        assert st is not None
        if not backend.capabilities.mtime:
            assert st.mtime is None or isinstance(st.mtime, float)
            return
        assert isinstance(st.mtime, float), (
            "capabilities.mtime is declared: stat() must report mtime (tools age objects by it)"
        )
        # Stores may keep whole seconds; allow a little clock skew between client and store.
        assert before - 5 <= st.mtime <= time.time() + 5, f"mtime {st.mtime} is not the write time"

    # -- model-based --------------------------------------------------------------------------

    async def test_state_machine_against_a_dict(self, backend: Backend) -> None:
        await asyncio.to_thread(
            run_backend_state_machine,
            backend,
            max_examples=self.stateful_max_examples,
            step_count=self.stateful_step_count,
        )
