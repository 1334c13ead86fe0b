"""``hicache-store bench backend URL``: throughput of a storage backend, next to the raw disk.

Writes ``--objects`` objects of ``--size`` bytes in batches of ``--batch``, then measures, in
order: write (durable as the URL's ``durability`` says), cold read, second read (the same
again), warm read (a third time: the file backend reads cold bytes with O_DIRECT and admits a
key to the page cache on its second cold read, so its third read is the first from the cache),
range read (one ``--range-fraction`` slice from the middle of every object) and exists
(``--exists-keys`` probes). Cold reads: by default only the benchmark's own files leave the page
cache (``--drop-caches files``: fsync and ``POSIX_FADV_DONTNEED`` per file of a ``file://`` or ``hf3fs://``
store, no root needed, nothing else on the machine is touched); ``--drop-caches all`` drops the
whole machine's page cache (root only, and said on stderr); other backends have nothing to drop. For local paths it also
measures a raw baseline in the same run on the same filesystem: the same bytes written and read
by ``--threads`` threads with O_DIRECT (plus ``fdatasync`` per file on write, so both sides are
durable), first, in the same process, and prints the backend/raw ratio. The backend's run then
follows the baseline's gigabytes, which its own measures do not (a backend's cold read after
them can read faster than the baseline's own): to compare like with like, ``--baseline only``
measures the baseline alone (no backend opened) and ``--baseline no`` the backend alone, each
in a fresh process (``bench/bench_file_engines.py`` does).

Memory: two sets of ``--batch`` page-aligned buffers (sources and destinations), pre-faulted
before timing, the way an engine's host pool is. Every object read back is checked (its stamp).
Output: a table, or ``--json``. Progress goes to stderr when it is a terminal (not with
``--quiet``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hicache_store._sync import run_sync
from hicache_store.backends import Backend, BackendURL, ByteRange, aligned_buffer, open_backend
from hicache_store.backends.file_layout import object_path
from hicache_store.backends.types import parse_size
from hicache_store.commands._common import add_command
from hicache_store.errors import UsageError

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_BLOCK = 4096  # O_DIRECT's unit of transfer here
_STAMP = 16  # bytes at the start of each object that identify it


def register(subparsers: Any) -> None:
    parser = add_command(
        subparsers, "backend", doc=__doc__,
        help="measure a backend's write/read/exists throughput against raw O_DIRECT")
    parser.add_argument("url", help="backend URL, e.g. file:///mnt/nvme/kv?durability=data")
    parser.add_argument("--objects", type=int, default=512, help="objects to write (512)")
    parser.add_argument("--size", default="8MiB", help="bytes per object (8MiB)")
    parser.add_argument("--batch", type=int, default=128,
                        help="objects per call (128, SGLang's storage batch size)")
    parser.add_argument("--range-fraction", type=float, default=0.25,
                        help="fraction of each object the range read fetches (0.25)")
    parser.add_argument("--exists-keys", type=int, default=10_000,
                        help="keys probed by the exists measure (10000)")
    parser.add_argument("--threads", type=int, default=16,
                        help="raw baseline threads (16, the file backend's default pool)")
    parser.add_argument("--baseline", choices=("auto", "no", "only"), default="auto",
                        help="raw O_DIRECT baseline: auto = for file:// and hf3fs:// URLs, "
                        "measured first in the same process (auto); only = the baseline "
                        "alone on the URL's filesystem, no backend opened")
    parser.add_argument("--drop-caches", choices=("files", "all", "no"), default="files",
                        help="before cold reads: evict only the benchmark's files from the page "
                        "cache (files, the default), drop the whole machine's page cache (all: "
                        "root only), or nothing (no)")
    parser.add_argument("--keep", action="store_true", help="keep the objects written")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.set_defaults(func=run)


@dataclass
class BenchConfig:
    objects: int = 512
    size: int = 8 << 20
    batch: int = 128
    range_fraction: float = 0.25
    exists_keys: int = 10_000
    threads: int = 16
    drop_caches: str = "files"
    keep: bool = False


@dataclass
class Measure:
    """One phase: how many objects (or keys) and bytes moved in how many seconds."""

    phase: str
    items: int
    nbytes: int
    seconds: float
    note: str = ""
    raw_seconds: float | None = None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def raw_gbps(self) -> float | None:
        if self.raw_seconds is None or self.raw_seconds <= 0:
            return None
        return self.nbytes / self.raw_seconds / 1e9

    @property
    def per_second(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(gbps=self.gbps, raw_gbps=self.raw_gbps, per_second=self.per_second)
        raw = self.raw_gbps
        out["ratio"] = self.gbps / raw if raw else None
        return out


@dataclass
class Progress:
    """A one-line progress display on stderr (nothing when disabled)."""

    enabled: bool = True
    _last: float = field(default=0.0, repr=False)

    def update(self, phase: str, done: int, total: int, nbytes: int, started: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        rate = nbytes / max(now - started, 1e-9) / 1e9
        end = "\n" if done >= total else ""
        print(f"\r{phase:<11} {done:>6}/{total:<6} {rate:6.2f} GB/s", end=end, file=sys.stderr,
              flush=True)


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``: the WHOLE machine's page cache, every
    process's (``--drop-caches all`` only). False when not permitted (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def evict_files(paths: Iterable[Path]) -> bool:
    """Take these files out of the page cache (fsync, then ``POSIX_FADV_DONTNEED``): cold reads
    of the benchmark's own files, nothing else evicted, no root needed. False when the platform
    cannot (no ``posix_fadvise``)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # removed meanwhile, or not ours to read
        try:
            os.fsync(fd)  # DONTNEED drops clean pages only
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def object_key(run: str, index: int) -> str:
    """A page-hash-like key (64 hex digits) unique to a run."""
    return f"{run}{index:056x}"


