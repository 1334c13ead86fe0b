"""The cache tier: KV and every other cache component through L1, L2 and L3 under one page tree.

Engines use ``HiCache`` (``cache``) with its primitives ``match`` / ``prepare`` / ``complete``
(per request), ``poll`` / ``drain_events`` / ``flush`` / ``close``, configured by
``TierConfig`` (``config``); a model's other cache components plug in as ``Component`` pool
adapters (``components``); ranks agree through a ``RankGroup`` (``group``); the eviction order is
a policy of ``eviction``. The page tree (``radix``), the pools (``pools``) and the L2 <-> L3
transfers (``transfers``) are the tier's own machinery.
"""

from __future__ import annotations

from .cache import ComponentSlots, DevicePagePool, HiCache, Prepared, Request, TierCapacityError
from .components import (
    Component,
    ComponentMatch,
    ComponentSpec,
    HitRule,
    Placement,
    component_namespace,
    match_components,
)
from .config import TierConfig
from .group import LocalGroup, RankGroup
from .radix import Tier
from .transfers import BackupEvent

__all__ = [
    "BackupEvent",
    "Component",
    "ComponentMatch",
    "ComponentSlots",
    "ComponentSpec",
    "DevicePagePool",
    "HiCache",
    "HitRule",
    "LocalGroup",
    "Placement",
    "Prepared",
    "RankGroup",
    "Request",
    "Tier",
    "TierCapacityError",
    "TierConfig",
    "component_namespace",
    "match_components",
]
