"""What the weights identity (``hicache_store.weights``) costs on a large checkpoint.

Run from the repository root::

    .venv/bin/python bench/bench_weights_fingerprint.py --size-gb 20 --write-md

Builds sparse safetensors checkpoints of ``--size-gb`` in total (one file, and ``--shards``
files), each a real header (``--tensors`` tensors, bf16) followed by tensor bytes that are
holes except where the fingerprint samples them, which hold random data on disk. Times
``weights_identity`` cold (each file evicted from the page cache first, ``POSIX_FADV_DONTNEED``:
the header and the samples are read from the device) and warm, ``--rounds`` times, median.
For contrast, the time a full read would take: ``--full-read-gib`` of real data written,
evicted and hashed (sha256) cold, scaled to the checkpoint's size. ``--write-md`` replaces the
"Weights identity" section to the run log (docs/benchmarks/log.md), dated.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path

from _markdown import log_run

from hicache_store.commands.bench_backend import evict_files
from hicache_store.weights import sample_ranges, weights_identity

ROOT = Path(__file__).resolve().parent.parent
SECTION = "Weights identity"


def sparse_checkpoint(folder: Path, total: int, shards: int, tensors: int, seed: int) -> list[Path]:
    """``shards`` safetensors files of ``total`` bytes of bf16 tensors, sparse but for the
    ranges the fingerprint reads (random bytes there)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    files = []
    per_file = total // shards
    for s in range(shards):
        per_tensor = per_file // tensors // 2 * 2
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in range(tensors):
            header[f"model.layers.{s}.{t}.weight"] = {
                "dtype": "BF16", "shape": [per_tensor // 2], "data_offsets": [offset, offset + per_tensor]}
            offset += per_tensor
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        path = folder / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            start = 8 + len(blob)
            f.truncate(start + offset)
            for at, length in sample_ranges(start, start + offset):
                f.seek(at)
                f.write(os.urandom(length))
        files.append(path)
    return files


def data_start(file: Path) -> int:
    """Where a safetensors file's tensor bytes begin (after its length field and header)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    return 8 + int(length)


def timed_identity(folder: Path, files: list[Path], *, cold: bool) -> float:
    if cold:
        evict_files([*files, folder / "config.json"])
    started = time.perf_counter()
    found = weights_identity(folder)
    elapsed = time.perf_counter() - started
    if found is None or not found.value.startswith("fp-"):
        raise RuntimeError(f"{folder}: no fingerprint ({found})")
    return elapsed


def full_read_seconds_per_gib(where: Path, gib: float) -> float:
    """Cold sha256 over ``gib`` GiB of real data: what reading every byte costs here."""
    path = where / "full.bin"
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(int(gib * 1024)):
            f.write(chunk)
    evict_files([path])
    started = time.perf_counter()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed / gib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=20.0)
    parser.add_argument("--shards", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=300, help="tensors per file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--full-read-gib", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, default=None, help="where to build (default: tmp)")
    parser.add_argument("--write-md", action="store_true")
    args = parser.parse_args()
    total = int(args.size_gb * 1e9)
    base = Path(tempfile.mkdtemp(prefix="weights-bench-", dir=args.dir))
    load = os.getloadavg()
    rows = []
    try:
        for shards in sorted({1, args.shards}):
            folder = base / f"{shards}-shards"
            files = sparse_checkpoint(folder, total, shards, args.tensors, seed=shards)
            starts = {f: data_start(f) for f in files}
            headers = sum(starts.values())
            samples = sum(n for f in files
                          for _, n in sample_ranges(starts[f], f.stat().st_size))
            cold = [timed_identity(folder, files, cold=True) for _ in range(args.rounds)]
            warm = [timed_identity(folder, files, cold=False) for _ in range(args.rounds)]
            rows.append((shards, headers, samples, statistics.median(cold),
                         statistics.median(warm)))
        per_gib = full_read_seconds_per_gib(base, args.full_read_gib)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load_after = os.getloadavg()
    full = per_gib * total / (1 << 30)
    table = ["| files | header bytes read | sample bytes read | cold (median) | warm (median) |",
             "|---:|---:|---:|---:|---:|"]
    for shards, headers, samples, cold_s, warm_s in rows:
        table.append(f"| {shards} | {headers:,} | {samples:,} | {cold_s * 1e3:.1f} ms | "
                     f"{warm_s * 1e3:.1f} ms |")
    text = "\n".join(table)
    print(text)
    print(f"full read (sha256, cold): {per_gib:.2f} s/GiB -> {full:.0f} s for "
          f"{args.size_gb:g} GB; load {load} -> {load_after}")
    if args.write_md:
        log_run(section(args, text, per_gib, full, load,
                                                        load_after))


def section(args: argparse.Namespace, table: str, per_gib: float, full: float,
            load: tuple[float, float, float], after: tuple[float, float, float]) -> str:
    return f"""## {SECTION} (`bench/bench_weights_fingerprint.py`)

The fingerprint the integrations put in every namespace when the model is not a hub snapshot
(`hicache_store.weights`: config.json, every safetensors header, three 64 KiB samples of each
file's tensor bytes). A sparse {args.size_gb:g} GB bf16 checkpoint ({args.tensors} tensors a
file), as one file and as {args.shards} shards; the header and the sampled ranges hold real
data on disk, the rest is holes the fingerprint never reads. Cold: each file evicted from the
page cache first (`POSIX_FADV_DONTNEED`), so the header and samples come from the device;
median of {args.rounds} rounds.

`.venv/bin/python bench/bench_weights_fingerprint.py --size-gb {args.size_gb:g} --shards {args.shards} --rounds {args.rounds} --write-md`
(this VM's virtio disk, 2 cores shared with other sessions; load average {load[0]:.1f} before,
{after[0]:.1f} after)

{table}

Reading every byte instead (sha256 of {args.full_read_gib:g} GiB of real data, cold) takes
{per_gib:.2f} s/GiB here: {full:.0f} s for the same {args.size_gb:g} GB. The fingerprint reads
a few hundred KiB a file whatever the file's size, so its cost grows with the number of files
and their headers, not with the bytes of weights; a hub snapshot costs one directory name.
"""


if __name__ == "__main__":
    main()
