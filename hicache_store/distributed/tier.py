"""``RankedHiCache``: the cache tier with the guarantees a multi-rank deployment needs.

Each rank of a deployment runs its own tier over its shard. ``HiCache`` already passes the two
numbers that decide what is computed through ``group.agree_min`` (``prefetch_pages`` when a
prefetch is settled, ``prefix_pages`` in ``prepare``). This subclass adds what keeps the ranks'
*sequences* of cache events identical, so that their trees, L2 contents and eviction choices
never drift apart (seed 000 §2.1-2.2), and so that no rank ever calls a collective the others
skip:

1. **Every request reaches the same agreements.** ``HiCache.prepare`` agrees on
   ``prefetch_pages`` only when this rank started a prefetch; a rank whose existence check
   failed or found less than the prefetch threshold skipped it, and its next collective paired
   with the wrong one on the other ranks (a silent wrong minimum, later a hang). Here a rank
   without a prefetch joins the agreement with 0: the sequence per request is always
   ``backup_acks`` (``match``), ``prefetch_pages``, ``prefix_pages`` (``prepare``),
   ``backup_acks`` (``complete``).

2. **Completions are consumed in the same order and number** (``poll``). L3 backups finish on
   each rank at its own time; applying "whatever is ready" lets one rank release a page's L2 lock
   (and later evict it) while another still holds it. As SGLang's ``pp_sync`` (PR #27285): at
   each check the *first PP stage* decides how many queued backup completions to apply (the
   minimum of its writing ranks' ready counts, one ``all_reduce(MIN)`` in which the other ranks
   vote "no opinion"), and every writing rank applies exactly that many, in FIFO order, waiting
   for its own transfer when it is not finished yet (bounded: an L3 operation ends within
   ``io_timeout_s``; a rank that could never reach the count raises instead of waiting). Extra
   ready completions stay queued for a later check. Our tier's events map onto the seed's as:
   "backup ACK" = an L3 backup completion (``HiCache._apply_backup``); "prefetch progress ACK"
   = the settled prefetch count, which is agreed directly (``prefetch_pages``) because the
   tier settles a prefetch synchronously at the request's cache check; "timeout / stop" = the
   prefetch policy's wait, after which the agreed count is what every rank uses. Since all
   ranks here take part in the same collective at each check, the first stage's count reaches
   the later stages in that collective rather than by point-to-point messages.

3. **Abandoned prefetch pages are returned before the request computes.** Host pages of
   prefetched pages past the agreed prefix come back when their read ends; in ``HiCache`` that
   can be now or at a later ``poll``, which would make L2 free space (and so L2 eviction)
   depend on read timing. Here ``prepare`` waits for the prefetch's reads to end (at most the
   one page in flight: reads past the agreed prefix are skipped) and returns them at once.

4. **``flush`` ends on every rank together.** Each round polls (one agreement) and agrees on
   whether every rank is idle, so every rank runs the same number of rounds.

In consensus-check mode (``TorchGroup`` with ``HICACHE_STORE_CONSENSUS_CHECK=1``) every
request's decisions carry its number, token count and token digest as arguments, and ``match``
notes the L1/L2 hit lengths it found (which are equal on every rank while their event
sequences are), so a rank whose tree drifted is reported at the first request it matters.

The base class is used as it is; see the report of issue 7 for the small hooks that would let
the tier offer these guarantees itself.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from hicache_store.backends.base import Backend
from hicache_store.kernels.ops import Backend as KernelBackend
from hicache_store.layout.errors import GridMismatchError
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.plans import plan_writes
from hicache_store.layout.topology import Topology
from hicache_store.tier.cache import DevicePagePool, HiCache, Prepared, Request
from hicache_store.tier.config import TierConfig
from hicache_store.tier.group import RankGroup

#: The vote of a rank that does not decide how many completions to consume.
NO_VOTE = 1 << 62


class CacheEventDivergenceError(RuntimeError):
    """A rank cannot apply the completions the deciding stage agreed on (its queue differs)."""


def writes_l3(namespace: Namespace, topology: Topology, rank: int) -> bool:
    """Whether ``rank`` writes any L3 object (one writer per shard; none for a misaligned one)."""
    try:
        return bool(plan_writes(namespace, topology, rank).objects)
    except GridMismatchError:
        return False


def ack_deciders(namespace: Namespace, topology: Topology) -> frozenset[int]:
    """Ranks whose ready counts decide how many backup completions everyone applies: the
    writing ranks of the first PP stage (all writing ranks if that stage has none)."""
    writers = [r for r in range(topology.world_size) if writes_l3(namespace, topology, r)]
    first = [r for r in writers if topology.coords_of(r)[1] == 0]
    return frozenset(first or writers)


def tokens_digest(tokens: torch.Tensor) -> str:
    """A short digest of a request's tokens (an argument of its logged decisions)."""
    data = tokens.to(torch.int64).numpy().astype("<u4").tobytes()
    return hashlib.sha256(data).hexdigest()[:12]


