"""``TorchGroup``: the tier's ``RankGroup`` over a ``torch.distributed`` process group.

Every number that changes what the engine computes passes through ``agree_min`` at the same
logical point on every rank (``hicache_store.tier.group``). Here that is one ``all_reduce(MIN)``
of an int64 over the group (gloo on CPU, NCCL-free: the tensor stays on the CPU even where GPUs
exist, the value is a few bytes). Collectives on one process group run in call order, so the
agreements are deterministic; what the tier must guarantee (and ``HiCache`` does) is that
every rank reaches the same agreements in the same order, for every request.

With the consensus check on (``HICACHE_STORE_CONSENSUS_CHECK=1``, see ``consensus``), every
agreement instead gathers each rank's log entries since the previous agreement with
``all_gather_object``, raises ``RankDivergenceError`` on every rank if they differ, and
otherwise takes the minimum of the gathered local values (so the agreed value is the same as
without the check).

``context(**args)`` sets the arguments logged with the decisions that follow (the request
number, its token count and a digest of its tokens); ``note(what, value)`` logs a rank-local
decision that must be equal on every rank (checked at the next agreement, free otherwise).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .consensus import Args, ConsensusLog, consensus_check_enabled, first_divergence

#: Default limit for one collective: far above any normal wait, so a real hang ends as an error.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)


class TorchGroup:
    """A ``RankGroup`` (``rank``, ``size``, ``agree_min``) over a torch.distributed group.

    ``process_group``: the group (None: the default, i.e. the whole world). ``consensus``:
    force the consensus check on or off (None: read ``HICACHE_STORE_CONSENSUS_CHECK``).
    Ranks are the group's ranks, which ``ShardedEngine`` uses as topology ranks.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        consensus: bool | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group")
        self.process_group = process_group
        self._rank = dist.get_rank(process_group)
        self._size = dist.get_world_size(process_group)
        self.consensus = consensus_check_enabled() if consensus is None else consensus
        self.log = ConsensusLog()
        self._context: Args = ()
        self.agreements = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # -- decision context ---------------------------------------------------------------------

    def set_context(self, **args: Any) -> None:
        """Arguments logged with the following decisions (until the next ``set_context``)."""
        self._context = tuple(sorted(args.items()))

    @contextlib.contextmanager
    def context(self, **args: Any) -> Iterator[None]:
        saved = self._context
        self.set_context(**args)
        try:
            yield
        finally:
            self._context = saved

    def note(self, value: Any, what: str) -> None:
        """Log a local decision that must be equal on every rank (consensus mode only)."""
        if self.consensus:
            self.log.add(what, self._context, value, agreement=False)

    # -- collectives ----------------------------------------------------------------------------

    def agree_min(self, value: int, what: str) -> int:
        """The minimum of ``value`` over the group's ranks (every rank must call this)."""
        self.agreements += 1
        if self.consensus:
            self.log.add(what, self._context, int(value), agreement=True)
            gathered = self.all_gather_object(self.log.take_pending())
            error = first_divergence(gathered)
            if error is not None:
                raise error
            return min(int(entries[-1].local) for entries in gathered)
        tensor = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.process_group)
        return int(tensor.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self.process_group)
        return out

    def all_gather_bytes(self, data: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Gather one flat ``uint8`` tensor per rank, rank ``r``'s of ``sizes[r]`` bytes.

        Every rank knows every size (from the topology), so the tensors are padded to the
        largest and gathered in one collective, then trimmed.
        """
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != sizes[self._rank]:
            raise ValueError(
                f"rank {self._rank}: expected {sizes[self._rank]} bytes as a flat uint8 tensor"
            )
        width = max(sizes)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.empty(width, dtype=torch.uint8) for _ in range(self._size)]
        dist.all_gather(out, padded, group=self.process_group)
        return [t[:n] for t, n in zip(out, sizes, strict=True)]

    def barrier(self) -> None:
        dist.barrier(group=self.process_group)
