"""vLLM's per-request KV hints on both vLLM routes: the envelope, and what each action does.

**The envelope** is vLLM 0.32's ``KvHintsEnvelope`` (``vllm.v1.kv_hints``): ``protocol_version``,
``message_id`` and ``actions``, each a ``KvHintAction`` of ``action_id``, ``action_type``,
``action_version`` and a JSON ``payload`` whose schema vLLM leaves to the component that
implements the action. Where each route reads it:

* vLLM's own field, ``Request.kv_hints`` / ``ReqContext.kv_hints``, set by
  ``LLMEngine.add_request(..., kv_hints=envelope)`` / ``AsyncLLM.generate(..., kv_hints=)``
  (the secondary tier, ``HiCacheStoreTier``, and the connector, ``HiCacheStoreConnector``);
* else the request's ``kv_transfer_params["kv_hints"]`` (``SamplingParams(extra_args=
  {"kv_transfer_params": {"kv_hints": ...}})``, or the ``kv_transfer_params`` of an OpenAI
  request to ``vllm serve``): the envelope as JSON with the same field names
  (``msgspec.to_builtins(envelope)``). Both routes read both.

**The schema this library implements** (``action_version`` "1"; ``parse_envelope``):
``action_type`` is one of ``tier.hints.HINT_ACTIONS`` (``pin``, ``retain``, ``prefetch``,
``demote``, ``drop``, ``session_end``; case ignored: ``Pin`` is ``pin``), and the
``payload`` may hold ``session`` (the owner of the holds: one session per envelope),
``start_token`` / ``end_token`` (the token range; default the whole request), ``priority``
(``retain``), ``duration_s`` (how long from arrival; default until released) and
``namespace`` (a namespace digest: hints about another deployment's objects are refused). An
``action_type`` outside that set (such as ``share``) is skipped and counted; anything else
that does not fit (another ``action_version``, an unknown payload key, a wrong type, a bad
range) refuses the whole envelope with ``HintError`` naming it: the route logs it, counts it
(``hints_malformed``) and serves the request as if it had no hints. Hints never fail a request
and never change a token: they decide what stays stored, not what an object holds.

**What each action does** to the request's objects (the tier's row objects of the request's
chunks; the connector's page objects), through the backend's retention API
(``backends.retention``), the owner being the session (``anonymous`` without one; its pins
and its retention as two owner ids, ``backends.retention.hold_owner``, so that a later
``retain`` never replaces the session's own pin):

=============== ==============================================================================
``pin``         ``Backend.retain(pinned=True, until=now + duration_s)`` on the units from the
                request's start to the range's end (a unit serves only with its prefix): never
                evicted while it holds. Past the backend's pin budget the pin is refused whole
                (``PinBudgetError``: logged with its reason, ``hint_pins_refused``); the
                request is served as usual.
``retain``      ``Backend.retain(priority, until)`` on the same units: evicted after
                unretained data, lowest priority first.
``prefetch``    nothing more than vLLM does for every request (counted, ``hint_prefetch``).
``demote``      ``Backend.release`` of the session's holds on the units the range touches.
``drop``        as ``demote``, then the units' objects are deleted unless another owner's
                hold is on them.
``session_end`` every hold the session made through this route instance is released.
=============== ==============================================================================

A backend that does not declare ``capabilities.retention`` takes none of this: each action
that needed it is counted (``hint_unsupported``) and logged once, never an error (``drop``
still deletes there). A failed backend call is counted (``hint_failures``) and logged. Holds
apply to objects that are stored (``retain`` ignores absent keys), so the routes hand them
over once a unit's write has ended. Each route instance remembers the keys every session
holds until its ``session_end``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_store._sync import submit
from hicache_store.backends import Backend
from hicache_store.backends.errors import PinBudgetError
from hicache_store.backends.retention import Retention, hold_owner, hold_owners
from hicache_store.tier.hints import HINT_ACTIONS, HintAction, RequestHints

log = logging.getLogger("hicache_store.integrations.vllm")

#: the ``kv_transfer_params`` key the connector reads an envelope from.
ENVELOPE_KEY = "kv_hints"

#: the ``action_version`` of the payload schema above.
ACTION_VERSION = "1"

#: owner of holds made without a session (the tier's convention).
ANONYMOUS = "anonymous"

_PAYLOAD_KEYS = frozenset({"session", "start_token", "end_token", "priority", "duration_s",
                           "namespace"})


class HintError(ValueError):
    """An envelope that does not fit the schema (the message names the field)."""


@dataclass(frozen=True)
class Parsed:
    """An envelope read: the hints (``session`` is the owner) and the action types skipped."""

    hints: RequestHints
    skipped: tuple[str, ...] = ()

    @property
    def owner(self) -> str:
        return self.hints.session or ANONYMOUS


def _field(obj: object, name: str) -> Any:
    if isinstance(obj, Mapping):
        if name not in obj:
            raise HintError(f"kv_hints: {name!r} is missing")
        return obj[name]
    if not hasattr(obj, name):
        raise HintError(f"kv_hints: {type(obj).__name__} has no {name!r}")
    return getattr(obj, name)


def _int(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HintError(f"kv_hints: {where} must be a non-negative integer, got {value!r}")
    return value


def _seconds(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        math.isfinite(value) and value >= 0
    ):
        raise HintError(f"kv_hints: {where} must be a finite, non-negative number, got {value!r}")
    return float(value)


def parse_envelope(envelope: object, *, now_s: float, namespace: str) -> Parsed | None:
    """Read a ``KvHintsEnvelope`` (or its JSON form) for a route of ``namespace`` (a digest);
    None when there is none or it has no action. ``HintError`` names what does not fit."""
    if envelope is None:
        return None
    for name in ("protocol_version", "message_id"):
        if not isinstance(_field(envelope, name), str):
            raise HintError(f"kv_hints: {name} must be a string")
    raw = _field(envelope, "actions")
    if not isinstance(raw, list | tuple):
        raise HintError(f"kv_hints: actions must be a list, got {type(raw).__name__}")
    actions: list[HintAction] = []
    skipped: list[str] = []
    sessions: set[str] = set()
    for i, item in enumerate(raw):
        kind = _field(item, "action_type")
        if not isinstance(kind, str):
            raise HintError(f"kv_hints: actions[{i}].action_type must be a string")
        if kind.lower() not in HINT_ACTIONS:
            skipped.append(kind)
            continue
        version = _field(item, "action_version")
        if version != ACTION_VERSION:
            raise HintError(
                f"kv_hints: actions[{i}] ({kind}) has action_version {version!r}; "
                f"this library implements {ACTION_VERSION!r}"
            )
        payload = _field(item, "payload")
        if not isinstance(payload, Mapping):
            raise HintError(f"kv_hints: actions[{i}].payload must be a JSON object")
        unknown = sorted(set(payload) - _PAYLOAD_KEYS)
        if unknown:
            raise HintError(
                f"kv_hints: actions[{i}] ({kind}) has unknown payload keys {unknown}; "
                f"known: {sorted(_PAYLOAD_KEYS)}"
            )
        where = f"actions[{i}].payload"
        session = payload.get("session")
        if session is not None:
            if not isinstance(session, str) or not session:
                raise HintError(f"kv_hints: {where}.session must be a non-empty string")
            sessions.add(session)
        digest = payload.get("namespace")
        if digest is not None and digest != namespace:
            raise HintError(
                f"kv_hints: {where}.namespace {digest!r} is not this deployment's "
                f"({namespace}); hints about another deployment's objects are refused"
            )
        end = payload.get("end_token")
        duration = payload.get("duration_s")
        try:
            actions.append(HintAction(
                kind.lower(),
                _int(f"{where}.start_token", payload.get("start_token", 0)),
                None if end is None else _int(f"{where}.end_token", end),
                _priority(f"{where}.priority", payload.get("priority", 0)),
                None if duration is None else _seconds(f"{where}.duration_s", duration),
            ))
        except HintError:
            raise
        except ValueError as exc:  # HintAction's own checks (a reversed range)
            raise HintError(f"kv_hints: {where}: {exc}") from exc
    if len(sessions) > 1:
        raise HintError(f"kv_hints: one session per envelope, got {sorted(sessions)}")
    if not actions and not skipped:
        return None
    hints = RequestHints(now_s, session=next(iter(sessions), None), actions=tuple(actions),
                         namespace=namespace)
    return Parsed(hints, tuple(skipped))


def _priority(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HintError(f"kv_hints: {where} must be an integer, got {value!r}")
    return value


# -- actions over a request's units -------------------------------------------------------------


@dataclass(frozen=True)
class KeyOp:
    """One backend step: ``kind`` ``hold`` (``retention``), ``release``, ``drop`` or ``end``
    (release everything ``owner`` holds) over ``names`` (storage keys, or page hashes that a
    connector worker turns into its keys)."""

    owner: str
    kind: str
    names: tuple[str, ...] = ()
    retention: Retention | None = None


@dataclass(frozen=True)
class Unit:
    """A stored unit of a request (a chunk, a page): tokens ``[start, end)`` and its names."""

    start: int
    end: int
    names: tuple[str, ...]


def ops_for(parsed: Parsed, units: Iterable[Unit], *, wall_s: float) -> list[KeyOp]:
    """The backend steps ``parsed``'s range actions take on ``units`` (module docstring):
    the holds first (a session's pins and its retention are kept under two owner ids,
    ``backends.retention.hold_owner``, so a retain never replaces a pin; within one envelope
    the last pin and the last retain of an object win), then releases and drops in the
    envelope's order.
    ``wall_s``: the request's arrival on the wall clock (deadlines start there)."""
    units = list(units)
    owner = parsed.owner
    holds: dict[tuple[str, bool], Retention] = {}  # per object and kind (pinned or not)
    ops: list[KeyOp] = []
    for action in parsed.hints.actions:
        stop = math.inf if action.end_token is None else action.end_token
        if action.action in ("pin", "retain"):
            chosen = [u for u in units if u.start < stop]
        elif action.action in ("demote", "drop"):
            chosen = [u for u in units if u.start < stop and u.end > action.start_token]
        else:
            continue
        names = tuple(n for u in chosen for n in u.names)
        if not names:
            continue
        if action.action in ("pin", "retain"):
            until = None if action.duration_s is None else wall_s + action.duration_s
            pinned = action.action == "pin"
            retention = Retention(hold_owner(owner, pinned=pinned), until, pinned,
                                  0 if pinned else action.priority)
            for name in names:
                holds[name, pinned] = retention
        else:
            ops.append(KeyOp(owner, "release" if action.action == "demote" else "drop", names))
    grouped: dict[Retention, list[str]] = {}
    for (name, _), retention in holds.items():
        grouped.setdefault(retention, []).append(name)
    return [KeyOp(owner, "hold", tuple(n), r) for r, n in grouped.items()] + ops


