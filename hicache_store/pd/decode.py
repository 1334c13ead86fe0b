"""The decode worker of P/D: reuse the prefix it holds, receive only the rest from prefill.

``DecodeWorker.serve(prompt)`` admits one request:

1. **Match and reserve** (``tier.match`` + ``tier.prepare``): the decode side's cache (L1 + L2,
   and an L3 span only once its prefetch has been accepted: ``prepare`` settles the prefetch
   before it fixes the prefix) locks the prefix it holds, starts restoring the L2 part into L1
   (layer by layer, in the background) and reserves device pages for the rest of the prompt.
   The reusable, page-aligned boundary ``decode_prefix_len`` is ``Prepared.start``. Without a
   cache (``tier=None``, decode reuse off: the baseline) the boundary is 0 and the pages come
   straight from the pool.
2. **Ask prefill** for the KV after the boundary: ``PrefillRequest`` names one landing row per
   suffix page (registered memory, ``pd.pages``) and the page hash at the boundary.
3. **Wait for both** the local restore and the remote reception (``PrefillDone``, sent after
   the data landed); then unpack the landing rows into the reserved pages. Only then is the
   request ready to decode: ``Served.slots`` hold the whole prompt's KV.
4. **Failure**: if the local restore cannot supply the promised prefix (the L2 -> L1 load
   failed), or prefill fails, or its answer does not match the request, the request is aborted
   (``tier.abort``: nothing of it is inserted, the pages it was filling are dropped) and retried
   once *without reuse* (boundary 0, everything from prefill); if that fails too,
   ``DecodeFailed`` is raised. A request is never served with KV that was not fully restored
   and received.

Landing rows are freed only once prefill has answered for their request (done or failed):
a late write can then never land in rows another request uses. Rows of a request whose
answer never came (timeout) stay *quarantined* (``quarantined_rows``) until the worker closes.

Then the caller decodes over ``Served.slots`` (``Served.extend(tokens)`` reserves the slots of
generated tokens) and calls ``Served.finish()``: the prompt and generated tokens join the
decode side's cache (``tier.complete``), or the pages go back to the pool (baseline).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.errors import HiCacheStoreError
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Namespace
from hicache_store.tier.cache import DevicePagePool, HiCache, Request, page_slots

from .pages import PageRows, unpack_from
from .protocol import (
    PROTOCOL_VERSION,
    Bye,
    Channel,
    Failed,
    Hello,
    Message,
    PrefillDone,
    PrefillRequest,
    ProtocolError,
    Welcome,
    check_boundary,
    suffix_pages,
)
from .state import StateCodec
from .transport import Transport

log = logging.getLogger(__name__)


class DecodeFailed(HiCacheStoreError):
    """A request could not be served, with reuse and then without: nothing was decoded."""


class _AttemptFailed(Exception):
    """One attempt failed (the request is retried without reuse). ``answered``: prefill has
    answered for it (so it writes nothing more into its landing rows)."""

    def __init__(self, message: str, *, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered


@dataclass
class Served:
    """A request ready to decode: the KV of every prompt token is at ``slots`` in the pool.

    ``boundary`` (``decode_prefix_len``): prompt tokens the decode side supplied itself;
    ``received_bytes``: bytes prefill sent for it (the successful attempt); ``attempts``: 1, or 2
    after a failure retried without reuse; ``first_token``: prefill's first output token;
    ``state``: the model's extra state handle (``StateCodec.decode``), None for plain KV;
    ``restore_wait_s`` / ``remote_wait_s``: how long the worker waited for each after sending;
    ``prefill_compute_s`` / ``prefill_send_s``: prefill's own account of computing the prompt
    and of writing the suffix.
    """

    prompt: list[int]
    slots: torch.Tensor
    boundary: int
    received_bytes: int
    attempts: int
    first_token: int
    prefill_cached: int
    restore_wait_s: float
    remote_wait_s: float
    prefill_compute_s: float = 0.0
    prefill_send_s: float = 0.0
    state: Any = None
    _worker: DecodeWorker | None = field(default=None, repr=False)
    _req: Request | None = field(default=None, repr=False)
    _pages: list[int] = field(default_factory=list, repr=False)

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Reserve slots for ``tokens`` generated after the prompt (and earlier extensions);
        return the slots of the whole sequence."""
        worker = self._live()
        if self._req is not None:
            assert worker.tier is not None
            self.slots = worker.tier.extend(self._req, tokens)
            return self.slots
        total = len(self.slots) + len(tokens)
        missing = math.ceil(total / worker.page_size) - len(self._pages)
        if missing > 0:
            self._pages.extend(worker.pool.alloc(missing))
        self.slots = page_slots(self._pages, worker.page_size)[:total]
        return self.slots

    def finish(self) -> None:
        """The request is done: its pages join the decode side's cache (baseline: freed)."""
        worker = self._live()
        if self._req is not None:
            assert worker.tier is not None
            worker.tier.complete(self._req)
        else:
            worker.pool.free(self._pages)
        self._worker = None

    def _live(self) -> DecodeWorker:
        if self._worker is None:
            raise ValueError("the request is already finished")
        return self._worker


