"""A fleet on one machine: three hosts, two writer processes each, one shared store and its index.

"Another host" is a process in its own UTS and mount namespaces, with its own host name and
boot id (``/proc/sys/kernel/random/boot_id`` bind-mounted over), as the file backend's
multi-host refusal tests make them (``tests/backends/test_file_site.py``); they share the
root's filesystem and reach the index server on loopback. Each writer (``fleet_worker.py``)
puts, reads and verifies, pins, retains and deletes at random for ``SECONDS``, while the test
SIGKILLs one writer (and starts it again), SIGSTOPs another past its lease, runs ``gc`` in the
middle and restarts the index server once.

The invariants, checked while it runs and after:

- **The bound**: at every sample (every 0.2 s) the bytes the root's files take on disk
  (allocated blocks of ``objects/`` and ``tmp/``) stay under ``capacity + one run per writer``:
  reservations never pass the capacity, but a run's victims are still on disk between the step
  that takes them out of the index and their removal, and a stopped writer that wakes may
  publish one run the index does not account for (until gc's reconcile).
- **Pins**: no object pinned for good (``P`` lines of the writers' logs) is ever missing.
- **Recovery**: after the run, a reconcile (``gc``) and an open, no reservation, no temp file
  and no unaccounted object is left (``check_index`` consistent).
- **Bytes**: every object read back by a writer, and every object left, is whole (its bytes
  are a function of its key).
- **Events**: a router's subscriber to ``hicache-store events`` holds exactly the pages of the
  final listing.
- **Query**: ``serve-query`` answers what ``exists_prefix_pages`` does for 1,000 random prompts.

The same mix runs on the SQLite index with the writers on this host (one host is all it
serves), and with the index server killed mid-run without persistence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _kv_subscriber import Subscriber

from hicache_store import sync
from hicache_store.backends import Retention, open_backend
from hicache_store.layout.keys import object_key_parts
from hicache_store.layout.manifest import manifest_key
from hicache_store.objects.manifest import ensure_manifest
from hicache_store.reader import KVReader

from . import fleet_worker as worker
from .valkey_server import ValkeyServer, server_or_skip

pytestmark = pytest.mark.slow

WORKER = Path(worker.__file__)
HOSTS = 3
PER_HOST = 2
SECONDS = 24.0
LEASE_S = 1.5
CAPACITY = 1 << 20
#: the most one run (one put) can take on disk: 8 pages of two 4 KiB objects
RUN_BYTES = worker.PROMPT_PAGES * worker.GROUPS * worker.OBJECT_BYTES


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-m", "-u", "true"], capture_output=True, text=True,
                           check=False)
    return None if probe.returncode == 0 else f"unshare -m -u not permitted: {probe.stderr}"


NO_UNSHARE = _can_unshare()


@dataclass
class Writer:
    host: int
    n: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0


@dataclass
class Fleet:
    """One run: the store, its writers and what the samples saw."""

    tmp: Path
    url: str
    root: Path | None  # a file root; None: an S3 prefix (``objects`` lists it)
    hosts: bool
    objects: Any = None  # () -> {key: bytes} of an S3 prefix
    writers: list[Writer] = field(default_factory=list)
    max_on_disk: int = 0
    samples: int = 0
    lost_pins: set[str] = field(default_factory=set)
    t0: float = field(default_factory=time.monotonic)

    def start(self, writer: Writer, seed: int, seconds: float) -> None:
        argv = [sys.executable, str(WORKER), self.url, f"w{writer.host}{writer.n}", str(seed),
                str(seconds), str(writer.log)]
        if self.hosts:
            boot = self.tmp / f"boot-{writer.host}"
            boot.write_text(f"0badc0de-0000-4000-8000-00000000000{writer.host}\n")
            argv = ["unshare", "-m", "-u", "sh", "-c",
                    'mount --bind "$1" /proc/sys/kernel/random/boot_id && hostname "$2" && '
                    'shift 2 && exec "$@"', "sh", str(boot), f"host{writer.host}", *argv]
        env = {**os.environ, "PYTHONPATH": str(WORKER.parent)}
        with open(writer.log.with_suffix(".err"), "a") as err:  # (a pipe could fill up)
            writer.proc = subprocess.Popen(argv, env=env, stderr=err)

    def kept_pins(self) -> set[str]:
        pins: set[str] = set()
        for w in self.writers:
            if w.log.exists():
                pins.update(line.split()[1] for line in w.log.read_text().splitlines()
                            if line.startswith("P "))
        return pins

    def still_there(self, key: str) -> bool:
        """A second look at one key the listing did not show (an S3 listing taken while the
        object is rewritten may miss it: the store's own answer decides)."""
        return self.root is None and key in self.objects(key)

    def sample(self) -> None:
        """One look at the store: the bytes it takes (a file root: the allocated blocks of
        its files, temp files included; an S3 prefix: its objects' lengths); kept pins
        present."""
        stored: dict[str, int] = {}
        if self.root is None:
            stored = self.objects()
        else:
            for folder in ("objects", "tmp"):
                for dirpath, _, files in os.walk(self.root / folder):
                    for name in files:
                        with contextlib.suppress(FileNotFoundError):
                            stored[name] = os.lstat(os.path.join(dirpath, name)).st_blocks * 512
        self.max_on_disk = max(self.max_on_disk, sum(stored.values()))
        self.samples += 1
        for key in self.kept_pins():
            if key not in stored and key not in self.lost_pins and not self.still_there(key):
                self.lost_pins.add(key)
                print(f"pin lost at {time.monotonic() - self.t0:.2f} s: {key}", flush=True)


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicache_store", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def _pages(keys: list[str], digest: str) -> set[bytes]:
    out = set()
    for key in keys:
        parts = object_key_parts(key)
        if parts is not None and parts[1] == digest:
            out.add(bytes.fromhex(parts[0]))
    return out


def _held(batches: list[tuple[int, list[Any]]]) -> set[bytes]:
    held: set[bytes] = set()
    for _, batch in batches:
        for event in batch[1]:
            if event["type"] == "BlockStored":
                held.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                held.difference_update(event["block_hashes"])
            else:
                assert event["type"] == "AllBlocksCleared"
                held.clear()
    return held


@pytest.fixture
def valkey_bin() -> str:
    return server_or_skip()


def run_fleet(tmp: Path, url: str, root: Path | None, *, hosts: bool,
              chaos: dict[float, Any], objects: Any = None) -> tuple[Fleet, list[dict[str, int]]]:
    """Start the writers (and the events process), run ``chaos`` (seconds -> action) while
    sampling, wait for them; the fleet and each writer's counts."""
    fleet = Fleet(tmp, url, root, hosts, objects)
    namespace = worker.fleet_namespace()
    backend = open_backend(url)

    async def manifest() -> None:
        # pinned: the oldest object of the store would be the first evicted, and a reader
        # (serve-query) needs it
        await ensure_manifest(backend, namespace)
        await backend.retain([manifest_key(namespace.digest)], Retention("fleet", None, True))
        await backend.close()

    asyncio.run(manifest())
    pub, replay = f"ipc://{tmp}/pub", f"ipc://{tmp}/replay"
    events = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "hicache_store", "events", url, "--namespace", namespace.digest,
         "--pub", pub, "--replay", replay, "--history", "1000000", "--interval", "0.05"],
        stdout=subprocess.PIPE, stderr=open(tmp / "events.err", "w"), text=True)  # noqa: SIM115
    assert events.stdout is not None
    first = events.stdout.readline()
    assert first.startswith("publishing"), first + (tmp / "events.err").read_text()
    sub = Subscriber(pub, replay)
    stop = threading.Event()

    def sampler() -> None:
        while not stop.wait(0.2):
            fleet.sample()

    sampling = threading.Thread(target=sampler, daemon=True)
    try:
        for h in range(HOSTS):
            for n in range(PER_HOST):
                w = Writer(h, n, tmp / f"w{h}{n}.log")
                fleet.writers.append(w)
                fleet.start(w, seed=100 * h + n, seconds=SECONDS)
        sampling.start()
        started = time.monotonic()
        for at, action in sorted(chaos.items()):
            time.sleep(max(0.0, at - (time.monotonic() - started)))
            action(fleet, started)
        counts = []
        for w in fleet.writers:
            assert w.proc is not None
            w.proc.wait(timeout=SECONDS + 300)
            assert w.proc.returncode == 0, w.log.with_suffix(".err").read_text()[-3000:]
        for w in fleet.writers:
            lines = w.log.read_text().splitlines()
            counts += [json.loads(line[5:]) for line in lines if line.startswith("done ")]
            assert not any(line.startswith("BAD") for line in lines), w.log
        stop.set()
        sampling.join()
        fleet.sample()
        # recovery: gc reconciles the index with the files (and bounds the store), then an
        # open reclaims what lapsed writers left
        gc = _cli("gc", url, "--max-bytes", f"{CAPACITY}B", "--state-dir", str(tmp / "gc"),
                  "--no-progress", "--yes")
        assert gc.returncode == 0, gc.stderr
        # the events of the still store: the subscriber converges on its listing
        listed = _listing(url)
        live: dict[int, list[Any]] = {}
        deadline = time.monotonic() + 120
        while True:
            while (got := sub.recv(0.5)) is not None:
                live[got[0]] = got[1]
            for seq, batch in sub.replay(0):
                live.setdefault(seq, batch)
            batches = [(s, live[s]) for s in sorted(live)]
            assert [s for s, _ in batches] == list(range(len(batches)))
            if _held(batches) == _pages(listed, namespace.digest) or time.monotonic() > deadline:
                break
        assert _held(batches) == _pages(listed, namespace.digest), (
            len(_held(batches)), len(_pages(listed, namespace.digest)))
    finally:
        stop.set()
        for w in fleet.writers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
                w.proc.kill()
                w.proc.wait()
        sub.close()
        events.terminate()
        try:
            events.wait(30)
        except subprocess.TimeoutExpired:
            events.send_signal(signal.SIGABRT)  # (faulthandler: every thread's stack)
            events.wait()
            raise AssertionError("the events process did not stop on SIGTERM: " +
                                 (tmp / "events.err").read_text()[-6000:]) from None
    return fleet, counts


