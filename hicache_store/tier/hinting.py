"""The tier's side of the engine's hints (``tier.hints``): what each action does in L1, L2, L3.

``HiCache.match(tokens, hints=...)`` hands a request's ``RequestHints`` over; ``HiCache.
response_end(end)`` a ``ResponseEnd``. ``Hinting`` (one per tier) then:

* **refuses** hints about a namespace the tier does not own (``ValueError``), and an action
  whose token range is not within the prompt;
* **announces** the request to every pool's eviction policy that takes hints (``session``:
  ``tier.eviction``), at ``match`` and again at ``complete`` (before its pages are inserted)
  when other requests were announced in between (the pages a request adds belong to its
  session);
* at ``match``, before anything is taken, **expires** pins past their deadline (on the hints'
  clock, ``now_s``) and **reserves** the pages the request's ``pin`` actions will hold: past
  the pin budget the request is refused with ``PinBudgetError`` (``tier.pins``);
* at ``complete``, once the prompt's pages are in the tree, **applies** the actions:

  ``pin``
      The pages from the prompt's start to the range's end (a page is served only with its
      prefix) are pinned for the request's session (``tier.pins``: until the deadline
      ``now_s + duration_s``, or until the session releases them): their L1 and L2 copies are
      not evicted. In L3 they are pinned through ``Backend.retain`` (``Retention(pinned=
      True)``, the backend's own pin budget) once their backup is stored.
  ``retain``
      The same pages are retained in L3 (``Retention(priority, until)``: evicted after
      unretained data, lowest priority first). L1 and L2 order by their eviction policy.
  ``prefetch``
      Nothing more than ``match`` does for every request: every page of the prompt that L3
      holds and memory lacks is prefetched (counted, ``hint_prefetch``).
  ``demote``
      The session's own pins on the range's pages are released, and their L1 copies leave L1
      now (deepest first, as far as prefix-closure and other requests' use allow; lower tiers
      keep theirs).
  ``drop``
      As ``demote``, and their L2 copies go too; the session's L3 holds on them are released
      (the objects stay, ordinary data for the backend's eviction).
  ``session_end``
      Every pin and L3 hold of the session is released; the session policy sends its pages
      first.

**L3 and failures.** Holds reach L3 only where the backend declares ``capabilities.
retention``; otherwise each action that would is counted (``hint_l3_unsupported``), never an
error. L3 calls run in the background like backups: pages held (``hint_l3_pinned_pages``,
``hint_l3_retained_pages``, ``hint_l3_released_pages``), refused by the backend's pin budget
(``hint_l3_refused_pages``) or failed (``hint_l3_failed_pages``) are counted, the last two
logged; pages not stored in L3 when their hold was due are ``hint_l3_not_stored``. Nothing in
the engine's path raises because of L3. Deadlines in L3 are wall-clock (they outlive the
process): ``time.time()`` at the request plus ``duration_s``. Only the KV's objects are held
(components' objects follow their own eviction). The tier remembers which pages each session
holds in L3 until the session ends (``session_end``), to release them then.

Hints never change what a hit returns: they change what stays, never which bytes a page holds.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Collection, Sequence
from typing import cast

from hicache_store._sync import submit
from hicache_store.backends.errors import PinBudgetError
from hicache_store.backends.retention import Retention, hold_owner, hold_owners
from hicache_store.objects import L3Link

from .components import KV, Tier
from .eviction import HintedEvictionPolicy, takes_hints
from .hints import RequestHints, ResponseEnd
from .pins import PinTable
from .radix import PageNode
from .request import Request
from .residency import Residency

log = logging.getLogger(__name__)

#: actions whose token range names the pages from the prompt's start to the range's end.
_PREFIX_ACTIONS = ("pin", "retain")


#: what a request without hints tells a policy: no session (the clock does not move).
_NO_SESSION = RequestHints(0.0)


def owner_of(hints: RequestHints) -> str:
    """The owner of a request's pins and holds: its session (``""`` without one)."""
    return hints.session or ""


def _l3_owner(owner: str) -> str:
    """The L3 holder of ``owner``'s holds (``backends.retention.hold_owner`` names its entries)."""
    return owner or "anonymous"


