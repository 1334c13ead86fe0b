"""What publishing KV events costs the tier: ``bench multiturn`` with events off and on, side by side.

Runs ``hicache-store bench multiturn --configs L1+L2+L3`` in fresh processes, alternating off /
on (the order of each pair swapped every other pair), each on an empty store. During the "on"
runs a subscriber process (ZMQ SUB on the same address) drains and counts the batches, so the
publisher really sends. Prints one row per run and the medians: input throughput (tokens/s),
median TTFT and the tier's bookkeeping share, plus the batches the subscriber received.

    .venv/bin/python bench/bench_events_cost.py --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBSCRIBER = """
import sys, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
batches = 0
poller = zmq.Poller()
poller.register(sub, zmq.POLLIN)
while True:
    if dict(poller.poll(500)).get(sub):
        sub.recv_multipart()
        batches += 1
    elif open(sys.argv[2]).read() == "stop":
        break
print(batches)
"""


def one_run(workdir: Path, events: str | None) -> dict[str, float]:
    out = workdir / "result.json"
    cmd = [str(Path(sys.executable).parent / "hicache-store"), "bench", "multiturn",
           "--configs", "L1+L2+L3", "--workdir", str(workdir / "w"), "--no-progress",
           "--json", str(out)]
    sub = None
    stop = workdir / "stop"
    if events is not None:
        cmd += ["--events", events]
        stop.write_text("")
        sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, events, str(stop)],
                               stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # connected before the first batch
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    (result,) = json.loads(out.read_text())["results"]
    row = {
        "tok_s": result["input_throughput_tok_s"],
        "ttft_ms": result["ttft_median_s"] * 1e3,
        "bookkeeping": result["bookkeeping_share"] * 100,
        "hit": result["hit_rate"] * 100,
        "batches": 0.0,
    }
    if sub is not None:
        time.sleep(1.0)  # the last batches
        stop.write_text("stop")
        row["batches"] = float(sub.communicate(timeout=30)[0].strip() or 0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="evcost-") as tmp:
        for pair in range(args.pairs):
            order = ("off", "on") if pair % 2 == 0 else ("on", "off")
            for mode in order:
                work = Path(tmp) / f"{pair}-{mode}"
                work.mkdir()
                events = f"ipc://{tmp}/kv-{pair}" if mode == "on" else None
                row = one_run(work, events)
                rows[mode].append(row)
                load = os.getloadavg()[0]
                print(f"pair {pair} {mode:3}: {row['tok_s']:8.0f} tok/s  TTFT median "
                      f"{row['ttft_ms']:6.1f} ms  bookkeeping {row['bookkeeping']:.2f}%  hit "
                      f"{row['hit']:.2f}%  batches {row['batches']:.0f}  load {load:.2f}",
                      flush=True)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for mode, rs in rows.items()}
    for mode in ("off", "on"):
        m = med[mode]
        print(f"median {mode:3}: {m['tok_s']:8.0f} tok/s  TTFT {m['ttft_ms']:6.1f} ms  "
              f"bookkeeping {m['bookkeeping']:.2f}%")
    cost = 1 - med["on"]["tok_s"] / med["off"]["tok_s"]
    print(f"throughput cost of events (medians): {cost * 100:+.1f}%")


if __name__ == "__main__":
    main()