def _listing(url: str) -> list[str]:
    async def go() -> list[str]:
        store = open_backend(url)
        try:
            return [k async for k in store.list_prefix("")]
        finally:
            await store.close()
    return asyncio.run(go())


def check_after(fleet: Fleet, url: str, tmp: Path, *, pins: bool = True) -> None:
    """The invariants of the module docstring that hold once the fleet has stopped
    (``pins``: the kept pins too; not where the index that held them was lost)."""
    namespace = worker.fleet_namespace()
    assert fleet.samples > 10
    assert fleet.max_on_disk <= CAPACITY + len(fleet.writers) * RUN_BYTES, fleet.max_on_disk
    if pins:
        assert not fleet.lost_pins, f"pinned objects gone: {sorted(fleet.lost_pins)[:5]}"

    async def go() -> None:
        store = open_backend(url)
        try:
            check = await store.check_index()
            assert check is not None and check.consistent, check
            assert store._index.reserved_bytes() == 0  # type: ignore[attr-defined]
            keys = [k async for k in store.list_prefix("")]
            for start in range(0, len(keys), 64):
                chunk = keys[start : start + 64]
                for key in chunk:
                    if key.startswith("M_"):
                        continue
                    assert await store.get_bytes(key) == worker.content(key), key
            for key in fleet.kept_pins() if pins else ():
                assert await store.exists([key]) == [True], key
        finally:
            await store.close()

    asyncio.run(go())
    if not pins:
        # the manifest's pin went with the index, and the manifest (the oldest object) with
        # the evictions after: an engine that starts stores it again, as this does
        async def manifest() -> None:
            store = open_backend(url)
            try:
                await ensure_manifest(store, namespace)
            finally:
                await store.close()

        asyncio.run(manifest())
    _query_agrees(url, namespace.digest)
    if fleet.root is not None and (fleet.root / "tmp").exists():
        left = [n for n in os.listdir(fleet.root / "tmp") if n.endswith(".tmp")]
        assert left == [], left