@dataclass
class _Attempt:
    """One attempt at receiving a request: what it holds until it is answered."""

    rid: int
    prompt: list[int]
    boundary: int
    slots: torch.Tensor
    suffix_pages: list[int]
    landing: list[int]
    state_rows: list[int]
    req: Request | None
    wait_layer: Any
    pages: list[int]


class DecodeWorker:
    """The decode side for one model and one prefill worker (see the module docstring).

    ``pool``: the device pool decode computes over (the tier's pool when ``tier`` is given);
    ``tier``: the decode-side cache, or None for decode reuse off; ``landing_rows``: registered
    rows for incoming pages (at least the longest prompt's pages plus the state rows);
    ``timeout_s``: how long to wait for prefill's answer to one request.
    """

    def __init__(
        self,
        pool: DevicePagePool,
        namespace: Namespace,
        transport: Transport,
        channel: Channel,
        *,
        tier: HiCache | None = None,
        landing_rows: int = 256,
        timeout_s: float = 60.0,
        state: StateCodec | None = None,
    ) -> None:
        if tier is not None and tier.pool is not pool:
            raise ValueError("pool: with a tier, decode computes over the tier's own pool")
        self.pool = pool
        self.namespace = namespace
        self.page_size = namespace.page_size
        self.tier = tier
        self.transport = transport
        self.channel = channel
        self.timeout_s = timeout_s
        self.state = state
        self.layout = tier.layout if tier is not None else UnifiedPageLayout.full_page(namespace)
        self.kernel_backend = tier.kernel_backend if tier is not None else "auto"
        self.device = DevicePool.mha(pool.k_buffers, pool.v_buffers)
        self.landing = PageRows(transport, landing_rows, self.layout.page_bytes)
        self.state_rows = state.rows(self.layout.page_bytes) if state is not None else 0
        self._rids = itertools.count(1)
        self._pending: dict[int, Message] = {}
        self._quarantined: dict[int, list[int]] = {}
        self.metrics = DecodeMetrics()

    @property
    def quarantined_rows(self) -> int:
        """Landing rows held back because prefill never answered for their request."""
        return sum(len(rows) for rows in self._quarantined.values())

    # -- handshake ------------------------------------------------------------------------------

    def handshake(self) -> None:
        """Introduce this side to the prefill worker; ``ProtocolError`` if it refuses."""
        self.channel.send(
            Hello(
                version=PROTOCOL_VERSION,
                namespace=self.namespace.digest,
                page_size=self.page_size,
                page_bytes=self.layout.page_bytes,
                transport=self.transport.name,
                endpoint=self.transport.endpoint,
                landing_address=self.landing.base,
                landing_rows=self.landing.num_rows,
                state=self.state.describe() if self.state is not None else {},
            )
        )
        answer = self.channel.recv(self.timeout_s)
        if isinstance(answer, Failed):
            raise ProtocolError(f"the prefill worker refused the handshake: {answer.error}")
        if not isinstance(answer, Welcome) or answer.namespace != self.namespace.digest:
            raise ProtocolError(f"unexpected handshake answer {answer!r:.200}")

    # -- one request ----------------------------------------------------------------------------

    def serve(self, prompt: Sequence[int]) -> Served:
        """Make ``prompt``'s KV ready to decode (see the module docstring); ``DecodeFailed`` if
        neither the attempt with reuse nor the retry without it succeeded."""
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("prompt: empty")
        errors: list[str] = []
        for attempt, reuse in enumerate((True, False), start=1):
            try:
                return self._attempt(tokens, reuse=reuse, attempt=attempt)
            except _AttemptFailed as exc:
                errors.append(str(exc))
                self.metrics.failed_attempts += 1
                log.warning("P/D request attempt %d failed: %s", attempt, exc)
        self.metrics.failed_requests += 1
        raise DecodeFailed("; then without reuse: ".join(errors), operation="pd-decode")

    def _attempt(self, prompt: list[int], *, reuse: bool, attempt: int) -> Served:
        state = self._admit(prompt, reuse=reuse)
        restore_error: BaseException | None = None
        sent = time.perf_counter()
        try:
            if state.wait_layer is not None:
                for layer in range(self.layout.num_layers):
                    state.wait_layer(layer)
        except Exception as exc:
            restore_error = exc
        restored = time.perf_counter()
        try:
            done = self._await(state)
        except _AttemptFailed as exc:
            if exc.answered:
                self._give_back(state)
            else:  # prefill may still write into these rows: never hand them out again
                self._quarantined[state.rid] = state.landing + state.state_rows
                self._release_local(state.req, state.pages)
            raise
        received = time.perf_counter()
        if restore_error is not None:
            self._give_back(state)
            raise _AttemptFailed(
                f"the local restore of the promised prefix ({state.boundary} tokens) failed: "
                f"{restore_error}"
            ) from restore_error
        try:
            handle = self._land(state)
        except Exception as exc:
            self._give_back(state)
            raise _AttemptFailed(f"unpacking the received KV failed: {exc}") from exc
        self.landing.free(state.landing + state.state_rows)
        self.metrics.count(state.boundary, len(prompt), done.bytes)
        return Served(
            prompt=prompt,
            slots=state.slots,
            boundary=state.boundary,
            received_bytes=done.bytes,
            attempts=attempt,
            first_token=done.first_token,
            prefill_cached=done.prefill_cached,
            restore_wait_s=restored - sent,
            remote_wait_s=received - restored,
            prefill_compute_s=done.prefill_s,
            prefill_send_s=done.transfer_s,
            state=handle,
            _worker=self,
            _req=state.req,
            _pages=state.pages,
        )

    def _admit(self, prompt: list[int], *, reuse: bool) -> _Attempt:
        """Match, reserve pages and landing rows, send the request (nothing held on error)."""
        page = self.page_size
        req: Request | None = None
        wait_layer = None
        pages: list[int] = []
        if self.tier is not None:
            req = self.tier.match(prompt, reuse=reuse)
            try:
                prep = self.tier.prepare(req)
            except BaseException:
                self.tier.abort(req)
                raise
            boundary, slots, wait_layer = prep.start, prep.slots, prep.wait_layer
        else:
            boundary = 0
            pages = self.pool.alloc(math.ceil(len(prompt) / page))
            slots = page_slots(pages, page)[: len(prompt)]
        check_boundary(len(prompt), boundary, page)
        count = suffix_pages(len(prompt), boundary, page)
        rows = self.landing.alloc(count + self.state_rows)
        if rows is None:
            self._release_local(req, pages)
            raise DecodeFailed(
                f"landing memory holds {self.landing.num_rows} rows "
                f"({self.quarantined_rows} quarantined); this prompt needs "
                f"{count + self.state_rows}: give the decode worker more landing rows",
                operation="pd-decode",
            )
        # The page hash at the boundary, so prefill can check it means the same tokens.
        boundary_hash = req.hashes[boundary // page - 1] if req is not None and boundary else ""
        rid = next(self._rids)
        state = _Attempt(
            rid=rid,
            prompt=prompt,
            boundary=boundary,
            slots=slots,
            suffix_pages=(slots[boundary::page] // page).tolist(),
            landing=rows[:count],
            state_rows=rows[count:],
            req=req,
            wait_layer=wait_layer,
            pages=pages,
        )
        try:
            self.channel.send(
                PrefillRequest(rid, prompt, boundary, boundary_hash, state.landing, state.state_rows)
            )
        except Exception as exc:
            # Nothing was asked of prefill: every row is free to reuse.
            self.landing.free(rows)
            self._release_local(req, pages)
            raise _AttemptFailed(f"could not ask prefill: {exc}") from exc
        return state

    def _await(self, state: _Attempt) -> PrefillDone:
        """Prefill's answer for ``state`` (``_AttemptFailed`` for a failure or a mismatch)."""
        try:
            answer = self._answer(state.rid)
        except TimeoutError as exc:
            raise _AttemptFailed(
                f"no answer from prefill for request {state.rid}: {exc}", answered=False
            ) from exc
        except Exception as exc:
            raise _AttemptFailed(f"control channel failed: {exc}", answered=False) from exc
        if isinstance(answer, Failed):
            raise _AttemptFailed(f"prefill failed request {state.rid}: {answer.error}")
        assert isinstance(answer, PrefillDone)
        expected = len(state.landing)
        if answer.boundary != state.boundary or answer.pages != expected:
            raise _AttemptFailed(
                f"prefill answered request {state.rid} for boundary {answer.boundary} with "
                f"{answer.pages} pages; decode asked from {state.boundary}, {expected} pages"
            )
        return answer

    def _answer(self, rid: int) -> Message:
        """The next answer for ``rid`` (answers for other requests are kept for them)."""
        deadline = time.monotonic() + self.timeout_s
        while rid not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {self.timeout_s:.1f}s")
            msg = self.channel.recv(left)
            if not isinstance(msg, (PrefillDone, Failed)) or msg.rid < 0:
                raise ProtocolError(f"unexpected message from prefill: {msg!r:.200}")
            late = self._quarantined.pop(msg.rid, None)
            if late is not None:  # answered at last: prefill writes no more into them
                self.landing.free(late)
            else:
                self._pending[msg.rid] = msg
        return self._pending.pop(rid)

    def _land(self, state: _Attempt) -> Any:
        """Unpack the landing rows into the reserved pages; decode the state rows."""
        unpack_from(
            self.landing.rows(state.landing),
            self.device,
            state.suffix_pages,
            self.layout,
            backend=self.kernel_backend,
        )
        if self.state is None:
            return None
        data = self.landing.rows(state.state_rows).reshape(-1)[: self.state.nbytes]
        return self.state.decode(data.clone(), len(state.prompt))

    def _give_back(self, state: _Attempt) -> None:
        """An answered attempt failed: its rows are free again, its pages and locks too."""
        self.landing.free(state.landing + state.state_rows)
        self._release_local(state.req, state.pages)

    def _release_local(self, req: Request | None, pages: list[int]) -> None:
        if req is not None:
            assert self.tier is not None
            self.tier.abort(req)
        elif pages:
            self.pool.free(pages)

    def close(self) -> None:
        """Say goodbye to prefill and release the landing memory."""
        try:
            self.channel.send(Bye())
        except Exception as exc:
            log.debug("could not say goodbye to prefill: %s", exc)
        self.channel.close()
        self.landing.close()


@dataclass
class DecodeMetrics:
    """What the decode side received and reused (successful attempts)."""

    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    received_bytes: int = 0
    failed_attempts: int = 0
    failed_requests: int = 0

    def count(self, boundary: int, prompt_tokens: int, received: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.reused_tokens += boundary
        self.received_bytes += received

    @property
    def hit_rate(self) -> float:
        """Prompt tokens the decode side supplied itself, over all prompt tokens."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
