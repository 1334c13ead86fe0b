"""Hints: what an engine knows about a request beyond its tokens, in the shape the tier takes.

An engine serving agent sessions knows things a cache cannot infer from page hashes: which
session a request belongs to, whether that session's previous response ended in a tool call
(the agent sends the next request within seconds) or handed the turn to a human (minutes, or
never), when that response ended, whether the request starts a subagent, and what the
application asked for (pin this system prompt, keep this conversation ten minutes, drop that
one). Two records carry it, both frozen and validated on construction:

``RequestHints``
    One per request, handed over when the request arrives (before its pages are used): the
    engine's clock ``now_s``, the ``session`` and the session that started it
    (``parent_session``, for a subagent), the ``previous_stop`` and ``previous_end_s`` of the
    session's previous response, and ``actions``: per-request ``HintAction`` items with the
    actions of vLLM's per-request hints envelope (``pin``, ``retain``, ``prefetch``,
    ``demote``, ``drop``, ``session_end``), each over a token range of the prompt. A request
    with no session (``session=None``) carries no session signal at all. ``namespace``: the
    digest of the namespace the hints are about (None: the tier's own); a tier refuses hints
    about a namespace it does not own.

``ResponseEnd``
    One per response, handed over when the response has ended (never earlier): its session,
    its stop reason and its end time. An engine sees this as the response finishes; a replay
    hands it over before the first request that arrives at or after ``end_s``.

Everything here is known at the time it is handed over: nothing in these records describes
the future. Consumers (``tier.eviction.SessionEviction``) predict from them; they never see
the trace or the requests to come.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: the response ended by calling a tool: the agent sends its next request once the tool ran.
STOP_TOOL_USE = "tool_use"

#: the response ended the turn: the next request waits for a human.
STOP_END_TURN = "end_turn"

#: actions of a ``HintAction`` (the per-request hints envelope's vocabulary).
HINT_ACTIONS: tuple[str, ...] = ("pin", "retain", "prefetch", "demote", "drop", "session_end")

#: request kinds of a session: its main conversation, or a subagent it started.
SESSION_KINDS: tuple[str, ...] = ("main", "subagent")


def _check_time(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite, non-negative number of seconds, got {value!r}")


@dataclass(frozen=True)
class HintAction:
    """One action over the prompt's tokens ``[start_token, end_token)`` (``end_token`` None: to
    the end of the prompt). ``priority``: higher is kept longer (``retain``); ``duration_s``:
    how long the action holds from the request's arrival (None: until undone or the session
    ends)."""

    action: str
    start_token: int = 0
    end_token: int | None = None
    priority: int = 0
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.action not in HINT_ACTIONS:
            raise ValueError(f"hint action {self.action!r} is not one of {', '.join(HINT_ACTIONS)}")
        if self.start_token < 0 or (self.end_token is not None and self.end_token < self.start_token):
            raise ValueError(
                f"hint action {self.action}: token range [{self.start_token}, {self.end_token}) "
                "is not a range of the prompt"
            )
        _check_time("duration_s", self.duration_s)


@dataclass(frozen=True)
class RequestHints:
    """What the engine knows of a request when it arrives (module docstring)."""

    now_s: float
    session: str | None = None
    parent_session: str | None = None
    kind: str = "main"
    previous_stop: str | None = None
    previous_end_s: float | None = None
    session_start: bool = False
    actions: tuple[HintAction, ...] = ()
    namespace: str | None = None

    def __post_init__(self) -> None:
        _check_time("now_s", self.now_s)
        _check_time("previous_end_s", self.previous_end_s)
        if self.kind not in SESSION_KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {', '.join(SESSION_KINDS)}")
        if self.session is None and (
            self.parent_session is not None
            or self.previous_stop is not None
            or self.previous_end_s is not None
        ):
            raise ValueError("session signals (parent, previous response) need a session id")
        if self.previous_end_s is not None and self.previous_end_s > self.now_s:
            raise ValueError(
                f"the previous response ends at {self.previous_end_s} s, after the request "
                f"arrives at {self.now_s} s: a hint cannot describe the future"
            )

    @property
    def idle_s(self) -> float | None:
        """Seconds since the session's previous response ended (None: none is known)."""
        if self.previous_end_s is None:
            return None
        return self.now_s - self.previous_end_s


@dataclass(frozen=True)
class ResponseEnd:
    """A response of ``session`` ended at ``end_s`` with ``stop`` (``""``: not known)."""

    session: str
    stop: str
    end_s: float

    def __post_init__(self) -> None:
        _check_time("end_s", self.end_s)