def _query_agrees(url: str, digest: str) -> None:
    """``serve-query`` (a process) answers what ``exists_prefix_pages`` does, 1,000 prompts."""
    store = open_backend(url)
    server = subprocess.Popen([sys.executable, "-m", "hicache_store", "serve-query", url,
                               "--namespace", digest, "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("serving http://"), line + (
            server.stderr.read() if server.stderr else "")
        address = line.split()[1]
        reader = KVReader(store, digest)
        rng = random.Random(3)
        pool = worker.prompts()
        hits = 0
        for _ in range(1000):
            base = rng.choice(pool)
            prompt = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(1000) for _ in range(rng.randrange(3 * worker.PAGE_TOKENS))]
            request = urllib.request.Request(address + "/query", method="POST",
                                             data=json.dumps({"tokens": prompt}).encode())
            with urllib.request.urlopen(request, timeout=60) as response:
                reply = json.loads(response.read())
            expected = reader.stored_pages(prompt)
            assert reply["medium"]["STORAGE"]["matched_pages"] == expected, prompt
            hits += expected > 0
        assert hits > 0  # the prompts found something stored
    finally:
        server.terminate()
        server.wait(30)
        sync.close(store)


# -- the chaos ------------------------------------------------------------------------------------


def kill_and_restart(index: int) -> Any:
    def act(fleet: Fleet, started: float) -> None:
        w = fleet.writers[index]
        assert w.proc is not None
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait()
        w.restarts += 1
        left = SECONDS - (time.monotonic() - started)
        fleet.start(w, seed=1000 + index, seconds=max(2.0, left))
    return act


