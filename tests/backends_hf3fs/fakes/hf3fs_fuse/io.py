"""FAKE ``hf3fs_fuse.io`` (3FS USRBIO): plain file I/O plus a checker of the call sequence.

THIS IS NOT 3FS. No 3FS cluster, FUSE daemon or RDMA exists on the machines these tests run
on, and the PyPI binding ships no native code. This module implements the *same calls, with
the same signatures* as the real ``hf3fs_fuse.io`` (``make_iovec``, ``make_ioring``,
``register_fd``, ``deregister_fd``, ``extract_mount_point``, ``force_fsync``; ``ioring.prepare``
/ ``submit`` / ``wait``; ``iovec[a:b]`` slices), moving bytes with ``os.preadv``/``os.pwrite``
between the file and the shared memory behind the iovec, so a backend driving it really
stores and loads data. What it cannot show: 3FS performance, RDMA registration, FUSE-side
behaviour (file length refresh, holes), the real ring's asynchrony (here I/O runs at submit).

A "mount" is any directory holding ``3fs-virt/iovs/`` (``make_fake_mount``); like the real
module, ``make_iovec`` links ``<mount>/3fs-virt/iovs/<uuid>`` to the shm file.

What it CHECKS (a violation raises ``UsrbioViolation``, an ``AssertionError``, and is also
recorded in ``STATE.violations`` so a backend that swallows exceptions is still caught):

- an iovec is made from a SharedMemory on a fake mount; I/O buffers are slices of a live
  iovec (not raw memory), with step 1, inside its bounds (stricter than the real binding,
  which clamps a slice: a clamped slice would silently shorten the I/O);
- ``prepare`` uses a ring of the right direction (``read`` equals the ring's ``for_read``), an
  fd that is registered (and is still the same open file), a non-negative offset, and at
  most ``entries`` outstanding I/Os;
- ``register_fd`` only for an open fd on the mount, never twice; ``deregister_fd`` only for a
  registered fd with no prepared or unreaped I/O on it; a registered fd closed before
  ``deregister_fd`` is reported;
- ``wait`` is only asked for results that were submitted (waiting for prepared-but-never-
  submitted I/O, or for more than was submitted, would hang a real ring forever);
- an iovec or ring dropped with I/O still outstanding is reported; ``STATE.check_clean()``
  (tests call it after ``close``) reports registered fds, outstanding I/O and live iovecs or
  rings, i.e. a backend that did not release everything at close.
"""

from __future__ import annotations

import contextlib
import gc
import os
import uuid
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

FAKE = True  # what a test checks to be sure it runs against this module, never a real one


class UsrbioViolation(AssertionError):
    """An illegal USRBIO call sequence (see the module docstring)."""


@dataclass
class _Pending:
    ring: ioring
    iov: _IovSlice
    read: bool
    fd: int
    off: int
    userdata: Any
    result: int | None = None


@dataclass
class FakeState:
    violations: list[str] = field(default_factory=list)
    registered: dict[int, tuple[int, int]] = field(default_factory=dict)  # fd -> (dev, ino)
    outstanding: list[_Pending] = field(default_factory=list)  # prepared or unreaped
    iovecs: weakref.WeakSet[iovec] = field(default_factory=weakref.WeakSet)
    rings: weakref.WeakSet[ioring] = field(default_factory=weakref.WeakSet)
    calls: list[str] = field(default_factory=list)

    def violate(self, message: str) -> None:
        self.violations.append(message)
        raise UsrbioViolation(message)

    def check_clean(self) -> list[str]:
        """Problems left behind (empty when the backend released everything).

        An iovec or ring kept alive only by a reference cycle is not left behind: when the
        first look finds any problem, a full garbage collection runs (its finalizers may add
        violations) and the state is looked at again. A first look that finds nothing needs no
        collection: every iovec and ring is then already gone, finalizers run.
        """
        problems = self._problems()
        if problems:
            gc.collect()
            problems = self._problems()
        return problems

    def _problems(self) -> list[str]:
        problems = list(self.violations)
        for fd in self.registered:
            problems.append(f"fd {fd} still registered")
        if self.outstanding:
            problems.append(f"{len(self.outstanding)} I/Os prepared or submitted but not reaped")
        if len(self.iovecs):
            problems.append(f"{len(self.iovecs)} iovecs still alive")
        if len(self.rings):
            problems.append(f"{len(self.rings)} iorings still alive")
        return problems


