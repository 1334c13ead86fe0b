"""The consensus comparison on its own (no processes): call, arguments, result, missing."""

from __future__ import annotations

from hicache_store.distributed.consensus import (
    ConsensusLog,
    Decision,
    consensus_check_enabled,
    first_divergence,
)


def log(*entries: tuple[str, int, bool], request: int = 1) -> list[Decision]:
    out = ConsensusLog()
    for what, value, agreement in entries:
        out.add(what, (("request", request),), value, agreement=agreement)
    return out.take_pending()


def test_agreements_may_differ_in_value_notes_may_not() -> None:
    assert (
        first_divergence([log(("prefix_pages", 3, True)), log(("prefix_pages", 5, True))]) is None
    )
    error = first_divergence([log(("l1", 3, False)), log(("l1", 3, False)), log(("l1", 4, False))])
    assert error is not None and error.field == "result" and error.index == 0
    assert error.groups == [("3", [0, 1]), ("4", [2])]


def test_call_and_argument_divergence() -> None:
    a = log(("backup_acks", 0, True), ("prefetch_pages", 2, True))
    b = log(("backup_acks", 0, True), ("prefix_pages", 2, True))
    error = first_divergence([a, b])
    assert error is not None and (error.index, error.field) == (1, "call")
    assert "decision #1 ('prefetch_pages')" in str(error)
    c = log(("backup_acks", 0, True), request=2)
    error = first_divergence([log(("backup_acks", 0, True)), c])
    assert error is not None and error.field == "arguments"


def test_a_rank_with_fewer_decisions() -> None:
    error = first_divergence([log(("a", 1, False), ("b", 0, True)), log(("b", 0, True))])
    assert error is not None and error.index == 0 and error.field == "call"


def test_env_switch() -> None:
    assert consensus_check_enabled({"HICACHE_STORE_CONSENSUS_CHECK": "1"})
    assert not consensus_check_enabled({"HICACHE_STORE_CONSENSUS_CHECK": "0"})
    assert not consensus_check_enabled({})
