"""Replaying traces through the real tier: hand-counted hits come out exactly, per tier, with
and without a file-backend L3; and the ``bench trace`` command around it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from _trace_helpers import make_trace

from hicache_store.cli import main
from hicache_store.commands.bench_trace import resolve_policies
from hicache_store.demo.bench.trace_format import Trace
from hicache_store.demo.bench.trace_replay import ReplaySetup, parse_capacity, replay
from hicache_store.demo.bench.trace_sim import block_policy, lru_reference, simulate
from hicache_store.tier.config import TierConfig
from hicache_store.tier.eviction import DEFAULT_EVICTION_POLICY

BLOCK = 512
PAGE = 128  # four pages per block


def setup(l2_blocks: int, backend_url: str | None = None, **options: object) -> ReplaySetup:
    per_block = BLOCK // PAGE
    return ReplaySetup(
        page_size=PAGE,
        l1_pages=3 * per_block,
        l2_pages=l2_blocks * per_block,
        backend_url=backend_url,
        settle=True,
        **options,  # type: ignore[arg-type]
    )


# L2 of 3 blocks, LRU, no L3. After each request, what L2 holds (least recent first):
#   r0 [1,2]   miss              {1 2}
#   r1 [1,3]   hits 1            {2 | 1 3}
#   r2 [4]     miss, evicts 2    {1 3 | 4}
#   r3 [1,3,5] hits 1,3, evicts 4 {1 3 5}
#   r4 [4,6]   miss, evicts 5, 3 (a chain loses its tail first)   {1 | 4 6}
#   r5 [1,3]   hits 1, evicts 6  {4 | 1 3}
#   r6 [4,6]   hits 4
HAND = [[1, 2], [1, 3], [4], [1, 3, 5], [4, 6], [1, 3], [4, 6]]
HAND_HITS_BLOCKS = 1 + 2 + 1 + 1


def hand_trace() -> Trace:
    return make_trace(HAND, block=BLOCK)


def test_hand_counted_trace_hits_exactly_through_l2() -> None:
    trace = hand_trace()
    result = replay(trace, setup(3))
    counts = result.counts
    assert counts.l2.hit_tokens == HAND_HITS_BLOCKS * BLOCK
    assert counts.l1.hit_tokens == 0  # L1 holds only the request being served
    assert counts.l3.hit_tokens == 0
    assert counts.l2.input_tokens == trace.input_tokens
    # the block-level simulator of the same policy agrees
    assert simulate(trace, 3, block_policy("lru", trace, 3)).hit_tokens == HAND_HITS_BLOCKS * BLOCK
    summary = result.summary()
    assert summary["hit_rate"] == pytest.approx(HAND_HITS_BLOCKS * BLOCK / trace.input_tokens)
    assert summary["capacity_blocks"] == 3
    assert summary["links"]["l2_to_l1"]["pages"] == HAND_HITS_BLOCKS * (BLOCK // PAGE)
    assert summary["l3_objects_written"] == 0


def test_l3_serves_what_l2_evicted(tmp_path: Path) -> None:
    # L2 of 2 blocks over a file backend:
    #   r0 [1] r1 [2] r2 [3]: misses; r2 evicts 1 from L2 (L3 keeps it)
    #   r3 [1,9]: block 1 from L3 (prefetched into L2, evicting 2), 9 computed (evicts 3)
    #   r4 [2,8]: block 2 from L3
    trace = make_trace([[1], [2], [3], [1, 9], [2, 8]], block=BLOCK)
    result = replay(trace, setup(2, f"file://{tmp_path}"))
    counts = result.counts
    assert (counts.l1.hit_tokens, counts.l2.hit_tokens) == (0, 0)
    assert counts.l3.hit_tokens == 2 * BLOCK
    summary = result.summary()
    pages_per_block = BLOCK // PAGE
    written = {1, 2, 3, 9, 8}
    # one object per page (a one-layer, one-head grid), plus the namespace's manifest
    assert summary["l3_objects_written"] == len(written) * pages_per_block + 1
    assert summary["l3_objects_read"] == 2 * pages_per_block
    assert summary["links"]["l3_to_l2"]["bytes"] > 0
    assert summary["prefetch"]["complete"] == 2
    assert summary["hit_rate"] == 0.0
    assert summary["hit_rate_with_l3"] == pytest.approx(2 * BLOCK / trace.input_tokens)


def test_arc_keeps_a_returning_chain_that_lru_loses() -> None:
    # One chain occurs every 4th request (10 times); one-off chains in between fill L2 (4
    # blocks) before it comes back, so LRU never has it. ARC: the 1st occurrence goes to T1
    # and is evicted (3 one-offs evict 24 pages: its ghosts leave B1, 16 pages long, but stay
    # in the recall memory, 64 pages); at the 2nd the recalled keys admit it to T2, p stays 0,
    # so the one-offs in T1 go first and it stays: from the 3rd on each occurrence hits all
    # its pages but the last (a prompt computes at least its last page).
    chains: list[list[int]] = []
    fresh = 100
    for i in range(40):
        chains.append([0, 1] if i % 4 == 0 else [fresh, fresh + 1])
        fresh += 0 if i % 4 == 0 else 2
    trace = make_trace(chains, block=BLOCK)
    lru = replay(trace, setup(4, eviction_policy="lru"))
    arc = replay(trace, setup(4, eviction_policy="arc"))
    assert lru.counts.l2.hit_tokens == 0
    returns_kept = 10 - 2
    assert arc.counts.l2.hit_tokens == returns_kept * (2 * BLOCK - PAGE)


def test_the_default_is_session_which_is_arc_without_hints() -> None:
    # The returning chain of the test above, in a trace without sessions: the default policy
    # (session) orders every page by its fallback, ARC, and hits exactly what arc hits.
    assert TierConfig(l1_pages=1, l2_pages=1).eviction_policy == "session"
    chains = [[0, 1] if i % 4 == 0 else [100 + 2 * i, 101 + 2 * i] for i in range(40)]
    trace = make_trace(chains, block=BLOCK)
    default = replay(trace, setup(4, eviction_policy=DEFAULT_EVICTION_POLICY))
    arc = replay(trace, setup(4, eviction_policy="arc"))
    assert default.counts.l2.hit_tokens == arc.counts.l2.hit_tokens > 0


def test_whole_blocks_give_a_partial_block_a_whole_blocks_space() -> None:
    # L2 of 2 blocks (8 pages). r1's last block holds 100 tokens: as a whole block (the
    # reference's accounting) it takes 4 pages and pushes block 1 out, so r2 misses, as in the
    # published LRU; as an engine stores it (full pages only: none here) block 1 stays.
    trace = make_trace([[1], [2, 3], [1]], block=BLOCK, lengths=[512, 612, 512])
    whole = replay(trace, setup(2))
    assert whole.counts.l2.hit_tokens == lru_reference(trace, 2).hit_tokens == 0
    partial = replay(trace, setup(2, whole_blocks=False))
    assert partial.counts.l2.hit_tokens == 3 * PAGE  # block 1 but its last page (computed)
    assert whole.counts.l2.input_tokens == partial.counts.l2.input_tokens == 1636


def test_hits_on_padding_are_not_counted() -> None:
    # r1 repeats r0, whose second block holds 10 tokens: padded, the tier hits 7 pages, but
    # the trace's prompt has 522 tokens, so 522 count (and nothing from the padding).
    trace = make_trace([[1, 2], [1, 2]], block=BLOCK, lengths=[522, 522])
    result = replay(trace, setup(4))
    assert result.counts.l2.hit_tokens == 522


def test_page_size_must_divide_the_block() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        replay(hand_trace(), ReplaySetup(page_size=96, l1_pages=16, l2_pages=8, backend_url=None))


def test_parse_capacity_units() -> None:
    def pages(text: str) -> int:
        return parse_capacity(text, block_tokens=512, page_size=64, page_bytes=1024)

    assert pages("4000") == pages("4000blocks") == 32_000
    assert pages("10pages") == 10
    assert pages("1000tokens") == pages("1000tok") == 15  # rounds down to whole pages
    assert pages("1MiB") == 1024
    assert pages("1_000") == 8000
    for bad in ("4k", "lots", "0", "10tokens", "-3"):
        with pytest.raises(ValueError):
            pages(bad)


def write_trace(path: Path, chains: list[list[int]]) -> Path:
    with gzip.open(path, "wt") as f:
        for i, chain in enumerate(chains):
            record = {"timestamp": 10 * i, "input_length": BLOCK * len(chain),
                      "output_length": 1, "hash_ids": chain}
            f.write(json.dumps(record) + "\n")
    return path


def test_bench_trace_command_writes_json_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "hand.jsonl.gz", HAND)
    out = tmp_path / "r.json"
    code = main([
        "bench", "trace", str(trace), "--capacities", "3,64", "--policy", "lru",
        "--page-size", str(PAGE), "--backend", "none", "--json", str(out), "--no-progress",
    ])
    assert code == 0
    document = json.loads(out.read_text())
    assert document["trace"] == str(trace)
    small, large = document["results"]
    assert small["capacity_blocks"] == 3
    assert small["policy"] == "lru"
    total = BLOCK * sum(len(c) for c in HAND)
    assert small["hit_rate"] == pytest.approx(HAND_HITS_BLOCKS * BLOCK / total)
    # the references are the benchmark's own, from the trace alone
    assert 0 <= small["lru_reference"] <= small["belady"] <= large["belady"]
    # Nothing is evicted at 64 blocks, so the tier hits what unbounded LRU hits, except that
    # a prompt cached whole still computes its last page (its logits are the output): r5 and
    # r6 repeat r1 and r4.
    assert large["hit_rate"] == pytest.approx(large["lru_reference"] - 2 * PAGE / total)
    for key in ("hit_rate_second_half", "lru_reference_second_half", "belady_second_half",
                "hit_rate_l1", "hit_rate_l2", "hit_rate_l3", "links", "prefetch",
                "bookkeeping_ms", "l3_objects_written", "l3_objects_read"):
        assert key in small
    table = capsys.readouterr().out
    assert "LRU ref" in table
    assert len(table.strip().splitlines()) == 2 + 2


def test_bench_trace_settle_lets_l3_serve_what_l2_evicted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The trace of test_l3_serves_what_l2_evicted through the command, file backend,
    # --settle: every backup is written before the next request, none is dropped, and the two
    # returning blocks come from L3 through two prefetches.
    chains = [[1], [2], [3], [1, 9], [2, 8]]
    trace = write_trace(tmp_path / "l3.jsonl.gz", chains)
    out = tmp_path / "r.json"
    code = main([
        "bench", "trace", str(trace), "--capacities", "2", "--policy", "lru", "--settle",
        "--page-size", str(PAGE), "--workdir", str(tmp_path / "work"), "--belady", "none",
        "--json", str(out), "--no-progress",
    ])
    assert code == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["setup"]["settle"] is True
    assert row["backups_dropped"] == 0
    assert row["prefetch"]["started"] == row["prefetch"]["complete"] == 2
    total = BLOCK * sum(len(c) for c in chains)
    assert row["hit_rate"] == 0.0
    assert row["hit_rate_l3"] == pytest.approx(2 * BLOCK / total)
    header, line = capsys.readouterr().out.strip().splitlines()[1:]
    assert "dropped" in header and "prefetch" in header
    assert line.split()[-5:-3] == ["0", "2"]  # dropped, prefetches started


def test_bench_trace_command_draws_the_chart(tmp_path: Path) -> None:
    pytest.importorskip(
        "matplotlib", reason="--chart needs the bench extra: pip install 'hicache-store[bench]'"
    )
    trace = write_trace(tmp_path / "hand.jsonl.gz", HAND)
    chart = tmp_path / "r.png"
    code = main([
        "bench", "trace", str(trace), "--capacities", "3,64", "--policy", "lru",
        "--page-size", str(PAGE), "--backend", "none", "--chart", str(chart), "--no-progress",
    ])
    assert code == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "mru"], "not one of"),
        (["--page-size", "96"], "must divide"),
        (["--capacities", "lots"], "expected N"),
        (["--l1", "1pages"], "cannot hold the longest prompt"),
    ],
)
def test_bench_trace_refuses_bad_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    trace = write_trace(tmp_path / "t.jsonl.gz", HAND)
    code = main(["bench", "trace", str(trace), "--backend", "none", "--no-progress", *flags])
    assert code == 2
    assert message in capsys.readouterr().err



def test_policy_default_names_the_tiers_default() -> None:
    # "default" is the tier's own default; each name once, in order. (That "lru" really runs
    # LRU under a tier whose default is not: test_arc_keeps_a_returning_chain_that_lru_loses.)
    assert TierConfig(l1_pages=1, l2_pages=1).eviction_policy == DEFAULT_EVICTION_POLICY
    assert resolve_policies("default, lru,default") == [DEFAULT_EVICTION_POLICY, "lru"]


def test_bench_trace_json_dash_is_stdout_not_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = write_trace(tmp_path / "hand.jsonl.gz", HAND)
    monkeypatch.chdir(tmp_path)
    code = main(["bench", "trace", str(trace), "--capacities", "3", "--policy", "lru",
                 "--page-size", str(PAGE), "--backend", "none", "--json", "-", "--no-progress"])
    assert code == 0
    out, err = capsys.readouterr()
    document = json.loads(out)  # stdout holds the JSON alone
    assert document["complete"] is True and len(document["results"]) == 1
    assert "LRU ref" in err  # the table went to stderr
    assert not (tmp_path / "-").exists()


def test_bench_trace_progress_has_no_carriage_return_off_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "hand.jsonl.gz", HAND * 20)
    code = main(["bench", "trace", str(trace), "--capacities", "3", "--policy", "lru",
                 "--page-size", str(PAGE), "--backend", "none"])
    assert code == 0
    err = capsys.readouterr().err
    assert "requests" in err and f"{len(HAND) * 20}/{len(HAND) * 20}" in err  # progress shown
    assert "\r" not in err


def test_max_requests_reads_the_trace_only_as_far_as_it_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "hand.jsonl.gz", HAND)
    with gzip.open(trace, "at") as f:
        f.write("{this line is never read\n")
    out = tmp_path / "r.json"
    code = main(["bench", "trace", str(trace), "--capacities", "3", "--policy", "lru",
                 "--page-size", str(PAGE), "--backend", "none", "--max-requests", "4",
                 "--json", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["requests"] == 4
    # the whole trace is still read (and refused) without the limit
    code = main(["bench", "trace", str(trace), "--capacities", "3", "--policy", "lru",
                 "--page-size", str(PAGE), "--backend", "none", "--no-progress"])
    assert code == 2 and "not JSON" in capsys.readouterr().err


def test_an_interrupted_bench_trace_keeps_its_finished_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache_store.demo.bench import trace_replay

    real = trace_replay.replay
    calls = []

    def interrupted_second(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second row
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(trace_replay, "replay", interrupted_second)
    trace = write_trace(tmp_path / "hand.jsonl.gz", HAND)
    out = tmp_path / "r.json"
    code = main(["bench", "trace", str(trace), "--capacities", "3,64", "--policy", "lru",
                 "--page-size", str(PAGE), "--backend", "none", "--json", str(out),
                 "--no-progress"])
    assert code == 130
    document = json.loads(out.read_text())
    assert document["complete"] is False
    (row,) = document["results"]
    assert row["capacity_blocks"] == 3 and row["policy"] == "lru"
    assert capsys.readouterr().err.strip().endswith("hicache-store bench: interrupted")
