"""``hicache-store bench multiturn``: what L2 changed, request by request (L1+L2 against L1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_store.cli import main
from hicache_store.demo.bench.multiturn import (
    RequestRecord,
    SetupResult,
    TierSetup,
    describe_l2_effect,
    l2_effect,
)


def records(rows: list[tuple[int, int, float]]) -> SetupResult:
    """A run of 100-token prompts: (hit tokens from L1, from L2, TTFT s) per request."""
    result = SetupResult(TierSetup("x", 8))
    result.records = [RequestRecord(i, 0, 100, l1, l2, 0, ttft, 0.0)
                      for i, (l1, l2, ttft) in enumerate(rows)]
    return result


def test_l2_effect_pairs_each_request_with_itself() -> None:
    # Requests 0-2 resume at the same prefix in both runs (same work, TTFT as the machine
    # gave it); 3 and 4 resume from L2 in the second; 5 resumes further from L1 there (not an
    # L2 hit, not the same work: in neither group).
    without = records([(0, 0, 1.0), (50, 0, 0.2), (50, 0, 0.4), (0, 0, 1.1), (10, 0, 0.9),
                       (0, 0, 1.0)])
    with_l2 = records([(0, 0, 1.2), (50, 0, 0.3), (50, 0, 0.5), (0, 80, 0.3), (10, 60, 0.2),
                       (20, 0, 0.8)])
    effect = l2_effect(without, with_l2)
    assert effect == {
        "requests": 6,
        "used_l2": 2,
        "used_l2_ttft_median_s": [pytest.approx(1.0), pytest.approx(0.25)],
        "same": 3,
        "same_ttft_median_s": [pytest.approx(0.4), pytest.approx(0.5)],
        "computed_tokens": [100 + 50 + 50 + 100 + 90 + 100, 100 + 50 + 50 + 20 + 30 + 80],
    }
    text = describe_l2_effect(effect, ("L1", "L1+L2"))
    assert "2 of 6 requests resumed from L2 (median TTFT 250 ms against 1000 ms in L1)" in text
    assert "The other 3 requests" in text and "median TTFT 500 against 400 ms" in text


def test_the_command_says_what_l2_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    argv = [
        "bench", "multiturn", "--preset", "tiny", "--groups", "1", "--conversations", "3",
        "--turns", "3", "--system-tokens", "64", "--question-tokens", "16",
        "--answer-tokens", "24", "--configs", "L1,L1+L2", "--workdir", str(tmp_path / "w"),
        "--no-progress", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    document = json.loads(out.read_text())
    effect = document["l2_effect"]
    assert effect["requests"] == 9 and effect["used_l2"] + effect["same"] <= 9
    assert f"{effect['used_l2']} of 9 requests resumed from L2" in printed
    computed = [r["prompt_tokens"] * (1 - r["hit_rate"]) for r in document["results"]]
    assert effect["computed_tokens"] == [round(c) for c in computed]
