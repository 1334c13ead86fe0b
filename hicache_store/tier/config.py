"""Cache-tier configuration: pool sizes and the write, prefetch and host-memory policies.

Defaults: write-through, host memory as a cache, and a ``timeout`` prefetch with SGLang's knobs
(``base=2 s``, ``per_ki_token=0.1 s``, ``max=30 s``) and no minimum length, so that whatever L3
holds of a prompt is restored, short prompts included, and no request waits unboundedly.
SGLang's own defaults (``best_effort`` with a 256-token threshold) restore nothing for prompts
under 256 tokens and, in a caller that prepares right after matching, nothing at all: set them
explicitly to get SGLang's behaviour. An L3 backend needs L2 (``l2_pages > 0``): L3 pages move
through host memory, and ``HiCache`` refuses a backend without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hicache_store.backends.retention import DEFAULT_PIN_FRACTION
from hicache_store.events.publisher import PublisherConfig
from hicache_store.objects.io import DEFAULT_IO_TIMEOUT_S

from .eviction import DEFAULT_EVICTION_POLICY

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
HostMode = Literal["cache", "buffer_only"]

WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES: tuple[str, ...] = ("best_effort", "wait_complete", "timeout")
HOST_MODES: tuple[str, ...] = ("cache", "buffer_only")


@dataclass(frozen=True)
class TierConfig:
    """How the tier behaves. Sizes are in pages of the namespace's page size.

    ``l2_pages = 0`` disables L2; L3 is reached through L2, so a tier with a backend needs
    ``l2_pages > 0`` (``HiCache`` raises otherwise).
    ``write_through_threshold``: hits before a page is backed up under
    ``write_through_selective`` (SGLang uses 2; ``write_through`` behaves as 1).
    ``prefetch_threshold_tokens``: no L3 prefetch starts for fewer tokens than this (default 0:
    any stored full page is worth restoring).
    ``max_inflight_bytes``: bytes of L3 traffic (each direction) in flight at once.
    ``max_queued_backup_pages``: L3 backups waiting beyond this are dropped and counted, so a
    slow backend never blocks compute.
    ``io_timeout_s``: an L3 operation slower than this counts as failed (degrade to recompute).
    Default 20 s, above every built-in backend's own bound for a stopped server (15 s), so that
    such a server shows up as the backend's retryable error first
    (docs/guide/backends/deadlines.md). A read past it is abandoned, and its host page
    quarantined until the I/O has ended.
    ``eviction_policy``: the order of eviction in every pool, the KV's and the components'
    (window pages, checkpoints, draft KV): one order across components (``tier.radix``;
    ``tier.eviction``: ``EVICTION_POLICIES``): ``session`` by default (the order of
    predicted return for requests whose hints name a session, prefix-closed ARC for the
    others: without hints it is ``arc``, which on production traces keeps 1.5-5.7 points more
    of the prompt than LRU at mid-size pools, BENCHMARKS.md "Production traces"); ``lru`` is
    SGLang's order.
    ``l3_record_pages``: pages the tree remembers beyond what L1 and L2 hold (pages only L3
    holds); older ones are forgotten and probed again when needed. None: ``l1_pages +
    l2_pages``, so the tree never holds more than twice the pages of the memory tiers plus
    those in transit.
    ``pin_fraction``: the share of each memory tier's pages that hint pins may hold at once
    (``tier.pins``; L3's pin budget is the backend's own).
    ``events_endpoint``: publish the tier's KV events (pages entering and leaving L2 and L3,
    vLLM's wire format, ``tier.events``) on this ZMQ address (None: off, the default; needs
    the ``events`` extra). ``events_replay_endpoint``: the replay socket (None: none);
    ``events_topic``: the topic frame; ``events_history``: batches held for replay.
    """

    l1_pages: int
    l2_pages: int = 0
    write_policy: WritePolicy = "write_through"
    write_through_threshold: int = 2
    prefetch_policy: PrefetchPolicy = "timeout"
    prefetch_threshold_tokens: int = 0
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_ki_token_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    host_mode: HostMode = "cache"
    max_inflight_bytes: int = 256 << 20
    max_queued_backup_pages: int = 4096
    io_timeout_s: float = DEFAULT_IO_TIMEOUT_S
    layerwise_load: bool = True
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    l3_record_pages: int | None = None
    pin_fraction: float = DEFAULT_PIN_FRACTION
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_topic: str = ""
    events_history: int = 10_000

    def __post_init__(self) -> None:
        if self.l1_pages < 1:
            raise ValueError("l1_pages: the device pool needs at least one page")
        if self.l2_pages < 0:
            raise ValueError("l2_pages: must not be negative")
        for name, value, choices in (
            ("write_policy", self.write_policy, WRITE_POLICIES),
            ("prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES),
            ("host_mode", self.host_mode, HOST_MODES),
        ):
            if value not in choices:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
        if self.prefetch_threshold_tokens < 0:
            raise ValueError("prefetch_threshold_tokens: must not be negative")
        if self.write_through_threshold < 1:
            raise ValueError("write_through_threshold: must be at least 1")
        if min(self.prefetch_timeout_base_s, self.prefetch_timeout_per_ki_token_s) < 0:
            raise ValueError("prefetch timeouts must not be negative")
        if self.max_inflight_bytes < 1 or self.max_queued_backup_pages < 0:
            raise ValueError("max_inflight_bytes / max_queued_backup_pages out of range")
        if not 0.0 <= self.pin_fraction <= 1.0:
            raise ValueError(f"pin_fraction: must be within [0, 1], got {self.pin_fraction!r}")
        if self.l3_record_pages is not None and self.l3_record_pages < 0:
            raise ValueError("l3_record_pages: must not be negative")
        if self.events_endpoint is not None:
            self.events_config()  # validates the addresses and the history now
        elif self.events_replay_endpoint is not None:
            raise ValueError("events_replay_endpoint: needs events_endpoint")
        from .eviction import EVICTION_POLICIES

        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy: {self.eviction_policy!r} is not one of "
                f"{', '.join(EVICTION_POLICIES)}"
            )

    def events_config(self) -> PublisherConfig:
        """The KV event publisher's configuration (``events_endpoint`` must be set)."""
        if self.events_endpoint is None:
            raise ValueError("events_endpoint: KV events are off")
        return PublisherConfig(
            self.events_endpoint, self.events_replay_endpoint, topic=self.events_topic,
            history=self.events_history,
        )

    @property
    def l3_record_limit(self) -> int:
        """The tree's bound on pages without an L1/L2 copy (see ``l3_record_pages``)."""
        if self.l3_record_pages is not None:
            return self.l3_record_pages
        return self.l1_pages + self.l2_pages

    @property
    def backup_threshold(self) -> int:
        """Hits a page needs before it is backed up to L2 (write-back: never proactively)."""
        if self.write_policy == "write_through":
            return 1
        if self.write_policy == "write_through_selective":
            return self.write_through_threshold
        return 0


def prefetch_timeout(config: TierConfig, tokens: int) -> float:
    """Seconds a ``timeout`` prefetch of ``tokens`` tokens may wait: SGLang's formula
    ``min(max, base + per_ki_token * tokens / 1024)``."""
    return min(
        config.prefetch_timeout_max_s,
        config.prefetch_timeout_base_s + config.prefetch_timeout_per_ki_token_s * tokens / 1024,
    )