def arrival_ops(parsed: Parsed) -> list[KeyOp]:
    """The steps a request's hints take when it arrives (``session_end``)."""
    return [KeyOp(parsed.owner, "end") for a in parsed.hints.actions if a.action == "session_end"]


# -- the backend side ---------------------------------------------------------------------------


class HintSink:
    """Applies ``KeyOp`` steps to one backend; never raises (module docstring). ``count(name,
    n)`` receives the counters; ``route`` names the route in log lines."""

    def __init__(self, backend: Backend, count: Callable[[str, int], None], route: str) -> None:
        self.backend = backend
        self.count = count
        self.route = route
        self._held: dict[str, set[str]] = collections.defaultdict(set)
        self._lock = threading.Lock()
        self._told: set[str] = set()

    def malformed(self, error: Exception) -> None:
        """A refused envelope: logged with its reason, counted."""
        self.count("hints_malformed", 1)
        log.error("%s: kv_hints refused, the request is served without hints: %s",
                  self.route, error)

    def read(self, parsed: Parsed | None) -> None:
        """Count what reading an envelope skipped (logged once per action type)."""
        if parsed is None:
            return
        for kind in parsed.skipped:
            self.count("hint_skipped_actions", 1)
            self._once(f"skip:{kind}", "%s: kv_hints action_type %r is not implemented here; "
                       "skipped (implemented: %s)", self.route, kind, ", ".join(HINT_ACTIONS))
        prefetch = sum(a.action == "prefetch" for a in parsed.hints.actions)
        if prefetch:
            self.count("hint_prefetch", prefetch)

    def _once(self, topic: str, message: str, *args: object) -> None:
        with self._lock:
            if topic in self._told:
                return
            self._told.add(topic)
        log.warning(message, *args)

    async def apply(self, ops: Sequence[KeyOp]) -> None:
        for op in ops:
            try:
                await self._apply(op)
            except Exception as exc:  # a hint never fails the request
                self.count("hint_failures", 1)
                log.warning("%s: kv_hints %s of %d objects for %s failed: %r",
                            self.route, op.kind, len(op.names), op.owner, exc)

    async def _apply(self, op: KeyOp) -> None:
        backend = self.backend
        if not backend.capabilities.retention:
            if op.kind != "drop":
                self.count("hint_unsupported", 1)
                self._once("unsupported", "%s: backend %s keeps no retention; kv_hints pin / "
                           "retain / demote / session_end are counted and ignored",
                           self.route, backend.name)
                return
            await backend.delete(list(op.names))
            self.count("hint_dropped_objects", len(op.names))
            return
        if op.kind == "hold":
            assert op.retention is not None
            kind = "pinned" if op.retention.pinned else "retained"
            try:
                await backend.retain(list(op.names), op.retention)
            except PinBudgetError as exc:
                self.count("hint_pins_refused", 1)
                log.warning("%s: kv_hints pin of %d objects for %s refused: %s",
                            self.route, len(op.names), op.owner, exc)
                return
            with self._lock:
                self._held[op.owner].update(op.names)
            self.count(f"hint_{kind}_objects", len(op.names))
            return
        if op.kind == "end":
            with self._lock:
                names = sorted(self._held.pop(op.owner, set()))
        else:
            names = list(op.names)
            with self._lock:
                self._held.get(op.owner, set()).difference_update(names)
        if names:
            for holder in hold_owners(op.owner):
                await backend.release(names, holder)
            self.count("hint_released_objects", len(names))
        if op.kind == "drop" and names:
            others = await backend.retention_of(names)
            free = [n for n, held in zip(names, others, strict=True) if not held]
            if free:
                await backend.delete(free)
            self.count("hint_dropped_objects", len(free))

    def held(self, owner: str) -> set[str]:
        """The keys ``owner`` holds through this sink (a copy)."""
        with self._lock:
            return set(self._held.get(owner, ()))


