"""``hicache-store bench multiturn --model hybrid``: per-component hit rates, consistent with the
token hit rates of the same run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_store.cli import main
from hicache_store.demo.bench.hybrid import hybrid_config
from hicache_store.demo.bench.multiturn import namespace_for
from hicache_store.demo.engine.config import MiniLlamaConfig


def test_hybrid_run_reports_per_component_hit_rates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hybrid.json"
    argv = [
        "bench", "multiturn", "--model", "hybrid", "--preset", "tiny", "--groups", "2",
        "--conversations", "3", "--turns", "3", "--system-tokens", "128", "--question-tokens",
        "16", "--answer-tokens", "24", "--sliding-window", "32", "--workdir",
        str(tmp_path / "work"), "--no-progress", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "per-component hit rates" in table
    assert "window hit" in table and "recurrent hit" in table
    results = json.loads(out.read_text())["results"]
    assert [r["setup"]["name"] for r in results] == ["L1", "L1+L2", "L1+L2+L3"]
    for result in results:
        components = result["tier"]["components"]
        rates = components["hit_rates"]
        assert set(rates) == {"kv", "window", "recurrent", "all"}
        # what was reused is what every component allowed at once, and it is what the records
        # counted as hits
        assert rates["all"] == pytest.approx(result["hit_rate"])
        assert 0 < rates["all"] <= min(rates["kv"], rates["window"], rates["recurrent"]) <= 1
        # shared system prompts: the second conversation of a group finds the prompt's KV but
        # no snapshot (nor window pages) at its end yet; the branch point is checkpointed then.
        # So the components cost hits the KV alone would have had.
        assert rates["all"] < rates["kv"]
        counters = components["counters"]
        assert counters["produced_window"] > 0 and counters["produced_recurrent"] > 0
    assert results[2]["tier"]["components"]["counters"]["backups_l3_window"] > 0


def test_hybrid_models_have_their_own_namespace() -> None:
    base = MiniLlamaConfig()
    hybrid = hybrid_config(base, 32)
    assert hybrid.window_layers == (1, 3)
    plain_ns, hybrid_ns = namespace_for(base, 16), namespace_for(hybrid, 16)
    assert hybrid_ns.num_layers == 2 and plain_ns.num_layers == 4
    assert hybrid_ns.digest != plain_ns.digest
    assert hybrid_ns.digest != namespace_for(hybrid_config(base, 64), 16).digest


def test_an_unknown_eviction_policy_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "multiturn", "--eviction-policy", "fifo", "--workdir", str(tmp_path / "w")]
    assert main(argv) == 2
    assert "--eviction-policy: 'fifo' is not one of lru, arc" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
