"""CP page ownership (seed 000, section 1.1), including the seed's worked example."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_store.layout.cp import (
    allocate_logical_page,
    chain_owners,
    check_rotation,
    logical_slot,
    page_owner,
    slot_owner,
)


def test_formula() -> None:
    # p = 4, N = 2: slot 13 is page 3 -> rank 1, local page 1, row 4 + 1.
    assert slot_owner(13, 4, 2) == (1, 5)
    assert slot_owner(0, 4, 2) == (0, 0)


@given(st.integers(0, 10**6), st.integers(1, 128), st.integers(1, 16))
def test_logical_slot_inverts_slot_owner(slot: int, page: int, ranks: int) -> None:
    rank, row = slot_owner(slot, page, ranks)
    assert 0 <= rank < ranks
    assert logical_slot(rank, row, page, ranks) == slot


def test_seed_example() -> None:
    # A, B, C cached at logical pages 2, 3, 4 with two ranks; D extends A/B/C.
    chain = [2, 3, 4]
    check_rotation(chain, 2)
    assert [page_owner(q, 2) for q in chain] == [0, 1, 0]
    (owner,) = chain_owners(3, 1, 2)
    assert owner == 1
    d = allocate_logical_page(owner, [6, 5, 7], 2)
    assert d == 5
    assert slot_owner(d * 16, 16, 2) == (1, 2 * 16)  # local page 2 on rank 1
    check_rotation([*chain, d], 2)


def test_rotation_breaking_insert_is_refused() -> None:
    with pytest.raises(ValueError, match="rotation needs rank 1"):
        check_rotation([2, 4], 2)
    with pytest.raises(ValueError, match="no free logical page"):
        allocate_logical_page(1, [0, 2, 4], 2)