def after(
    previous: concurrent.futures.Future[Any] | None, coro: Coroutine[Any, Any, None]
) -> Coroutine[Any, Any, None]:
    """``coro`` once ``previous`` (a write chain's future) has ended, whatever its outcome."""

    async def chained() -> None:
        if previous is not None:
            with contextlib.suppress(Exception):  # the write chain logs its own failures
                await asyncio.wrap_future(previous)
        await coro

    return chained()


def now() -> float:
    """The wall clock hints' deadlines run on (``Retention.until_s``: unix seconds)."""
    return time.time()



# -- the routes' hooks --------------------------------------------------------------------------


@dataclass
class _Request:
    """A hinted request: its hints, its arrival (wall clock), the units already handed over."""

    parsed: Parsed
    wall_s: float
    sent: int = 0


def envelope_of(kv_hints: object, kv_transfer_params: Mapping[str, Any] | None) -> object:
    """A request's envelope: vLLM's ``kv_hints`` field, else ``kv_transfer_params["kv_hints"]``."""
    if kv_hints is not None:
        return kv_hints
    return (kv_transfer_params or {}).get(ENVELOPE_KEY)


def _read(sink: HintSink, envelope: object, namespace: str) -> _Request | None:
    wall = now()
    try:
        parsed = parse_envelope(envelope, now_s=wall, namespace=namespace)
    except HintError as exc:
        sink.malformed(exc)
        return None
    sink.read(parsed)
    return None if parsed is None else _Request(parsed, wall)


