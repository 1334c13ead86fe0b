"""Hybrid-model cache components (sliding-window KV, recurrent snapshots) through every tier.

* ``components``: ``ComponentSpec`` (name, component tag, hit rule), ``match_components`` (the
  longest prefix every needed component can resume, and what to restore from where).
* ``state_l3``: ``StateL3``, the L3 path for non-KV objects (namespaced and framed like KV).
* ``store``: ``ComponentStore``, a component's own L1/L2 pools plus its L3 objects, with the
  backup-only-what-is-missing rule for snapshots taken on an existing prefix.
* ``model``: ``HybridMiniLlama``, the mini engine (full-attention and sliding-window layers) plus
  a recurrent layer (resumable from a snapshot, bit-exact); ``WindowComponent``, the
  sliding-window KV component (one object per page, needed only inside the window).
* ``draft``: a speculative-decoding draft model's KV beside the target's, packed (draft layers
  inside the target's page objects, ``PackedDraftCache``) or sidecar (its own component and
  pools following the target's pages, ``SidecarDraftCache``), seed 000 §3.
* ``cache``: ``HybridCache``, the KV tier (``HiCache``) plus a window-page store and a
  recurrent-checkpoint store: the prefix is the longest KV prefix at which every component loads;
  snapshots and window pages are backed up on their own.
"""

from __future__ import annotations

from .cache import (
    RECURRENT,
    HybridCache,
    HybridMetrics,
    HybridPrepared,
    HybridRequest,
    run_request,
)
from .components import (
    ComponentSpec,
    HitRule,
    HybridMatch,
    Location,
    match_components,
    validate_components,
)
from .draft import (
    TARGET,
    DraftPrepared,
    DraftRequest,
    PackedDraftCache,
    SidecarDraftCache,
    check_packable,
    draft_config,
    draft_spec,
    layer_view,
    packed_namespace,
)
from .model import WINDOW_COMPONENT, HybridMiniLlama, WindowComponent
from .state_l3 import StateIO, StateL3
from .store import ComponentStore, StoreFullError, StoreMetrics

__all__ = [
    "RECURRENT",
    "WINDOW_COMPONENT",
    "WindowComponent",
    "TARGET",
    "DraftPrepared",
    "DraftRequest",
    "PackedDraftCache",
    "SidecarDraftCache",
    "check_packable",
    "draft_config",
    "draft_spec",
    "layer_view",
    "packed_namespace",
    "HybridCache",
    "HybridMetrics",
    "HybridMiniLlama",
    "HybridPrepared",
    "HybridRequest",
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
    "run_request",
    "validate_components",
]
