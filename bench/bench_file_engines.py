"""The file family's writes and reads against raw O_DIRECT, two source trees in one run.

Run from the repository root::

    .venv/bin/python bench/bench_file_engines.py --before /path/to/tree --rounds 4 --write-md

``--before`` is another checkout laid out as the installed package (a folder holding
``hicache_store/`` with ``backends``, ``layout`` and ``kernels`` inside it, C accelerators
built), e.g. main before a change; without it only this tree runs. Each round runs, in a fresh
process each (``hicache-store bench backend --json``), the raw O_DIRECT baseline alone
(``--baseline only``), ``file://`` and ``hf3fs://`` with ``engine=posix`` (its POSIX path; no 3FS
runs here), as configured by default (no index) and with ``index=sqlite`` (the file backend's
index, separating the engine from the index), on the same directory, for each tree in turn; the
trees' order and the rows' order alternate from round to round. Every row is measured the same
way: a fresh process that writes its gigabyte durably (``durability=data``), evicts its own
files from the page cache and reads them cold; no row runs after another's I/O in its own
process (one that did read faster than the baseline it followed). A backend's figure is read
against the raw row of its tree in the same round (the raw code is the same in both trees).
``--write-md`` replaces the "I/O engines against raw O_DIRECT" section of
docs/benchmarks/file.md (the dated run log, docs/benchmarks/log.md, is kept by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _markdown import replace_section

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("write", "cold read", "warm read", "range read")
#: the raw O_DIRECT row: ``bench backend --baseline only`` on this URL (no backend opened).
RAW = "raw O_DIRECT"
#: what each round runs: the raw baseline alone, file://, hf3fs:// as configured by default (no
#: index: 3FS roots are shared by hosts) and with the file backend's index, which separates the
#: engine from the index.
SYSTEMS = {
    RAW: "file://{where}/raw",
    "file://": "file://{where}/file?durability=data",
    "hf3fs:// posix": "hf3fs://{where}/hf3fs?durability=data&engine=posix",
    "hf3fs:// posix, index=sqlite": "hf3fs://{where}/hf3fs-i?durability=data&engine=posix&index=sqlite",
}


#: what ``before`` and ``after`` were in the study the page first carried (``--trees`` says it
#: for another comparison).
TREES = (
    "`before`: main before the I/O engines (hf3fs overrode the file backend's reads and writes, "
    "so its POSIX path ran Python system calls); `after`: the file backend's engine chosen at "
    "open, hf3fs its configuration.")


def command(system: str, where: Path, args: argparse.Namespace) -> list[str]:
    """The ``hicache-store bench backend`` arguments of one row: the same sizes for every row;
    the raw row is the baseline alone, every other row the backend alone."""
    return ["bench", "backend", SYSTEMS[system].format(where=where),
            "--objects", str(args.objects), "--size", args.size, "--batch", str(args.batch),
            "--exists-keys", "1000", "--baseline", "only" if system == RAW else "no", "--json",
            "--quiet"]


def bench(tree: Path | None, argv: list[str]) -> dict[str, Any]:
    """One ``hicache-store bench backend`` run (``argv``: ``command``'s) in a fresh process
    (``tree``: the other source tree first on the path; None: this one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_STORE_")}
    env.pop("PYTHONPATH", None)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-m", "hicache_store", *argv]
    # (run outside the repository: its hicache_store/ folder must not shadow ``tree``)
    done = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    out = json.loads(done.stdout)
    return {m["phase"]: m for m in out["measures"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    where = Path(args.dir)
    trees: dict[str, Path | None] = {"after": None}
    if args.before:
        trees = {"before": Path(args.before), "after": None}
    rows: list[dict[str, Any]] = []
    load_start = os.getloadavg()[0]
    for round_no in range(args.rounds):
        order = list(trees) if round_no % 2 == 0 else list(reversed(trees))
        for name in order:
            shutil.rmtree(where, ignore_errors=True)
            # (which row goes first alternates too: a later one runs on a busier disk)
            names = SYSTEMS if round_no % 2 == 0 else tuple(reversed(SYSTEMS))
            got = {system: bench(trees[name], command(system, where, args))
                   for system in names}
            raw = {p: got[RAW][p]["gbps"] for p in ("write", "cold read")}
            for system in SYSTEMS:
                measures = got[system]
                row: dict[str, Any] = {"round": round_no + 1, "tree": name, "system": system}
                for phase in PHASES:  # (the raw row has no warm or range read)
                    row[phase] = measures[phase]["gbps"] if phase in measures else None
                for phase in ("write", "cold read"):
                    row[f"raw {phase}"] = raw[phase]
                    row[f"{phase} %"] = 100 * measures[phase]["gbps"] / raw[phase]
                rows.append(row)
                print(json.dumps(row), flush=True)
    shutil.rmtree(where, ignore_errors=True)
    return {"rows": rows, "objects": args.objects, "size": args.size, "batch": args.batch,
            "load_start": load_start, "load_end": os.getloadavg()[0],
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def render(results: dict[str, Any], cmd: str) -> str:
    rows = results["rows"]
    when = results.get("when", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    lines = [
        "## I/O engines against raw O_DIRECT",
        "",
        f"Last logged {when[:10]}, on the 2-vCPU development VM (no GPU), load as stated.",
        "",
        f"Command: `{cmd}`. Per round, in a fresh process each (every row measured the same "
        "way: write, evict its own files, cold read, nothing before it in its process), "
        "`hicache-store bench backend` with `--baseline only` (the raw O_DIRECT row, 16 "
        "threads, no backend opened) and with `--baseline no` for `file://` and "
        "`hf3fs://?engine=posix` (the POSIX path; no 3FS here; by default without an index, "
        "and with `index=sqlite` as `file://` has), "
        f"{results['objects']} objects of {results['size']}, batches of {results['batch']}, "
        "`durability=data`; the trees' order "
        f"alternates by round, and so does the rows' order. {results.get('trees', TREES)} "
        "GB/s = 10^9 bytes/s; % = of the same round's raw baseline. Load average "
        f"{results['load_start']:.1f} at the start, {results['load_end']:.1f} at the end "
        f"(2 cores shared with other sessions: read rows of one round against each other). "
        f"Run {when}.",
        "",
        "| round | tree | system | write | cold read | warm read | range read (1/4) "
        "| write % of raw | cold read % of raw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    def gbps(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for row in rows:
        lines.append(
            f"| {row['round']} | {row['tree']} | {row['system']} | {gbps(row['write'])} "
            f"| {gbps(row['cold read'])} | {gbps(row['warm read'])} "
            f"| {gbps(row['range read'])} "
            f"| {row['write %']:.0f}% | {row['cold read %']:.0f}% |")
    lines += ["", "Median over the rounds (% of raw):", ""]
    for tree in dict.fromkeys(row["tree"] for row in rows):
        for system in dict.fromkeys(row["system"] for row in rows):
            mine = [r for r in rows if r["tree"] == tree and r["system"] == system]
            if system == RAW:
                lines.append(
                    f"- {tree}, {system}: write {statistics.median(r['write'] for r in mine):.2f}"
                    f" GB/s, cold read {statistics.median(r['cold read'] for r in mine):.2f} GB/s")
                continue
            lines.append(
                f"- {tree}, {system}: write {statistics.median(r['write %'] for r in mine):.0f}%, "
                f"cold read {statistics.median(r['cold read %'] for r in mine):.0f}% "
                f"(range {min(r['cold read %'] for r in mine):.0f}-"
                f"{max(r['cold read %'] for r in mine):.0f}%), "
                f"warm read {statistics.median(r['warm read'] for r in mine):.2f} GB/s")
    lines += ["", "Every run and study of this subject: [run log](log.md#file-io-engines)."]
    return "\n".join(lines) + "\n"


def _run_arguments(argv: list[str]) -> list[str]:
    """The arguments that shape the run: without ``--write-md``, and without ``--from-json``
    and ``--trees`` with their values (given as ``--x=v`` or ``--x v``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--from-json", "--trees"):
            skip = True
        elif not arg.startswith(("--write-md", "--from-json=", "--trees=")):
            out.append(arg)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="another source tree (see the module docstring)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--objects", type=int, default=128)
    parser.add_argument("--size", default="8MiB")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dir", default=str(ROOT / ".build" / "bench-engines"))
    parser.add_argument("--write-md", action="store_true",
                        help="update docs/benchmarks/file.md")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--from-json", help="render the results of an earlier --json run")
    parser.add_argument("--trees", default=TREES,
                        help="what `before` and `after` are, for the page (a sentence)")
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = run(args)
        results["trees"] = args.trees if args.before else "Only this tree ran (`after`)."
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    cmd = ".venv/bin/python bench/bench_file_engines.py " + " ".join(_run_arguments(sys.argv[1:]))
    text = render(results, cmd)
    print(text)
    if args.write_md:
        replace_section(ROOT / "docs" / "benchmarks" / "file.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
