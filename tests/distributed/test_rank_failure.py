"""A rank that fails while its peers wait in a collective: reported, peers killed, no hang."""

from __future__ import annotations

import time

import pytest
from _dist_tasks import fail_on_rank

from hicache_store.demo.launch import RankPool, RankTaskError


@pytest.mark.slow
def test_failure_kills_stuck_peers_instead_of_hanging() -> None:
    with RankPool(2) as pool:
        started = time.monotonic()
        with pytest.raises(RankTaskError) as info:
            pool.run(fail_on_rank, 1, timeout_s=60, grace_s=1.0)
        assert time.monotonic() - started < 30
        assert info.value.kinds() == {0: "Stuck", 1: "RuntimeError"}
        assert "rank 1 failed on purpose" in info.value.messages()[1]
        assert pool.broken
        assert not any(p.is_alive() for p in pool._procs)
        with pytest.raises(RuntimeError, match="closed or broken"):
            pool.run(fail_on_rank, 1)
