"""The SGLang adapter's numbers: SGLang's ``StorageMetrics`` and the adapter's own counters.

SGLang (``--enable-metrics``) calls ``get_stats()`` on the scheduler thread every step and
passes the result to ``StorageMetricsCollector.log_storage_metrics``, which asserts that it is
a ``sglang.srt.observability.metrics_collector.StorageMetrics``: pages per call and GB/s per
call of prefetches (reads) and backups (writes), drained on each call as SGLang's own backends
do. ``AdapterMetrics.drain`` returns exactly that class (a field-for-field stand-in when SGLang's
metrics module cannot be imported, in which case SGLang cannot log it either).

The adapter's own counters (pages stored and read, failures, refusals, corrupt objects, ...)
are cumulative and never drained: ``AdapterMetrics.counters()`` (the adapter's ``counters``
property), and, when SGLang runs with metrics enabled and ``prometheus_client`` is installed,
the Prometheus counter ``hicache_store_sglang_events_total{event, tp_rank, pp_rank}`` in the
scheduler process's registry, which SGLang's ``/metrics`` endpoint serves. Its lookups
(``batch_exists``: pages asked of the store, pages found) are counted as every integration
counts them (``_lookups``: ``lookup_pages_asked_l3`` / ``lookup_pages_found_l3`` in
``counters()``, ``hicache_store_lookup_pages_{asked,found}_total{integration="sglang"}``).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

from hicache_store.integrations._lookups import LookupCounters

#: the Prometheus counter of the adapter's events.
PROMETHEUS_COUNTER = "hicache_store_sglang_events"


@dataclass
class FallbackStorageMetrics:
    """SGLang's ``StorageMetrics`` fields, for processes where its class does not import."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


_FOUND: list[type[Any]] = []


def storage_metrics_class() -> type[Any]:
    """SGLang's ``StorageMetrics`` when importable, else ``FallbackStorageMetrics``.

    Only success is remembered: where SGLang's metrics module does not import, SGLang does
    not log storage metrics either, and a later successful import must win.
    """
    if _FOUND:
        return _FOUND[0]
    try:
        from sglang.srt.observability.metrics_collector import (  # type: ignore[import-untyped]
            StorageMetrics,
        )
    except Exception:  # SGLang absent, or its metrics module does not import here
        return FallbackStorageMetrics
    _FOUND.append(StorageMetrics)
    return _FOUND[0]


@functools.lru_cache(maxsize=1)
def _prometheus_counter() -> Any:
    """One process-wide labelled counter (a second registration of a name would raise)."""
    try:
        from prometheus_client import Counter
    except ImportError:
        return None
    try:
        return Counter(
            PROMETHEUS_COUNTER,
            "hicache-store SGLang adapter events (pages stored/read, failures, refusals)",
            ["event", "tp_rank", "pp_rank"],
        )
    except ValueError:  # registered by another copy of this module: export nothing
        return None


class AdapterMetrics:
    """Thread-safe counters plus SGLang's per-call page and bandwidth lists."""

    def __init__(self, *, prometheus_labels: dict[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {}
        self._pages: dict[str, list[int]] = {"get": [], "set": []}
        self._bandwidth: dict[str, list[float]] = {"get": [], "set": []}
        self._prometheus = _prometheus_counter() if prometheus_labels is not None else None
        self._labels = prometheus_labels or {}
        self._lookups = LookupCounters("sglang", labels=prometheus_labels)

    def count(self, name: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n
        if self._prometheus is not None:
            self._prometheus.labels(event=name, **self._labels).inc(n)

    def lookup(self, asked: int, found: int) -> None:
        """One ``batch_exists``: ``asked`` pages asked of the store, the first ``found`` held."""
        self._lookups.count("l3", asked, found)

    def record(self, op: str, results: list[bool], page_bytes: int, seconds: float) -> None:
        """One batch call of ``op`` ("get" = prefetch, "set" = backup): its pages and GB/s."""
        ok = sum(results)
        self.count(f"{op}_pages", ok)
        self.count(f"{op}_failed", len(results) - ok)
        with self._lock:
            self._pages[op].append(ok)
            self._bandwidth[op].append(ok * page_bytes / max(seconds, 1e-9) / 1e9)

    def drain(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the last drain."""
        with self._lock:
            pages, self._pages = self._pages, {"get": [], "set": []}
            bandwidth, self._bandwidth = self._bandwidth, {"get": [], "set": []}
        return storage_metrics_class()(
            prefetch_pgs=pages["get"],
            backup_pgs=pages["set"],
            prefetch_bandwidth=bandwidth["get"],
            backup_bandwidth=bandwidth["set"],
        )

    def counters(self) -> dict[str, int]:
        with self._lock:
            counters = dict(self._counters)
        return counters | self._lookups.counters()
