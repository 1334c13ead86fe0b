"""P/D workers on the mini engine, as real processes (``bench pd`` and the P/D tests).

``WorkerSetup`` says everything a worker process needs (model config, page size, its tier's
sizes, the transport); it travels as JSON on the command line. A prefill worker process::

    python -m hicache_store.demo.bench.pd_worker prefill SETUP_JSON

reads the control channel's key from ``HICACHE_PD_AUTHKEY`` (hex), listens on 127.0.0.1,
prints ``READY <host> <port>`` and serves decode connections one after the other
(``pd.PrefillWorker``), printing ``STATS <json>`` after each, until its stdin is closed. ``start_prefill`` launches one and waits for it to be ready;
``decode_side`` builds the matching decode worker in the calling process (the tests, and the
decode process of ``bench pd``).

Both sides compute with one torch thread: the mini engine is bit-exact across processes only
at equal thread counts (``engine.model``), and the tests compare decode-side logits with a
single-process recompute bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache_store.backends.base import Backend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama, WindowKV
from hicache_store.demo.hybrid import HybridMiniLlama, RecurrentPool, WindowPool, prefill_prepared
from hicache_store.pd import (
    Channel,
    ChannelListener,
    DecodeWorker,
    PrefillWorker,
    open_transport,
)
from hicache_store.pd.prefill import Compute
from hicache_store.pd.state import StateCodec
from hicache_store.tier.cache import ComponentSlots, HiCache, Prepared
from hicache_store.tier.components import Component
from hicache_store.tier.config import TierConfig

from .multiturn import namespace_for

AUTHKEY_ENV = "HICACHE_PD_AUTHKEY"


@dataclass(frozen=True)
class WorkerSetup:
    """One worker's configuration. ``l2_pages = 0``: no host tier; for the decode side,
    ``reuse=False`` means no decode-side cache at all (every prompt's KV comes from prefill).
    ``recurrent_dim > 0``: the model is ``HybridMiniLlama`` (plus a recurrent layer of that
    many channels); with window layers in ``model`` or a recurrent layer, each request also
    carries the model state of ``ResumeStateCodec``."""

    model: dict[str, Any]
    page_size: int
    l1_pages: int
    l2_pages: int = 0
    reuse: bool = True
    transport: str = "tcp"
    timeout_s: float = 60.0
    send_rows: int = 64
    landing_rows: int = 256
    threads: int = 1
    recurrent_dim: int = 0
    tier_options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSetup:
        return cls(**json.loads(text))

    @property
    def config(self) -> MiniLlamaConfig:
        return MiniLlamaConfig(**self.model)


Model = MiniLlama | HybridMiniLlama


def build_model(setup: WorkerSetup) -> Model:
    """The worker's model: ``MiniLlama``, or ``HybridMiniLlama`` with a recurrent layer."""
    if setup.recurrent_dim:
        return HybridMiniLlama(setup.config, state_dim=setup.recurrent_dim)
    return MiniLlama(setup.config)


def build_tier(
    setup: WorkerSetup,
    model: Model,
    backend: Backend | None = None,
    components: Sequence[Component] = (),
) -> HiCache:
    """A tier over a fresh device pool of ``setup``'s sizes for ``model`` (L3: ``backend``)."""
    pool = model.make_pool(setup.l1_pages, setup.page_size)
    config = TierConfig(l1_pages=setup.l1_pages, l2_pages=setup.l2_pages, **setup.tier_options)
    namespace = namespace_for(model.config, setup.page_size)
    return HiCache(namespace, config, pool, backend=backend, components=list(components))


@dataclass
class PrefillState:
    """What the prefill compute fills for ``ResumeStateCodec``: the window layers' K/V of the
    prompt and the recurrent state after its last token."""

    window: WindowKV | None
    recurrent: torch.Tensor | None = None


@dataclass
class ResumeState:
    """The decode side's copy: the window layers' K/V of the last ``tail`` prompt tokens
    (``[window layers, 2, tail, kv_heads, head_dim]``, zeros before position 0) and the
    recurrent state after the prompt."""

    config: MiniLlamaConfig
    prompt_tokens: int
    tail: torch.Tensor | None
    recurrent: torch.Tensor | None

    def window(self, length: int) -> WindowKV | None:
        """A ``WindowKV`` of ``length >= prompt_tokens`` rows holding the tail at its positions:
        what ``MiniLlama.prefill`` needs to decode after the prompt."""
        if self.tail is None:
            return None
        window = WindowKV.zeros(self.config, length)
        n, size = self.prompt_tokens, self.tail.shape[2]
        rows = min(n, size)
        window.k[:, n - rows : n] = self.tail[:, 0, size - rows :]
        window.v[:, n - rows : n] = self.tail[:, 1, size - rows :]
        return window


class ResumeStateCodec(StateCodec):
    """The mini engine's state beyond KV pages at the end of a prompt (``pd.state``): the
    fresh sliding-window tail, K/V of the last ``sliding_window - 1`` prompt tokens of every
    window layer (a query at position ``t`` sees keys ``(t - W, t]``), and the recurrent state
    of ``HybridMiniLlama``. Bytes: the tail in the model dtype, then the state in float32."""

    def __init__(self, config: MiniLlamaConfig, recurrent_dim: int = 0) -> None:
        if not config.window_layers and not recurrent_dim:
            raise ValueError("a full-attention model without a recurrent layer has no state")
        self.config = config
        self.recurrent_dim = recurrent_dim
        self.tail_tokens = max(1, config.sliding_window - 1) if config.window_layers else 0
        self.tail_shape = (
            len(config.window_layers),
            2,
            self.tail_tokens,
            config.num_kv_heads,
            config.head_dim,
        )
        itemsize = torch.finfo(config.torch_dtype).bits // 8
        self.tail_bytes = math.prod(self.tail_shape) * itemsize

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "mini-llama-resume",
            "window_layers": list(self.config.window_layers),
            "tail_tokens": self.tail_tokens,
            "kv_heads": self.config.num_kv_heads,
            "head_dim": self.config.head_dim,
            "dtype": self.config.dtype,
            "recurrent_dim": self.recurrent_dim,
        }

    @property
    def nbytes(self) -> int:
        return self.tail_bytes + 4 * self.recurrent_dim

    def begin(self, prompt_tokens: int) -> PrefillState:
        window = WindowKV.zeros(self.config, prompt_tokens) if self.config.window_layers else None
        return PrefillState(window)

    def encode(self, handle: Any) -> torch.Tensor:
        assert isinstance(handle, PrefillState)
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        if handle.window is not None:
            n, size = handle.window.length, self.tail_tokens
            rows = min(n, size)
            tail = torch.zeros(self.tail_shape, dtype=self.config.torch_dtype)
            tail[:, 0, size - rows :] = handle.window.k[:, n - rows : n]
            tail[:, 1, size - rows :] = handle.window.v[:, n - rows : n]
            out[: self.tail_bytes] = tail.reshape(-1).view(torch.uint8)
        if self.recurrent_dim:
            if handle.recurrent is None:
                raise ValueError("the compute left no recurrent state")
            state = handle.recurrent.to(torch.float32).reshape(-1)
            out[self.tail_bytes :] = state.contiguous().view(torch.uint8)
        return out

    def decode(self, data: torch.Tensor, prompt_tokens: int) -> ResumeState:
        if data.numel() != self.nbytes:
            raise ValueError(f"state: {data.numel()} bytes, expected {self.nbytes}")
        tail = None
        if self.config.window_layers:
            raw = data[: self.tail_bytes].clone()
            tail = raw.view(self.config.torch_dtype).reshape(self.tail_shape)
        recurrent = None
        if self.recurrent_dim:
            recurrent = data[self.tail_bytes :].clone().view(torch.float32)
        return ResumeState(self.config, prompt_tokens, tail, recurrent)


