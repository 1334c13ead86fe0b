"""``ops.distinct``: exact distinct counts, in memory and through the spill files."""

from __future__ import annotations

import random

import pytest

from hicache_store.ops.distinct import DistinctCounter


@pytest.mark.parametrize("buffer_values", [1 << 20, 3000])
def test_distinct_counts_are_exact_whatever_the_buffer(buffer_values: int) -> None:
    # Low-entropy hashes (shared leading characters) and repeats, in random order.
    values = [f"{i:064x}" for i in range(20_000)] + [f"{i:032x}" for i in range(5_000)]
    stream = values + random.Random(1).sample(values, 8_000)
    random.Random(2).shuffle(stream)
    counter = DistinctCounter(buffer_values=buffer_values)
    for value in stream:
        counter.add(value)
    spilled = counter._dir is not None
    assert spilled == (buffer_values < len(stream))
    directory = counter._dir
    assert counter.count() == 25_000
    assert directory is None or not directory.exists(), "count() removes the spill files"


def test_an_empty_counter_counts_zero() -> None:
    assert DistinctCounter().count() == 0
