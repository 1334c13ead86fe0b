"""Against a REAL 3FS mount: only when ``HICACHE_STORE_HF3FS_MOUNT`` names its mount point
(and the real ``hf3fs_fuse`` client is installed). Skipped, with that reason, everywhere else:
no 3FS can run on the machines this project is developed and tested on."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import pytest

from hicache_store.backends import Backend, open_backend
from hicache_store.backends.hf3fs import HF3FSBackend
from hicache_store.testing import BackendTests, pattern

from .test_hf3fs_conformance import HF3FSOracle

MOUNT = os.environ.get("HICACHE_STORE_HF3FS_MOUNT")
pytestmark = pytest.mark.skipif(
    not MOUNT, reason="no real 3FS here: set HICACHE_STORE_HF3FS_MOUNT=/path/to/3fs/mount to run"
)


@pytest.fixture
async def real_store() -> AsyncIterator[HF3FSBackend]:
    assert MOUNT
    store = open_backend(f"hf3fs://{MOUNT}/hicache-store-test-{uuid.uuid4().hex[:8]}",
                         engine="usrbio", capacity_bytes="1GiB")
    assert isinstance(store, HF3FSBackend)
    yield store
    await store.close()


async def test_real_mount_uses_usrbio(real_store: HF3FSBackend) -> None:
    assert real_store.engine == "usrbio"
    auto = HF3FSBackend(real_store.root)
    assert auto.engine == "usrbio", auto.engine_reason
    await auto.close()


async def test_real_mount_zero_copy_roundtrip(real_store: HF3FSBackend) -> None:
    page = 1 << 20
    pool = await real_store.allocate_host_buffer(4 * page)
    pool[: 2 * page] = pattern(2 * page, 1)
    keys = ["a0", "a1"]
    await real_store.put(keys, [pool[:page], pool[page : 2 * page]])
    assert await real_store.get_into(keys, [pool[3 * page :], pool[2 * page : 3 * page]]) == [
        page, page]
    assert bytes(pool[3 * page :]) == bytes(pool[:page])
    assert real_store.stats.usrbio_zero_copy_bytes == 4 * page


class TestHF3FSRealMount(HF3FSOracle, BackendTests):
    stateful_max_examples = 5

    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        assert MOUNT
        store = open_backend(f"hf3fs://{MOUNT}/hicache-store-test-{uuid.uuid4().hex[:8]}",
                             engine="usrbio", capacity_bytes="256MiB")
        yield store
        await store.close()