def state_codec(setup: WorkerSetup) -> StateCodec | None:
    """The model's extra-state codec (None: a full-attention model needs none)."""
    if setup.config.window_layers or setup.recurrent_dim:
        return ResumeStateCodec(setup.config, setup.recurrent_dim)
    return None


@dataclass
class PrefillComponents:
    """The prefill tier's components for a model with state: its window pages and recurrent
    checkpoints, so that its cache resumes such a model after a cached prefix too."""

    window: WindowPool | None
    recurrent: RecurrentPool | None

    @property
    def components(self) -> list[Component]:
        return [p.component for p in (self.window, self.recurrent) if p is not None]


def prefill_components(setup: WorkerSetup, model: Model) -> PrefillComponents | None:
    """Component pools of ``setup``'s sizes (one snapshot slot per KV page: generous), or None
    for a full-attention model."""
    config = model.config
    if not config.window_layers and not isinstance(model, HybridMiniLlama):
        return None
    namespace = namespace_for(config, setup.page_size)
    window = None
    if config.window_layers:
        window = WindowPool(config, namespace, setup.l1_pages, l2_slots=setup.l2_pages)
    recurrent = None
    if isinstance(model, HybridMiniLlama):
        recurrent = RecurrentPool(
            model.state_dim, namespace, setup.l1_pages, l2_slots=setup.l2_pages
        )
    return PrefillComponents(window, recurrent)


