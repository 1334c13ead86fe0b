"""``layout.blocks``: pages of one size over blocks of another, held to a token-by-token oracle."""

from __future__ import annotations

import pytest

from hicache_store.layout.blocks import SKIP, BlockPages


@pytest.mark.parametrize(("page", "block"), [(24, 32), (32, 24), (0, 32), (32, 0), (48, 32)])
def test_a_page_that_neither_divides_nor_is_a_multiple_is_refused(page: int, block: int) -> None:
    with pytest.raises(ValueError, match="neither a multiple nor a divisor|positive"):
        BlockPages(page, block)


@pytest.mark.parametrize(("page", "block", "segment", "per_page", "per_block"), [
    (32, 32, 32, 1, 1), (64, 32, 32, 2, 1), (128, 32, 32, 4, 1), (16, 32, 16, 1, 2),
    (8, 32, 8, 1, 4),
])
def test_segments(page: int, block: int, segment: int, per_page: int, per_block: int) -> None:
    g = BlockPages(page, block)
    assert (g.segment, g.segments_per_page, g.segments_per_block) == (segment, per_page,
                                                                     per_block)


@pytest.mark.parametrize(("page", "block"), [(32, 32), (64, 32), (96, 32), (16, 32), (8, 32)])
def test_slots_name_each_token_where_the_block_table_puts_it(page: int, block: int) -> None:
    """Oracle: token ``t`` of the request is token ``t % block`` of block
    ``block_ids[t // block]``; a slot's segment must hold exactly those tokens."""
    g = BlockPages(page, block)
    block_ids = [7, 3, 11, 0, 5, 9, 2, 4]
    tokens = len(block_ids) * block
    pages = tokens // page
    for first in range(pages):
        for end in range(first, pages + 1):
            for held in (0, block, 2 * block, first * page + g.segment):
                slots = g.slots(first, end, block_ids, held)
                assert len(slots) == (end - first) * g.segments_per_page
                for k, slot in enumerate(slots):
                    t0 = (first * g.segments_per_page + k) * g.segment  # its first token
                    if t0 < held:
                        assert slot == SKIP
                        continue
                    for t in range(t0, t0 + g.segment):
                        where = (block_ids[t // block], t % block)
                        at = (g.block_of(slot),
                              (slot % g.segments_per_block) * g.segment + t - t0)
                        assert at == where
                assert g.slot_tokens(slots) == sum(g.segment for s in slots if s != SKIP)


def test_slots_past_the_block_table_are_refused() -> None:
    with pytest.raises(ValueError, match="reach past"):
        BlockPages(64, 32).slots(0, 2, [1, 2, 3])  # page 1 needs a fourth block
    assert BlockPages(16, 32).slots(0, 2, [5]) == [10, 11]  # two pages of one block


@pytest.mark.parametrize(("page", "block"), [(32, 32), (64, 32), (16, 32)])
def test_offers_are_whole_blocks_and_never_the_last_tokens_page(page: int, block: int) -> None:
    g = BlockPages(page, block)
    for num_tokens in range(1, 400):
        usable = g.usable_pages(num_tokens)
        # the last token (index num_tokens - 1) lies past the usable pages, in the next one
        assert usable * page <= num_tokens - 1 < (usable + 1) * page
        for pages in range(usable + 1):
            hit = g.hit_tokens(pages)
            assert hit % block == 0 and hit <= pages * page < hit + block
