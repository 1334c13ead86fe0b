"""``hicache-store inspect`` and ``gc`` on file stores of growing size: time and peak memory.

Run from the repository root::

    .venv/bin/python bench/bench_ops_scale.py --objects 10000 100000 1000000 \\
        --baseline 6a78708 --workdir /tmp/hicache-ops-scale

For each size, one store of 8 KiB framed objects (a 4 KiB header and a 4 KiB payload, one
object per page) in chains of 16 pages, each header naming its parent, written through the
file backend (``durability=none``). Then, each command in a fresh process as an operator runs
it (``--json --no-progress``), measuring wall time, CPU time and peak RSS (GNU ``time``:
``%U + %S``, ``%M``):

* ``inspect URL``;
* ``gc URL --max-bytes <half> --dry-run`` with an empty state directory (every header read);
* the same again (the parent cache: no header read);
* ``gc URL --max-bytes <90%>`` (deletes 10%, in plan order).

``--baseline COMMIT`` runs ``inspect`` and ``gc --dry-run`` of that commit too, side by side on
the same store (its tree is extracted with ``git archive`` and put first on ``PYTHONPATH``; it
builds the store, in its own file layout, which this tree then upgrades once, timed apart).
Figures are printed as a table with a linear projection to 100 M objects from the largest
size (time per object x 100 M; memory as measured: it does not grow with the store).
``--verify-big 512MiB`` also measures ``inspect --verify`` of a store holding one object of
that size (the memory one large object costs), for both trees. ``--objects`` with no value
skips the scale runs.

``--synthetic 1000000 10000000`` runs the same commands beyond what this disk holds, on
``synthetic_store.SyntheticStore``: a real ``Backend`` whose listing and header reads are
computed on the fly (chains of 16 pages scattered over the key space, one 8 KiB object a
page), holding nothing per object. It measures gc's and inspect's own memory and CPU, not
file I/O: each command runs ``ops.gc.collect_garbage`` / ``ops.inspection.inspect_store``
in a fresh process (peak RSS from GNU ``time``), and the store's own CPU (computing headers)
is reported apart and subtracted in "own us/object". ``gc (deletes 10%)`` deletes nothing
(the store only counts the calls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hicache_store.backends import open_backend
from hicache_store.layout.framing import encode_header
from hicache_store.layout.keys import ObjectCoords, ObjectKey, format_key

ROOT = Path(__file__).resolve().parent.parent
NS = "0123456789abcdef"
CHAIN = 16
PAYLOAD = bytes(range(256)) * 16  # 4 KiB
OBJECT_BYTES = 4096 + len(PAYLOAD)
TIME = shutil.which("time") or "/usr/bin/time"  # GNU time, for the peak RSS of a command


async def build(root: Path, objects: int) -> None:
    """``objects`` framed objects in chains of ``CHAIN`` pages, written parent first."""
    store = open_backend(f"file://{root}", durability="none", capacity_bytes=1 << 50)
    batch_keys: list[str] = []
    batch_data: list[bytes] = []
    parent: str | None = None
    start = time.perf_counter()
    for i in range(objects):
        page = f"{i:064x}"
        if i % CHAIN == 0:
            parent = None
        key = ObjectKey(page, NS, ObjectCoords(0, 1, 0))
        batch_keys.append(format_key(key))
        batch_data.append(encode_header(key, PAYLOAD, 2, parent_hash=parent) + PAYLOAD)
        parent = page
        if len(batch_keys) == 4096 or i == objects - 1:
            await store.put(batch_keys, batch_data)
            batch_keys, batch_data = [], []
    await store.close()
    print(f"  built {objects:,} objects in {time.perf_counter() - start:.0f} s", flush=True)


def run(argv: list[str], env: dict[str, str], workdir: Path) -> dict[str, Any]:
    """Run a command to its end; its wall time, peak RSS and output (JSON when it printed
    JSON, else its text). The peak RSS comes from GNU ``time`` (``%M``): a child forked from
    this process would inherit this process's own high-water mark in ``wait4``."""
    out_path, err_path, rss_path = workdir / "stdout", workdir / "stderr", workdir / "rss"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        start = time.perf_counter()
        # cwd: not the repository (``python -m`` would import this tree's package first).
        code = subprocess.call([TIME, "-f", "%M %U %S", "-o", str(rss_path), *argv], stdout=out,
                               stderr=err, env=env, cwd=workdir)
        seconds = time.perf_counter() - start
    if code not in (0, 1):
        raise RuntimeError(f"{argv} failed ({code}): {err_path.read_text()[-2000:]}")
    text = out_path.read_text()
    try:
        report: Any = json.loads(text)
    except ValueError:
        report = {"text": text.strip()}
    rss_kib, user, system = rss_path.read_text().split()[-3:]
    return {"seconds": seconds, "rss_mib": int(rss_kib) / 1024,
            "cpu_s": float(user) + float(system), "report": report}