def prefill_compute(
    model: Model, pool: DeviceKVPool, page_size: int, parts: PrefillComponents | None = None
) -> Compute:
    """The prefill worker's engine call: last-position logits, filling a ``PrefillState``; a
    model with state resumes from and fills the tier's components (``parts``)."""

    def compute(
        tokens: torch.Tensor,
        start: int,
        slots: torch.Tensor,
        wait_layer: Any,
        state: PrefillState | None,
        components: Mapping[str, ComponentSlots],
    ) -> torch.Tensor:
        if state is None:  # a full-attention MiniLlama (no codec)
            assert isinstance(model, MiniLlama)
            return model.prefill(tokens, start, slots, pool, wait_layer, last_only=True)
        # prefill_prepared wants the whole prompt; only tokens[start:] are read
        prompt = [0] * start + tokens.tolist()
        logits, state.recurrent = prefill_prepared(
            model,
            pool,
            prompt,
            Prepared(start, slots, wait_layer, components),
            page_size,
            window=parts.window if parts is not None else None,
            recurrent=parts.recurrent if parts is not None else None,
            buffer=state.window,
        )
        return logits[-1:]

    return compute


def prefill_main(setup_json: str) -> int:
    """The prefill worker process (see the module docstring): serves decode connections one
    after the other, printing ``STATS`` after each, until its stdin is closed."""
    setup = WorkerSetup.from_json(setup_json)
    torch.set_num_threads(setup.threads)
    authkey = bytes.fromhex(os.environ[AUTHKEY_ENV])
    model = build_model(setup)
    parts = prefill_components(setup, model)
    tier = build_tier(setup, model, components=parts.components if parts is not None else ())
    pool = tier.pool
    assert isinstance(pool, DeviceKVPool)
    transport = open_transport(setup.transport, timeout_s=setup.timeout_s)
    worker = PrefillWorker(
        tier,
        prefill_compute(model, pool, setup.page_size, parts),
        transport,
        send_rows=setup.send_rows,
        state=state_codec(setup),
    )
    listener = ChannelListener(authkey)

    def exit_when_parent_is_done() -> None:
        sys.stdin.read()  # EOF: the parent closed our stdin (or died)
        os._exit(0)  # the accept loop cannot be interrupted portably; nothing to flush

    threading.Thread(target=exit_when_parent_is_done, daemon=True).start()
    host, port = listener.address
    print(f"READY {host} {port}", flush=True)
    while True:
        channel = listener.accept()
        try:
            with torch.inference_mode():
                worker.serve(channel)
        finally:
            channel.close()
        stats = {
            "requests": worker.requests,
            "bytes_sent": worker.bytes_sent,
            "tier": tier.metrics.to_dict(),
        }
        print(f"STATS {json.dumps(stats)}", flush=True)