def stop_past_the_lease(index: int) -> Any:
    def act(fleet: Fleet, started: float) -> None:
        w = fleet.writers[index]
        assert w.proc is not None
        w.proc.send_signal(signal.SIGSTOP)
        time.sleep(3 * LEASE_S)
        w.proc.send_signal(signal.SIGCONT)
    return act


def run_gc(fleet: Fleet, started: float) -> None:
    done = _cli("gc", fleet.url, "--max-bytes", f"{CAPACITY * 7 // 10}B", "--state-dir",
                str(fleet.tmp / "gc-mid"), "--no-progress", "--yes")
    assert done.returncode in (0, 1), done.stderr  # (1: a deletion raced a writer)


def restart_server(server: ValkeyServer, *, crash: bool, down_s: float) -> Any:
    def act(fleet: Fleet, started: float) -> None:
        if crash:
            server.kill()
        else:
            server.stop()
        time.sleep(down_s)
        server.start()
    return act


# -- the runs -------------------------------------------------------------------------------------


@pytest.mark.skipif(NO_UNSHARE is not None, reason=NO_UNSHARE or "")
def test_a_fleet_of_three_hosts_shares_one_root_through_valkey(tmp_path: Path,
                                                               valkey_bin: str) -> None:
    server = ValkeyServer(valkey_bin, appendonly=True).start()
    root = tmp_path / "root"
    url = (f"file://{root}?index={server.url}&capacity_bytes={CAPACITY}"
           f"&index_lease_s={LEASE_S}&durability=none")
    try:
        fleet, counts = run_fleet(tmp_path, url, root, hosts=True, chaos={
            3.0: kill_and_restart(0),
            6.0: stop_past_the_lease(3),
            9.0: run_gc,
            13.0: restart_server(server, crash=False, down_s=0.5),
        })
        check_after(fleet, url, tmp_path)
    finally:
        server.remove()
    totals = {k: sum(c[k] for c in counts) for k in counts[0]}
    print(f"\nfleet (valkey, {HOSTS} hosts x {PER_HOST} writers, {SECONDS:.0f} s): {totals}; "
          f"most on disk {fleet.max_on_disk} of {CAPACITY} (+{len(fleet.writers)} runs of "
          f"{RUN_BYTES}); {fleet.samples} samples; {len(fleet.kept_pins())} kept pins")
    assert totals["puts"] > 0 and totals["verified"] > 0 and totals["pins"] > 0
    assert totals["bad"] == 0