def baseline_tree(commit: str, workdir: Path) -> Path:
    """The package of ``commit`` laid out as an importable ``hicache_store`` (as the
    Makefile's type-check tree maps layout/, kernels/, backends/ into it)."""
    tree = workdir / f"baseline-{commit}"
    if tree.exists():
        shutil.rmtree(tree)
    source = tree / "src"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package = tree / "path" / "hicache_store"
    package.mkdir(parents=True)
    for item in (source / "hicache_store").iterdir():
        (package / item.name).symlink_to(item)
    for sub in ("layout", "kernels", "backends"):
        (package / sub).symlink_to(source / sub)
    return tree / "path"


async def build_big(root: Path, nbytes: int, layers: int = 64) -> None:
    """One framed object of about ``nbytes`` (``layers`` layer blocks)."""
    store = open_backend(f"file://{root}", durability="none", capacity_bytes=1 << 50)
    block = nbytes // layers // 4096 * 4096
    payload = bytearray(block * layers)
    for i in range(layers):
        payload[i * block : (i + 1) * block] = bytes([i]) * block
    key = ObjectKey(f"{1:064x}", NS, ObjectCoords(0, layers, 0))
    await store.put([format_key(key)], [encode_header(key, payload, 2) + payload])
    await store.close()


def big_object(args: argparse.Namespace, workdir: Path, cli: str, env: dict[str, str],
               old_env: dict[str, str] | None) -> None:
    """``inspect --verify`` of a store holding one large object: peak memory."""
    from hicache_store.backends.types import parse_size

    nbytes = parse_size(args.verify_big)
    store = workdir / "store-big"
    shutil.rmtree(store, ignore_errors=True)
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-big", str(store),
                    str(nbytes)], env=old_env or env, cwd=workdir, check=True)
    url = f"file://{store}"
    print(f"\none object of {nbytes >> 20} MiB (64 layer blocks), inspect --verify "
          "(concurrency 16)\n")
    print("| code | seconds | peak RSS (MiB) |")
    print("|---|---|---|")
    runs = [("this tree", [cli, "inspect", url, "--verify", "--json", "--no-progress"], env)]
    if old_env is not None:
        runs[:0] = [
            (args.baseline, [sys.executable, "-m", "hicache_store.cli", "inspect", url,
                             "--verify", "--json", "--no-progress"], old_env),
            ("(this tree: layout upgrade)", [sys.executable, "-c", "import sys; from "
             "hicache_store.backends import open_backend; open_backend(sys.argv[1])", url], env),
        ]
    for name, argv, step_env in runs:
        result = run(argv, step_env, workdir)
        print(f"| {name} | {result['seconds']:.1f} | {result['rss_mib']:.0f} |", flush=True)
    shutil.rmtree(store, ignore_errors=True)


SYNTHETIC_COMMANDS = ("inspect", "gc --dry-run", "gc --dry-run, parents cached",
                      "gc (deletes 10%)")