STATE = FakeState()


def reset() -> FakeState:
    """A fresh checker state (tests call this before each use)."""
    global STATE  # noqa: PLW0603 - the module-level state is the fake's API
    STATE = FakeState()
    return STATE


def make_fake_mount(directory: str | os.PathLike[str]) -> str:
    """Turn ``directory`` into a fake 3FS mount point (creates ``3fs-virt/iovs``)."""
    os.makedirs(os.path.join(directory, "3fs-virt", "iovs"), exist_ok=True)
    return os.fspath(directory)


def _is_mount(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "3fs-virt", "iovs"))


def extract_mount_point(path: str) -> str | None:
    current = os.path.realpath(path)
    while True:
        if _is_mount(current):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def register_fd(fd: int, flags: int = 0) -> None:
    STATE.calls.append("register_fd")
    ident = _identity(fd)
    if ident is None:
        STATE.violate(f"register_fd({fd}): not an open file descriptor")
    if fd in STATE.registered:
        STATE.violate(f"register_fd({fd}): already registered (deregister first)")
    target = os.path.realpath(f"/proc/self/fd/{fd}")
    if extract_mount_point(target) is None:
        STATE.violate(f"register_fd({fd}): {target} is not on a (fake) 3FS mount")
    assert ident is not None
    STATE.registered[fd] = ident


def deregister_fd(fd: int) -> None:
    STATE.calls.append("deregister_fd")
    if fd not in STATE.registered:
        STATE.violate(f"deregister_fd({fd}): not registered")
    ident = STATE.registered.pop(fd)
    if _identity(fd) != ident:
        STATE.violate(f"deregister_fd({fd}): the fd was closed (or reused) while registered")
    if any(p.fd == fd for p in STATE.outstanding):
        STATE.violate(f"deregister_fd({fd}): I/O on it is prepared or not yet reaped")


def force_fsync(fd: int) -> None:
    os.fsync(fd)


class iovec:
    """Registered shared memory (FAKE)."""

    def __init__(self, shm: Any, mount: str, link: str) -> None:
        self.buf: memoryview = shm.buf
        self.size = len(shm.buf)
        self.mount = mount
        self.link = link
        self._finalizer = weakref.finalize(self, _iovec_gone, id(self), link)
        STATE.iovecs.add(self)

    def __getitem__(self, item: slice) -> _IovSlice:
        if not isinstance(item, slice):
            STATE.violate("iovec[...] takes a slice")
        start, stop, step = item.indices(self.size)
        if step != 1:
            STATE.violate("iovec slice step must be 1")
        if (item.start or 0) < 0 or (item.stop is not None and item.stop > self.size) or stop < start:
            STATE.violate(f"iovec slice [{item.start}:{item.stop}] outside the {self.size}-byte region")
        return _IovSlice(self, start, stop - start)


def _iovec_gone(ident: int, link: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link)
    for p in STATE.outstanding:
        if id(p.iov.parent) == ident:  # pragma: no cover - parent alive while referenced
            STATE.violations.append("iovec released with I/O outstanding")


@dataclass
class _IovSlice:
    parent: iovec
    start: int
    length: int

    @property
    def view(self) -> memoryview:
        return self.parent.buf[self.start : self.start + self.length]


def make_iovec(shm: Any, hf3fs_mount_point: str, block_size: int = 0, numa: int = -1) -> iovec:
    STATE.calls.append("make_iovec")
    if not hasattr(shm, "name") or not hasattr(shm, "buf"):
        STATE.violate("make_iovec needs a multiprocessing.shared_memory.SharedMemory")
    if not _is_mount(hf3fs_mount_point):
        STATE.violate(f"make_iovec: {hf3fs_mount_point} is not a (fake) 3FS mount point")
    ident = str(uuid.uuid4())
    link = os.path.join(hf3fs_mount_point, "3fs-virt", "iovs",
                        ident + (f".b{block_size}" if block_size > 0 else ""))
    os.symlink(os.path.normpath(f"/dev/shm/{shm.name}"), link)
    return iovec(shm, hf3fs_mount_point, link)


