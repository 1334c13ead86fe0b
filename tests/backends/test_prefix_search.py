"""The prefix search (``backends/prefix.py``) against a model, and ``Backend.exists_prefix_pages``
on a real backend."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_store.backends import open_backend
from hicache_store.backends.prefix import search_prefix


class Store:
    """A set of stored page indices, and a record of every probe."""

    def __init__(self, stored: set[int], count: int) -> None:
        self.stored = stored
        self.count = count
        self.rounds: list[list[int]] = []

    async def probe(self, pages: Sequence[int]) -> list[bool]:
        pages = list(pages)
        assert pages, "never an empty round"
        assert all(0 <= p < self.count for p in pages), pages
        self.rounds.append(pages)
        return [p in self.stored for p in pages]

    @property
    def probed(self) -> list[int]:
        return [p for r in self.rounds for p in r]

    def first_missing(self) -> int:
        return next((p for p in range(self.count) if p not in self.stored), self.count)


def run(store: Store, **kw: object) -> int:
    return asyncio.run(search_prefix(store.count, store.probe, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("count", [0, 1, 2, 7, 8, 9, 100, 15_625])
def test_a_stored_prefix_is_found_exactly_at_every_length(count: int) -> None:
    for length in sorted({0, 1, count // 3, count // 2, count - 1, count} - {-1}):
        if length > count:
            continue
        for ordered in (True, False):
            store = Store(set(range(length)), count)
            assert run(store, ordered=ordered) == length, (count, length, ordered)
            assert len(store.probed) == len(set(store.probed)), "a page probed twice"


def test_a_long_prompt_costs_tens_of_pages_in_a_few_round_trips() -> None:
    # 1M tokens at 64 tokens per page: 15,625 pages, every boundary position.
    count = 15_625
    worst_pages = worst_rounds = 0
    for length in [0, 1, 5, 64, 1000, 7777, 15_000, 15_624, 15_625]:
        store = Store(set(range(length)), count)
        assert run(store) == length
        worst_pages = max(worst_pages, len(store.probed))
        worst_rounds = max(worst_rounds, len(store.rounds))
    assert worst_pages <= 80, worst_pages
    assert worst_rounds <= 2 + math.ceil(math.log(count, 9)), worst_rounds
    # A cold prompt: one round trip.
    cold = Store(set(), count)
    assert run(cold) == 0 and len(cold.rounds) == 1
    # The linear probe stops at the first missing page, in doubling rounds.
    linear = Store(set(range(20)), count)
    assert run(linear, ordered=False) == 20
    assert linear.probed == list(range(24)), "8 pages, then 16: stops in the round with page 20"


def test_a_hole_just_below_the_boundary_is_found_by_the_verification() -> None:
    # A writer died with pages 100-107 in flight and page 103 never landed.
    count = 5000
    stored = set(range(108)) - {103}
    store = Store(stored, count)
    assert run(store) == 103


def test_a_hole_the_search_never_looks_at_can_only_make_the_answer_longer() -> None:
    count = 15_625
    stored = set(range(9000)) - {4321}
    store = Store(stored, count)
    got = run(store)
    if 4321 in store.probed:
        assert got == 4321
    else:
        assert got == 9000
    assert all(p in stored for p in store.probed if p < got), "a page seen missing is counted"


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(0, 3000),
    data=st.data(),
    fanout=st.integers(2, 16),
    verify=st.integers(0, 16),
)
def test_the_search_against_the_model(count: int, data: st.DataObject, fanout: int,
                                      verify: int) -> None:
    length = data.draw(st.integers(0, count))
    holes = data.draw(st.sets(st.integers(0, max(0, length - 1)), max_size=3)) if length else set()
    extra = data.draw(st.sets(st.integers(0, max(0, count - 1)), max_size=3)) if count else set()
    stored = (set(range(length)) - holes) | extra
    store = Store(stored, count)
    truth = store.first_missing()
    # Unordered: exact, whatever the store holds, and nothing probed past the answer's round.
    linear = Store(stored, count)
    assert run(linear, ordered=False, fanout=fanout) == truth
    # Ordered: never shorter than the truth, never counts a page it saw missing, exact on a
    # prefix; never probes a page twice, never outside the prompt.
    got = run(store, ordered=True, fanout=fanout, verify=verify)
    assert got >= truth
    assert all(p in stored for p in store.probed if p < got)
    assert len(store.probed) == len(set(store.probed))
    if stored == set(range(truth)):
        assert got == truth
    if got > truth:
        assert truth not in store.probed


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="count"):
        run(Store(set(), 0).__class__(set(), -1))
    with pytest.raises(ValueError, match="fanout"):
        run(Store(set(), 5), fanout=1)

    async def liar(pages: Sequence[int]) -> list[bool]:
        return [True]

    with pytest.raises(ValueError, match="answered 1 pages for"):
        asyncio.run(search_prefix(100, liar))


async def test_exists_prefix_pages_on_a_backend_probes_only_what_it_needs() -> None:
    store = open_backend("memory://")
    count, per_page = 2000, 4

    def keys(page: int) -> list[str]:
        return [f"{page:06x}_L{layer}-{layer}" for layer in range(per_page)]

    stored = 700
    await store.put([k for p in range(stored) for k in keys(p)], [b"x"] * stored * per_page)
    # Page 650 lost one of its four objects: not a whole page.
    await store.delete([keys(650)[2]])
    asked: list[int] = []

    def keys_of(page: int) -> list[str]:
        asked.append(page)
        return keys(page)

    got = await store.exists_prefix_pages(count, keys_of)
    assert got in (650, 700)  # 700 only if page 650 was never looked at
    assert len(asked) <= 60
    assert await store.exists_prefix_pages(count, keys, ordered=False) == 650
    assert await store.exists_prefix_pages(0, keys) == 0
    # Keys are validated like every other call's.
    with pytest.raises(Exception, match="key"):
        await store.exists_prefix_pages(3, lambda p: ["../etc/passwd"])
    await store.close()