async def synthetic_run(command: str, objects: int, state: Path) -> dict[str, Any]:
    """One command on a ``SyntheticStore`` of ``objects``, in this process: its figures."""
    sys.path.insert(0, str(ROOT / "bench"))
    from synthetic_store import SyntheticStore

    from hicache_store.ops.gc import collect_garbage
    from hicache_store.ops.inspection import inspect_store

    store = SyntheticStore(objects)
    total = objects * OBJECT_BYTES
    cpu = time.process_time()
    report: dict[str, Any]
    if command == "inspect":
        report = (await inspect_store(store)).as_dict()
    else:
        budget = total * 9 // 10 if command == "gc (deletes 10%)" else total // 2
        got = await collect_garbage(store, max_bytes=budget, max_age=None, state_dir=state,
                                    dry_run="dry-run" in command)
        report = got.as_dict()
    cpu = time.process_time() - cpu
    return {"cpu_s": cpu, "store_cpu_s": store.spent, "deleted": store.deleted,
            "report": report}


def synthetic(args: argparse.Namespace, workdir: Path, env: dict[str, str],
              rows: list[tuple[int, str, dict[str, Any]]], load_start: float) -> None:
    """The commands on synthetic stores, each in a fresh process; see the docstring."""
    for objects in args.synthetic:
        state = workdir / f"state-synthetic-{objects}"
        shutil.rmtree(state, ignore_errors=True)
        print(f"{objects:,} objects (synthetic)", flush=True)
        for name in SYNTHETIC_COMMANDS:
            result = run([sys.executable, str(Path(__file__).resolve()), "--synthetic-run",
                          name, str(objects), str(state)], env, workdir)
            figures = result["report"]
            result["own_us"] = (figures["cpu_s"] - figures["store_cpu_s"]) / objects * 1e6
            rows.append((objects, f"{name} (synthetic)", result))
            _save(args, rows, load_start)
            print(f"  {name}: {result['seconds']:.1f} s, {result['rss_mib']:.0f} MiB peak RSS, "
                  f"own CPU {result['own_us']:.1f} us/object (store "
                  f"{figures['store_cpu_s']:.1f} s)", flush=True)
        shutil.rmtree(state, ignore_errors=True)


