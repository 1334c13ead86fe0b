"""The one Mooncake client of a process: setup, registered memory, staging, return codes.

``MooncakeDistributedStore`` is a blocking C++ client that starts a transfer engine (threads,
sockets) on ``setup``. One per process and configuration is enough and is what Mooncake
expects, so ``acquire(config)`` hands out a shared, reference-counted ``SharedClient`` and
``release`` closes it when its last backend closes.

Threads: every Mooncake call runs on the client's bounded ``ThreadPoolExecutor`` (``threads``
workers), never on an event loop. Mooncake's client is safe to call from several threads at
once (SGLang calls it from its prefetch and backup threads); what *we* share (the table of
registered regions, the staging slabs) is guarded by ``self._lock`` / a queue.

Calls on one key are ordered by ``SharedClient.keys`` (``KeyLocks``): a write or delete of a
key runs alone, reads of it share. Mooncake's master does not order them between the calls of
one client and serves wrong bytes when they race (see ``KeyLocks``).

Memory the transfer engine touches must be registered (``register_buffer``): RDMA requires
it for every buffer, and Mooncake's ranged read requires it even over TCP. Registered
regions come from ``register`` (the cache tier's host pool) and from the staging slabs
allocated here; a caller's buffer outside them is copied through a slab.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import socket
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ._aligned import address_of
from ._mooncake_config import MooncakeConfig
from .errors import (
    BackendError,
    BackendIOError,
    BackendUnavailableError,
    CapacityError,
    MissingDependencyError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Mooncake ``ErrorCode`` values we act on (mooncake-store/include/types.h).
OK = 0
NO_AVAILABLE_HANDLE = -200  # no segment space for a put (pool full, or no holder mounted)
INVALID_PARAMS = -600  # e.g. buffer too small, range past the end, unregistered buffer
REPLICA_IS_NOT_READY = -703  # a put of this key is still in flight: not visible yet
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706  # a reader holds a lease; only a forced remove succeeds
LEASE_EXPIRED = -707  # the lease ran out mid-transfer: the bytes were discarded
REPLICA_IS_GONE = -712
TRANSFER_FAIL = -800  # the transfer engine could not move the bytes (holder down, ...)
RPC_FAIL = -900  # the master did not answer
RPC_TIMEOUT = -901

#: codes that mean "try again later" (a holder restarting, a lease, a transient RPC failure).
RETRYABLE_CODES = frozenset(
    {NO_AVAILABLE_HANDLE, OBJECT_HAS_LEASE, LEASE_EXPIRED, TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT,
     -1010, -1011}
)
#: codes that a read treats as a miss: the object is absent or not (any longer) readable.
MISS_CODES = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, REPLICA_IS_GONE})

INSTALL_HINT = "pip install mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)"

#: Mooncake's own deadlines (environment variables it reads at setup) and the values we give
#: them unless the process already set them. Its defaults are 30 s for a master RPC and for a
#: TCP transfer without progress: a stopped master or segment holder held every call that
#: long, and a zero-copy call (which cannot be abandoned, see ``MooncakeBackend``) with it.
#: At 10 s they end below our default call deadline (15 s). Measured on a local deployment
#: with the master, then the holder, stopped by SIGSTOP: 30.0 s per call with Mooncake's
#: defaults, 5.0 s with these set to 5 s.
MOONCAKE_TIMEOUT_ENV: dict[str, str] = {
    "MC_RPC_TIMEOUT_MS": "10000",
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "10",
    "MC_TCP_STATUS_TIMEOUT_SEC": "10",
}


def code_error(
    code: int, *, operation: str, key: str | None = None, backend: str = "mooncake"
) -> BackendError:
    """The exception for a Mooncake error code (the caller raises it).

    -200 (no space) is a retryable ``CapacityError``-like unavailability: with a holder gone
    it is what every put returns, and eviction makes room later. -706 (lease), -707, -800
    (transfer failure) and RPC failures are ``BackendUnavailableError(retryable=True)``.
    Everything else is a non-retryable ``BackendIOError``.
    """
    message = f"{operation} failed with Mooncake error {code}"
    if code == NO_AVAILABLE_HANDLE:
        message += " (no segment space available)"
    if code in RETRYABLE_CODES:
        return BackendUnavailableError(message, retryable=True, backend=backend,
                                       operation=operation, key=key)
    return BackendIOError(message, retryable=False, backend=backend, operation=operation,
                          key=key)


def _import_store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise MissingDependencyError(
            f"the mooncake backend needs Mooncake's Python client ({exc})",
            install_hint=INSTALL_HINT, backend="mooncake",
        ) from exc
    return MooncakeDistributedStore


class KeyLocks:
    """Per-key locks of one Mooncake client: a writer of a key excludes everyone else on it,
    readers of it share. Every process-side ordering between calls on the same key is here.

    Why (Mooncake's master, all clients of one store share one client id):

    - Two upserts of one key in flight: the second preempts the first (the first's buffer is
      discarded, a fresh one allocated), then the *first* one's ``UpsertEnd`` passes the
      client-id check and marks the second's replica complete while the second is still
      writing it. A reader then gets the new length with whatever the fresh buffer held:
      wrong bytes, no error (raw ``store.upsert``/``store.get`` from 6+6 threads: a bad read
      within seconds; with writers of a key serialized: none in 100k reads).
    - A same-size upsert rewrites the replica in place, and a forced remove frees it at
      once: a read already transferring from it gets torn or foreign bytes.

    Other processes are other client ids: their racing ``UpsertEnd`` fails (an error, not
    wrong bytes); in-place rewrites and forced removes racing a reader in another process
    stay Mooncake's (the framed-object checksums catch those at the tier).

    ``hold(shared=..., exclusive=...)`` takes every key of a call at once (all or nothing,
    so batches never deadlock); a waiting writer holds back new readers of its keys.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers: dict[str, int] = {}
        self._writing: set[str] = set()
        self._waiting: dict[str, int] = {}  # writers waiting per key (they go first)

    @contextmanager
    def hold(self, *, shared: Iterable[str] = (), exclusive: Iterable[str] = ()) -> Iterator[None]:
        """Hold ``shared`` keys for reading and ``exclusive`` ones for writing (blocking)."""
        mine = set(exclusive)
        reads = set(shared) - mine
        with self._cond:
            for key in mine:
                self._waiting[key] = self._waiting.get(key, 0) + 1
            try:
                self._cond.wait_for(lambda: not any(
                    k in self._writing or k in self._readers for k in mine) and not any(
                    k in self._writing or k in self._waiting for k in reads))
            finally:
                for key in mine:
                    if self._waiting[key] == 1:
                        del self._waiting[key]
                    else:
                        self._waiting[key] -= 1
            self._writing |= mine
            for key in reads:
                self._readers[key] = self._readers.get(key, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._writing -= mine
                for key in reads:
                    if self._readers[key] == 1:
                        del self._readers[key]
                    else:
                        self._readers[key] -= 1
                self._cond.notify_all()


@dataclass(frozen=True)
class Region:
    """A registered memory region ``[start, end)``; ``owner`` keeps the memory alive."""

    start: int
    end: int
    owner: object


class SharedClient:
    """A set-up ``MooncakeDistributedStore`` with its worker pool, regions and staging slabs.

    Built by ``acquire``; not constructed directly. All methods are thread-safe.
    """

    def __init__(self, config: MooncakeConfig) -> None:
        self.config = config
        self.store: Any = None
        self._lock = threading.Lock()
        self._regions: list[Region] = []  # sorted by start, non-overlapping
        self._slabs: queue.Queue[tuple[memoryview, int]] = queue.Queue()
        self._arena: mmap.mmap | None = None
        self.slab_bytes = 0
        self.refs = 0
        self.keys = KeyLocks()
        import concurrent.futures

        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.threads, thread_name_prefix="hicache-mooncake"
        )

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Connect: check the master answers (``setup`` would block ~90 s on a dead master),
        set up the client, then allocate and register the staging slabs."""
        cls = _import_store_class()
        host, port = self.config.master_host_port
        try:
            with socket.create_connection((host, port), timeout=3.0):
                pass
        except OSError as exc:
            raise BackendUnavailableError(
                f"mooncake master {self.config.master} is unreachable: {exc}",
                backend="mooncake", operation="setup",
            ) from exc
        for name, value in MOONCAKE_TIMEOUT_ENV.items():
            os.environ.setdefault(name, value)  # read by Mooncake's C++ client at setup
        store = cls()
        cfg = self.config
        rc = store.setup(cfg.hostname, cfg.metadata, cfg.segment, cfg.buffer, cfg.protocol,
                         cfg.device, cfg.master)
        if rc != 0:
            raise BackendUnavailableError(
                f"mooncake setup against {cfg.master} failed with code {rc}",
                backend="mooncake", operation="setup",
            )
        self.store = store
        slabs = cfg.threads
        self.slab_bytes = max(1 << 20, (cfg.bounce // slabs) & ~4095)
        self._arena = mmap.mmap(-1, self.slab_bytes * slabs)
        arena_view = memoryview(self._arena)
        self.register(arena_view, owner=self._arena)
        for i in range(slabs):
            view = arena_view[i * self.slab_bytes : (i + 1) * self.slab_bytes]
            self._slabs.put((view, address_of(view)))

    def close(self) -> None:
        """Stop the workers (waiting for running calls), unregister, close the client."""
        self.executor.shutdown(wait=True, cancel_futures=True)
        store, self.store = self.store, None
        if store is None:
            return
        with self._lock:
            regions, self._regions = self._regions, []
        for region in regions:
            store.unregister_buffer(region.start)
        rc = store.close()
        if rc != 0:
            log.warning("mooncake client close returned %s", rc)

    # -- registered memory --------------------------------------------------------------------

    def register(self, view: memoryview, owner: object) -> Region:
        """Register ``view``'s memory with the transfer engine; ``owner`` is kept alive until
        ``unregister``. Registering a region that overlaps one already registered raises."""
        start = address_of(view)
        region = Region(start, start + len(view), owner)
        with self._lock:
            i = bisect_right([r.start for r in self._regions], start)
            if (i > 0 and self._regions[i - 1].end > start) or (
                i < len(self._regions) and self._regions[i].start < region.end
            ):
                raise ValueError("buffer overlaps memory already registered with Mooncake")
            rc = self.store.register_buffer(start, len(view))
            if rc != 0:
                raise code_error(rc, operation="register_buffer")
            self._regions.insert(i, region)
        return region

    def unregister(self, start: int) -> bool:
        """Forget the region starting at ``start``; False when none does. The caller must make
        sure no transfer into it is in flight (the backend tracks that)."""
        with self._lock:
            for i, region in enumerate(self._regions):
                if region.start == start:
                    del self._regions[i]
                    break
            else:
                return False
            rc = self.store.unregister_buffer(start)
        if rc != 0:
            log.warning("mooncake unregister_buffer(%#x) returned %s", start, rc)
        return True

    def is_registered(self, start: int, length: int) -> bool:
        """Whether ``[start, start + length)`` lies inside one registered region."""
        with self._lock:
            i = bisect_right([r.start for r in self._regions], start) - 1
            return i >= 0 and self._regions[i].end >= start + length

    # -- staging ------------------------------------------------------------------------------

    @contextmanager
    def staging(self, nbytes: int) -> Iterator[tuple[memoryview, int]]:
        """Registered scratch memory of at least ``nbytes``: a slab from the pool (blocking
        until one is free) or, for larger requests, a temporary region registered for the
        duration. Yields ``(view, address)``; the memory is reused as soon as the block exits,
        so nothing may keep a view of it."""
        if nbytes <= self.slab_bytes:
            slab = self._slabs.get()
            try:
                yield slab
            finally:
                self._slabs.put(slab)
            return
        temp = mmap.mmap(-1, nbytes)
        view = memoryview(temp)
        region = self.register(view, owner=temp)
        try:
            yield view, region.start
        finally:
            # Unregistered first; the mapping itself goes when the last view of it does
            # (numpy views made by the caller may outlive this block by a moment).
            self.unregister(region.start)

    # -- blocking calls (run on ``executor`` threads) ---------------------------------------

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a Mooncake method, turning a closed client into a non-retryable error."""
        if self.store is None:
            raise BackendUnavailableError("mooncake client is closed", retryable=False,
                                          backend="mooncake")
        return fn(*args)


def as_uint8(view: memoryview) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A numpy view of a byte buffer (no copy), for fast slab copies."""
    return np.frombuffer(view, dtype=np.uint8)


_clients_lock = threading.Lock()
_clients: dict[tuple[Any, ...], SharedClient] = {}


def acquire(config: MooncakeConfig) -> SharedClient:
    """The process's client for ``config`` (set up on first use); pair with ``release``.

    Blocking (``setup`` takes tens of milliseconds; an unreachable master fails in seconds):
    call it from a worker thread when on an event loop.
    """
    key = config.client_key()
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = SharedClient(config)
            try:
                client.start()
            except BaseException:
                client.executor.shutdown(wait=False)
                raise
            _clients[key] = client
        client.refs += 1
        return client


def release(client: SharedClient) -> None:
    """Drop one reference; the last one closes the client."""
    with _clients_lock:
        client.refs -= 1
        if client.refs > 0:
            return
        _clients.pop(client.config.client_key(), None)
    client.close()


def check_capacity(code: int, key: str) -> None:
    """Raise for a put's return code (0 is success)."""
    if code == OK:
        return
    if code == OBJECT_ALREADY_EXISTS:
        return  # only reached with put-if-absent semantics: the key is there, as wanted
    if code == INVALID_PARAMS:
        raise CapacityError(
            f"put rejected by Mooncake (code {code}: object too large for the pool or empty)",
            backend="mooncake", operation="put", key=key,
        )
    raise code_error(code, operation="put", key=key)