def test_the_same_mix_on_the_sqlite_index_of_one_host(tmp_path: Path) -> None:
    root = tmp_path / "root"
    url = f"file://{root}?capacity_bytes={CAPACITY}&durability=none"
    fleet, counts = run_fleet(tmp_path, url, root, hosts=False, chaos={
        3.0: kill_and_restart(0),
        9.0: run_gc,
    })
    check_after(fleet, url, tmp_path)
    totals = {k: sum(c[k] for c in counts) for k in counts[0]}
    print(f"\nfleet (sqlite, one host, {len(fleet.writers)} writers): {totals}; most on disk "
          f"{fleet.max_on_disk} of {CAPACITY}")
    assert totals["bad"] == 0 and totals["verified"] > 0


def test_the_index_server_killed_without_persistence(tmp_path: Path, valkey_bin: str) -> None:
    """Killed mid-run, back empty 2 s later: no wrong byte, no hang, writes refused and
    counted meanwhile, reads go on, and the index rebuilt from the files equals them."""
    server = ValkeyServer(valkey_bin, appendonly=False).start()
    root = tmp_path / "root"
    url = (f"file://{root}?index={server.url}&capacity_bytes={CAPACITY}"
           f"&index_lease_s={LEASE_S}&index_timeout_s=0.5&durability=none")
    try:
        fleet, counts = run_fleet(tmp_path, url, root, hosts=False, chaos={
            8.0: restart_server(server, crash=True, down_s=2.0),
        })
        totals = {k: sum(c[k] for c in counts) for k in counts[0]}
        assert totals["refused"] > 0 and totals["bad"] == 0 and totals["verified"] > 0
        check_after(fleet, url, tmp_path, pins=False)  # (lost with the index, and reported)
    finally:
        server.remove()
    print(f"\nfleet (valkey killed without persistence): {totals}")


@pytest.mark.s3
def test_the_same_mix_on_s3_with_the_index(tmp_path: Path, valkey_bin: str, seaweed: Any
                                           ) -> None:
    """Six writers on one S3 prefix (SeaweedFS) through the index: the bound on the objects'
    lengths, pins, events, the query and the reconcile, exact."""
    server = ValkeyServer(valkey_bin, appendonly=True).start()
    prefix = f"fleet-{os.getpid()}"
    client = seaweed.client()

    def objects(only: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=seaweed.bucket, Prefix=f"{prefix}/{only}"):
            for item in page.get("Contents", []):
                out[item["Key"][len(prefix) + 1:]] = int(item["Size"])
        return out

    options = "&".join(f"{k}={v}" for k, v in seaweed.options.items())
    url = (f"s3://{seaweed.bucket}/{prefix}?index={server.url}&capacity_bytes={CAPACITY}"
           f"&index_lease_s={LEASE_S}&{options}")
    try:
        fleet, counts = run_fleet(tmp_path, url, None, hosts=False, objects=objects, chaos={
            3.0: kill_and_restart(0),
            6.0: stop_past_the_lease(3),
            9.0: run_gc,
        })
        check_after(fleet, url, tmp_path)
    finally:
        server.remove()
    totals = {k: sum(c[k] for c in counts) for k in counts[0]}
    print(f"\nfleet (s3 + valkey, {len(fleet.writers)} writers): {totals}; most stored "
          f"{fleet.max_on_disk} of {CAPACITY}")
    assert totals["bad"] == 0 and totals["verified"] > 0 and totals["pins"] > 0
