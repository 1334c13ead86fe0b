"""Pages of one size over an engine's blocks of another: the one place their arithmetic lives.

An engine allocates KV in *blocks* of ``block_size`` tokens (vLLM); hicache-store names and
stores *pages* of ``page_size`` tokens (the namespace's page size, hashed by
``hashing.page_hashes``). One must divide the other. A *segment* is the run of tokens that lies
in one page and one block: ``min(page_size, block_size)`` tokens, so a page is
``segments_per_page`` consecutive segments and a block ``segments_per_block`` (one of the two is
1). The engine's cache, seen in segments, has *segment slots*: slot ``s`` is tokens
``[(s % segments_per_block) * segment, ... + segment)`` of block ``s // segments_per_block``.

| page vs block | segment | a page is | a block is |
|---|---|---|---|
| equal | the block | one block | one page |
| ``k`` blocks | the block | ``k`` blocks, in token order | a ``k``-th of a page |
| a ``k``-th of a block | the page | part ``j`` of one block | ``k`` pages |

Token counts the engine accepts as computed are whole blocks (``block_floor``); a page is
offered only when all of its tokens are, and never the page holding a prompt's last token
(``usable_pages``: the engine computes that token itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: a segment slot that is not to be written (a segment the engine holds already)
SKIP = -1


@dataclass(frozen=True)
class BlockPages:
    """Pages of ``page_size`` tokens over blocks of ``block_size`` tokens (see the module
    docstring). Raises ``ValueError`` unless one of the two divides the other."""

    page_size: int
    block_size: int

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.block_size < 1:
            raise ValueError(f"page size {self.page_size} and block size {self.block_size} "
                             "must be positive")
        if self.page_size % self.block_size and self.block_size % self.page_size:
            raise ValueError(f"page size {self.page_size} is neither a multiple nor a divisor "
                             f"of the block size {self.block_size}")

    @property
    def segment(self) -> int:
        """Tokens of one segment: ``min(page_size, block_size)``."""
        return min(self.page_size, self.block_size)

    @property
    def segments_per_page(self) -> int:
        return self.page_size // self.segment

    @property
    def segments_per_block(self) -> int:
        return self.block_size // self.segment

    def usable_pages(self, num_tokens: int) -> int:
        """Leading whole pages of a prompt of ``num_tokens`` tokens, the page holding its last
        token excluded."""
        return max(0, num_tokens - 1) // self.page_size

    def block_floor(self, tokens: int) -> int:
        """``tokens`` rounded down to whole blocks."""
        return tokens // self.block_size * self.block_size

    def hit_tokens(self, pages: int) -> int:
        """The tokens the engine can take from ``pages`` leading pages: whole blocks only."""
        return self.block_floor(pages * self.page_size)

    def pages_of(self, tokens: int) -> int:
        """Leading whole pages within ``tokens`` tokens."""
        return tokens // self.page_size

    def slots(self, first_page: int, end_page: int, block_ids: Sequence[int],
              held_tokens: int = 0) -> list[int]:
        """Segment slots of pages ``[first_page, end_page)`` of a request whose block table is
        ``block_ids`` (``segments_per_page`` per page, in order); a segment before token
        ``held_tokens`` (the engine holds it already) is ``SKIP``. Raises ``ValueError`` when
        the block table does not reach the last page."""
        seg, per_block = self.segment, self.segments_per_block
        first, end = first_page * self.segments_per_page, end_page * self.segments_per_page
        if end > first and (end * seg - 1) // self.block_size >= len(block_ids):
            raise ValueError(f"pages [{first_page}, {end_page}) reach past the request's "
                             f"{len(block_ids)} blocks of {self.block_size} tokens")
        return [SKIP if s * seg < held_tokens
                else block_ids[s // per_block] * per_block + s % per_block
                for s in range(first, end)]

    def block_of(self, slot: int) -> int:
        """The block a segment slot lies in."""
        return slot // self.segments_per_block

    def slot_tokens(self, slots: Sequence[int]) -> int:
        """Tokens of the slots that are not ``SKIP``."""
        return sum(self.segment for s in slots if s != SKIP)
