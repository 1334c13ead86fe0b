"""Agreement between the ranks of one deployment.

Every rank runs its own tier over its shard; cache decisions that change what the engine
computes (how many prefix pages hit, how many prefetched pages are used) must be equal on all
ranks, or tensors disagree in shape and collectives hang. The tier therefore passes each such
number through ``RankGroup.agree_min`` at the same logical point on every rank. A single-process
deployment uses ``LocalGroup``, for which agreement is the identity.
"""

from __future__ import annotations

from typing import Protocol


class RankGroup(Protocol):
    """The collective operations the tier needs. Every rank must call them in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def agree_min(self, value: int, what: str) -> int:
        """The minimum of ``value`` over all ranks. ``what`` names the decision (for the
        consensus checker, which records every call in order)."""
        ...


class LocalGroup:
    """A group of one rank: every agreement returns the value unchanged."""

    rank = 0
    size = 1

    def agree_min(self, value: int, what: str) -> int:
        del what
        return value
