"""The prefetch protocol: what a request reads from L3 while it waits, and how it is settled.

A collaborator of the request protocol (``tier.cache`` decides the prefix), built with the
tier's residency (``tier.residency``: the rows, the tree, the transfers) and its prefix
arithmetic (``tier.prefix``); one ``Prefetcher`` per tier, used on the engine's thread. In the
order a request meets it:

1. ``start`` (from ``match``): probe L3 past what memory holds (the KV pages' leading run, then
   the component objects a resume there would need), plan the prefix every needed component
   can resume at (and a fallback in case the L3 objects it reads fail), pin the L2 copies of
   the objects the plans resume with, take host rows and start one ``Prefetch`` (its reads run
   on the bridge loop, ``tier.transfers``).
2. ``settle`` (from ``prepare``): wait as the prefetch policy says (``best_effort``: not at
   all; ``wait_complete``; ``timeout``), agree with the other ranks on how many KV pages
   arrived, hand the rows that arrived to the tree, and *abandon* the rest: a row whose read
   has not ended is quarantined and returns to its pool when the read ends (``return_row``,
   from the ``ReadEnded`` completion, which the tier applies in ``poll``), never earlier.
3. ``unpin`` (once ``prepare`` has restored the planned objects) or ``drop`` (from ``abort``).

L3 knowledge is kept honest here too: an existence check that says a page is missing, or a
read that failed, refutes what the tree believed (``refute_l3``), so the next backup rewrites
the object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from hicache_store._sync import run_sync
from hicache_store.objects import IOStats, L3Link

from .components import KV, ComponentMatch, Tier
from .config import prefetch_timeout
from .group import CacheEventDivergenceError, RankGroup
from .prefix import Prefixes
from .radix import PageNode
from .request import Request, timed_io
from .residency import Residency
from .transfers import Fetch, Prefetch

log = logging.getLogger(__name__)


class Prefetcher:
    """The prefetches of one tier over ``residency``, its prefixes chosen by ``prefixes``,
    agreed in ``group`` (a rank waits ``ack_wait_s`` at most for its reads to end): starts,
    settles and retires them (see the module docstring). ``ops``: those whose rows are not all
    back in their pools or in the tree."""

    def __init__(
        self, residency: Residency, prefixes: Prefixes, group: RankGroup, ack_wait_s: float
    ) -> None:
        self.residency = residency
        self.prefixes = prefixes
        self.group = group
        self.ack_wait_s = ack_wait_s
        self.ops: list[Prefetch] = []

    @property
    def _link(self) -> L3Link | None:
        return self.residency.parts[KV.tag].link

    # -- accounting -------------------------------------------------------------------------

    def retire(self) -> None:
        """Forget the prefetches that are settled, ended and hold no row."""
        self.ops = [op for op in self.ops if not op.retired()]

    def idle(self) -> bool:
        """No read of any prefetch is still running."""
        return all(op.finished.is_set() for op in self.ops)

    def rows_held(self, tag: int) -> int:
        """Host rows of component ``tag`` that prefetches hold."""
        return sum(1 for op in self.ops for f in op.fetches() if f.tag == tag and f.row >= 0)

    def quarantined(self) -> int:
        """Rows of abandoned reads that have not ended yet."""
        return sum(
            1
            for op in self.ops
            for f in op.fetches()
            if f.abandoned and f.done is None and f.row >= 0
        )

    # -- start --------------------------------------------------------------------------------

    def start(self, req: Request) -> None:
        """Probe L3 beyond what memory holds, pick the prefix every needed component can
        resume at, and read its missing KV pages and component objects into L2."""
        res = self.residency
        link = self._link
        assert link is not None
        page = self.prefixes.page_size
        start = len(req.nodes)
        usable = (len(req.tokens) - 1) // page
        available = 0
        found: dict[int, list[bool]] = {}
        try:
            with timed_io(req):  # round trips to the backend: I/O, not bookkeeping
                if start < len(req.hashes):
                    available = run_sync(
                        link.exists_prefix(req.hashes[start:]), timeout=res.config.io_timeout_s
                    )
                if req.need:
                    found = self._probe_components(req, min(start + available, usable))
        except Exception as exc:
            log.warning("L3 existence check failed, recomputing instead: %s", exc)
            available, found = 0, {}
        else:
            if start < len(req.hashes):
                res.metrics.count_lookup("l3", len(req.hashes) - start, available)
            if start + available < len(req.hashes):  # the first page L3 says it lacks
                self.refute_l3(req.hashes[start + available])
        kv_end = start + available
        req.l3_found, req.l3_kv_pages = found, kv_end
        plans: list[ComponentMatch] = []
        if req.need:
            cap = min(kv_end, usable)
            plans = self._plans(req, cap, found)
            kv_end = max(start, plans[0].prefix_pages)
        if (kv_end - start) * page < res.config.prefetch_threshold_tokens:
            kv_end = start  # too little KV to fetch: resume where memory allows
            if req.need:
                plans = self._plans(req, min(start, usable), found)
        try:
            op = self._op(req, start, kv_end, plans)
        except BaseException:
            self.unpin(req)
            raise
        if op is None:
            return
        res.metrics.prefetch_started += 1
        res.transfers.start_prefetch(op, res.links(), lambda f: res.parts[f.tag].host.row(f.row))
        self.ops.append(op)
        req.prefetch = op

    def unpin(self, req: Request) -> None:
        """Release the plan's pins (``_pin_planned``)."""
        for node, tag in req.pinned:
            self.residency.tree.release_host(node, tag)
        req.pinned = []

    def _pin_planned(self, req: Request, plan: ComponentMatch) -> None:
        """Hold the L2 copies of the component objects ``plan`` restores (``req.pinned``)."""
        tree, parts = self.residency.tree, self.residency.parts
        nodes = tree.match(req.hashes)
        pinned = {(id(node), tag) for node, tag in req.pinned}
        for tag in req.need:
            for i, _ in plan.restore[parts[tag].name]:
                held = nodes[i].held(tag) if i < len(nodes) else None
                if held is not None and held.l2 is not None and (id(nodes[i]), tag) not in pinned:
                    tree.hold_host(nodes[i], tag)
                    req.pinned.append((nodes[i], tag))

    def _op(
        self, req: Request, start: int, kv_end: int, plans: Sequence[ComponentMatch]
    ) -> Prefetch | None:
        """Rows for the KV pages ``[start, kv_end)`` and the L3 objects ``plans`` restore, as
        one prefetch (None: nothing to fetch)."""
        res = self.residency
        kv_fetch: list[Fetch] = []
        if kv_end > start:
            kv = res.parts[KV.tag]
            host = kv.host
            host_pages = res.alloc_rows(kv, kv_end - start)
            count = kv_end - start
            while host_pages is None and count > 0:
                count = min(count - 1, host.free_pages)
                host_pages = host.alloc(count) if count else None
            kv_fetch = [
                Fetch(KV.tag, start + i, req.hashes[start + i], row)
                for i, row in enumerate(host_pages or [])
            ]
        extra: list[Fetch] = []
        wanted: set[tuple[int, int]] = set()
        # Plan by plan (the fallback gets rows only once the first has its own): pin the L2
        # copies of the objects it resumes with until ``prepare`` has restored them (or
        # ``abort``), so that neither making room for what is fetched nor other requests
        # served in between evict them (the prefix would fall short of the plan, to an earlier
        # checkpoint or to 0); then take rows for its objects in L3.
        for plan in plans:
            self._pin_planned(req, plan)
            for tag in req.need:
                part = res.parts[tag]
                for i, where in plan.restore[part.name]:
                    if where is not Tier.L3 or part.link is None or (tag, i) in wanted:
                        continue
                    wanted.add((tag, i))
                    rows = res.alloc_rows(part, 1)
                    if rows is None:
                        continue  # the prefix will end before this object (prepare recomputes)
                    extra.append(Fetch(tag, i, req.hashes[i], rows[0]))
        if not kv_fetch and not extra:
            return None
        return Prefetch(kv_fetch, extra)

    def _plans(
        self, req: Request, cap: int, found: Mapping[int, Sequence[bool]]
    ) -> list[ComponentMatch]:
        """The prefix to prefetch for (L1, L2 and L3 objects count), and the one to fall back to
        if the L3 component objects it reads fail (corrupt or gone): fetching both keeps a
        failed read from sending the request back to what memory holds."""
        first = self.prefixes.best(req, cap, cap, found)
        tags = {part.name: tag for tag, part in self.residency.parts.items()}
        fetched = {
            (tags[name], i)
            for name, objects in first.restore.items()
            if name != KV.name
            for i, where in objects
            if where is Tier.L3
        }
        if not fetched:
            return [first]
        without = {
            tag: [hit and (tag, i) not in fetched for i, hit in enumerate(flags)]
            for tag, flags in found.items()
        }
        return [first, self.prefixes.best(req, cap, cap, without, known_l3=False)]

    def _probe_components(self, req: Request, pages: int) -> dict[int, list[bool]]:
        """Per needed component: which of the first ``pages`` pages' objects L3 holds (pages
        whose object is in memory are not probed)."""
        res = self.residency
        nodes = res.tree.match(req.hashes[:pages])
        out: dict[int, list[bool]] = {}
        for tag in req.need:
            link = res.parts[tag].link
            if link is None:
                continue
            todo = [
                i
                for i in range(pages)
                if i >= len(nodes) or (h := nodes[i].held(tag)) is None or not h.in_memory
            ]
            hits: list[bool] = []
            if todo:  # everything in memory: no round trip
                hits = run_sync(
                    link.exists_pages([req.hashes[i] for i in todo]),
                    timeout=res.config.io_timeout_s,
                )
            flags = [False] * pages
            for i, hit in zip(todo, hits, strict=True):
                flags[i] = hit
            out[tag] = flags
        return out

    # -- settle ---------------------------------------------------------------------------

    def settle(self, req: Request) -> float:
        """Wait as the policy says, take what arrived, and return the seconds waited. With
        several ranks, also wait (``ack_wait_s`` at most) until every read of the prefetch has
        ended: the tier then applies their completions (``poll``) before the request computes,
        so that L2 free space does not depend on read timing."""
        res = self.residency
        tree, m, config = res.tree, res.metrics, res.config
        op = req.prefetch
        assert op is not None
        policy = config.prefetch_policy
        started = time.perf_counter()
        timed_out = False
        if policy == "wait_complete":
            timed_out = not op.finished.wait(config.io_timeout_s)
        elif policy == "timeout":
            limit = prefetch_timeout(config, len(op.kv) * self.prefixes.page_size)
            timed_out = not op.finished.wait(limit)
        waited = time.perf_counter() - started
        done = op.completed_prefix()
        agreed = self.group.agree_min(done, "prefetch_pages")
        if agreed == len(op.kv):
            m.prefetch_complete += 1
        elif timed_out:
            m.prefetch_timed_out += 1
        else:
            m.prefetch_partial += 1
        m.prefetch_failed_pages += sum(1 for f in op.kv if f.done is False)
        io, op.io = op.io, IOStats()
        m.corruptions += io.corruptions
        m.tampered += io.tampered
        m.bytes_l3_to_l2 += io.bytes_moved
        m.l3_fetched_bytes += io.bytes_fetched
        m.l3_needed_bytes += io.bytes_needed
        self._forget_failed_read(op, done)
        # KV pages past the agreed prefix are abandoned, and so are component objects whose
        # read has not ended: their rows come back once the reads have ended (now, or when
        # the read's completion is polled: quarantined until then).
        for fetch in op.kv[agreed:]:
            self.abandon(fetch)
        nodes = tree.insert(req.hashes[: len(req.nodes) + agreed])[len(req.nodes) :]
        for node, fetch in zip(nodes, op.kv[:agreed], strict=True):
            held = node.held(KV.tag)
            if held is None or held.l2 is None:
                tree.set_copy(node, KV.tag, Tier.L2, fetch.row)
            else:
                res.parts[KV.tag].host.free([fetch.row])
            fetch.row = -1  # owned by the tree now
            tree.set_copy(node, KV.tag, Tier.L3, True)
        res.hold(req, nodes)
        tree.touch(nodes)
        req.l3_pages = agreed
        op.settled = True
        known = tree.match(req.hashes)
        refuted: list[tuple[PageNode, int]] = []
        for fetch in op.extra:
            if fetch.done is False:  # a corrupt or vanished object: absent from now on
                req.l3_found[fetch.tag][fetch.index] = False
                m.count(res.parts[fetch.tag].name, "fetch_failed")
                if fetch.index < len(known):  # so that its next backup replaces it (KV: above)
                    refuted.append((known[fetch.index], fetch.tag))
            if fetch.done is not True or fetch.index >= len(known):
                self.abandon(fetch)
                continue
            node, part = known[fetch.index], res.parts[fetch.tag]
            held = node.held(fetch.tag)
            if held is not None and held.in_memory:
                part.host.free([fetch.row])  # a copy arrived meanwhile
            else:
                tree.set_copy(node, fetch.tag, Tier.L2, fetch.row)
            tree.set_copy(node, fetch.tag, Tier.L3, True)
            fetch.row = -1
            m.count(part.name, "restored_l3")
        # After the loop: a refuted page may hold nothing more and leave the tree, and a later
        # fetch may land on the same page.
        for node, tag in refuted:
            tree.set_copy(node, tag, Tier.L3, False)
        # Rows of abandoned reads come back before the request computes, so L2 free space
        # (and with it L2 eviction) does not depend on read timing (at most the reads in
        # flight remain: reads past the agreed prefix are skipped).
        if self.group.size > 1 and not op.finished.wait(self.ack_wait_s):
            raise CacheEventDivergenceError(
                    f"rank {self.group.rank}: a prefetch did not end within {self.ack_wait_s}s"
                )
        return waited

    def drop(self, req: Request) -> None:
        """``abort`` of a request matched but never prepared: abandon every fetch (rows
        return now, or when their reads end)."""
        op = req.prefetch
        if op is not None and not op.settled:
            for fetch in op.fetches():
                self.abandon(fetch)
            op.settled = True

    def _forget_failed_read(self, op: Prefetch, done: int) -> None:
        """Stop taking for stored the KV page whose L3 read failed (corrupt, torn, vanished,
        timed out). Only the first KV page not read (``done``: every one before it read well)
        was read and failed; those past it were skipped."""
        if done < len(op.kv) and op.kv[done].done is False:
            self.refute_l3(op.kv[done].page_hash)

    def refute_l3(self, page_hash: str) -> None:
        """L3 answered that it does not hold this KV page (a failed read, a miss of the
        existence check): ``in_l3`` is an acknowledged write or a confirmed read, and this
        refutes it. Kept, it made every backup skip the page, so an object that went bad or
        went away (evicted by the backend, deleted) was never written again by this
        instance, and every request of every instance recomputed from there on.

        One rank only: with several, ``in_l3`` decides which backups each rank queues, and the
        ranks must queue alike (the backup-ack agreement), so a rank-local refutation would
        make them diverge.
        """
        if self.group.size > 1:
            return
        tree = self.residency.tree
        node = tree.get(page_hash)
        if node is not None and node.resident(Tier.L3, KV.tag):
            tree.set_copy(node, KV.tag, Tier.L3, False)

    def abandon(self, fetch: Fetch) -> None:
        """The engine stops waiting for ``fetch``: its row returns now if its read has ended,
        else when it ends (``ReadEnded``): quarantined until then."""
        fetch.abandoned = True
        if fetch.done is not None:
            self.return_row(fetch)
        elif fetch.row >= 0:
            self.residency.metrics.host_pages_quarantined += 1

    def return_row(self, fetch: Fetch) -> None:
        """Free an abandoned fetch's row (once: row -1 afterwards); its read has ended."""
        assert fetch.done is not None, "a row freed while its read may still write into it"
        if fetch.row >= 0:
            self.residency.parts[fetch.tag].host.free([fetch.row])
            fetch.row = -1
