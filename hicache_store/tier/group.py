"""Agreement between the ranks of one deployment.

Every rank runs its own tier over its shard; cache decisions that change what the engine
computes (how many prefix pages hit, how many prefetched pages are used) must be equal on all
ranks, or tensors disagree in shape and collectives hang. The tier therefore passes each such
number through ``RankGroup.agree_min`` at the same logical point on every rank, and every
request reaches the same agreements on every rank. A single-process deployment
uses ``LocalGroup``, for which agreement is the identity. ``distributed.TorchGroup`` is the
group over ``torch.distributed`` (gloo).

A group may also offer ``set_context(**args)`` (arguments logged with the decisions that follow)
and ``note(value, what)`` (a rank-local decision that must be equal on every rank): the
consensus checker uses them; the tier calls them through ``context`` and ``note`` here.
"""

from __future__ import annotations

from typing import Any, Protocol

from hicache_store.layout.errors import GridMismatchError
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.plans import plan_writes
from hicache_store.layout.topology import Topology

#: the vote of a rank that does not decide how many completions to consume.
NO_VOTE = 1 << 62


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


class CacheEventDivergenceError(RuntimeError):
    """A rank cannot apply the completions the deciding stage agreed on (its queue differs)."""


def context(group: RankGroup, **args: Any) -> None:
    """Set the arguments logged with the group's next decisions (if it logs any)."""
    setter = getattr(group, "set_context", None)
    if setter is not None:
        setter(**args)


def note(group: RankGroup, value: Any, what: str) -> None:
    """Log a rank-local decision that must be equal on every rank (if the group checks)."""
    noter = getattr(group, "note", None)
    if noter is not None:
        noter(value, what)


def writes_l3(namespace: Namespace, topology: Topology, rank: int) -> bool:
    """Whether ``rank`` writes any KV object (one writer per shard; none for a misaligned one)."""
    try:
        return bool(plan_writes(namespace, topology, rank).objects)
    except GridMismatchError:
        return False


def ack_deciders(namespace: Namespace, topology: Topology) -> frozenset[int]:
    """Ranks whose ready counts decide how many KV backup completions everyone applies: the
    writing ranks of the first PP stage (all writing ranks if that stage has none)."""
    writers = [r for r in range(topology.world_size) if writes_l3(namespace, topology, r)]
    first = [r for r in writers if topology.coords_of(r)[1] == 0]
    return frozenset(first or writers)