def _save(args: argparse.Namespace, rows: list[tuple[int, str, dict[str, Any]]],
          load_start: float) -> None:
    """The figures so far (after every step: they survive an interrupted run)."""
    if args.json:
        Path(args.json).write_text(json.dumps({
            "load_start": load_start, "load_end": os.getloadavg()[0],
            "rows": [{"objects": o, "command": c, "seconds": r["seconds"],
                      "rss_mib": r["rss_mib"], "cpu_s": r["cpu_s"],
                      **({"own_us": r["own_us"]} if "own_us" in r
                                                  else {})} for o, c, r in rows],
        }, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, nargs="*", default=[10_000, 100_000])
    parser.add_argument("--baseline", help="a commit to run side by side (e.g. 6a78708)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--verify-big", metavar="SIZE",
                        help="also: inspect --verify of one object of SIZE (e.g. 512MiB)")
    parser.add_argument("--synthetic", type=int, nargs="*", default=[],
                        help="also: the commands on synthetic stores of these sizes")
    parser.add_argument("--keep", action="store_true", help="keep the stores built")
    parser.add_argument("--reuse", action="store_true",
                        help="use WORKDIR/store-N as built by an earlier --build (once: the "
                             "deleting gc changes it)")
    parser.add_argument("--json", help="write the figures here (commands, seconds, peak RSS)")
    parser.add_argument("--build", nargs=2, metavar=("ROOT", "OBJECTS"), help=argparse.SUPPRESS)
    parser.add_argument("--build-big", nargs=2, metavar=("ROOT", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--synthetic-run", nargs=3, metavar=("COMMAND", "OBJECTS", "STATE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.synthetic_run:
        command, objects, state = args.synthetic_run
        print(json.dumps(asyncio.run(synthetic_run(command, int(objects), Path(state)))))
        return
    # Internal: build a store with whichever tree is first on sys.path.
    if args.build:
        asyncio.run(build(Path(args.build[0]), int(args.build[1])))
        return
    if args.build_big:
        asyncio.run(build_big(Path(args.build_big[0]), int(args.build_big[1])))
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hicache-ops-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cli = str(Path(sys.executable).with_name("hicache-store"))
    env = {**os.environ, "XDG_CACHE_HOME": str(workdir / "cache")}
    old_env = None
    if args.baseline:
        old_env = {**env, "PYTHONPATH": str(baseline_tree(args.baseline, workdir))}
    rows: list[tuple[int, str, dict[str, Any]]] = []
    load_start = os.getloadavg()[0]
    for objects in args.objects:
        store = workdir / f"store-{objects}"
        print(f"{objects:,} objects", flush=True)
        if args.reuse and store.exists():
            print("  (reusing the store built before)", flush=True)
        else:
            if store.exists():
                shutil.rmtree(store)
            # The baseline's file layout is older: the store is built by the baseline and
            # opened once by this tree (its one-time upgrade, timed apart) before this tree's
            # runs.
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build",
                            str(store), str(objects)], env=old_env or env, cwd=workdir,
                           check=True)
        url = f"file://{store}"
        total = objects * OBJECT_BYTES
        state = workdir / f"state-{objects}"
        shutil.rmtree(state, ignore_errors=True)
        steps: list[tuple[str, list[str], dict[str, str]]] = []
        if old_env is not None:
            old = [sys.executable, "-m", "hicache_store.cli"]
            steps += [
                (f"inspect ({args.baseline})", [*old, "inspect", url, "--json", "--no-progress"],
                 old_env),
                (f"gc --dry-run ({args.baseline})",
                 [*old, "gc", url, "--max-bytes", str(total // 2), "--dry-run"], old_env),
                ("open once (this tree: layout upgrade, one walk)", [
                    sys.executable, "-c", "import sys; from hicache_store.backends import "
                    "open_backend; open_backend(sys.argv[1])", url], env),
            ]
        steps += [
            ("inspect", [cli, "inspect", url, "--json", "--no-progress"], env),
            ("gc --dry-run", [cli, "gc", url, "--max-bytes", str(total // 2), "--dry-run",
                              "--json", "--no-progress", "--state-dir", str(state)], env),
            ("gc --dry-run, parents cached", [cli, "gc", url, "--max-bytes", str(total // 2),
                                              "--dry-run", "--json", "--no-progress",
                                              "--state-dir", str(state)], env),
            ("gc (deletes 10%)", [cli, "gc", url, "--max-bytes", str(total * 9 // 10),
                                  "--json", "--no-progress", "--state-dir", str(state)], env),
        ]
        for name, argv, step_env in steps:
            result = run(argv, step_env, workdir)
            rows.append((objects, name, result))
            _save(args, rows, load_start)
            print(f"  {name}: {result['seconds']:.1f} s, {result['cpu_s']:.1f} s CPU, "
                  f"{result['rss_mib']:.0f} MiB peak RSS",
                  flush=True)
        if not args.keep:  # (deleting 1 M files takes over 30 minutes on this VM's ext4)
            shutil.rmtree(store, ignore_errors=True)
    synthetic(args, workdir, env, rows, load_start)
    if rows:
        _table(rows)
    if args.verify_big:
        big_object(args, workdir, cli, env, old_env)


def _table(rows: list[tuple[int, str, dict[str, Any]]]) -> None:
    largest = max(objects for objects, _, _ in rows)
    print("\n| objects | command | seconds | CPU seconds | peak RSS (MiB) | us/object | "
          "own CPU us/object |")
    print("|---|---|---|---|---|---|---|")
    for objects, name, result in rows:
        per = result["seconds"] / objects * 1e6
        own = f"{result['own_us']:.1f}" if "own_us" in result else ""
        print(f"| {objects:,} | {name} | {result['seconds']:.1f} | {result['cpu_s']:.1f} | "
              f"{result['rss_mib']:.0f} | "
              f"{per:.1f} | {own} |")
    print(f"\nProjected to 100 M objects (time per object at {largest:,} x 100 M):")
    for objects, name, result in rows:
        if objects == largest:
            hours = result["seconds"] / objects * 1e8 / 3600
            print(f"  {name}: {hours:.1f} h")


if __name__ == "__main__":
    main()
