"""Context-parallel page ownership.

With ``N`` shard ranks and pages of ``p`` tokens, logical token slot ``x`` lives on rank
``r = floor(x / p) mod N`` at local row ``l = floor(floor(x / p) / N) * p + x mod p``. The
logical page id ``q = floor(x / p)`` alone decides the owner, so no lookup table exists.

Every rank keeps the same logical radix tree. The page at position ``i`` of a cached chain is
owned by rank ``i mod N``; extending a prefix continues that rotation, and a restore from L2/L3
puts each page back on its owner, so backup and restore keep ownership.
"""

from __future__ import annotations

from collections.abc import Iterable


def _check(page_size: int, num_ranks: int) -> None:
    if page_size < 1 or num_ranks < 1:
        raise ValueError(f"page_size ({page_size}) and num_ranks ({num_ranks}) must be positive")


def slot_owner(slot: int, page_size: int, num_ranks: int) -> tuple[int, int]:
    """``(owner rank, local row)`` of logical token slot ``slot``."""
    _check(page_size, num_ranks)
    if slot < 0:
        raise ValueError(f"slot {slot} is negative")
    page, offset = divmod(slot, page_size)
    return page % num_ranks, (page // num_ranks) * page_size + offset


def logical_slot(rank: int, local_row: int, page_size: int, num_ranks: int) -> int:
    """Inverse of ``slot_owner``: the logical slot stored at ``local_row`` of ``rank``."""
    _check(page_size, num_ranks)
    if not 0 <= rank < num_ranks or local_row < 0:
        raise ValueError(f"rank {rank} / local row {local_row} out of range")
    local_page, offset = divmod(local_row, page_size)
    return (local_page * num_ranks + rank) * page_size + offset


def page_owner(logical_page: int, num_ranks: int) -> int:
    """Owner rank of logical page ``q``."""
    _check(1, num_ranks)
    return logical_page % num_ranks


def chain_owners(start_position: int, count: int, num_ranks: int) -> list[int]:
    """Owners of ``count`` pages appended at ``start_position`` of a chain: the rotation goes on."""
    _check(1, num_ranks)
    return [(start_position + i) % num_ranks for i in range(count)]


def allocate_logical_page(owner: int, free_pages: Iterable[int], num_ranks: int) -> int:
    """The first free logical page id owned by ``owner`` (raises if none is free)."""
    _check(1, num_ranks)
    for page in free_pages:
        if page % num_ranks == owner:
            return page
    raise ValueError(f"no free logical page for rank {owner}")


def check_rotation(logical_pages: Iterable[int], num_ranks: int, start_position: int = 0) -> None:
    """Raise unless the chain's pages follow the owner rotation from ``start_position``.

    Inserting a branch whose pages would break the rotation is refused: every rank must agree
    on which rank holds each page of a cached prefix.
    """
    for position, page in enumerate(logical_pages, start_position):
        if page % num_ranks != position % num_ranks:
            raise ValueError(
                f"page {page} at chain position {position} is owned by rank "
                f"{page % num_ranks}, the rotation needs rank {position % num_ranks}"
            )
