"""Tier metrics: counters as a dict and in Prometheus text format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: What the tier counts for every component, the KV's included (``TierMetrics.count``):
#: copies made L1 -> L2 (``backups_l2``) and L2 -> L3 (``backups_l3``, ``backups_l3_failed``),
#: objects whose backup was not attempted (``backups_dropped``: L2 could not take them, or the
#: L3 backup queue was full; a later use backs them up), copies given up (``evictions_l1`` /
#: ``evictions_l2``), objects restored from L2 / L3 (``restored_l2`` / ``restored_l3``), new
#: objects kept (``produced``) or dropped for want of a slot (``produce_dropped``), reads
#: of L3 objects that failed (``fetch_failed``), and bytes copied L1 -> L2 (``bytes_l1_to_l2``).
COMPONENT_COUNTERS = (
    "backups_l2",
    "backups_l3",
    "backups_l3_failed",
    "backups_dropped",
    "evictions_l1",
    "evictions_l2",
    "bytes_l1_to_l2",
    "restored_l2",
    "restored_l3",
    "produced",
    "produce_dropped",
    "fetch_failed",
)
#: The tiers a lookup asks, top down: the engine's device pool, host memory, the store.
LOOKUP_TIERS = ("l1", "l2", "l3")
#: What every integration counts of its lookups, per tier: the pages a lookup asked the tier
#: for (those past what the tiers above it held) and the leading pages of those the tier held.
#: Flat names ``<counter>_<tier>`` (``lookup_pages_asked_l3``); in Prometheus the counters
#: ``hicache_store_<counter>_total`` labelled ``tier``. A tier's hit rate: found over asked.
LOOKUP_COUNTERS = ("lookup_pages_asked", "lookup_pages_found")


def lookup_counts(tier: str, asked: int, found: int) -> dict[str, int]:
    """One lookup's counters by flat name; raises ``ValueError`` on an unknown tier or a
    count that is not ``0 <= found <= asked``."""
    if tier not in LOOKUP_TIERS:
        raise ValueError(f"tier must be one of {LOOKUP_TIERS}, got {tier!r}")
    if not 0 <= found <= asked:
        raise ValueError(f"a lookup finds 0..{asked} of the {asked} pages asked, not {found}")
    asked_name, found_name = (f"{counter}_{tier}" for counter in LOOKUP_COUNTERS)
    return {asked_name: asked, found_name: found}


#: the counters the KV's read under their plain names (the KV's own fields once).
_PLAIN_COUNTERS = COMPONENT_COUNTERS[:7]
#: the component whose counters keep their plain names (``backups_l2``, not ``backups_l2_kv``)
#: in ``to_dict`` and as attributes; Prometheus labels it like every other.
_PLAIN = "kv"


class _PlainCounter:
    """A KV counter read as an attribute of ``TierMetrics`` under its plain name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, metrics: TierMetrics, owner: type | None = None) -> int:
        return metrics._plain(self.name)


