"""``hicache-store bench pd``: two processes per arm, the figures the issue asks for, and the
bytes each arm sends checked against the boundaries the workload implies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pd_support import TRANSPORTS

from hicache_store.cli import main
from hicache_store.commands.bench_pd import compare, describe
from hicache_store.demo.bench.workload import WorkloadSpec, generate
from hicache_store.demo.engine.config import MiniLlamaConfig

PAGE = 16


def expected_pages(spec: WorkloadSpec) -> tuple[list[int], list[int]]:
    """Per request: the prompt's pages (what the baseline receives) and the pages after the
    longest page-aligned prefix an earlier request's prompt + answer shares with it (what a
    decode cache that never evicts receives)."""
    whole, suffix, seen = [], [], []
    for request in generate(spec):
        prompt = request.prompt
        shared = 0
        for earlier in seen:
            n = 0
            while n < min(len(earlier), len(prompt) - 1) and earlier[n] == prompt[n]:
                n += 1
            shared = max(shared, n)
        pages = -(-len(prompt) // PAGE)
        whole.append(pages)
        suffix.append(pages - shared // PAGE)
        seen.append(prompt + request.answer)
    return whole, suffix


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bench_pd_reports_the_reuse_against_the_baseline(
    transport: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if transport == "mooncake":
        pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is not installed")
    spec = WorkloadSpec(
        groups=2, conversations=2, turns=2, system_tokens=128, question_tokens=32,
        answer_tokens=16, vocab_size=MiniLlamaConfig.preset("tiny").vocab_size,
    )  # fmt: skip
    out = tmp_path / "pd.json"
    argv = [
        "bench", "pd", "--preset", "tiny", "--page-size", str(PAGE), "--transport", transport,
        "--groups", "2", "--conversations", "2", "--turns", "2", "--system-tokens", "128",
        "--question-tokens", "32", "--answer-tokens", "16", "--l1-fraction", "1",
        "--workdir", str(tmp_path / "work"), "--no-progress", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "reuse vs baseline after the first round" in printed
    report = json.loads(out.read_text())
    base, reuse = report["baseline"], report["reuse"]
    for arm in (base, reuse):
        for key in ("bytes_transferred", "ttft_median_s", "ttft_mean_s", "decode_hit_rate"):
            assert key in arm
        assert arm["requests"] == 8 and arm["retried_requests"] == 0
        assert arm["ttft_median_s"] > 0 and arm["ttft_mean_s"] > 0

    row = MiniLlamaConfig.preset("tiny").kv_bytes_per_token * PAGE
    whole, suffix = expected_pages(spec)
    turn0 = spec.groups * spec.conversations
    # the baseline has no decode cache: every prompt's whole KV travels, nothing is a hit
    assert base["decode_hit_rate"] == 0
    assert base["bytes_transferred"] == sum(whole) * row
    assert base["after_first_round"]["bytes_transferred"] == sum(whole[turn0:]) * row
    # the decode cache holds each conversation's history (and the shared prefixes): only the
    # pages after it travel, and what decode reused is what its tier counted as hits
    assert reuse["bytes_transferred"] == sum(suffix) * row
    assert reuse["after_first_round"]["bytes_transferred"] == sum(suffix[turn0:]) * row
    prompt_tokens = sum(len(r.prompt) for r in generate(spec))
    hits = reuse["decode_hit_tokens"]["l1"] + reuse["decode_hit_tokens"]["l2"]
    assert hits == pytest.approx(reuse["decode_hit_rate"] * prompt_tokens)
    assert hits == sum(w - s for w, s in zip(whole, suffix, strict=True)) * PAGE
    # the prefill side decides its own compute: the same in both arms
    assert base["prefill_hit_rate"] == reuse["prefill_hit_rate"] > 0
    assert base["prefill"]["bytes_sent"] == base["bytes_transferred"]
    assert reuse["prefill"]["bytes_sent"] == reuse["bytes_transferred"]
    fall = report["comparison"]["after_first_round"]["bytes_transferred_fall"]
    assert fall == pytest.approx(1 - sum(suffix[turn0:]) / sum(whole[turn0:])) and fall >= 0.8


def test_comparison_reports_signed_changes() -> None:
    def arm(nbytes: float, median: float) -> dict[str, object]:
        figures = {"bytes_transferred": nbytes, "ttft_mean_s": median, "ttft_median_s": median}
        return {**figures, "after_first_round": dict(figures), "e2e_s": median}

    comparison = compare({"baseline": arm(100, 0.2), "reuse": arm(10, 0.25)})
    assert comparison["after_first_round"]["bytes_transferred_fall"] == pytest.approx(0.9)
    assert comparison["all"]["ttft_median_s_fall"] == pytest.approx(-0.25)
    first = describe(comparison)[0]
    assert "bytes sent -90.0%" in first and "median TTFT +25.0%" in first
    assert compare({"reuse": arm(10, 0.1)}) == {}
