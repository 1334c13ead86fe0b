"""Hybrid models (KV + SWA, KV + Mamba) through SGLang 0.5.23's real controller on a real S3
server (SeaweedFS on loopback): the cases of ``tests/sglang/hybrid_cases``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from .seaweed import SeaweedServer

sys.path.insert(0, str(Path(__file__).parents[1] / "sglang"))
import hybrid_cases as cases
import sglang_cpu

pytestmark = pytest.mark.s3


@pytest.fixture
def sglang() -> Iterator[ModuleType]:
    """As ``tests/sglang/conftest.py``: SGLang's own classes, no stub touched."""
    with sglang_cpu.imported() as mod:
        yield mod


@pytest.fixture
def store(seaweed: SeaweedServer, s3_prefix: str) -> cases.Store:
    return cases.Store(f"s3://{seaweed.bucket}/{s3_prefix}", dict(seaweed.options))


@pytest.mark.parametrize("pools", [("swa", "mamba")], ids="+".join)
def test_sidecars_round_trip_on_s3(
    sglang: ModuleType, store: cases.Store, pools: tuple[str, ...]
) -> None:
    cases.round_trip(sglang, store, pools)


def test_hits_stop_where_a_sidecar_cannot_resume_on_s3(
    sglang: ModuleType, store: cases.Store
) -> None:
    cases.sparse_hits(sglang, store, ("swa", "mamba"))


@pytest.mark.parametrize("pool", ["swa", "mamba"])
def test_a_corrupt_sidecar_object_is_a_miss_on_s3(
    sglang: ModuleType, store: cases.Store, pool: str
) -> None:
    cases.corrupt_state(sglang, store, pool)