@dataclass
class TierMetrics:
    """Counters of one tier instance. ``to_dict`` and ``to_prometheus`` export them.

    Token counts: ``requests``, ``input_tokens``, and the prefix tokens served from each tier
    (``hit_tokens_l1/l2/l3``); ``computed_tokens`` were recomputed. Bytes per link and
    direction: ``bytes_l1_to_l2`` (backup), ``bytes_l2_to_l1`` (load), ``bytes_l2_to_l3``
    (backup), ``bytes_l3_to_l2`` (prefetch). Prefetch outcomes: ``prefetch_complete``,
    ``prefetch_partial``, ``prefetch_timed_out``, ``prefetch_failed_pages``.
    ``corruptions``: objects that failed verification (served as misses).
    ``tampered``: objects of a sealed namespace that failed authentication (served as misses).
    ``host_pages_quarantined``: host rows whose prefetch was abandoned while their read was
    still in flight, held back from reuse until it ended (``HiCache.quarantined_host_pages``).
    ``lookups``: pages each ``match`` asked of each tier and found there (``LOOKUP_COUNTERS``,
    ``count_lookup``), in ``to_dict`` under their flat names.

    ``by_component[name][counter]``: the counters of ``COMPONENT_COUNTERS``, one schema for
    every component (``count``). The KV's read as attributes under their plain names
    (``backups_l2``, ``evictions_l1`` ...), every other component's in ``extra`` with its name
    as suffix (``backups_l2_window``); Prometheus labels them all the same way
    (``hicache_store_backups_l2{component="kv"}``).
    ``extra``: those, and the tier's other named counters (``others``):
    ``component_hit_tokens_<name>``: prompt tokens that component alone could have resumed
    after; ``limited_by_<name>``: requests it shortened; ``limited_by_prefetch`` /
    ``limited_by_ranks``: requests that resumed before what every component allowed, for want
    of a transfer / because another rank could resume less (``tier.prefix.LIMITED_BY_PREFETCH``).
    """

    requests: int = 0
    input_tokens: int = 0
    hit_tokens_l1: int = 0
    hit_tokens_l2: int = 0
    hit_tokens_l3: int = 0
    computed_tokens: int = 0
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
    corruptions: int = 0
    tampered: int = 0
    host_pages_quarantined: int = 0
    by_component: dict[str, dict[str, int]] = field(default_factory=dict)
    others: dict[str, float] = field(default_factory=dict)
    lookups: dict[str, int] = field(default_factory=dict)

    def count_lookup(self, tier: str, asked: int, found: int) -> None:
        """Add one lookup of ``asked`` pages of ``tier`` that found ``found`` of them."""
        for name, n in lookup_counts(tier, asked, found).items():
            self.lookups[name] = self.lookups.get(name, 0) + n

    def count(self, component: str, counter: str, n: int = 1) -> None:
        """Add ``n`` to ``component``'s ``counter`` (one of ``COMPONENT_COUNTERS``)."""
        counters = self.by_component.setdefault(component, {})
        counters[counter] = counters.get(counter, 0) + n

    def note(self, name: str, n: float = 1) -> None:
        """Add ``n`` to the named counter ``name`` of ``others``."""
        self.others[name] = self.others.get(name, 0) + n

    def _plain(self, counter: str) -> int:
        return self.by_component.get(_PLAIN, {}).get(counter, 0)

    backups_l2 = _PlainCounter()
    backups_l3 = _PlainCounter()
    backups_l3_failed = _PlainCounter()
    backups_dropped = _PlainCounter()
    evictions_l1 = _PlainCounter()
    evictions_l2 = _PlainCounter()
    bytes_l1_to_l2 = _PlainCounter()

    @property
    def extra(self) -> Mapping[str, float]:
        """The other components' counters (``<counter>_<name>``) and ``others`` (a copy)."""
        out: dict[str, float] = dict(self.others)
        for name, counters in self.by_component.items():
            if name != _PLAIN:
                out.update((f"{counter}_{name}", value) for counter, value in counters.items())
        return out

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
        del data["by_component"], data["others"], data["lookups"]
        data.update(
            (f"{counter}_{tier}", self.lookups.get(f"{counter}_{tier}", 0))
            for tier in LOOKUP_TIERS for counter in LOOKUP_COUNTERS
        )
        data.update((counter, self._plain(counter)) for counter in _PLAIN_COUNTERS)
        data.update(self.extra)
        data["read_amplification"] = self.read_amplification
        data["token_hit_rate"] = self.token_hit_rate
        return data

    def to_prometheus(self, prefix: str = "hicache_store") -> str:
        """The counters in Prometheus text exposition format (via ``prometheus-client``)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

        registry = CollectorRegistry()
        data = self.to_dict()
        labelled = {
            f"{counter}_{name}" if name != _PLAIN else counter
            for name, counters in self.by_component.items()
            for counter in counters
        } | set(_PLAIN_COUNTERS)
        for counter in LOOKUP_COUNTERS:
            # Counters (``..._total``), named and labelled as every integration's lookups are.
            lookups = Counter(f"{prefix}_{counter}", counter.replace("_", " "), ["tier"],
                              registry=registry)
            for tier in LOOKUP_TIERS:
                labelled.add(f"{counter}_{tier}")
                lookups.labels(tier=tier).inc(data[f"{counter}_{tier}"])
        for name, value in data.items():
            if name not in labelled:
                gauge = Gauge(f"{prefix}_{name}", name.replace("_", " "), registry=registry)
                gauge.set(float(value))
        components = {_PLAIN: {}, **self.by_component}
        for counter in COMPONENT_COUNTERS:
            family = Gauge(
                f"{prefix}_{counter}", counter.replace("_", " "), ["component"], registry=registry
            )
            for name, counters in components.items():
                family.labels(component=name).set(float(counters.get(counter, 0)))
        text: bytes = generate_latest(registry)
        return text.decode()