@dataclass
class _Result:
    result: int
    userdata: Any


class ioring:
    """A submission ring (FAKE: I/O runs synchronously at ``submit``)."""

    def __init__(self, mount: str, entries: int, for_read: bool) -> None:
        self.mount = mount
        self.entries = entries
        self.for_read = for_read
        self._prepared: list[_Pending] = []
        self._done: list[_Pending] = []
        weakref.finalize(self, _ring_gone, id(self))
        STATE.rings.add(self)

    def prepare(self, iov: Any, read: bool, fd: int, off: int, userdata: Any = None) -> ioring:
        STATE.calls.append("prepare")
        if isinstance(iov, iovec):
            iov = iov[:]
        if not isinstance(iov, _IovSlice):
            STATE.violate(f"prepare: buffer {type(iov).__name__} is not a slice of a registered iovec")
        if iov.parent not in STATE.iovecs:
            STATE.violate("prepare: iovec is not registered (released?)")
        if iov.parent.mount != self.mount:
            STATE.violate("prepare: iovec and ring belong to different mounts")
        if bool(read) != self.for_read:
            STATE.violate(f"prepare: read={read} on a ring made with for_read={self.for_read}")
        if fd not in STATE.registered:
            STATE.violate(f"prepare: fd {fd} is not registered")
        if _identity(fd) != STATE.registered[fd]:
            STATE.violate(f"prepare: fd {fd} was closed or reused since register_fd")
        if off < 0:
            STATE.violate(f"prepare: negative offset {off}")
        if len(self._prepared) + len(self._done) + self._in_flight() >= self.entries:
            STATE.violate(f"prepare: more than {self.entries} outstanding I/Os on this ring")
        pending = _Pending(self, iov, bool(read), fd, off, userdata)
        self._prepared.append(pending)
        STATE.outstanding.append(pending)
        return self

    def _in_flight(self) -> int:
        return 0  # I/O completes at submit in the fake

    def submit(self) -> ioring:
        STATE.calls.append("submit")
        for p in self._prepared:
            if p.fd not in STATE.registered or _identity(p.fd) != STATE.registered[p.fd]:
                STATE.violate(f"submit: fd {p.fd} deregistered or closed after prepare")
            view = p.iov.view
            try:
                if p.read:
                    p.result = os.preadv(p.fd, [view], p.off)
                else:
                    p.result = os.pwrite(p.fd, view, p.off)
            except OSError as exc:
                p.result = -(exc.errno or 5)
            finally:
                view.release()
        self._done.extend(self._prepared)
        self._prepared = []
        return self

    def wait(self, *, max_results: int = 0, min_results: int = 0,
             timeout: timedelta | None = None) -> list[_Result]:
        STATE.calls.append("wait")
        if min_results > len(self._done):
            if self._prepared:
                STATE.violate(f"wait: {len(self._prepared)} I/Os prepared but never submitted")
            if timeout is None:
                STATE.violate(f"wait(min_results={min_results}) with only {len(self._done)} "
                              "submitted: would block forever")
        limit = max(max_results, min_results) or len(self._done)
        out, self._done = self._done[:limit], self._done[limit:]
        for p in out:
            STATE.outstanding.remove(p)
        return [_Result(int(p.result or 0), p.userdata) for p in out]


def _ring_gone(ident: int) -> None:
    left = [p for p in STATE.outstanding if id(p.ring) == ident]
    if left:  # pragma: no cover - pending entries keep their ring alive
        STATE.violations.append(f"ioring released with {len(left)} I/Os outstanding")


def make_ioring(hf3fs_mount_point: str, entries: int, for_read: bool = True, io_depth: int = 0,
                priority: int | None = None, timeout: int | None = None, numa: int = -1,
                flags: int = 0) -> ioring:
    STATE.calls.append("make_ioring")
    if not _is_mount(hf3fs_mount_point):
        STATE.violate(f"make_ioring: {hf3fs_mount_point} is not a (fake) 3FS mount point")
    if entries < 1:
        STATE.violate("make_ioring: entries must be >= 1")
    return ioring(hf3fs_mount_point, entries, for_read)
