"""Session-scoped real Mooncake deployment on loopback for the ``mooncake`` tests.

One ``mooncake_master`` and one separate ``mooncake_client`` segment holder (256 MB) start on
first use, on free 127.0.0.1 ports with P2PHANDSHAKE metadata, and stop by PID at the end of
the session (``backends.mooncake_local.LocalMooncake``). Without the binaries
(``pip install mooncake-transfer-engine-non-cuda``) or ``libibverbs1`` the tests are skipped
with that reason; nothing is installed from here.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hicache_store.backends import open_backend
from hicache_store.backends.mooncake import MooncakeBackend
from hicache_store.backends.mooncake_local import LocalMooncake, binaries_available


@pytest.fixture(scope="session")
def mooncake() -> Iterator[LocalMooncake]:
    why = binaries_available()
    if why is not None:
        pytest.skip(why)
    pytest.importorskip("mooncake.store", reason="Mooncake's Python client is not installed")
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # read by the in-process transfer engine
    deployment = LocalMooncake(segment="256 MB", client_ttl=2)
    deployment.start()
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="session")
def mooncake_url(mooncake: LocalMooncake) -> Iterator[Callable[..., str]]:
    """``mooncake_url(**options)``: the deployment's URL, with a session-long backend on the
    same options kept open so that the process's shared client (set up once, closed in about
    a second) outlives each test's backend, as it would in an engine."""
    anchors: dict[tuple[tuple[str, Any], ...], MooncakeBackend] = {}

    def url(**options: Any) -> str:
        key = tuple(sorted(options.items()))
        if key not in anchors:
            anchor = open_backend(mooncake.url, **options)
            assert isinstance(anchor, MooncakeBackend)
            anchor._client_sync()
            anchors[key] = anchor
        return mooncake.url

    yield url
    for anchor in anchors.values():
        asyncio.run(anchor.close())
