"""Reading block-hash traces: the Mooncake format, strictness, chain consistency."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hicache_store.demo.bench.trace_format import (
    TraceFormatError,
    TraceRequest,
    check_chains,
    read_trace,
)

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "bench" / "traces"


def write_lines(path: Path, records: list[object], *, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


RECORDS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 7, "input_length": 512, "output_length": 0, "hash_ids": [0]},
    {"timestamp": 7, "input_length": 1025, "output_length": 9, "hash_ids": [0, 1, 2]},
]


@pytest.mark.parametrize("gz", [False, True])
def test_reads_plain_and_gzipped_lines(tmp_path: Path, gz: bool) -> None:
    path = write_lines(tmp_path / "t.jsonl.gz", RECORDS, gz=gz)
    trace = read_trace(path, "mooncake")
    assert trace.name == "t"
    assert trace.block_tokens == 512
    assert trace.requests == (
        TraceRequest(0, 1000, 5, (0, 1)),
        TraceRequest(7, 512, 0, (0,)),
        TraceRequest(7, 1025, 9, (0, 1, 2)),
    )
    assert trace.input_tokens == 2537
    assert trace.block_accesses == 6
    assert trace.longest_blocks == 3
    assert trace.duration_s == pytest.approx(0.007)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}, "1 hash ids"),
        ({"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}, "input_length"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-3]}, "hash_ids"),
        ({"timestamp": 0, "input_length": 5, "output_length": True, "hash_ids": [1]}, "output"),
        ({"timestamp": "0", "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp"),
        ([1, 2], "JSON object"),
    ],
)
def test_refuses_a_malformed_line_naming_it(tmp_path: Path, record: object, message: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [RECORDS[0], record])
    with pytest.raises(TraceFormatError, match=message) as info:
        read_trace(path)
    assert "bad.jsonl:2" in str(info.value)


def test_refuses_time_going_backwards_and_garbage(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [RECORDS[2], RECORDS[0]])
    with pytest.raises(TraceFormatError, match="before the previous"):
        read_trace(path)
    (tmp_path / "g.jsonl").write_text('{"timestamp": 0,\n')
    with pytest.raises(TraceFormatError, match="g.jsonl:1: not JSON"):
        read_trace(tmp_path / "g.jsonl")
    with pytest.raises(ValueError, match="not one of mooncake"):
        read_trace(path, "csv")


def test_check_chains_finds_an_id_under_two_parents(tmp_path: Path) -> None:
    good = read_trace(write_lines(tmp_path / "a.jsonl", RECORDS))
    check_chains(good)
    bad = [*RECORDS, {"timestamp": 9, "input_length": 700, "output_length": 1, "hash_ids": [5, 1]}]
    with pytest.raises(TraceFormatError, match="hash id 1 follows 5, but 0 elsewhere"):
        check_chains(read_trace(write_lines(tmp_path / "b.jsonl", bad)))


@pytest.mark.parametrize(
    ("name", "requests", "blocks", "unique"),
    [("conversation", 12_031, 288_500, 182_790), ("synthetic", 3_993, 121_877, 43_924)],
)
def test_shipped_traces_read_whole_and_consistent(
    name: str, requests: int, blocks: int, unique: int
) -> None:
    trace = read_trace(TRACES / f"mooncake_{name}_trace.jsonl.gz")
    assert len(trace) == requests
    assert trace.block_accesses == blocks
    assert len({b for r in trace.requests for b in r.hash_ids}) == unique
    check_chains(trace)