class TierHints:
    """``HiCacheStoreTier``'s hints: read at ``on_new_request`` (``ReqContext.kv_hints``, else
    its ``kv_transfer_params["kv_hints"]``), applied to the row objects of the request's
    chunks the tier stores (once the store job has ended) or finds (``lookup`` hits, handed
    over at the step's end). A chunk's tokens are ``[position - tokens per chunk,
    position)``, its position being vLLM's (``ReqContext.get_offload_key_position``).
    Counters: ``counts``."""

    def __init__(
        self, backend: Backend, namespace: str, storage_key: Callable[[bytes], str],
        chunk_tokens: Mapping[int, int],
    ) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.sink = HintSink(backend, self._count, "HiCacheStoreTier")
        self.namespace = namespace
        self._storage_key = storage_key
        self._chunk_tokens = dict(chunk_tokens)
        self._default_chunk = max(self._chunk_tokens.values(), default=0)
        self._found: list[tuple[Any, bytes]] = []
        self._calls: list[concurrent.futures.Future[None]] = []

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        self._calls = [c for c in self._calls if not c.done()]
        self._calls.append(submit(coro))

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the backend steps handed over so far (tests, shutdown)."""
        concurrent.futures.wait(self._calls, timeout)

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self.counts[name] += n

    def new_request(self, req_context: Any) -> None:
        envelope = envelope_of(req_context.kv_hints, req_context.kv_transfer_params)
        request = _read(self.sink, envelope, self.namespace)
        if request is None:
            return
        req_context.set_state(request)
        ops = arrival_ops(request.parsed)
        if ops:
            self._submit(self.sink.apply(ops))

    def _ops(self, req_context: Any, keys: Iterable[bytes]) -> list[KeyOp]:
        request = req_context.get_state(_Request)
        if request is None:
            return []
        units = []
        for key in keys:
            end = req_context.get_offload_key_position(key)
            if end is None:
                continue
            span = self._chunk_tokens.get(int.from_bytes(key[-4:], "big"), self._default_chunk)
            units.append(Unit(max(0, end - span), end, (self._storage_key(key),)))
        return ops_for(request.parsed, units, wall_s=request.wall_s)

    def holds(self, job: Any) -> bool:
        """Whether the request's hints hold (pin or retain) any of the store job's rows: such
        a job is written whatever the tier's write admission says."""
        return any(op.kind == "hold" for op in self._ops(job.req_context, job.keys))

    def stored(self, job: Any, future: concurrent.futures.Future[Any]) -> None:
        """A store job was submitted: its chunks' holds once it has ended."""
        ops = self._ops(job.req_context, job.keys)
        if ops:
            self._submit(after(future, self.sink.apply(ops)))

    def found(self, key: bytes, req_context: Any) -> None:
        """``lookup`` found ``key`` stored for a request (held at the step's end)."""
        if req_context.get_state(_Request) is not None:
            self._found.append((req_context, key))

    def flush(self) -> None:
        """The step's end: the holds of the chunks found in it."""
        found, self._found = self._found, []
        by_request: dict[int, tuple[Any, list[bytes]]] = {}
        for ctx, key in found:
            by_request.setdefault(id(ctx), (ctx, []))[1].append(key)
        ops = [op for ctx, keys in by_request.values() for op in self._ops(ctx, keys)]
        if ops:
            self._submit(self.sink.apply(ops))


