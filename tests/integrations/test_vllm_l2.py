"""The vLLM connector's L2 (``integrations.vllm._l2.HostPageCache``), without vLLM.

Checked against a model: an ``OrderedDict`` LRU of pages with the chain order of
``backends._lru`` (a put or a hit marks its batch used, the batch's tail first out). Every
byte served is compared with what was put.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from hicache_store.integrations.vllm._config import DEFAULT_L2_MIB, ConnectorConfig
from hicache_store.integrations.vllm._l2 import HostPageCache
from hicache_store.layout.errors import ConfigError

PAGE = 256


def page(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_serves_what_was_put_and_misses_what_was_not() -> None:
    l2 = HostPageCache(4 * PAGE, PAGE)
    rows = torch.stack([page(i) for i in range(3)])
    added, evicted = l2.put(["a", "b", "c"], rows)
    assert (added, evicted) == (["a", "b", "c"], [])
    out = torch.zeros((4, PAGE), dtype=torch.uint8)
    assert l2.copy_into(["a", "x", "c", "b"], out) == [True, False, True, True]
    assert torch.equal(out[0], rows[0]) and torch.equal(out[2], rows[2])
    assert torch.equal(out[3], rows[1])
    assert not out[1].any()  # a miss leaves the caller's row alone
    counts = l2.take_counts()
    assert (counts.hits, counts.misses, counts.puts, counts.evictions) == (3, 1, 3, 0)
    assert l2.held_bytes == 3 * PAGE


def test_no_reference_to_a_row_leaves_the_cache() -> None:
    """What the caller does with its buffers afterwards never reaches the L2's copy."""
    l2 = HostPageCache(2 * PAGE, PAGE)
    source = page(7)
    kept = source.clone()
    l2.put(["a"], [source])
    source.fill_(0)  # the caller reuses its buffer
    out = torch.empty((1, PAGE), dtype=torch.uint8)
    l2.copy_into(["a"], out)
    out.fill_(1)  # and writes into what it was served
    again = torch.empty((1, PAGE), dtype=torch.uint8)
    assert l2.copy_into(["a"], again) == [True]
    assert torch.equal(again[0], kept)