class PrefillProcess:
    """A running prefill worker process (``start_prefill``); use as a context manager."""

    def __init__(
        self,
        proc: subprocess.Popen[str],
        setup: WorkerSetup,
        address: tuple[str, int],
        authkey: bytes,
        log: Path,
    ) -> None:
        self.proc = proc
        self.setup = setup
        self.address = address
        self.authkey = authkey
        self.log = log
        self.stats: dict[str, Any] = {}

    def connect(self) -> Channel:
        return Channel.connect(self.address, self.authkey)

    def connection_stats(self, timeout: float = 30.0) -> dict[str, Any]:
        """The ``STATS`` the process prints once a decode connection has ended (cumulative
        over the process's connections)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            line = self.proc.stdout.readline() if ready else ""
            if line.startswith("STATS "):
                self.stats = json.loads(line[len("STATS ") :])
                return self.stats
            if ready and not line:
                break  # EOF: the process is gone
        raise RuntimeError(f"the prefill worker printed no STATS:\n{self.log_tail()}")

    def stop(self) -> None:
        """End the process: close its stdin (it exits), kill it if it does not."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> PrefillProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_prefill(
    setup: WorkerSetup,
    *,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    timeout: float = 120.0,
) -> PrefillProcess:
    """Launch a prefill worker process and wait until it listens (``RuntimeError`` with its
    log's tail if it exits or stays silent for ``timeout`` seconds)."""
    authkey = secrets.token_bytes(32)
    folder = log_dir or Path(tempfile.mkdtemp(prefix="hicache-pd-"))
    log = folder / "prefill.log"
    child_env = dict(os.environ, **(env or {}))
    child_env[AUTHKEY_ENV] = authkey.hex()
    child_env.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with open(log, "w") as stderr:
        proc = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments, no shell
            [sys.executable, "-m", "hicache_store.demo.bench.pd_worker", "prefill", setup.to_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=child_env,
        )
    process = PrefillProcess(proc, setup, ("", 0), authkey, log)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, left))
        line = proc.stdout.readline() if ready else ""
        if line.startswith("READY "):
            _, host, port = line.split()
            process.address = (host, int(port))
            return process
        if proc.poll() is not None or left <= 0:
            process.stop()
            raise RuntimeError(
                f"the prefill worker did not start (exit {proc.returncode}):\n"
                f"{process.log_tail()}"
            )


def decode_side(
    setup: WorkerSetup,
    channel: Channel,
    model: Model | None = None,
    *,
    backend: Backend | None = None,
) -> tuple[DecodeWorker, Model]:
    """A decode worker in this process, handshaken with the prefill worker at the other end of
    ``channel`` (its cache's L3: ``backend``). ``close_decode_side`` releases all it built."""
    model = model or build_model(setup)
    namespace = namespace_for(model.config, setup.page_size)
    tier = build_tier(setup, model, backend) if setup.reuse else None
    pool = tier.pool if tier is not None else model.make_pool(setup.l1_pages, setup.page_size)
    transport = open_transport(setup.transport, timeout_s=setup.timeout_s)
    worker = DecodeWorker(
        pool,
        namespace,
        transport,
        channel,
        tier=tier,
        landing_rows=setup.landing_rows,
        timeout_s=setup.timeout_s,
        state=state_codec(setup),
    )
    worker.handshake()
    return worker, model


def close_decode_side(worker: DecodeWorker) -> None:
    """Close a ``decode_side`` worker, its cache and its transport."""
    try:
        worker.close()
        if worker.tier is not None:
            worker.tier.close()
    finally:
        worker.transport.close()


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "prefill":
        return prefill_main(argv[1])
    print("usage: python -m hicache_store.demo.bench.pd_worker prefill SETUP_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