class ConnectorHints:
    """``HiCacheStoreConnector``'s hints. Scheduler: read when a request is first tracked
    (``Request.kv_hints``, else ``kv_transfer_params["kv_hints"]``); each step, ``plan`` hands
    the actions over for the request's pages up to where the store holds them or their saves
    have been planned, as ``KeyOp`` steps over page hashes carried in the step's metadata.
    Worker: ``apply_after`` runs them after every save issued before (the save chain), over
    the objects this rank writes of each page."""

    def __init__(
        self, backend: Backend, namespace: str, page_tokens: int,
        count: Callable[[str, int], None],
    ) -> None:
        self.sink = HintSink(backend, count, "HiCacheStoreConnector")
        self.namespace = namespace
        self.page_tokens = page_tokens
        self._requests: dict[str, _Request] = {}
        self._arrivals: list[KeyOp] = []

    def track(self, request: Any) -> None:
        """A request seen for the first time."""
        envelope = envelope_of(getattr(request, "kv_hints", None),
                               getattr(request, "kv_transfer_params", None))
        hinted = _read(self.sink, envelope, self.namespace)
        if hinted is not None:
            self._requests[request.request_id] = hinted
            self._arrivals.extend(arrival_ops(hinted.parsed))

    def plan(self, tracked: Mapping[str, Any]) -> list[KeyOp]:
        """This step's steps; ``tracked``: request id -> the connector's ``_Tracked`` (its
        ``hashes``, ``planned`` and ``stored_pages``)."""
        ops, self._arrivals = self._arrivals, []
        for req_id, request in self._requests.items():
            state = tracked.get(req_id)
            if state is None:
                continue
            frontier = min(len(state.hashes), max(state.planned, state.stored_pages))
            if frontier <= request.sent:
                continue
            pages = self.page_tokens
            units = [Unit(i * pages, (i + 1) * pages, (state.hashes[i],))
                     for i in range(request.sent, frontier)]
            request.sent = frontier
            ops.extend(ops_for(request.parsed, units, wall_s=request.wall_s))
        return ops

    def holds(self, req_id: str, pages: Iterable[int]) -> bool:
        """Whether the request's hints hold (pin or retain) any of its pages ``pages`` (page
        indexes): their saves are made whatever the connector's write admission says."""
        request = self._requests.get(req_id)
        if request is None:
            return False
        span = self.page_tokens
        units = [Unit(i * span, (i + 1) * span, (str(i),)) for i in pages]
        return any(op.kind == "hold" for op in ops_for(request.parsed, units, wall_s=request.wall_s))

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def apply_after(
        self, previous: concurrent.futures.Future[Any] | None, ops: Sequence[KeyOp],
        names: Callable[[str], list[str]],
    ) -> concurrent.futures.Future[None]:
        """Worker: ``ops`` (over page hashes) on this rank's objects of those pages
        (``names``), after ``previous``; the returned future never raises."""
        keyed = [dataclasses.replace(op, names=tuple(k for h in op.names for k in names(h)))
                 for op in ops]
        return submit(after(previous, self.sink.apply(keyed)))
