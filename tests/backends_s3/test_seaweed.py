"""The test server helper never leaves a server behind when it cannot finish starting it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from .seaweed import SeaweedServer


class _NoClient(SeaweedServer):
    """A server whose readiness check cannot even build its client (as without boto3)."""

    started: subprocess.Popen[bytes] | None = None

    def client(self, **config: Any) -> Any:
        self.started = self.process
        raise ModuleNotFoundError("No module named 'boto3'", name="boto3")


def test_a_failed_start_stops_the_process_it_started(tmp_path: Path) -> None:
    fake = tmp_path / "weed"  # stands for the binary: a process that would run for a minute
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    server = _NoClient(weed=str(fake), root=tmp_path / "root")
    with pytest.raises(ModuleNotFoundError):
        server.start(timeout=5)
    assert server.started is not None
    try:
        assert server.started.poll() is not None, "the server outlived its failed start"
    finally:
        if server.started.poll() is None:
            server.started.kill()
            server.started.wait(5)
