"""Hybrid models (KV + SWA, KV + Mamba) through SGLang 0.5.23's v2 storage interface, driven by
its real ``HybridCacheController`` and ``HostPoolGroup`` on a file store (``hybrid_cases``;
the same cases run on S3 in ``tests/backends_s3/test_sglang_hybrid_s3``)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import hybrid_cases as cases
import pytest

from hicache_store.tenant import KEY_FILE_ENV, KEY_TEXT_ENV, format_key_ring

POOLS = [("swa",), ("mamba",), ("swa", "mamba")]


@pytest.mark.parametrize("pools", POOLS, ids="+".join)
def test_sidecars_round_trip_through_sglangs_controller(
    sglang: ModuleType, url: str, pools: tuple[str, ...]
) -> None:
    cases.round_trip(sglang, url, pools)


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct", "page_head"])
def test_swa_round_trips_in_every_host_layout(sglang: ModuleType, url: str, layout: str) -> None:
    cases.round_trip(sglang, url, ("swa",), layout=layout)


@pytest.mark.parametrize("pools", POOLS, ids="+".join)
def test_hits_stop_where_a_sidecar_cannot_resume(
    sglang: ModuleType, url: str, pools: tuple[str, ...]
) -> None:
    cases.sparse_hits(sglang, url, pools)


@pytest.mark.parametrize("pool", ["swa", "mamba"])
def test_a_corrupt_sidecar_object_is_a_miss_never_wrong_state(
    sglang: ModuleType, url: str, pool: str
) -> None:
    cases.corrupt_state(sglang, url, pool)


def test_swa_written_at_tp1_is_read_by_each_tp2_rank(sglang: ModuleType, url: str) -> None:
    cases.tp_reshard(sglang, url)


def test_a_state_of_another_structure_or_tp_size_never_hits(sglang: ModuleType, url: str) -> None:
    """The Mamba namespace names the state's structure and the TP shard: a server whose state
    differs (here its conv width; or its TP size) finds the KV but no state, so no hit."""
    grid = {"grid": "1x2"}  # KV any TP size reads
    writer = cases.hybrid_rank(sglang, url, ("mamba",), extra=grid)
    page = writer.geometry.page_size
    tokens = sglang.tokens_for(cases.NODE_PAGES, page, seed=6)
    pages = [writer.random_page(s) for s in range(cases.NODE_PAGES)]
    writer.backup_hybrid(tokens, pages, sidecar_seed=6)
    writer.close()
    other = cases.hybrid_rank(sglang, url, ("mamba",), extra=grid, mamba={"conv": (6, 4)})
    assert other.storage.batch_exists(other.hashes(tokens)) == cases.NODE_PAGES  # KV is there
    assert other.prefetch_hybrid(tokens).hit == 0
    other.close()
    tp2 = cases.hybrid_rank(sglang, url, ("mamba",), extra=grid,
                            geometry=sglang.Geometry(heads=2), parallel=sglang.parallel_state(0, 2))
    assert tp2.storage.batch_exists(tp2.hashes(tokens)) == cases.NODE_PAGES
    assert tp2.prefetch_hybrid(tokens).hit == 0
    tp2.close()


@pytest.mark.parametrize("pool", ["swa", "mamba"])
def test_a_sidecar_with_pipeline_parallelism_is_refused_at_startup(
    sglang: ModuleType, url: str, pool: str
) -> None:
    with pytest.raises(ValueError, match=rf"'{pool}' host pool.*PP > 1") as caught:
        cases.hybrid_rank(sglang, url, (pool,), parallel=sglang.parallel_state(0, 1, 0, 2),
                          extra={"num_layers": 8})
    assert "refuses at start-up" in str(caught.value)


def test_a_sealed_deployments_sidecars_are_sealed(
    sglang: ModuleType, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a tenant key ring the sidecar namespaces are sealed too: keyed names (SGLang's page
    hashes never appear), AES-GCM payloads (the state's bytes never appear), and a round trip
    still gives the bytes back; without the ring the same store finds nothing."""
    for name in (KEY_FILE_ENV, KEY_TEXT_ENV):
        monkeypatch.delenv(name, raising=False)
    ring = tmp_path / "tenant.keys"
    ring.write_text(format_key_ring(b"\x07" * 32))
    ring.chmod(0o600)
    sealed = {"tenant_key_file": str(ring)}
    writer = cases.hybrid_rank(sglang, url, ("swa", "mamba"), extra=sealed)
    page = writer.geometry.page_size
    tokens = sglang.tokens_for(cases.NODE_PAGES, page, seed=8)
    pages = [writer.random_page(s) for s in range(cases.NODE_PAGES)]
    _, written, _ = writer.backup_hybrid(tokens, pages, sidecar_seed=8)
    hashes = writer.hashes(tokens)
    for name in ("swa", "mamba"):
        sidecar = writer.storage._sidecars[name]
        assert sidecar.namespace.sealed
        for key in cases.sidecar_keys(writer, name, hashes[-1]):
            assert hashes[-1] not in key
            stored = cases.run(writer.storage.backend.get_bytes(key))
            assert bytes(written[name][-1].numpy()) not in stored
    writer.close()
    reader = cases.hybrid_rank(sglang, url, ("swa", "mamba"), extra=sealed)
    fetched = reader.prefetch_hybrid(tokens)
    assert fetched.whole(page)
    cases.check_loaded(reader, fetched, pages, written)
    reader.close()
    outsider = cases.hybrid_rank(sglang, url, ("swa", "mamba"))
    assert outsider.prefetch_hybrid(tokens).hit == 0
    outsider.close()
