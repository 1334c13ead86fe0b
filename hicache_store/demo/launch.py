"""``RankPool``: real rank processes joined in a gloo group on loopback, reused across tasks.

``RankPool(world_size)`` spawns ``world_size`` processes (``multiprocessing`` *spawn*: no
forked torch state), each of which joins one ``torch.distributed`` gloo group rendezvousing on
``127.0.0.1`` (gloo is told to use the loopback interface, so nothing listens beyond the
machine) and creates a sub-group for each size ``1 .. world_size`` (ranks ``0 .. k-1``). Then
``pool.run(fn, *args, ranks=k)`` runs ``fn(ctx, *args)`` on ranks ``0 .. k-1`` with
``ctx.group`` a ``TorchGroup`` over that sub-group, and returns the results in rank order.
Processes outlive tasks: starting a process that imports torch costs seconds, so tests run many
cases (several topologies) on one pool.

``fn`` must be importable by name (a module-level function); arguments and results are
pickled. Each task runs with ``torch.set_num_threads(1)`` (deterministic, bit-exact kernels;
several ranks share few cores) and with the environment overrides it is given (for example
``HICACHE_STORE_CONSENSUS_CHECK``), restored afterwards.

Failure handling: a task that raises on some ranks raises ``RankTaskError`` with every
failing rank's error (type name, message, traceback); if the other ranks have not answered
within ``grace_s`` (stuck in a collective their peer will never join), the pool is killed and
marked broken. A task that runs past ``timeout_s`` kills every process of the pool and raises
``TimeoutError``. A closed or broken pool refuses new tasks; ``close`` ends the processes
(asking first, then terminating, then killing), and is called at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

#: Environment of every rank process: gloo binds the loopback interface only.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}


@dataclass
class RankContext:
    """What a task function receives: its rank, the group's size and the group."""

    rank: int
    size: int
    group: Any  # TorchGroup (typed loosely: the parent never imports torch.distributed)
    world_rank: int
    scratch: dict[str, Any]


class RankTaskError(RuntimeError):
    """A task raised on some ranks. ``errors``: rank -> (exception type name, message, traceback)."""

    def __init__(self, errors: Mapping[int, tuple[str, str, str]]) -> None:
        self.errors = dict(errors)
        first = min(self.errors)
        kind, message, tb = self.errors[first]
        ranks = sorted(self.errors)
        super().__init__(f"task failed on ranks {ranks}; rank {first}: {kind}: {message}\n{tb}")

    def messages(self) -> dict[int, str]:
        return {rank: message for rank, (_, message, _) in self.errors.items()}

    def kinds(self) -> dict[int, str]:
        return {rank: kind for rank, (kind, _, _) in self.errors.items()}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _worker(
    rank: int,
    world: int,
    port: int,
    conn: multiprocessing.connection.Connection,
    timeout_s: float,
) -> None:
    os.environ.update(LOOPBACK_ENV)
    import torch
    import torch.distributed as dist

    from hicache_store.distributed.group import TorchGroup

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    groups = {k: dist.new_group(list(range(k)), backend="gloo") for k in range(1, world + 1)}
    scratch: dict[str, Any] = {}
    conn.send(("ready", rank))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args, ranks, env = message
        if rank >= ranks:
            conn.send(("ok", None))
            continue
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            ctx = RankContext(rank, ranks, TorchGroup(groups[ranks]), rank, scratch)
            result = fn(ctx, *args)
            reply: tuple[Any, ...] = ("ok", result)
        except BaseException as exc:  # reported to the parent, never swallowed
            reply = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        conn.send(reply)
    # Leave without interpreter teardown: the parent is done with this rank, and joining the
    # I/O threads or destroying the process group could only delay (or hang) the exit.
    conn.close()
    os._exit(0)


class RankPool:
    """``world_size`` rank processes in one gloo group; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        collective_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        if world_size < 1:
            raise ValueError("world_size must be at least 1")
        self.world_size = world_size
        self.broken = False
        self.closed = False
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, child, collective_timeout_s),
                name=f"hicache-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        atexit.register(self.close)
        try:
            self._collect(start_timeout_s, what="start")
        except BaseException:
            self.kill()
            raise

    # -- tasks ------------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        ranks: int | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 120.0,
        grace_s: float = 10.0,
    ) -> list[Any]:
        """Run ``fn(ctx, *args)`` on ranks ``0 .. ranks-1``; their results in rank order."""
        if self.closed or self.broken:
            raise RuntimeError("the rank pool is closed or broken")
        k = self.world_size if ranks is None else ranks
        if not 1 <= k <= self.world_size:
            raise ValueError(f"ranks must be in [1, {self.world_size}], got {k}")
        message = (fn, args, k, dict(env or {}))
        for conn in self._conns:
            conn.send(message)
        replies = self._collect(timeout_s, what=getattr(fn, "__name__", "task"), grace_s=grace_s)
        errors = {r: payload for r, (status, payload) in replies.items() if status == "error"}
        if errors:
            raise RankTaskError(errors)
        return [replies[r][1] for r in range(k)]

    def _collect(
        self, timeout_s: float, *, what: str, grace_s: float | None = None
    ) -> dict[int, tuple[str, Any]]:
        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple[str, Any]] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                self.kill()
                if any(status == "error" for status, _ in replies.values()):
                    for rank in waiting.values():
                        replies[rank] = (
                            "error",
                            ("Stuck", "no answer after a peer failed; pool killed", ""),
                        )
                    return replies
                raise TimeoutError(
                    f"{what}: ranks {sorted(waiting.values())} did not answer within "
                    f"{timeout_s:.0f}s; the pool's processes were killed"
                )
            ready = multiprocessing.connection.wait(list(waiting), timeout=deadline - now)
            for obj in ready:
                conn = cast(multiprocessing.connection.Connection, obj)
                rank = waiting.pop(conn)
                try:
                    replies[rank] = conn.recv()
                except EOFError:
                    self.kill()
                    raise RuntimeError(f"{what}: rank {rank} died") from None
                if replies[rank][0] == "error" and grace_s is not None:
                    deadline = min(deadline, time.monotonic() + grace_s)
        return replies

    # -- lifetime ---------------------------------------------------------------------------------

    def kill(self) -> None:
        """Kill every process now (after a timeout or a failure that left ranks stuck)."""
        self.broken = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        for proc in self._procs:
            proc.join(5)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