def make_buffers(count: int, size: int, seed: int = 0) -> list[memoryview]:
    """``count`` page-aligned, pre-faulted buffers of pseudo-random bytes."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, 256, size=size, dtype=np.uint8)
    buffers = []
    for i in range(count):
        buf = aligned_buffer(size)
        arr = np.frombuffer(buf, dtype=np.uint8)
        arr[:] = np.roll(pattern, i)
        buffers.append(buf)
    return buffers


def stamp(buf: memoryview, index: int) -> None:
    buf[:_STAMP] = index.to_bytes(_STAMP, "little")


def check_stamp(buf: memoryview, index: int) -> None:
    if bytes(buf[:_STAMP]) != index.to_bytes(_STAMP, "little"):
        raise RuntimeError(f"object {index} read back with the wrong bytes")


async def bench_store(
    store: Backend,
    cfg: BenchConfig,
    *,
    run: str,
    progress: Progress,
    before_cold_read: Callable[[], bool] | None = None,
) -> list[Measure]:
    """Write, cold read, second read, warm read, range read and exists on ``store``; returns the
    measures."""
    size, n = cfg.size, cfg.objects
    srcs = make_buffers(min(cfg.batch, n), size, seed=1)
    dsts = make_buffers(min(cfg.batch, n), size, seed=2)
    keys = [object_key(run, i) for i in range(n)]
    batches = [range(i, min(i + cfg.batch, n)) for i in range(0, n, cfg.batch)]
    measures: list[Measure] = []

    started = time.perf_counter()
    for batch in batches:
        bufs = [srcs[j % len(srcs)] for j in range(len(batch))]
        for j, i in enumerate(batch):
            stamp(bufs[j], i)
        await store.put([keys[i] for i in batch], bufs)
        progress.update("write", batch.stop, n, batch.stop * size, started)
    measures.append(Measure("write", n, n * size, time.perf_counter() - started))

    async def read_all(phase: str, rng: ByteRange | None = None) -> Measure:
        length = rng.length if rng else size
        t0 = time.perf_counter()
        for batch in batches:
            views = dsts[: len(batch)]
            got = await store.get_into(
                [keys[i] for i in batch], views, None if rng is None else [rng] * len(batch)
            )
            for j, i in enumerate(batch):
                if got[j] != length:
                    raise RuntimeError(f"object {i}: read {got[j]} bytes, expected {length}")
                if rng is None:
                    check_stamp(views[j], i)
            progress.update(phase, batch.stop, n, batch.stop * length, t0)
        return Measure(phase, n, n * length, time.perf_counter() - t0)

    cold = before_cold_read() if before_cold_read else False
    measures.append(await read_all("cold read"))
    if not cold:
        measures[-1].note = "page cache not dropped"
    measures.append(await read_all("second read"))
    measures.append(await read_all("warm read"))
    length = max(4096, int(size * cfg.range_fraction)) // 4096 * 4096
    start = (size - length) // 2 // 4096 * 4096
    if 0 < length <= size:
        measures.append(await read_all("range read", ByteRange(start, start + length)))

    probes = 0
    t0 = time.perf_counter()
    while probes < cfg.exists_keys:
        chunk = keys[: min(len(keys), cfg.exists_keys - probes)]
        hits = await store.exists(chunk)
        if not all(hits):
            raise RuntimeError("exists missed an object that was just written")
        probes += len(chunk)
    measures.append(Measure("exists", probes, 0, time.perf_counter() - t0, note="keys/s"))

    if not cfg.keep:
        for batch in batches:
            await store.delete([keys[i] for i in batch])
    return measures


class RawBaseline:
    """Threaded O_DIRECT writes (+ fdatasync) and reads of the same bytes in ``directory``."""

    def __init__(self, directory: Path, cfg: BenchConfig) -> None:
        self.dir = directory
        self.cfg = cfg
        # O_DIRECT moves whole 4 KiB blocks: buffers are rounded up, files cut to size after.
        self.span = -(-cfg.size // _BLOCK) * _BLOCK
        self.srcs = make_buffers(min(cfg.batch, cfg.objects), self.span, seed=1)
        self.dsts = make_buffers(cfg.threads, self.span, seed=2)

    def _path(self, i: int) -> str:
        return os.path.join(self.dir, f"{i:08d}")

    def _write(self, i: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT
        fd = os.open(self._path(i), flags, 0o644)
        try:
            view = self.srcs[i % len(self.srcs)]
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
            if self.span != self.cfg.size:
                os.ftruncate(fd, self.cfg.size)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read(self, i: int, slot: int) -> None:
        fd = os.open(self._path(i), os.O_RDONLY | _O_DIRECT)
        try:
            view = self.dsts[slot]
            done = 0
            while done < self.cfg.size:
                got = os.preadv(fd, [view[done:]], done)
                if got == 0:
                    raise RuntimeError("short raw read")
                done += got
        finally:
            os.close(fd)

    def write_seconds(self) -> float:
        self.dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.cfg.threads) as pool:
            list(pool.map(self._write, range(self.cfg.objects)))
        return time.perf_counter() - t0

    def read_seconds(self) -> float:
        slots = list(range(self.cfg.threads))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.cfg.threads) as pool:
            list(pool.map(lambda i: self._read(i, slots[i % len(slots)]), range(self.cfg.objects)))
        return time.perf_counter() - t0

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


#: the schemes whose stores are the file layout (``backends.file.object_path``).
FILE_LAYOUT_SCHEMES = ("file", "hf3fs")


def _file_root(url: str) -> Path | None:
    """The root of a file-layout store's URL (its objects' files known by ``object_path``),
    else None."""
    with contextlib.suppress(ValueError):
        parsed = BackendURL.parse(url)
        if parsed.scheme in FILE_LAYOUT_SCHEMES and parsed.location:
            return Path(parsed.location).expanduser().resolve()
    return None


def _config(args: argparse.Namespace) -> BenchConfig:
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        raise UsageError(f"--size: {exc}") from None
    if args.objects < 1 or args.batch < 1 or args.threads < 1 or args.exists_keys < 0:
        raise UsageError("--objects, --batch and --threads must be >= 1, --exists-keys >= 0")
    if size < 4096:
        raise UsageError("--size must be at least 4KiB")
    if not 0 < args.range_fraction <= 1:
        raise UsageError("--range-fraction must be in (0, 1]")
    return BenchConfig(
        objects=args.objects, size=size, batch=args.batch, range_fraction=args.range_fraction,
        exists_keys=args.exists_keys, threads=args.threads,
        drop_caches=args.drop_caches, keep=args.keep,
    )


def _cold_read_preparation(
    mode: str, files: Callable[[], list[Path]] | None
) -> Callable[[], bool] | None:
    """What runs before each cold read (see ``--drop-caches``); ``files`` lists the benchmark's
    own files (None: the backend has no files)."""
    if mode == "all":
        def drop_all() -> bool:
            dropped = drop_page_cache()
            print("bench backend: " + ("dropped the whole machine's page cache (--drop-caches "
                  "all)" if dropped else "could not drop the page cache (--drop-caches all "
                  "needs root)"), file=sys.stderr)
            return dropped

        return drop_all
    if mode == "files" and files is not None:
        return lambda: evict_files(files())
    return None


def run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    root = _file_root(args.url)
    if args.baseline == "only":
        return _run_baseline_only(args, cfg, root)
    baseline: RawBaseline | None = None
    if args.baseline == "auto" and root is not None and _O_DIRECT:
        baseline = RawBaseline(root / f"bench-raw-{os.getpid()}", cfg)
    store = open_backend(args.url)
    progress = Progress(enabled=not args.quiet and sys.stderr.isatty())
    run_id = os.urandom(4).hex()

    def own_files() -> list[Path]:
        paths = ([] if root is None else
                 [object_path(root, object_key(run_id, i)) for i in range(cfg.objects)])
        return paths + (sorted(baseline.dir.iterdir()) if baseline is not None else [])

    drop = _cold_read_preparation(cfg.drop_caches, own_files if root or baseline else None)
    try:
        raw_write = raw_read = None
        if baseline is not None:
            raw_write = baseline.write_seconds()
            if drop:
                drop()
            raw_read = baseline.read_seconds()
        measures = run_sync(bench_store(store, cfg, run=run_id, progress=progress,
                                        before_cold_read=drop))
    finally:
        if baseline is not None:
            baseline.cleanup()
        run_sync(store.close())
    for m in measures:
        if m.phase == "write":
            m.raw_seconds = raw_write
        elif m.phase == "cold read":
            m.raw_seconds = raw_read
    report = {
        "url": args.url,
        "objects": cfg.objects,
        "object_bytes": cfg.size,
        "batch": cfg.batch,
        "drop_caches": cfg.drop_caches,
        "baseline": None if baseline is None else f"O_DIRECT, {cfg.threads} threads, fdatasync",
        "measures": [m.as_dict() for m in measures],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(measures, cfg, args.url, baseline is not None))
    return 0


def _run_baseline_only(args: argparse.Namespace, cfg: BenchConfig, root: Path | None) -> int:
    """``--baseline only``: the raw O_DIRECT write and cold read alone, in a process of their
    own, as a backend's run is measured (a backend measured after the baseline in the same
    process is not measured as the baseline was: its writes come after a gigabyte of others)."""
    if root is None or not _O_DIRECT:
        raise UsageError("--baseline only needs a file:// or hf3fs:// URL on a system with "
                         "O_DIRECT")
    baseline = RawBaseline(root / f"bench-raw-{os.getpid()}", cfg)
    drop = _cold_read_preparation(cfg.drop_caches, lambda: sorted(baseline.dir.iterdir()))
    try:
        raw_write = baseline.write_seconds()
        cold = drop() if drop else False
        raw_read = baseline.read_seconds()
    finally:
        baseline.cleanup()
    nbytes = cfg.objects * cfg.size
    measures = [Measure("write", cfg.objects, nbytes, raw_write, raw_seconds=raw_write),
                Measure("cold read", cfg.objects, nbytes, raw_read, raw_seconds=raw_read,
                        note="" if cold else "page cache not dropped")]
    report = {
        "url": args.url, "objects": cfg.objects, "object_bytes": cfg.size, "batch": cfg.batch,
        "drop_caches": cfg.drop_caches,
        "baseline": f"O_DIRECT, {cfg.threads} threads, fdatasync (alone: no backend opened)",
        "measures": [m.as_dict() for m in measures],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(measures, cfg, f"{args.url} (raw baseline only)", True))
    return 0


def format_table(measures: Sequence[Measure], cfg: BenchConfig, url: str, raw: bool) -> str:
    lines = [
        f"{url}: {cfg.objects} objects x {cfg.size} bytes, batches of {cfg.batch}",
        f"{'phase':<11} {'GB/s':>7} {'raw GB/s':>9} {'ratio':>6} {'seconds':>8}  note",
    ]
    for m in measures:
        if m.phase == "exists":
            lines.append(f"{m.phase:<11} {m.per_second:>17,.0f} keys/s {m.seconds:>8.3f}  "
                         f"{m.items} probes")
            continue
        raw_gbps = m.raw_gbps
        raw_text = f"{raw_gbps:9.2f}" if raw_gbps else " " * 9
        ratio = f"{m.gbps / raw_gbps:6.2f}" if raw_gbps else " " * 6
        lines.append(f"{m.phase:<11} {m.gbps:7.2f} {raw_text} {ratio} {m.seconds:8.3f}  {m.note}")
    if raw:
        lines.append(f"raw = O_DIRECT with {cfg.threads} threads (+fdatasync per file on write), "
                     "same bytes, same filesystem, same run")
    return "\n".join(lines)


__all__ = ["BenchConfig", "Measure", "RawBaseline", "bench_store", "drop_page_cache", "run"]
