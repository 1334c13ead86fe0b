"""What an engine integration counts of its lookups: pages asked of each tier, pages found.

The names are the tier's (``tier.metrics.LOOKUP_COUNTERS``): ``counters()`` by flat name
(``lookup_pages_asked_l3``, ``lookup_pages_found_l3``), and, where ``prometheus_client`` is
installed and the integration exports metrics, the process-wide Prometheus counters
``hicache_store_lookup_pages_asked_total`` / ``hicache_store_lookup_pages_found_total``
labelled ``integration`` (``sglang``, ``sglang_linker``, ``vllm``, ``vllm_secondary_tier``),
``tier``, ``tp_rank`` and ``pp_rank`` (empty where the caller serves every rank). The engine's
``/metrics`` endpoint serves its process's registry (SGLang with ``--enable-metrics``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from hicache_store.tier.metrics import LOOKUP_COUNTERS, lookup_counts

#: the labels of the Prometheus counters, the same for every integration.
PROMETHEUS_LABELS = ("integration", "tier", "tp_rank", "pp_rank")


@functools.lru_cache(maxsize=1)
def _prometheus_counters() -> dict[str, Any] | None:
    """One labelled counter per name for the process (a second registration would raise)."""
    try:
        from prometheus_client import Counter
    except ImportError:
        return None
    try:
        return {
            counter: Counter(f"hicache_store_{counter}",
                             f"hicache-store lookups: {counter.replace('_', ' ')} per tier",
                             list(PROMETHEUS_LABELS))
            for counter in LOOKUP_COUNTERS
        }
    except ValueError:  # registered by another copy of this module: export nothing
        return None


class LookupCounters:
    """Thread-safe lookup counters of one integration instance (see the module docstring).

    ``labels``: ``tp_rank`` and ``pp_rank`` for Prometheus; None: not exported."""

    def __init__(self, integration: str, *, labels: dict[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._prometheus = _prometheus_counters() if labels is not None else None
        self._labels = {"integration": integration, "tp_rank": "", "pp_rank": "",
                        **(labels or {})}

    def count(self, tier: str, asked: int, found: int) -> dict[str, int]:
        """One lookup that asked ``tier`` for ``asked`` pages and found ``found`` of them;
        returns its counts by flat name (for a caller that keeps its own counters too)."""
        counts = lookup_counts(tier, asked, found)
        with self._lock:
            for name, n in counts.items():
                self._counts[name] = self._counts.get(name, 0) + n
        if self._prometheus is not None:
            for counter, n in zip(LOOKUP_COUNTERS, counts.values(), strict=True):
                if n:
                    self._prometheus[counter].labels(tier=tier, **self._labels).inc(n)
        return counts

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