class Hinting:
    """The hints state of one tier over ``residency`` (module docstring): ``namespaces`` the
    digests the tier owns (its model's and its components'), pages of ``page_size`` tokens."""

    def __init__(self, residency: Residency, namespaces: Collection[str], page_size: int) -> None:
        self.residency = residency
        self.page_size = page_size
        config = residency.config
        budgets = {"L1": int(config.l1_pages * config.pin_fraction)}
        if config.l2_pages and config.host_mode == "cache":
            budgets["L2"] = int(config.l2_pages * config.pin_fraction)
        self.pins: PinTable[PageNode] = PinTable(budgets)
        self._announced: Request | None = None
        # page hash -> the holds to apply in L3 once its backup is stored
        self._after_backup: dict[str, list[tuple[str, Retention]]] = {}
        # owner -> page hashes it holds in L3 (released at its session_end / drop)
        self._l3_held: dict[str, set[str]] = collections.defaultdict(set)
        # L3 calls running: their kind (``pinned``, ``retained``, ``released``) and pages
        self._calls: list[tuple[concurrent.futures.Future[None], str, int]] = []
        self._namespaces = set(namespaces)

    @property
    def _link(self) -> L3Link | None:
        """The KV's L3 link (holds reach L3 through it)."""
        return self.residency.parts[KV.tag].link

    # == match ===============================================================================

    def check(self, tokens: int, hints: RequestHints) -> None:
        """Refuse hints the tier cannot take for a prompt of ``tokens`` tokens (``ValueError``)."""
        if hints.namespace is not None and hints.namespace not in self._namespaces:
            raise ValueError(
                f"hints for namespace {hints.namespace!r}: this tier owns "
                f"{', '.join(sorted(self._namespaces))}; hints about another deployment's "
                "pages are refused"
            )
        for action in hints.actions:
            end = action.end_token
            if action.start_token > tokens or (end is not None and end > tokens):
                raise ValueError(
                    f"hint action {action.action}: token range [{action.start_token}, {end}) "
                    f"is not within the prompt of {tokens} tokens"
                )

    def announce(self, req: Request) -> None:
        """Tell the pools' policies which request (and session: none without hints) is served
        now."""
        self._announced = req
        hints = req.hints if req.hints is not None else _NO_SESSION
        for policy in self._hinted():
            policy.hint_request(hints)

    def _hinted(self) -> list[HintedEvictionPolicy[PageNode]]:
        """The pools' policies that take hints."""
        return [
            cast("HintedEvictionPolicy[PageNode]", p)
            for p in self.residency.tree.policies.values()
            if takes_hints(p)
        ]

    def resume(self, req: Request) -> None:
        """``complete``, before the request's pages are inserted and touched: announce it again
        if another request was announced since (its pages belong to its own session)."""
        if self._announced is not req:
            self.announce(req)

    def arrive(self, tokens: int, hashes: Sequence[str], hints: RequestHints) -> int:
        """``match``, before anything is taken: check the hints, expire pins, reserve the
        pages the request's pins will hold (``PinBudgetError`` past the budget). Returns the
        pages reserved (``Request.pin_reserved``)."""
        self.check(tokens, hints)
        self.expire(hints.now_s)
        end = max(
            (self._range(tokens, self.page_size, a.start_token, a.end_token)[1]
             for a in hints.actions if a.action == "pin"),
            default=0,
        )
        if not end:
            return 0
        known = [self.residency.tree.get(h) for h in hashes[:end]]
        new = sum(1 for n in known if n is None or not self.pins.is_pinned(n))
        self.pins.reserve(new)
        return new

    def expire(self, now_s: float) -> None:
        """Drop the pins whose deadline has passed at ``now_s``."""
        for node in self.pins.expire(now_s):
            self.residency.tree.unpin(node, KV.tag)
        self._gauge()

    @staticmethod
    def _range(tokens: int, page: int, start: int, end: int | None) -> tuple[int, int]:
        """Full pages of a prompt of ``tokens`` tokens that the token range ``[start, end)``
        touches."""
        full = tokens // page
        stop = min(full, -(-(tokens if end is None else end) // page))
        return min(start // page, stop), stop

    # == complete / abort ====================================================================

    def complete(self, req: Request, path: Sequence[PageNode]) -> None:
        """Apply the request's actions to its pages ``path`` (in the tree now)."""
        hints = req.hints
        assert hints is not None
        owner = owner_of(hints)
        page = self.page_size
        wall = time.time()
        try:
            for action in hints.actions:
                start, end = self._range(
                    len(req.tokens), page, action.start_token, action.end_token
                )
                if action.action in _PREFIX_ACTIONS:
                    start = 0
                nodes = list(path[start:end])
                until = None if action.duration_s is None else hints.now_s + action.duration_s
                wall_until = None if action.duration_s is None else wall + action.duration_s
                if action.action == "pin":
                    for node in nodes:
                        if self.pins.hold(node, owner, until):
                            self.residency.tree.pin(node, KV.tag)
                    pin = Retention(hold_owner(_l3_owner(owner), pinned=True), wall_until, True)
                    self._hold_l3(nodes, owner, pin)
                elif action.action == "retain":
                    retention = Retention(hold_owner(_l3_owner(owner), pinned=False),
                                          wall_until, False, action.priority)
                    self._hold_l3(nodes, owner, retention)
                elif action.action == "prefetch":
                    self.residency.metrics.note("hint_prefetch")
                elif action.action in ("demote", "drop"):
                    self._let_go(nodes, owner, drop=action.action == "drop")
                elif action.action == "session_end":
                    self.end_session(owner)
        finally:
            self.pins.unreserve(req.pin_reserved)
            req.pin_reserved = 0
            self._gauge()

    def unreserve(self, pages: int) -> None:
        self.pins.unreserve(pages)

    def abort(self, req: Request) -> None:
        """The request will not complete: give its pin reservation back."""
        self.pins.unreserve(req.pin_reserved)
        req.pin_reserved = 0
        if self._announced is req:
            self._announced = None

    def response_end(self, end: ResponseEnd) -> None:
        for policy in self._hinted():
            policy.hint_response(end)

    def end_session(self, owner: str) -> None:
        """Release every pin and L3 hold of ``owner``."""
        for node in self.pins.release_owner(owner):
            self.residency.tree.unpin(node, KV.tag)
        pages = self._l3_held.pop(owner, set())
        self._release_l3(sorted(pages), owner)
        self._gauge()

    def _let_go(self, nodes: Sequence[PageNode], owner: str, *, drop: bool) -> None:
        """``demote`` / ``drop`` of ``nodes`` (module docstring)."""
        res, tree = self.residency, self.residency.tree
        kv = res.parts[KV.tag]
        for node in nodes:
            if self.pins.release(node, owner):
                tree.unpin(node, KV.tag)
        moved = 0
        for node in sorted(nodes, key=lambda n: -n.depth):  # leaves first: prefix-closed
            if tree.is_evictable(node, Tier.L1, KV.tag):
                res.evict(node, kv)
                moved += 1
            if drop and tree.is_evictable(node, Tier.L2, KV.tag):
                res.drop(node, kv)
                res.metrics.count(kv.name, "evictions_l2")
                moved += 1
        res.metrics.note("hint_dropped_copies" if drop else "hint_demoted_copies", moved)
        if drop:
            held = self._l3_held.get(owner)
            names = [n.page_hash for n in nodes if held is not None and n.page_hash in held]
            if held is not None:
                held.difference_update(names)
            self._release_l3(names, owner)

    # == L3 ==================================================================================

    def _l3_ready(self) -> bool:
        """Whether holds can reach L3 (counting the actions that cannot, when L3 exists)."""
        link = self._link
        if link is None or not link.can_write:
            return False
        if not link.backend.capabilities.retention:
            self.residency.metrics.note("hint_l3_unsupported")
            return False
        return True

    def _hold_l3(self, nodes: Sequence[PageNode], owner: str, retention: Retention) -> None:
        if not nodes or not self._l3_ready():
            return
        stored: list[str] = []
        for node in nodes:
            held = node.held(KV.tag)
            if held is not None and held.in_l3:
                stored.append(node.page_hash)
            elif held is not None and held.l3_pending:
                self._after_backup.setdefault(node.page_hash, []).append((owner, retention))
            else:
                self.residency.metrics.note("hint_l3_not_stored")
        self._retain(stored, owner, retention)

    def backed_up(self, node: PageNode, ok: bool) -> None:
        """A backup of ``node``'s KV ended (``ok``: stored): apply the holds waiting for it."""
        waiting = self._after_backup.pop(node.page_hash, None)
        if waiting is None:
            return
        if not ok:
            self.residency.metrics.note("hint_l3_not_stored", len(waiting))
            return
        for owner, retention in waiting:
            self._retain([node.page_hash], owner, retention)

    def _keys(self, pages: Sequence[str]) -> list[str]:
        link = self._link
        assert link is not None
        return [key for page in pages for key in link.write_names(page)]

    def _retain(self, pages: Sequence[str], owner: str, retention: Retention) -> None:
        keys = self._keys(pages)
        if not keys:
            return
        self._l3_held[owner].update(pages)
        backend = self._link.backend  # type: ignore[union-attr]
        kind = "pinned" if retention.pinned else "retained"
        self._calls.append((submit(backend.retain(keys, retention)), kind, len(pages)))

    def _release_l3(self, pages: Sequence[str], owner: str) -> None:
        link = self._link
        if not pages or link is None or not link.backend.capabilities.retention:
            return
        keys = self._keys(pages)
        if keys:
            backend = link.backend

            async def release() -> None:
                for holder in hold_owners(_l3_owner(owner)):
                    await backend.release(keys, holder)

            self._calls.append((submit(release()), "released", len(pages)))

    def poll(self) -> None:
        """Count the L3 calls that ended (engine thread, from ``HiCache.poll``)."""
        running = []
        for future, kind, pages in self._calls:
            if not future.done():
                running.append((future, kind, pages))
                continue
            error = future.exception()
            if error is None:
                self.residency.metrics.note(f"hint_l3_{kind}_pages", pages)
            elif isinstance(error, PinBudgetError):
                self.residency.metrics.note("hint_l3_refused_pages", pages)
                log.warning("L3 refused a pin: %s", error)
            else:
                self.residency.metrics.note("hint_l3_failed_pages", pages)
                log.warning("an L3 retention call failed: %s", error)
        self._calls = running

    def idle(self) -> bool:
        return not self._calls

    def _gauge(self) -> None:
        self.residency.metrics.others["pinned_pages"] = self.pins.pinned
