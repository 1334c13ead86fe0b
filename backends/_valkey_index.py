"""The index of a store shared by a fleet: the ``ObjectIndex`` contract on Valkey (or Redis).

Any number of hosts and processes open one store (a file root on a shared filesystem, an S3
bucket) with ``index=valkey://host:port/N`` (or ``redis://``): each of them reads and changes the
same index, on one server, so the fleet shares one capacity bound and its eviction order, pins
and retention, the recovery of writers that died, ``exists`` and the change feed.

**Atomic steps run in the server** (``_valkey_scripts``): reserving a put and making its room,
settling it, deleting, evicting more, retaining, reclaiming a lapsed writer. A reservation is
granted only with its room: the indexed bytes plus every put in flight never pass the
capacity, whichever processes race (a settled put is charged what the store charges for its
objects, so the bound holds to the reservation estimate: ``ObjectSite.charge_of``). A step
touches one object at most once; two steps never interleave.

**Writers hold leases.** Each process registers an *incarnation* (``writer``: a random name,
also the name of its temp files) with a heartbeat: a key with a TTL of ``lease_s`` that a thread
renews three times per lease, only while it still exists. Its batches in flight are recorded
under it. A writer whose heartbeat lapsed (killed, stopped, cut off from the server) is
reclaimed by any other process (``recover``: at open, when room runs short, when a key stays
busy): its batches move to the reclaimer in one step, which then removes the lapsed writer's
temp files, finishes its deletes and evictions, and sets every key of its puts from the store.
A reclaimed writer that wakes finds its heartbeat gone: it cannot renew it, and every settle
of its batches is refused (``WriterFencedError``: its put is reported failed); it registers a
new incarnation for its next call. An object it published after the reclaim is unaccounted;
the writer removes it at once (``index.settle_or_unpublish``), gc's reconcile where it cannot. Nothing here depends on a host's clock: ranks
and leases use the server's.

**When the server cannot be reached** (``_valkey_link``: every call bounded by ``timeout_s``):
writes are refused (``reserve`` raises ``BackendUnavailableError``; counted, logged once per
outage), ``exists`` probes the store itself (the backend's reads verify every object as
always), recency is dropped, eviction pauses. **When the index is gone** (a server restarted
without persistence, or ``rebuild``): the first process to notice builds it again from a walk
of the store, under a build lock the others wait on (reads probe the store meanwhile);
``rebuilt`` says so, ``rebuilt_at`` is kept in the index for ``doctor``, and the pins and
retention set before are reported lost (logged): an empty hold table holds nothing, and never
means "evict everything". Change numbers of a rebuilt index start above any the old one gave,
so a feed reader starts over from a listing.

**Memory** (``_valkey_keys``, ``_valkey_scripts``): per *page*, one record (its objects'
suffixes and sizes) in a compact hash and its rank in a small rank set of the same bucket; per
object, its suffix and sizes in that record. The index records its format; one written by the
previous version is migrated at open (``_valkey_pages.Builder``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack

from ._valkey_keys import names, pack, unpack
from ._valkey_link import Link
from ._valkey_pages import Builder, Pages
from ._valkey_scripts import SCRIPTS
from .errors import (
    BackendUnavailableError,
    CapacityError,
    WriterFencedError,
)
from .index import (
    EvictionCount,
    FeedChanges,
    IndexFeatures,
    Measured,
    ObjectIndex,
    ObjectSite,
    Reservation,
    page_depths,
)
from .retention import Retention, check_pin_budget

log = logging.getLogger(__name__)

_SCRIPT_KEYS = 2000  # keys per script call (a put or delete of more goes in several)
_EXISTS_KEYS = 65_536  # keys per exists call (one string argument of about 20 bytes a key)


class ValkeyIndex(ObjectIndex):
    """The index of one store (``root_id``) on the Valkey or Redis server at ``url``
    (module docstring). Thread-safe.

    ``site``: the store of the bytes. ``writer``: this process's first incarnation (the name
    its temp files carry). ``clock``: unix seconds for retention deadlines (None: the
    server's). ``lock_timeout``: how long a call waits for a key busy in another process, for
    room that puts in flight hold, or for another process's build."""

    features = IndexFeatures(exact=True, retention=True, change_feed=True, hosts=True,
                             leases=True)

    def __init__(
        self, url: str, root_id: str, site: ObjectSite, *, writer: str, lease_s: float = 10.0,
        timeout_s: float = 2.0, lock_timeout: float = 30.0,
        clock: Callable[[], float] | None = None, feed_max: int = 100_000, connections: int = 64,
    ) -> None:
        self.url = url
        self.root_id = root_id
        self._site = site
        self._clock = clock
        self.lock_timeout = lock_timeout
        self.lease_ms = max(1, int(lease_s * 1000))
        self._feed_max = str(feed_max)
        self._link = Link(url, root_id, timeout_s=timeout_s, connections=connections,
                          scripts=SCRIPTS)
        self._base = writer
        self._incarnations = 0
        self.writer = writer
        self._writer_lock = threading.Lock()
        self._lapsed = False
        self._renewed_at = time.monotonic()
        self._touches: dict[bytes, int] = {}
        self._touch_lock = threading.Lock()
        self._touched_at = time.monotonic()
        self._stop = threading.Event()
        self.rebuilt = False
        self._builder = Builder(self._link, site, writer, self._set_from, self._waiting)
        self._pages = Pages(self._link, self._ready)
        self._ready()
        self._register(self.writer)
        self._heart = threading.Thread(target=self._beat, name="hicache-index-lease", daemon=True)
        self._heart.start()
        self.recovered = self.recover()

    # -- the writer's lease --------------------------------------------------------------------

    def _register(self, writer: str) -> None:
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        reply = self._script("register", [writer, info, self.lease_ms], "open")
        if reply[0] == b"NOINDEX":
            self._ready()
            self._script("register", [writer, info, self.lease_ms], "open")

    def _beat(self) -> None:
        """Renew the heartbeat while it exists; a lapsed one marks this writer fenced."""
        while not self._stop.wait(self.lease_ms / 3000):
            writer = self.writer
            try:
                kept = self._link.call("lease", self._link.client.set, self._link.key(f"H:{writer}"),
                                       "1", px=self.lease_ms, xx=True)
            except BackendUnavailableError:
                continue  # cut off: the lease may lapse, and then this writer is fenced
            if kept:
                self._renewed_at = time.monotonic()
            elif writer == self.writer:
                self._lapsed = True

    def _writer_now(self) -> str:
        """This process's incarnation, a new one if the last one's lease lapsed."""
        if self._lapsed:
            with self._writer_lock:
                if self._lapsed:
                    self._incarnations += 1
                    writer = f"{self._base}r{self._incarnations}{secrets.token_hex(2)}"
                    self._register(writer)
                    log.warning("index writer %s lost its lease (it was stopped or cut off, or "
                                "the index was rebuilt): its puts in flight are not stored; now "
                                "writing as %s", self.writer, writer)
                    self.writer, self._lapsed = writer, False
        return self.writer

    def alive(self) -> bool:
        """Whether this writer's lease is current: known without a round trip while it was
        renewed within half a lease (the monotonic clock runs on while a process is stopped,
        so a process that wakes from a stop asks the server)."""
        if self._lapsed:
            return False
        if time.monotonic() - self._renewed_at < self.lease_ms / 2000:
            return True
        return bool(self._link.call("lease", self._link.client.exists,
                                    self._link.key(f"H:{self.writer}")))

    # -- calls ---------------------------------------------------------------------------------------

    def _script(self, name: str, args: Sequence[Any], operation: str) -> list[Any]:
        return self._link.script(name, args, operation=operation)

    def _now_arg(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    def _waiting(self) -> Iterator[float]:
        """Pauses (seconds, growing) until ``lock_timeout`` has passed."""
        deadline = time.monotonic() + self.lock_timeout
        pause = 0.001
        while time.monotonic() < deadline:
            yield pause
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    # -- presence and sizes ------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited. One round trip for the batch; the store itself answers when the
        # index cannot (unreachable, or being rebuilt).
        if not keys:
            return []
        packed = [pack(key) for key in keys]
        try:
            out: list[bool] = []
            for start in range(0, len(packed), _EXISTS_KEYS):
                blob = b"".join(p.fp + bytes([len(p.suffix)]) + p.suffix
                                for p in packed[start : start + _EXISTS_KEYS])
                reply = self._script("exists", [blob], "exists")
                if reply[0] != b"OK":
                    return self._probe(keys)
                out += [bit == ord("1") for bit in reply[1]]
            return out
        except BackendUnavailableError:
            return self._probe(keys)

    def _probe(self, keys: Sequence[str]) -> list[bool]:
        return [found is not None for found in self._site.measure(keys)]

    def totals(self) -> tuple[int, int]:
        # docstring inherited
        total, count = self._link.call("totals", self._link.client.hmget, self._link.meta,
                                       "total", "count")
        return int(total or 0), int(count or 0)

    def reserved_bytes(self) -> int:
        # docstring inherited
        value = self._link.call("totals", self._link.client.hget, self._link.meta, "reserved")
        return int(value or 0)

    def usage(self) -> dict[str, int]:
        # docstring inherited. Kept per namespace by every change (no listing).
        raw = self._link.call("usage", self._link.client.hgetall, self._link.key("N"))
        return {bytes(k).hex(): int(v) for k, v in raw.items() if int(v)}

    def details(self) -> dict[str, int]:
        # docstring inherited. The index's counters (``seq``, ``rebuilt_at``, ...), the
        # writers registered and alive, the calls refused while the server was unreachable.
        raw = self._link.call("details", self._link.client.hgetall, self._link.meta)
        out = {bytes(k).decode(): int(v) for k, v in raw.items() if bytes(v).isdigit()}
        out["writers"] = int(self._link.call("details", self._link.client.hlen,
                                             self._link.key("W")))
        out["refused"] = self.refused
        return out

    # -- the bound -----------------------------------------------------------------------------------

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], capacity: int,
                pin_budget: int | None = None) -> Reservation:
        # docstring inherited. Reserves and makes room in one step: the reply names the
        # victims (out of the index, announced as deletes) whose objects make_room removes.
        incoming = sum(sizes)
        if incoming > capacity:
            raise CapacityError(f"{incoming} bytes cannot fit a capacity of {capacity} bytes",
                                backend="index", operation="put",
                                key=keys[0] if len(keys) == 1 else None)
        packed = [pack(key) for key in keys]
        depths = page_depths(keys)
        started = time.time()
        recovered = False
        waits = self._waiting()
        while True:
            writer = self._writer_now()
            args: list[Any] = [writer, capacity, self._feed_max, self._now_arg(),
                               "" if pin_budget is None else pin_budget]
            for p, size, depth in zip(packed, sizes, depths, strict=True):
                args += [p.fp, p.prefix, p.suffix, self._site.charge_of(size), depth]
            reply = self._script("reserve", args, "put")
            status = reply[0]
            if status == b"OK":
                return Reservation(list(keys), int(reply[1]), incoming, started,
                                   victims=names(reply[2]), writer=writer)
            if status == b"BUDGET":
                budget, used, asked = (int(x) for x in reply[1:4])
                check_pin_budget(budget=budget, used=used, asked=asked, backend="index",
                                 operation="put")
            if status == b"FENCED":
                self._lapsed = True
                continue
            if status == b"NOINDEX":
                self._ready()
                self._register(writer)  # (a rebuilt index knows no writer yet)
                continue
            if status == b"NOROOM" and not recovered:
                recovered = True
                if self.recover():
                    continue  # a lapsed writer's reservations were holding the room
            if status == b"NOROOM" and int(reply[2]) == 0:
                raise CapacityError(
                    f"no room: {int(reply[1])} bytes over a capacity of {capacity} bytes and "
                    "nothing more can be evicted (what remains is pinned, or busy in a call in "
                    "flight)", backend="index", operation="put")
            if next(waits, None) is None:  # BUSY, or NOROOM while puts in flight hold room
                if status == b"BUSY":
                    raise BackendUnavailableError(
                        f"a key stayed busy in another process for {self.lock_timeout} s",
                        backend="index", operation="put")
                raise CapacityError(
                    f"no room: {int(reply[1])} bytes over a capacity of {capacity} bytes while "
                    f"{int(reply[2])} bytes of other puts stayed in flight for "
                    f"{self.lock_timeout} s", backend="index", operation="put")
            if status == b"BUSY":
                self.recover()

    def make_room(self, capacity: int, reservation: Reservation | None = None) -> EvictionCount:
        # docstring inherited. The room was made in ``reserve``: remove its victims' objects;
        # an object that cannot be removed is indexed again (last in line) and room is made
        # once more from other pages, in the server.
        counts = EvictionCount()
        if reservation is None:
            return counts
        done = 0
        while done < len(reservation.victims):
            if reservation.writer != self.writer or not self.alive():
                # lapsed: the victims are a reclaimer's to remove now (another writer may be
                # putting one of them again)
                raise WriterFencedError("this writer's lease lapsed before its eviction",
                                        backend="index", operation="put")
            todo = reservation.victims[done:]
            outcomes = self._site.remove(todo)
            failed = [done + i for i, outcome in enumerate(outcomes)
                      if isinstance(outcome, OSError)]
            counts.evicted += len(todo) - len(failed)
            counts.failed += len(failed)
            done = len(reservation.victims)
            if not failed:
                break
            args: list[Any] = [reservation.writer, reservation.batch, capacity, self._feed_max,
                               self._now_arg()]
            found = self._site.measure([reservation.victims[i] for i in failed])
            for i, m in zip(failed, found, strict=True):
                args += [i + 1, -1 if m is None else m.size, 0 if m is None else m.charged]
            reply = self._script("room", args, "put")
            if reply[0] in (b"FENCED", b"NOINDEX"):
                raise WriterFencedError("this writer's put was reclaimed", backend="index",
                                        operation="put")
            kept = set(failed)
            added = names(reply[1])
            reservation.victims = [v for i, v in enumerate(reservation.victims)
                                   if i not in kept] + added
            done = len(reservation.victims) - len(added)
            if reply[0] == b"NOROOM":
                raise CapacityError(
                    f"no room under a capacity of {capacity} bytes: {counts.failed} objects "
                    "could not be removed and nothing more can be evicted", backend="index",
                    operation="put")
        return counts

    def settle_put(self, reservation: Reservation) -> None:
        # docstring inherited
        unknown = [key for key in dict.fromkeys(reservation.keys) if key not in reservation.stored]
        known: dict[str, Measured | None] = dict(reservation.stored)
        known.update(zip(unknown, self._site.measure(unknown), strict=True))
        found = [known.get(key) for key in reservation.keys]
        args: list[Any] = [reservation.writer, reservation.batch, self._feed_max]
        for m in found:
            args += [-1, 0] if m is None else [m.size, m.charged]
        args += [-1, 0] * len(reservation.victims)
        reply = self._script("settle", args, "put")
        if reply[0] == b"FENCED":
            raise WriterFencedError(
                f"this writer's lease lapsed and its put of {len(reservation.keys)} objects was "
                "reclaimed: not stored", backend="index", operation="put")
        if reply[0] == b"NOINDEX":
            raise BackendUnavailableError("the index was lost before this put settled",
                                          backend="index", operation="put")

    # -- reads ------------------------------------------------------------------------------------------

    def touch(self, keys: Sequence[str]) -> bool:
        # docstring inherited. Buffered per page (the page's first depth in the call).
        depths = page_depths(keys)
        with self._touch_lock:
            for key, depth in zip(keys, depths, strict=True):
                self._touches.setdefault(pack(key).fp, depth)
            return len(self._touches) >= 4096 or time.monotonic() - self._touched_at >= 1.0

    def flush_touches(self) -> None:
        # docstring inherited. Best effort: dropped when the server cannot be reached.
        with self._touch_lock:
            touches, self._touches = self._touches, {}
            self._touched_at = time.monotonic()
        if not touches:
            return
        args: list[Any] = []
        for fp, depth in touches.items():
            args += [fp, depth]
        with contextlib.suppress(BackendUnavailableError):
            self._script("touch", args, "get_into")

    def repair_missing(self, key: str) -> None:
        # docstring inherited. The read's miss may be stale by now (a put stored the key again
        # since: its repair was queued, or its process stopped): the store is asked again, and
        # the step skips the key if its page was settled or read after that look began.
        p = pack(key)
        with contextlib.suppress(BackendUnavailableError):
            seconds, micros = self._link.call("get_into", self._link.client.time)
            if self._site.measure([key])[0] is not None:
                return
            look = int(seconds) * 1000 + int(micros) // 1000
            self._script("set", [self._feed_max, look, "", p.fp, p.prefix, p.suffix, -1, 0, 0],
                         "get_into")

    def adopt(self, keys: Sequence[str]) -> int:
        # docstring inherited
        return self._set_from(keys, self._site.measure(keys), "adopt")

    def _set_from(self, keys: Sequence[str], found: Sequence[Measured | None], operation: str,
                  mode: str = "") -> int:
        indexed = 0
        for start in range(0, len(keys), _SCRIPT_KEYS):
            args: list[Any] = [self._feed_max, "", mode]
            for key, m in zip(keys[start : start + _SCRIPT_KEYS],
                              found[start : start + _SCRIPT_KEYS], strict=True):
                p = pack(key)
                args += [p.fp, p.prefix, p.suffix, -1 if m is None else m.size,
                         0 if m is None else m.charged, 0 if m is None else int(m.mtime * 1000)]
            reply = self._script("set", args, operation)
            if reply[0] != b"OK":
                raise BackendUnavailableError("the index is being built", backend="index",
                                              operation=operation)
            indexed += int(reply[1])
        return indexed

    # -- deletes ----------------------------------------------------------------------------------------

    def delete(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        return self._delete_groups([keys], "0")[1]

    def delete_until_held(self, groups: Sequence[Sequence[str]]) -> tuple[int, list[bool]]:
        # docstring inherited. The holds are read in the step that takes the keys out.
        return self._delete_groups(groups, "2")

    def _delete_groups(self, groups: Sequence[Sequence[str]], mode: str
                       ) -> tuple[int, list[bool]]:
        keys = [key for group in groups for key in group]
        writer, batch, chosen, done = self._announce_deletes(
            keys, mode, ",".join(str(len(g)) for g in groups))
        taken = [keys[i] for i in chosen]
        outcomes = self._site.remove(taken)
        self._settle_deletes(writer, batch, taken, list(range(len(taken))), outcomes,
                             restore=True)
        error = next((o for o in outcomes if isinstance(o, OSError)), None)
        if error is not None:
            raise error
        return (done if mode == "2" else len(groups)), [o is True for o in outcomes]

    def delete_unindexed(self, keys: Sequence[str]) -> int:
        # docstring inherited
        writer, batch, chosen, _ = self._announce_deletes(keys, "1", str(len(keys)))
        strays = [keys[i] for i in chosen]
        outcomes = self._site.remove(strays)
        self._settle_deletes(writer, batch, strays, list(range(len(strays))), outcomes,
                             restore=False)
        return sum(o is True for o in outcomes)

    def _announce_deletes(self, keys: Sequence[str], mode: str, groups: str
                          ) -> tuple[str, int, list[int], int]:
        """Take ``keys`` out of the index as deletes in flight of one batch (``mode`` and
        ``groups``: the DELETE script's); the writer, the batch, the indexes of the keys it
        holds and how many groups it took."""
        packed = [pack(key) for key in keys]
        waits = self._waiting()
        while True:
            writer = self._writer_now()
            args: list[Any] = [writer, self._feed_max, mode, groups, self._now_arg()]
            for p in packed:
                args += [p.fp, p.prefix, p.suffix]
            reply = self._script("delete", args, "delete")
            if reply[0] == b"OK":
                return writer, int(reply[1]), [int(i) - 1 for i in reply[2]], int(reply[3])
            if reply[0] == b"FENCED":
                self._lapsed = True
            elif reply[0] == b"NOINDEX":
                self._ready()
                self._register(writer)
            elif next(waits, None) is None:
                raise BackendUnavailableError(
                    f"a key stayed busy in another process for {self.lock_timeout} s",
                    backend="index", operation="delete")
            else:
                self.recover()

    def _settle_deletes(self, writer: str, batch: int, keys: Sequence[str],
                        chosen: Sequence[int], outcomes: Sequence[bool | OSError], *,
                        restore: bool) -> None:
        """Release a delete batch; with ``restore``, the objects that stayed are indexed again."""
        args: list[Any] = [writer, batch, self._feed_max]
        if restore:
            kept = [i for i, o in enumerate(outcomes) if isinstance(o, OSError)]
            found = self._site.measure([keys[i] for i in kept])
            position = {key_index: n for n, key_index in enumerate(chosen)}
            for i, m in zip(kept, found, strict=True):
                if i in position and m is not None:
                    args += [position[i] + 1, m.size, m.charged]
        self._script("settle_delete", args, "delete")

    # -- retention -------------------------------------------------------------------------------------

    def retain(self, keys: Sequence[str], retention: Retention, pin_budget: int) -> None:
        # docstring inherited
        args: list[Any] = [retention.owner, "" if retention.until_s is None else
                           repr(float(retention.until_s)), 1 if retention.pinned else 0,
                           retention.priority, pin_budget, self._now_arg()]
        for key in dict.fromkeys(keys):
            p = pack(key)
            args += [p.fp, p.suffix]
        reply = self._script("retain", args, "retain")
        if reply[0] == b"BUDGET":
            budget, used, asked = (int(x) for x in reply[1:4])
            check_pin_budget(budget=budget, used=used, asked=asked, backend="index")
        self._check(reply, "retain")

    def release(self, keys: Sequence[str], owner: str) -> None:
        # docstring inherited
        args: list[Any] = [owner]
        for key in dict.fromkeys(keys):
            p = pack(key)
            args += [p.fp, p.suffix]
        self._check(self._script("release", args, "release"), "release")

    def retention_of(self, keys: Sequence[str]) -> list[tuple[Retention, ...]]:
        # docstring inherited
        return self._holds(keys)[0]

    def pinned_bytes(self) -> int:
        # docstring inherited
        return self._holds([])[1]

    def _holds(self, keys: Sequence[str]) -> tuple[list[tuple[Retention, ...]], int]:
        args: list[Any] = [self._now_arg()]
        for key in keys:
            p = pack(key)
            args += [p.fp, p.suffix]
        reply = self._check(self._script("holds", args, "retention_of"), "retention_of")
        out: list[tuple[Retention, ...]] = []
        for blob in reply[1:-1]:
            entries = msgpack.unpackb(blob, raw=False) if blob else []
            out.append(tuple(sorted(
                (Retention(owner, None if until is False else float(until), pinned == 1, prio)
                 for owner, until, pinned, prio in entries), key=lambda r: r.owner)))
        return out, int(reply[-1])

    def _check(self, reply: list[Any], operation: str) -> list[Any]:
        if reply[0] == b"NOINDEX":
            self._ready()
            raise BackendUnavailableError("the index was being rebuilt; try again",
                                          backend="index", operation=operation)
        return reply

    # -- recovery ----------------------------------------------------------------------------------------

    def recover(self) -> int:
        # docstring inherited. Every writer whose heartbeat lapsed is reclaimed (module
        # docstring); returns how many of its batches were settled.
        writers = [bytes(w).decode() for w in self._link.call(
            "recover", self._link.client.hkeys, self._link.key("W"))]
        me = self._writer_now()
        others = [w for w in writers if w != me]
        if not others:
            return 0
        beats = self._link.pipeline("recover", lambda pipe: [
            pipe.exists(self._link.key(f"H:{w}")) for w in others])
        settled = 0
        for writer, beat in zip(others, beats, strict=True):
            if beat:
                continue
            reply = self._script("claim", [writer, me], "recover")
            if reply[0] != b"OK":
                continue  # renewed meanwhile, or claimed by another process
            self._site.remove_temps(writer)
            for at in range(1, len(reply), 2):
                self._finish(me, int(reply[at]), msgpack.unpackb(reply[at + 1], raw=True))
                settled += 1
        return settled

    def _finish(self, me: str, batch: int, record: dict[bytes, Any]) -> None:
        """Settle a reclaimed batch: its deletes and evictions finished, its puts' keys set
        from the store."""
        victims = [unpack(bytes(v[1]), bytes(v[2])) for v in _items(record.get(b"victims"))]
        self._site.remove(victims)
        if record.get(b"op") == b"del":
            self._script("settle_delete", [me, batch, self._feed_max], "recover")
            return
        keys = [unpack(bytes(k[1]), bytes(k[2])) for k in _items(record.get(b"keys"))]
        reservation = Reservation(keys, batch, 0, victims=victims, writer=me)
        self.settle_put(reservation)

    # -- the index built whole, and read whole (``_valkey_pages``) --------------------------------

    def _ready(self) -> None:
        """Make sure the index exists (built from a walk of the store when it does not)."""
        if self._builder.ready():
            self.rebuilt = True

    def clear(self) -> None:
        """Delete every key of this store's index (``Builder.clear``)."""
        self._builder.clear()

    def rebuild(self) -> None:
        # docstring inherited. (``gc --rebuild-index``)
        self._link.call("rebuild", self._link.client.hdel, self._link.meta, "ready")
        self._ready()
        self._register(self.writer)

    def changes_after(self, seq: int, limit: int = 64) -> FeedChanges:
        # docstring inherited
        return self._pages.changes_after(seq, limit)

    def listing(self) -> tuple[int, list[str]]:
        # docstring inherited
        return self._pages.listing()

    def key_pages(self, prefix: str) -> Iterator[list[str]]:
        # docstring inherited. In no particular order.
        for page in self._pages.pages(prefix):
            yield [key for key, _, _ in page]

    def entry_pages(self, prefix: str) -> Iterator[list[tuple[str, int, float]]]:
        # docstring inherited. In no particular order; sizes are the objects' lengths.
        yield from self._pages.pages(prefix)

    # -- close ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush read recency, stop renewing the lease (it lapses; nothing of this writer is
        in flight after a clean close), close the connections."""
        with contextlib.suppress(BackendUnavailableError):
            self.flush_touches()
        self._stop.set()
        self._heart.join()
        with contextlib.suppress(BackendUnavailableError):
            self._link.call("close", self._link.client.hdel, self._link.key("W"), self.writer)
            self._link.call("close", self._link.client.delete,
                            self._link.key(f"H:{self.writer}"))
        self._link.close()

    @property
    def refused(self) -> int:
        """Calls refused because the server could not be reached (since open)."""
        return self._link.refused


def _items(value: Any) -> list[Any]:
    """A msgpack'd Lua table as a list (Lua's empty table packs as a map)."""
    if isinstance(value, dict):
        return [value[k] for k in sorted(value)]
    return list(value or [])


__all__ = ["ValkeyIndex"]
