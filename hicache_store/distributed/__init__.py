"""Multi-rank deployments: ranks that agree on cache decisions, and KV shared across TP/PP sizes.

* ``TorchGroup`` (``group``): the tier's ``RankGroup`` over a ``torch.distributed`` (gloo)
  group: ``agree_min`` is one ``all_reduce(MIN)``; with ``HICACHE_STORE_CONSENSUS_CHECK=1`` every
  agreement also compares the ranks' logged decisions (``consensus``) and reports the first
  divergence (``RankDivergenceError``).
* ``RankedHiCache`` (``tier``): ``HiCache`` plus the guarantees a group needs: every request
  reaches the same agreements on every rank, backup completions are applied in the order and
  number the first PP stage decides (seed 000 §2.1-2.2), ``flush`` ends together.
* ``ShardedEngine`` (``engine``): one rank of a TP x PP deployment of the mini engine. KV
  sharding, per-rank tiers, L3 objects and agreement are real; the TP/PP compute split is
  simulated (every rank computes the full forward over an all-gathered prefix).
* ``cp`` : context-parallel restore: each rank restores the pages it owns (``layout.cp``).
* ``RankPool`` (``launch``): rank processes on loopback, reused across tasks (tests, tools).
"""

from __future__ import annotations

from .consensus import ENV_VAR, Decision, RankDivergenceError, consensus_check_enabled
from .engine import Served, ShardedEngine
from .group import TorchGroup
from .launch import RankContext, RankPool, RankTaskError
from .tier import CacheEventDivergenceError, RankedHiCache, ack_deciders, writes_l3

__all__ = [
    "ENV_VAR",
    "CacheEventDivergenceError",
    "Decision",
    "RankContext",
    "RankDivergenceError",
    "RankPool",
    "RankTaskError",
    "RankedHiCache",
    "Served",
    "ShardedEngine",
    "TorchGroup",
    "ack_deciders",
    "consensus_check_enabled",
    "writes_l3",
]
