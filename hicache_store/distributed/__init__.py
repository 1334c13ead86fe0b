"""Multi-rank deployments: ranks that agree on cache decisions, and KV shared across TP/PP sizes.

* ``TorchGroup`` (``group``): the tier's ``RankGroup`` over a ``torch.distributed`` (gloo)
  group: ``agree_min`` is one ``all_reduce(MIN)``; with ``HICACHE_STORE_CONSENSUS_CHECK=1`` every
  agreement also compares the ranks' logged decisions (``consensus``) and reports the first
  divergence (``RankDivergenceError``).
* The tier itself (``tier.HiCache`` with a group) gives the guarantees a group needs: every
  request reaches the same agreements on every rank, backup completions are applied in the
  order and number the first PP stage decides, ``flush`` ends together.
* ``cp``: context-parallel restore: each rank restores the pages it owns (``layout.cp``).

The harness that runs ranks as processes (``demo.launch.RankPool``) and one rank of a sharded
deployment of the mini engine (``demo.sharded.ShardedEngine``) live in ``hicache_store.demo``.
"""

from __future__ import annotations

from .consensus import ENV_VAR, Decision, RankDivergenceError, consensus_check_enabled
from .group import TorchGroup

__all__ = [
    "ENV_VAR",
    "Decision",
    "RankDivergenceError",
    "TorchGroup",
    "consensus_check_enabled",
]
