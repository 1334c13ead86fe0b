"""Tier metrics: counters as a dict and in Prometheus text format."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TierMetrics:
    """Counters of one tier instance. ``to_dict`` and ``to_prometheus`` export them.

    Token counts: ``requests``, ``input_tokens``, and the prefix tokens served from each tier
    (``hit_tokens_l1/l2/l3``); ``computed_tokens`` were recomputed. Bytes per link and
    direction: ``bytes_l1_to_l2`` (backup), ``bytes_l2_to_l1`` (load), ``bytes_l2_to_l3``
    (backup), ``bytes_l3_to_l2`` (prefetch). Prefetch outcomes: ``prefetch_complete``,
    ``prefetch_partial``, ``prefetch_timed_out``, ``prefetch_failed_pages``.
    ``backups_dropped``: KV pages whose backup was not attempted: L2 could not take them
    (L1 -> L2), or the L3 backup queue was full (L2 -> L3; a later use of the page backs it up).
    ``corruptions``: objects that failed verification (served as misses).
    ``tampered``: objects of a sealed namespace that failed authentication (served as misses).
    ``host_pages_quarantined``: host rows whose prefetch was abandoned while their read was
    still in flight, held back from reuse until it ended (``HiCache.quarantined_host_pages``).
    ``extra``: per-component counters (``component_hit_tokens_<name>``: prompt tokens that
    component alone could have resumed after; ``limited_by_<name>``: requests it shortened;
    ``limited_by_prefetch`` / ``limited_by_ranks``: requests that resumed before what every
    component allowed, for want of a transfer / because another rank could resume less
    (``tier.cache.LIMITED_BY_PREFETCH``); ``backups_dropped_<name>``: objects not backed up;
    ``restored_l2_<name>``, ``restored_l3_<name>``, ``produced_<name>``, ``backups_l2_<name>``,
    ``backups_l3_<name>``, ``fetch_failed_<name>``, ``evictions_l1_<name>`` ...).
    """

    requests: int = 0
    input_tokens: int = 0
    hit_tokens_l1: int = 0
    hit_tokens_l2: int = 0
    hit_tokens_l3: int = 0
    computed_tokens: int = 0
    bytes_l1_to_l2: int = 0
    bytes_l2_to_l1: int = 0
    bytes_l2_to_l3: int = 0
    bytes_l3_to_l2: int = 0
    l3_fetched_bytes: int = 0
    l3_needed_bytes: int = 0
    prefetch_started: int = 0
    prefetch_complete: int = 0
    prefetch_partial: int = 0
    prefetch_timed_out: int = 0
    prefetch_failed_pages: int = 0
    backups_l2: int = 0
    backups_l3: int = 0
    backups_l3_failed: int = 0
    backups_dropped: int = 0
    corruptions: int = 0
    tampered: int = 0
    evictions_l1: int = 0
    evictions_l2: int = 0
    host_pages_quarantined: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def read_amplification(self) -> float:
        """L3 bytes fetched over bytes needed (1.0 when no layer or head subsets were read)."""
        return self.l3_fetched_bytes / self.l3_needed_bytes if self.l3_needed_bytes else 1.0

    @property
    def token_hit_rate(self) -> float:
        hits = self.hit_tokens_l1 + self.hit_tokens_l2 + self.hit_tokens_l3
        return hits / self.input_tokens if self.input_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        extra = data.pop("extra")
        data.update(extra)
        data["read_amplification"] = self.read_amplification
        data["token_hit_rate"] = self.token_hit_rate
        return data

    def to_prometheus(self, prefix: str = "hicache_store") -> str:
        """The counters in Prometheus text exposition format (via ``prometheus-client``)."""
        from prometheus_client import CollectorRegistry, Gauge, generate_latest

        registry = CollectorRegistry()
        for name, value in self.to_dict().items():
            gauge = Gauge(f"{prefix}_{name}", name.replace("_", " "), registry=registry)
            gauge.set(float(value))
        text: bytes = generate_latest(registry)
        return text.decode()
