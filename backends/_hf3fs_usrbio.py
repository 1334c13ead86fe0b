"""USRBIO plumbing for the ``hf3fs`` backend: engine detection, registered memory, ring batches.

3FS's user-space batch I/O (``hf3fs_fuse.io``) moves bytes between files on a 3FS FUSE mount
and *registered* shared memory. The call sequence it requires, and which this module keeps:

1. ``make_iovec(shm, mount)`` registers a ``multiprocessing.shared_memory.SharedMemory``
   (memory in ``/dev/shm``) as an I/O vector; every I/O's buffer is a slice of one.
2. ``make_ioring(mount, entries, for_read=...)`` creates a submission ring (reads and writes
   need separate rings).
3. ``register_fd(fd)`` before any I/O on an open file, ``deregister_fd(fd)`` before closing it.
4. ``ring.prepare(iov_slice, read, fd, offset)`` per I/O (at most ``entries`` outstanding),
   ``ring.submit()``, then ``ring.wait(min_results=n)`` until every submitted I/O is reaped;
   only then may the memory be reused. Each result is the byte count or ``-errno``.

``hf3fs_fuse`` is imported lazily (``load_usrbio``): it is a native module that only exists
where a 3FS client is installed. Nothing here runs at import time.

Memory: I/O whose caller buffer lies inside a registered *host region* (``HostRegion``: the
cache tier's host pool, allocated in or registered from ``/dev/shm``) is prepared on a slice of
that region's iovec, so bytes land in the pool with no copy. Any other buffer bounces through
a registered staging region of ``staging_bytes`` per direction. Objects larger than the staging
region, or batches with more I/Os than the ring holds, are split into rounds.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from types import ModuleType
from typing import Any

from ._aligned import address_of
from .errors import BackendIOError, BackendUnavailableError

log = logging.getLogger(__name__)

#: filesystem types /proc/mounts shows for a 3FS FUSE mount.
HF3FS_FSTYPES = ("fuse.hf3fs", "hf3fs", "fuse.3fs", "3fs")
#: where POSIX shared memory (``SharedMemory``) lives on Linux; USRBIO registers only that.
_SHM_DIR = "/dev/shm/"  # noqa: S108 - not a temp file: the shm_open namespace


def load_usrbio() -> ModuleType | None:
    """``hf3fs_fuse.io`` if it can be imported, else None (never raises ImportError)."""
    try:
        return importlib.import_module("hf3fs_fuse.io")
    except ImportError:
        return None
    except Exception as exc:  # a broken native install: report, fall back to POSIX
        log.warning("hf3fs_fuse.io failed to import (%s); using POSIX I/O", exc)
        return None


def _table_lines(path: str) -> list[str] | None:
    """The lines of a kernel table such as ``/proc/mounts``; ``None`` where it cannot be read
    (not Linux, no ``/proc``): the callers then know nothing of mounts or mappings."""
    try:
        with open(path) as fh:
            return fh.read().splitlines()
    except OSError:
        return None


def mount_of(path: str, mounts_file: str = "/proc/mounts") -> tuple[str, str] | None:
    """``(mount point, fstype)`` of the filesystem holding ``path`` (longest prefix match)."""
    path = os.path.realpath(path)
    best: tuple[str, str] | None = None
    lines = _table_lines(mounts_file)
    if lines is None:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, parts[2])
    return best


def is_hf3fs_fstype(fstype: str) -> bool:
    return fstype in HF3FS_FSTYPES or fstype.startswith("fuse.hf3fs")


def shm_buf(shm: SharedMemory) -> memoryview:
    """The mapped bytes of an open ``SharedMemory`` (typed as optional by typeshed)."""
    buf = shm.buf
    if buf is None:
        raise ValueError("shared memory is closed")
    return buf


def _open_shm(name: str) -> SharedMemory:
    """Attach to an existing ``/dev/shm`` segment without letting this process's resource
    tracker unlink it at exit (it belongs to whoever created it)."""
    shm = SharedMemory(name=name, create=False)
    with contextlib.suppress(Exception):  # tracker internals differ across versions
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def shm_mapping_of(address: int, maps_file: str = "/proc/self/maps") -> tuple[str, int] | None:
    """``(shm name, offset in the shm file)`` of an address mapped from ``/dev/shm``, else None."""
    lines = _table_lines(maps_file)
    if lines is None:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith(_SHM_DIR):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= address < hi:
            name = parts[5][len(_SHM_DIR):].strip()
            if name.endswith(" (deleted)"):
                return None  # unlinked: cannot be attached by name any more
            return name, address - lo + int(parts[2], 16)
    return None


@dataclass
class HostRegion:
    """Caller memory ``[start, start + size)`` that is also bytes ``[iov_offset, ...)`` of a
    registered iovec over ``shm``. At unregister the iovec is dropped; ``shm`` is closed when
    this module attached it (``close_shm``) and also unlinked when it allocated it."""

    start: int
    size: int
    iov: Any
    iov_offset: int
    shm: SharedMemory
    close_shm: bool
    unlink_shm: bool

    def covers(self, address: int, length: int) -> bool:
        return self.start <= address and address + length <= self.start + self.size


@dataclass
class IoOp:
    """One transfer: ``view`` <-> bytes ``[offset, offset + len(view))`` of the file ``fd``."""

    fd: int
    offset: int
    view: memoryview
    error: BaseException | None = None


class _Channel:
    """One direction: a ring plus its registered staging region, used by one batch at a time."""

    def __init__(self, io: ModuleType, mount: str, entries: int, staging_bytes: int,
                 for_read: bool) -> None:
        self.lock = threading.Lock()
        self.for_read = for_read
        self.entries = entries
        self.shm = SharedMemory(create=True, size=staging_bytes)
        self.staging = shm_buf(self.shm)
        self.iov: Any = io.make_iovec(self.shm, mount)
        self.ring: Any = io.make_ioring(mount, entries, for_read=for_read)

    def release(self) -> None:
        self.ring = None
        self.iov = None
        self.staging.release()
        with contextlib.suppress(BufferError):  # a view escaped; the mapping dies with it
            self.shm.close()
        self.shm.unlink()


class UsrbioEngine:
    """Batched USRBIO transfers for one backend (see the module docstring)."""

    def __init__(self, io: ModuleType, mount: str, *, entries: int, staging_bytes: int,
                 timeout_s: float) -> None:
        self.io = io
        self.mount = mount
        self.entries = entries
        self.staging_bytes = staging_bytes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._regions: list[HostRegion] = []
        self._regions_lock = threading.Lock()
        self._broken: str | None = None
        self.submissions = 0
        self.ios = 0
        self.staged_bytes = 0
        self.zero_copy_bytes = 0
        self._read = _Channel(io, mount, entries, staging_bytes, True)
        try:
            self._write = _Channel(io, mount, entries, staging_bytes, False)
        except BaseException:
            self._read.release()
            raise

    # -- file descriptors ----------------------------------------------------------------------

    def register_fd(self, fd: int) -> None:
        self.io.register_fd(fd)

    def deregister_fd(self, fd: int) -> None:
        self.io.deregister_fd(fd)

    # -- host regions --------------------------------------------------------------------------

    def allocate_region(self, nbytes: int) -> memoryview:
        """New ``/dev/shm`` memory of ``nbytes``, registered; the caller's until close."""
        shm = SharedMemory(create=True, size=nbytes)
        try:
            iov = self.io.make_iovec(shm, self.mount)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        view = shm_buf(shm)[:nbytes]
        region = HostRegion(address_of(view), nbytes, iov, 0, shm, True, True)
        with self._regions_lock:
            self._regions.append(region)
        return view

    def register_region(self, buffer: SharedMemory | tuple[int, int]) -> bool:
        """Register caller memory as an iovec; False when it is not ``/dev/shm`` memory.

        A ``SharedMemory`` is registered whole. Other memory is given as ``(address,
        length)``, never as a view: this runs on a worker thread, and a thread pool drops a
        job's arguments only some time after the caller has resumed, so a view passed here
        would keep the caller's mapping exported past the call (its ``SharedMemory.close()``
        then fails with ``BufferError``). The address is looked up in ``/proc/self/maps``: if
        it is mapped from a ``/dev/shm`` file, that file is attached again and registered,
        and I/O for the buffer uses the matching slice of it (same pages, so still no copy)."""
        if isinstance(buffer, SharedMemory):
            view = shm_buf(buffer)
            region = HostRegion(address_of(view), len(view), None, 0, buffer, False, False)
            del view  # the region holds the SharedMemory, never a view of it
        else:
            address, length = buffer
            found = shm_mapping_of(address) if length else None
            if found is None:
                return False
            shm = _open_shm(found[0])
            if found[1] + length > shm.size:
                shm.close()
                return False
            region = HostRegion(address, length, None, found[1], shm, True, False)
        try:
            region.iov = self.io.make_iovec(region.shm, self.mount)
        except BaseException:
            if region.close_shm:
                region.shm.close()
            raise
        with self._regions_lock:
            self._regions.append(region)
        return True

    def unregister_region(self, address: int) -> bool:
        with self._regions_lock:
            for i, region in enumerate(self._regions):
                if region.start == address:
                    del self._regions[i]
                    self._drop_region(region)
                    return True
        return False

    @staticmethod
    def _drop_region(region: HostRegion) -> None:
        region.iov = None
        if region.close_shm:
            # BufferError: the caller still holds views; the mapping goes with the last one.
            with contextlib.suppress(BufferError):
                region.shm.close()
        if region.unlink_shm:
            with contextlib.suppress(FileNotFoundError):
                region.shm.unlink()

    def _region_for(self, view: memoryview) -> HostRegion | None:
        if not self._regions or not len(view):
            return None
        address = address_of(view)
        with self._regions_lock:
            for region in self._regions:
                if region.covers(address, len(view)):
                    return region
        return None

    # -- transfers -----------------------------------------------------------------------------

    def transfer(self, read: bool, ops: Sequence[IoOp]) -> None:
        """Run every op through the ring, in as few submissions as the ring and staging allow.

        Per-op failures are left in ``op.error``; nothing raises for them. Raises
        ``BackendUnavailableError`` when the ring itself failed (then no later call uses it).
        """
        if self._broken is not None:
            raise BackendUnavailableError(f"USRBIO ring unusable: {self._broken}", retryable=False)
        channel = self._read if read else self._write
        # Pieces: (op, piece offset within the op, length, region or None).
        pieces: list[tuple[IoOp, int, int, HostRegion | None]] = []
        for op in ops:
            region = self._region_for(op.view)
            if region is not None:
                pieces.append((op, 0, len(op.view), region))
                continue
            for start in range(0, len(op.view), self.staging_bytes):
                pieces.append((op, start, min(self.staging_bytes, len(op.view) - start), None))
        with channel.lock:
            at = 0
            while at < len(pieces):
                used = 0
                batch: list[tuple[IoOp, int, int, HostRegion | None, int]] = []
                while at < len(pieces) and len(batch) < channel.entries:
                    op, start, length, region = pieces[at]
                    if region is None and used + length > self.staging_bytes:
                        break
                    batch.append((op, start, length, region, used))
                    if region is None:
                        used += length
                    at += 1
                self._round(channel, read, batch)

    def _round(self, channel: _Channel, read: bool,
               batch: list[tuple[IoOp, int, int, HostRegion | None, int]]) -> None:
        prepared: list[tuple[IoOp, int, int, HostRegion | None, int]] = []
        for item in batch:
            op, start, length, region, staged_at = item
            if op.error is not None:
                continue
            if region is None:
                iov = channel.iov[staged_at : staged_at + length]
                if not read:
                    channel.staging[staged_at : staged_at + length] = op.view[start : start + length]
            else:
                base = region.iov_offset + address_of(op.view) - region.start + start
                iov = region.iov[base : base + length]
            try:
                channel.ring.prepare(iov, read, op.fd, op.offset + start, userdata=len(prepared))
            except OSError as exc:
                op.error = exc
                continue
            prepared.append(item)
        if not prepared:
            return
        try:
            channel.ring.submit()
            # Pieces aimed straight at caller memory (a registered region) cannot be left
            # running: their wait outlasts ``timeout`` (buffer lifetime, ``_wait_all``).
            zero_copy = any(region is not None for _, _, _, region, _ in prepared)
            done = self._wait_all(channel, len(prepared), until_done=zero_copy)
        except OSError as exc:
            self._broken = f"submit/wait failed: {exc}"
            raise BackendUnavailableError(
                f"USRBIO submit/wait failed: {exc}", retryable=False
            ) from exc
        self.submissions += 1
        self.ios += len(prepared)
        for res in done:
            op, start, length, region, staged_at = prepared[int(res.userdata)]
            n = int(res.result)
            if n < 0:
                op.error = OSError(-n, os.strerror(-n))
            elif n != length:
                op.error = BackendIOError(
                    f"short USRBIO {'read' if read else 'write'}: {n} of {length} bytes "
                    f"at offset {op.offset + start}"
                )
            elif region is None:
                self.staged_bytes += length
                if read:
                    op.view[start : start + length] = channel.staging[staged_at : staged_at + length]
            else:
                self.zero_copy_bytes += length

    def _wait_all(self, channel: _Channel, count: int, *, until_done: bool = False) -> list[Any]:
        """Wait for ``count`` completions, ``timeout`` at a time.

        Past ``timeout``: with ``until_done`` (some I/O reads into or writes from caller
        memory, which nothing can stop) keep waiting, warning each period, so that the call
        never returns while the ring still moves the caller's bytes; otherwise give up, and
        never use this ring (or its staging region, which late I/O may still reach) again.
        """
        done: list[Any] = []
        periods = 0
        while len(done) < count:
            got = channel.ring.wait(min_results=count - len(done), timeout=self.timeout)
            if not got:
                periods += 1
                if until_done:
                    log.warning("USRBIO: %d I/Os into caller memory still in flight after %s; "
                                "waiting for them", count - len(done), self.timeout * periods)
                    continue
                self._broken = f"{count - len(done)} I/Os not completed within {self.timeout}"
                raise BackendUnavailableError(
                    f"USRBIO wait timed out: {self._broken}", retryable=True
                )
            done.extend(got)
        return done

    def close(self) -> None:
        with self._regions_lock:
            regions, self._regions = self._regions, []
        for region in regions:
            self._drop_region(region)
        for channel in (self._read, self._write):
            with channel.lock:
                channel.release()