class RankedHiCache(HiCache):
    """``HiCache`` for one rank of a group. See the module docstring for what it adds.

    Same constructor as ``HiCache``; ``group`` should be the deployment's group (a
    ``TorchGroup``) and ``rank`` this rank's topology rank, equal to its rank in the group.
    ``ack_wait_s``: how long a rank waits for a completion the deciding stage already applied
    (default: twice the configured L3 timeout plus a margin).
    """

    def __init__(
        self,
        namespace: Namespace,
        config: TierConfig,
        device_pool: DevicePagePool,
        *,
        backend: Backend | None = None,
        topology: Topology | None = None,
        rank: int = 0,
        group: RankGroup | None = None,
        kernel_backend: KernelBackend = "auto",
        ack_wait_s: float | None = None,
    ) -> None:
        super().__init__(
            namespace,
            config,
            device_pool,
            backend=backend,
            topology=topology,
            rank=rank,
            group=group,
            kernel_backend=kernel_backend,
        )
        if self.group.size != self.topology.world_size or self.group.rank != rank:
            raise ValueError(
                f"group rank {self.group.rank}/{self.group.size} does not match topology rank "
                f"{rank} of {self.topology} ({self.topology.world_size} ranks)"
            )
        self._decides_acks = rank in ack_deciders(namespace, self.topology)
        self.ack_wait_s = ack_wait_s if ack_wait_s is not None else 2 * config.io_timeout_s + 10
        # Backup completions taken off the I/O thread's queue, not applied yet (FIFO).
        self._ready_backups: collections.deque[tuple[Any, ...]] = collections.deque()
        self.requests_seen = 0

    # -- helpers -------------------------------------------------------------------------------

    def _set_context(self, **args: Any) -> None:
        setter = getattr(self.group, "set_context", None)
        if setter is not None:
            setter(**args)

    def _note(self, value: Any, what: str) -> None:
        note = getattr(self.group, "note", None)
        if note is not None:
            note(value, what)

    def _drain(self) -> None:
        """Move completions off the I/O queue: backups to ``_ready_backups``; returns of
        abandoned prefetch pages are rank-local resource releases and applied at once."""
        while self._acks:
            kind, payload = self._acks.popleft()
            if kind == "backup":
                self._ready_backups.append(payload)
            elif kind == "prefetch_page":
                self._apply_abandoned_page(*payload)

    # -- the request path ----------------------------------------------------------------------

    def match(self, tokens: Sequence[int] | torch.Tensor, *, reuse: bool = True) -> Request:
        token_tensor = torch.as_tensor(tokens, dtype=torch.int64)
        self.requests_seen += 1
        self._set_context(
            request=self.requests_seen,
            tokens=int(token_tensor.numel()),
            digest=tokens_digest(token_tensor),
        )
        req = super().match(token_tensor, reuse=reuse)
        self._note((req.l1_pages, req.l2_pages), "match_l1_l2_pages")
        return req

    def prepare(self, req: Request) -> Prepared:
        # ``HiCache.prepare`` makes the ``prefetch_pages`` agreement on every rank, with 0 where
        # a rank started no prefetch.
        prepared = super().prepare(req)
        op = req.prefetch
        if op is not None:
            # Reads past the agreed prefix are skipped; at most one is still running.
            if not op.finished.wait(self.ack_wait_s):
                raise CacheEventDivergenceError(
                    f"rank {self.rank}: a prefetch did not end within {self.ack_wait_s}s"
                )
            self._drain()
        self._note(prepared.start, "prefix_tokens")
        return prepared

    # -- background work -----------------------------------------------------------------------

    def poll(self) -> None:
        """Apply the backup completions the first stage agreed on, in FIFO order."""
        self._drain()
        vote = len(self._ready_backups) if self._decides_acks else NO_VOTE
        agreed = self.group.agree_min(vote, "backup_acks")
        if agreed == NO_VOTE:
            agreed = 0
        writes = self.l3 is not None and self.l3.can_write
        if writes and agreed:
            deadline = time.monotonic() + self.ack_wait_s
            while len(self._ready_backups) < agreed:
                if self._backups_in_flight < agreed:
                    raise CacheEventDivergenceError(
                        f"rank {self.rank}: the first stage applied {agreed} backup completions "
                        f"but this rank has only {self._backups_in_flight} backups queued"
                    )
                if time.monotonic() > deadline:
                    raise CacheEventDivergenceError(
                        f"rank {self.rank}: {agreed - len(self._ready_backups)} backups did "
                        f"not complete within {self.ack_wait_s}s"
                    )
                time.sleep(0.0005)
                self._drain()
            for _ in range(agreed):
                self._apply_backup(*self._ready_backups.popleft())
        self._prefetches = [op for op in self._prefetches if not self._prefetch_retired(op)]

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every rank's L3 backups and prefetches have ended (same rounds on all)."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            idle = not self._backups_in_flight and all(
                op.finished.is_set() for op in self._prefetches
            )
            state = 2 if idle else (0 if time.monotonic() > deadline else 1)
            agreed = self.group.agree_min(state, "flush_idle")
            if agreed == 2:
                return
            if agreed == 0:
                raise TimeoutError("L3 transfers did not finish in time on some rank")
            time.sleep(0.002)
