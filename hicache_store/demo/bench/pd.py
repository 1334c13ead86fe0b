"""``bench pd``: P/D on the mini engine, decode-side reuse off (baseline) against on.

Each arm is two real processes on the multi-turn shared-prefix workload (``bench.workload``:
groups of conversations sharing a long prefix, each round adding a
question and an answer): a prefill worker (``bench.pd_worker``, with its own L1 + L2 cache, the
same in both arms) and a decode worker (``decode_main`` here) that receives the KV over the
transport and decodes the answer. Arms:

* ``baseline``: decode-side reuse off: no decode cache, every prompt's whole KV is sent;
* ``reuse``: the decode worker's cache with L1 ("GPU") and L2 (host) reuse.

Both arms start cold (fresh processes, empty caches). They
run side by side, *interleaved request by request* (request ``i`` on one arm, then on the other,
alternating which goes first), so that the load other work puts on a shared machine hits both
arms alike and every TTFT has a partner measured moments apart. Each arm serves one request at
a time in turn-major order (on a few CPU cores, concurrency would only time-share the same
cores).

TTFT is measured at the decode worker from sending the request until the prompt's KV is ready
there (prefill compute + transfer + landing + the local restore): when a P/D server emits the
first token it got from prefill. The answer is then decoded by the decode worker (computed as one
chunk over the received KV: the same KV as token-by-token decoding, faster on a CPU) and joins
its cache. An arm's end-to-end time is the time its workers spent on its requests (serve,
decode, finish), summed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hicache_store.demo.engine.model import MiniLlama
from hicache_store.pd import Channel

from .pd_worker import (
    AUTHKEY_ENV,
    PrefillProcess,
    WorkerSetup,
    close_decode_side,
    decode_side,
    start_prefill,
)
from .workload import WorkloadSpec, generate

ARMS = ("baseline", "reuse")


@dataclass
class PDRecord:
    """One request as the decode worker saw it (times in seconds)."""

    conversation: int
    turn: int
    prompt_tokens: int
    boundary: int
    received_bytes: int
    prefill_cached: int
    attempts: int
    ttft_s: float
    busy_s: float
    restore_wait_s: float
    remote_wait_s: float
    prefill_compute_s: float
    prefill_send_s: float


def decode_main(setup_json: str, spec_json: str, address: str) -> int:
    """The decode worker process of ``bench pd``, driven over stdin/stdout.

    For each ``NEXT`` line it serves the workload's next request and prints ``RECORD <json>``;
    on ``END`` (or EOF) it prints ``END <json>`` (its cache's metrics) and exits. The channel key
    comes from ``HICACHE_PD_AUTHKEY``."""
    setup = WorkerSetup.from_json(setup_json)
    spec = WorkloadSpec(**json.loads(spec_json))
    torch.set_num_threads(setup.threads)
    host, _, port = address.rpartition(":")
    channel = Channel.connect((host, int(port)), bytes.fromhex(os.environ[AUTHKEY_ENV]))
    model = MiniLlama(setup.config)
    worker, _ = decode_side(setup, channel, model)
    requests = generate(spec)
    print("READY", flush=True)
    try:
        with torch.inference_mode():
            for line in sys.stdin:
                if line.strip() != "NEXT":
                    break
                request = next(requests)
                sent = time.perf_counter()
                served = worker.serve(request.prompt)
                ttft = time.perf_counter() - sent
                if request.answer:
                    slots = served.extend(request.answer)
                    model.prefill(
                        torch.tensor(request.answer),
                        len(request.prompt),
                        slots,
                        worker.pool,  # type: ignore[arg-type]
                        last_only=True,
                    )
                served.finish()
                record = PDRecord(
                    request.conversation,
                    request.turn,
                    len(request.prompt),
                    served.boundary,
                    served.received_bytes,
                    served.prefill_cached,
                    served.attempts,
                    ttft,
                    time.perf_counter() - sent,
                    served.restore_wait_s,
                    served.remote_wait_s,
                    served.prefill_compute_s,
                    served.prefill_send_s,
                )
                print(f"RECORD {json.dumps(asdict(record))}", flush=True)
        tier = worker.tier.metrics.to_dict() if worker.tier is not None else {}
    finally:
        close_decode_side(worker)
    print(f"END {json.dumps(tier)}", flush=True)
    return 0


class _DecodeProcess:
    """A running ``decode_main`` process and the prefill process it talks to."""

    def __init__(
        self, prefill: PrefillProcess, setup: WorkerSetup, spec: WorkloadSpec, env: dict[str, str],
        log: Path,
    ) -> None:
        host, port = prefill.address
        child_env = dict(os.environ, **env)
        child_env[AUTHKEY_ENV] = prefill.authkey.hex()
        self.prefill = prefill
        self.log = log
        with open(log, "w") as stderr:
            self.proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
                [
                    sys.executable,
                    "-m",
                    "hicache_store.demo.bench.pd",
                    setup.to_json(),
                    json.dumps(asdict(spec)),
                    f"{host}:{port}",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=child_env,
            )
        self.records: list[dict[str, Any]] = []
        self.tier: dict[str, Any] = {}
        self._expect("READY")

    def _expect(self, tag: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(tag):
            self.proc.kill()
            tail = self.log.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(f"the decode worker failed (said {line!r}):\n" + "\n".join(tail))
        return line[len(tag) :].strip()

    def next(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("NEXT\n")
        self.proc.stdin.flush()
        self.records.append(json.loads(self._expect("RECORD ")))

    def end(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("END\n")
        self.proc.stdin.close()
        self.tier = json.loads(self._expect("END "))
        self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def run_arms(
    arms: dict[str, tuple[WorkerSetup, WorkerSetup]],
    spec: WorkloadSpec,
    workdir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Start each arm's prefill and decode processes, serve the workload interleaved request by
    request, and return each arm's records and both sides' cache metrics."""
    total = sum(1 for _ in generate(spec))
    names = list(arms)
    with ExitStack() as stack:
        decoders: dict[str, _DecodeProcess] = {}
        for name, (prefill_setup, decode_setup) in arms.items():
            folder = workdir / name
            folder.mkdir(parents=True, exist_ok=True)
            env = loopback_env(decode_setup.transport, folder)
            prefill = stack.enter_context(start_prefill(prefill_setup, env=env, log_dir=folder))
            decoder = _DecodeProcess(prefill, decode_setup, spec, env, folder / "decode.log")
            stack.callback(decoder.kill)
            decoders[name] = decoder
        for i in range(total):
            for name in names if i % 2 == 0 else reversed(names):
                decoders[name].next()
            if progress is not None:
                progress(i + 1, total)
        results = {}
        for name, decoder in decoders.items():
            decoder.end()
            results[name] = {
                "records": decoder.records,
                "tier": decoder.tier,
                "prefill": decoder.prefill.connection_stats(),
            }
    return results


def summarize(records: list[dict[str, Any]], answer_tokens: int) -> dict[str, Any]:
    """The figures of one arm (see the module docstring)."""

    def part(rows: list[dict[str, Any]]) -> dict[str, Any]:
        prompt = sum(r["prompt_tokens"] for r in rows)
        ttfts = [r["ttft_s"] for r in rows]
        return {
            "requests": len(rows),
            "bytes_transferred": sum(r["received_bytes"] for r in rows),
            "decode_hit_rate": sum(r["boundary"] for r in rows) / prompt if prompt else 0.0,
            "prefill_hit_rate": sum(r["prefill_cached"] for r in rows) / prompt if prompt else 0.0,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else 0.0,
            "ttft_median_s": statistics.median(ttfts) if ttfts else 0.0,
        }

    figures = part(records)
    figures["after_first_round"] = part([r for r in records if r["turn"] > 0])
    busy = sum(r["busy_s"] for r in records)
    figures["e2e_s"] = busy
    figures["output_tok_s"] = len(records) * answer_tokens / busy if busy else 0.0
    figures["retried_requests"] = sum(1 for r in records if r["attempts"] > 1)
    for name in ("restore_wait_s", "remote_wait_s", "prefill_compute_s", "prefill_send_s"):
        figures[f"{name[:-2]}_mean_s"] = statistics.fmean(r[name] for r in records)
    return figures


def loopback_env(transport: str, workdir: Path) -> dict[str, str]:
    """Environment for worker processes: Mooncake's listeners on loopback only (the
    ``LD_PRELOAD`` shim of ``backends.mooncake_local``, when a C compiler is there)."""
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    if transport == "mooncake":
        from hicache_store.backends.mooncake_local import build_loopback_shim

        shim = build_loopback_shim(workdir)
        if shim is not None:
            env["LD_PRELOAD"] = shim
    return env


if __name__ == "__main__":
    sys.exit(decode_main(*sys.argv[1:4]))
