"""Consensus-check mode: find the first cache decision on which the ranks of a group disagree.

A disagreement between ranks about a cache decision (how many prefix pages hit, how many
completed transfers to apply) shows up much later as a tensor of the wrong shape or as a
collective that never returns. In this mode
every rank keeps a log of its decisions in logical order, and at each agreement the ranks
exchange the entries logged since the previous one (``all_gather_object``) and compare them
position by position. The first position where they differ is reported on every rank at once
(so no rank is left waiting in a collective) as a ``RankDivergenceError`` naming:

* the decision's index in the logical sequence (the same on every rank by construction),
* what differs: the *call* (ranks reached different decisions at this point: different call
  order, or one rank skipped one), its *arguments* (the request the decision was about: request
  number, token count, digest of the tokens; different arguments point to an earlier state
  mismatch), or its *result* (same call and arguments, different value: inspect the cache
  operation itself),
* which ranks had which value.

Two kinds of entry are logged:

* agreements (``RankGroup.agree_min``): the local inputs may differ (that is why the group
  takes the minimum); only the call and its arguments are compared, and the local values are
  shown in a report.
* notes (``note``): a rank-local decision that must be equal on every rank (for example how many
  pages of a request were found in L1). Notes cost no collective; they are compared at the
  next agreement.

Enable it on every rank before startup with ``HICACHE_STORE_CONSENSUS_CHECK=1`` (the analogue
of SGLang's ``SGLANG_ENABLE_RANK_CONSENSUS_CHECKER``). It costs one ``all_gather_object`` of a
few small tuples per agreement instead of one ``all_reduce`` of an integer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The environment variable that enables the consensus check (``1``/``true``/``yes``/``on``).
ENV_VAR = "HICACHE_STORE_CONSENSUS_CHECK"


def consensus_check_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``HICACHE_STORE_CONSENSUS_CHECK`` asks for the consensus check."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() in {"1", "true", "yes", "on"}


Args = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Decision:
    """One logged decision of one rank.

    ``index``: position in the rank's logical sequence of decisions. ``what``: the decision's
    name (``"prefix_pages"``, ``"backup_acks"``, ...). ``args``: what it was about, as sorted
    ``(name, value)`` pairs (must be equal on every rank). ``local``: this rank's value.
    ``agreement``: True for an agreement (local values may differ), False for a note (local
    values must be equal).
    """

    index: int
    what: str
    args: Args
    local: Any
    agreement: bool

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.args)
        kind = "agree" if self.agreement else "note"
        return f"{kind} {self.what}({args}) local={self.local!r}"


class RankDivergenceError(RuntimeError):
    """Ranks disagreed on a cache decision; raised on every rank of the group at once.

    ``index``: the first divergent decision's position; ``what``: its name on the reporting
    rank; ``field``: ``"call"``, ``"arguments"`` or ``"result"``; ``groups``: for each distinct
    value of that field, the ranks that had it; ``decisions``: every rank's entry at ``index``
    (None for a rank that had none).
    """

    def __init__(
        self,
        index: int,
        what: str,
        field: str,
        groups: Sequence[tuple[str, Sequence[int]]],
        decisions: Sequence[Decision | None],
    ) -> None:
        self.index = index
        self.what = what
        self.field = field
        self.groups = [(value, list(ranks)) for value, ranks in groups]
        self.decisions = list(decisions)
        parts = "; ".join(f"ranks {ranks}: {value}" for value, ranks in self.groups)
        detail = "\n".join(
            f"  rank {r}: {d.describe() if d is not None else '(no decision)'}"
            for r, d in enumerate(self.decisions)
        )
        super().__init__(
            f"Found rank divergence at decision #{index} ({what!r}): the {field} differs: "
            f"{parts}\n{detail}"
        )


def _grouped(values: Sequence[str]) -> list[tuple[str, list[int]]]:
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return list(groups.items())


def first_divergence(entries: Sequence[Sequence[Decision]]) -> RankDivergenceError | None:
    """Compare the ranks' entries (``entries[rank]``, logical order) and return the error
    describing the first divergence, or None when they agree."""
    longest = max((len(e) for e in entries), default=0)
    for pos in range(longest):
        row = [e[pos] if pos < len(e) else None for e in entries]
        present = [d for d in row if d is not None]
        index = present[0].index
        what = present[0].what
        calls = [
            "(no decision)" if d is None else f"{d.what} ({'agree' if d.agreement else 'note'})"
            for d in row
        ]
        if len(set(calls)) > 1:
            return RankDivergenceError(index, what, "call", _grouped(calls), row)
        args = [", ".join(f"{k}={v}" for k, v in d.args) for d in present]
        if len(set(args)) > 1:
            return RankDivergenceError(index, what, "arguments", _grouped(args), row)
        if not present[0].agreement:
            results = [repr(d.local) for d in present]
            if len(set(results)) > 1:
                return RankDivergenceError(index, what, "result", _grouped(results), row)
    return None


@dataclass
class ConsensusLog:
    """One rank's decisions in logical order; ``pending`` are those not yet compared."""

    decisions: list[Decision] = field(default_factory=list)
    pending: list[Decision] = field(default_factory=list)

    def add(self, what: str, args: Args, local: Any, *, agreement: bool) -> Decision:
        decision = Decision(len(self.decisions), what, args, local, agreement)
        self.decisions.append(decision)
        self.pending.append(decision)
        return decision

    def take_pending(self) -> list[Decision]:
        pending, self.pending = self.pending, []
        return pending