def test_bounded_least_recently_used_out_first_tail_before_head() -> None:
    l2 = HostPageCache(3 * PAGE + PAGE // 2, PAGE)  # room for 3 pages
    assert l2.capacity_pages == 3
    l2.put(["a0", "a1"], [page(0), page(1)])
    l2.put(["b0"], [page(2)])
    # a0 is read again, its tail a1 is not: a1 goes first (a chain loses its untouched tail,
    # never its head), then b0, then a0.
    l2.copy_into(["a0"], torch.empty((1, PAGE), dtype=torch.uint8))
    added, evicted = l2.put(["c0"], [page(3)])
    assert (added, evicted) == (["c0"], ["a1"])
    added, evicted = l2.put(["d0"], [page(4)])
    assert evicted == ["b0"]
    assert "a0" in l2 and "a1" not in l2
    assert l2.put(["e0"], [page(5)])[1] == ["a0"]
    assert l2.held_bytes == 3 * PAGE


def test_a_batch_larger_than_the_cache_keeps_its_head() -> None:
    l2 = HostPageCache(2 * PAGE, PAGE)
    l2.put(["old"], [page(9)])
    added, evicted = l2.put(["p0", "p1", "p2", "p3"], [page(i) for i in range(4)])
    assert added == ["p0", "p1"] and evicted == ["old"]
    assert len(l2) == 2 and l2.held_bytes <= 2 * PAGE


def test_a_page_put_twice_keeps_one_copy() -> None:
    l2 = HostPageCache(2 * PAGE, PAGE)
    first = page(1)
    l2.put(["a"], [first])
    added, evicted = l2.put(["a"], [page(2)])
    assert (added, evicted) == ([], [])
    out = torch.empty((1, PAGE), dtype=torch.uint8)
    l2.copy_into(["a"], out)
    assert torch.equal(out[0], first) and len(l2) == 1


def test_random_operations_match_an_lru_model() -> None:
    rng = random.Random(3)
    capacity = 5
    l2 = HostPageCache(capacity * PAGE, PAGE)
    model: OrderedDict[str, torch.Tensor] = OrderedDict()  # front = evicted first
    evictions = 0
    for step in range(400):
        chain = [f"k{rng.randrange(12)}" for _ in range(rng.randrange(1, 4))]
        chain = list(dict.fromkeys(chain))
        if rng.random() < 0.5:
            rows = [page(1000 * step + i) for i in range(len(chain))]
            added, evicted = l2.put(chain, rows)
            expect_added: list[str] = []
            expect_evicted: list[str] = []
            for key, row in zip(chain, rows, strict=True):
                if key in model:
                    continue
                if len(model) == capacity:
                    victim = next((k for k in model if k not in chain), None)
                    if victim is None:
                        break
                    del model[victim]
                    expect_evicted.append(victim)
                    evictions += 1
                model[key] = row
                expect_added.append(key)
            for key in reversed(chain):
                if key in model:
                    model.move_to_end(key)
            assert (added, evicted) == (expect_added, expect_evicted)
        else:
            out = torch.zeros((len(chain), PAGE), dtype=torch.uint8)
            found = l2.copy_into(chain, out)
            assert found == [k in model for k in chain]
            for i, key in enumerate(chain):
                if key in model:
                    assert torch.equal(out[i], model[key])
            for key in reversed(chain):
                if key in model:
                    model.move_to_end(key)
        assert set(model) == {k for k in model if k in l2} and len(l2) == len(model)
    assert evictions > 0
    assert l2.held_bytes <= capacity * PAGE


def test_wrong_rows_are_refused() -> None:
    l2 = HostPageCache(2 * PAGE, PAGE)
    with pytest.raises(ValueError, match="uint8"):
        l2.put(["a"], [torch.zeros(PAGE, dtype=torch.float32)])
    with pytest.raises(ValueError, match="2 pages, 1 rows"):
        l2.put(["a", "b"], [page(0)])
    with pytest.raises(ValueError, match=r"\(2, 256\)"):
        l2.copy_into(["a", "b"], torch.zeros((1, PAGE), dtype=torch.uint8))
    assert len(l2) == 0


def test_l2_mib_key() -> None:
    assert ConnectorConfig.from_extra({}).l2_bytes == DEFAULT_L2_MIB << 20
    assert ConnectorConfig.from_extra({"l2_mib": 0}).l2_bytes == 0
    assert ConnectorConfig.from_extra({"l2_mib": 1.5}).l2_bytes == 3 << 19
    with pytest.raises(ConfigError, match="l2_mib: must be non-negative"):
        ConnectorConfig.from_extra({"l2_mib": -1})
    with pytest.raises(ConfigError, match="l2_mib: expected a number"):
        ConnectorConfig.from_extra({"l2_mib": "lots"})


@pytest.mark.parametrize(("policy", "gone"), [("lru", "a"), ("arc", "b"), ("session", "b")])
def test_evicts_in_the_order_of_the_tiers_policy(policy: str, gone: str) -> None:
    """The L2 orders its pages by the cache tier's eviction policies: ``a`` was used again,
    ``b`` once, more recently. LRU gives up ``a``; ARC (and ``session`` without hints, which is
    ARC) keeps the page used twice and gives up ``b``."""
    l2 = HostPageCache(2 * PAGE, PAGE, policy=policy)
    l2.put(["a"], [page(0)])
    assert l2.copy_into(["a"], torch.empty((1, PAGE), dtype=torch.uint8)) == [True]
    l2.put(["b"], [page(1)])
    assert l2.put(["c"], [page(2)])[1] == [gone]
    with pytest.raises(ValueError, match="eviction policy 'fifo'"):
        HostPageCache(2 * PAGE, PAGE, policy="fifo")
