"""Hybrid-model cache components (sliding-window KV, recurrent snapshots) through every tier.

* ``components``: ``ComponentSpec`` (name, component tag, hit rule), ``match_components`` (the
  longest prefix every needed component can resume, and what to restore from where).
* ``state_l3``: ``StateL3``, the L3 path for non-KV objects (namespaced and framed like KV).
* ``store``: ``ComponentStore``, a component's own L1/L2 pools plus its L3 objects, with the
  backup-only-what-is-missing rule for snapshots taken on an existing prefix.
"""

from __future__ import annotations

from .components import (
    ComponentSpec,
    HitRule,
    HybridMatch,
    Location,
    match_components,
    validate_components,
)
from .state_l3 import StateIO, StateL3
from .store import ComponentStore, StoreFullError, StoreMetrics

__all__ = [
    "ComponentSpec",
    "ComponentStore",
    "HitRule",
    "HybridMatch",
    "Location",
    "StateIO",
    "StateL3",
    "StoreFullError",
    "StoreMetrics",
    "match_components",
    "validate_components",
]
