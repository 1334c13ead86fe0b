"""A throwaway Mooncake deployment on 127.0.0.1, for tests and benchmarks.

``LocalMooncake`` starts the real ``mooncake_master`` and a *separate* ``mooncake_client``
process that holds the memory (the "segment holder"), so every byte a backend in this process
moves crosses TCP loopback. Both get free ports, P2PHANDSHAKE metadata (no HTTP metadata
server: Mooncake's binds 0.0.0.0) and ``MC_TCP_BIND_ADDRESS=127.0.0.1``; they are stopped by
PID. The holder can be killed and restarted to exercise failure handling.

Mooncake 0.3.13's transfer engine opens its data and handshake listeners on the wildcard
address whatever ``MC_TCP_BIND_ADDRESS`` says. When a C compiler is available, the servers
started here run with a tiny ``LD_PRELOAD`` shim that rewrites wildcard ``bind`` calls to
127.0.0.1, so they are reachable on loopback only (``loopback_only`` tells whether it is in
use). It cannot cover the calling process itself (see the README of the tests).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real = 0;
    if (!real) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a; memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a; memcpy(&a, addr, sizeof a);
        if (memcmp(&a.sin6_addr, &in6addr_any, sizeof a.sin6_addr) == 0) {
            /* dual-stack wildcard -> IPv4 loopback, as the peers dial 127.0.0.1 */
            struct sockaddr_in v4; memset(&v4, 0, sizeof v4);
            v4.sin_family = AF_INET; v4.sin_port = a.sin6_port;
            v4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            struct sockaddr_in6 m; memset(&m, 0, sizeof m);
            m.sin6_family = AF_INET6; m.sin6_port = a.sin6_port;
            m.sin6_addr.s6_addr[10] = 0xff; m.sin6_addr.s6_addr[11] = 0xff;
            m.sin6_addr.s6_addr[12] = 127; m.sin6_addr.s6_addr[15] = 1;
            return real(fd, (const struct sockaddr *)&m, sizeof m);
        }
    }
    return real(fd, addr, len);
}
"""


def find_binary(name: str) -> str | None:
    """A Mooncake binary next to this interpreter (a venv's ``bin``) or on ``PATH``."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def binaries_available() -> str | None:
    """None when ``mooncake_master`` and ``mooncake_client`` can run; else why not."""
    for name in ("mooncake_master", "mooncake_client"):
        path = find_binary(name)
        if path is None:
            return f"{name} not found (pip install mooncake-transfer-engine-non-cuda)"
        probe = subprocess.run(  # noqa: S603 - our own binary path, no shell
            [path, "--version"], capture_output=True, text=True, check=False)
        if "error while loading shared libraries" in probe.stderr:
            return f"{name} cannot start: {probe.stderr.strip()} (apt-get install -y libibverbs1)"
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the usual small race is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until 127.0.0.1:port accepts a connection; raise if ``proc`` dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open within {timeout}s")


def build_loopback_shim(workdir: Path) -> str | None:
    """Compile the wildcard-bind -> loopback ``LD_PRELOAD`` shim into ``workdir``; its path, or
    None without a C compiler. Processes started with it listen on 127.0.0.1 only."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src, lib = workdir / "loopback_bind.c", workdir / "loopback_bind.so"
    src.write_text(_SHIM_SOURCE)
    args = [cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"]
    done = subprocess.run(args, capture_output=True, check=False)  # noqa: S603 - no shell
    return str(lib) if done.returncode == 0 else None


class LocalMooncake:
    """A master plus one segment-holder process on loopback. Use as a context manager.

    ``url`` is what a backend opens (``mooncake://127.0.0.1:PORT?...``). ``kill_holder``
    SIGKILLs the holder (its objects are lost), ``start_holder`` starts a fresh one.
    ``client_ttl`` (seconds) is how long the master waits before unmounting a dead holder.
    """

    def __init__(self, *, segment: str = "512 MB", client_ttl: int = 2,
                 workdir: str | None = None, extra_master_flags: tuple[str, ...] = ()) -> None:
        self.segment = segment
        self.client_ttl = client_ttl
        self.extra_master_flags = extra_master_flags
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hicache-mooncake-"))
        self.master_port = free_port()
        self.master: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None
        self.holder_port = 0
        self.shim: str | None = None
        self._holder_runs = 0

    @property
    def loopback_only(self) -> bool:
        return self.shim is not None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def url(self) -> str:
        return f"mooncake://{self.master_address}?protocol=tcp&metadata=P2PHANDSHAKE&segment=0"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        if self.shim:
            env["LD_PRELOAD"] = self.shim
        return env

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / log_name, "wb")  # noqa: SIM115 - handed to the child
        try:
            return subprocess.Popen(  # noqa: S603 - our binaries, fixed flags, no shell
                args, stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                                    cwd=self.workdir, start_new_session=True)
        finally:
            log.close()

    def start(self) -> LocalMooncake:
        """Start the master and a holder; wait until both listen."""
        why = binaries_available()
        if why is not None:
            raise RuntimeError(why)
        self.shim = build_loopback_shim(self.workdir)
        master = find_binary("mooncake_master")
        assert master is not None
        self.master = self._spawn([
            master, "--rpc_address=127.0.0.1", f"--rpc_port={self.master_port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}",
            f"--client_ttl={self.client_ttl}", "--enable_http_metadata_server=false",
            *self.extra_master_flags,
        ], "master.log")
        wait_port(self.master_port, 20, self.master)
        self.start_holder()
        return self

    def start_holder(self) -> None:
        """Start a segment holder (after ``kill_holder``) and wait until it serves."""
        client = find_binary("mooncake_client")
        assert client is not None
        self.holder_port = free_port()
        self._holder_runs += 1
        self.holder = self._spawn([
            client, "--host=127.0.0.1", f"--port={self.holder_port}",
            f"--global_segment_size={self.segment}",
            f"--master_server_address={self.master_address}",
            "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
        ], f"holder{self._holder_runs}.log")
        wait_port(self.holder_port, 20, self.holder)

    def kill_holder(self) -> None:
        """SIGKILL the holder, as a crash would."""
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(10)
        self.holder = None

    def stop(self) -> None:
        """Stop the holder, then the master (SIGTERM, SIGKILL after 5 s), by PID."""
        for proc in (self.holder, self.master):
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.holder = self.master = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, name: str = "master.log", lines: int = 20) -> str:
        path = self.workdir / name
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def __enter__(self) -> LocalMooncake:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
