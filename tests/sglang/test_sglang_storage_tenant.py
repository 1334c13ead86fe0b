"""The SGLang adapter with a tenant key ring (``tenant_key_file``): sealed KV that another user
of the same store can neither read, probe nor poison, and nothing changes without a ring."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_sglang_storage import StandInPool, adapter, keys_for, random_pages, same, slots

from hicache_store.layout.errors import MissingKeyError
from hicache_store.layout.framing import decode_header, encode_object
from hicache_store.layout.keys import parse_key
from hicache_store.tenant import KEY_FILE_ENV, KEY_TEXT_ENV, format_key_ring


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'kv'}"


@pytest.fixture(autouse=True)
def _no_ring_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(KEY_TEXT_ENV, raising=False)


@pytest.fixture
def ring(tmp_path: Path) -> str:
    path = tmp_path / "tenant.keys"
    path.write_text(format_key_ring(b"\x07" * 32))
    path.chmod(0o600)
    return str(path)


def objects(tmp_path: Path) -> list[Path]:
    """The stored KV objects (not the namespace manifest ``M_...``)."""
    return sorted(p for p in (tmp_path / "kv" / "objects").rglob("*_L*") if p.is_file())


def write(url: str, keys: list[str], **extra: object) -> list[torch.Tensor]:
    pool = StandInPool("page_first")
    data = random_pages(len(keys))
    for page, d in enumerate(data):
        pool.put(page, d)
    w = adapter(pool, url=url, **extra)
    assert w.batch_set_v1(keys, slots(list(range(len(keys))))) == [True] * len(keys)
    return data


@pytest.mark.parametrize("grid", [None, "1x1"], ids=["one-object-per-page", "per-layer-head"])
def test_tamper_free_round_trip_is_sealed_at_rest(
    url: str, ring: str, tmp_path: Path, grid: str | None
) -> None:
    keys = keys_for(3)
    extra = {"tenant_key_file": ring, **({"grid": grid} if grid else {})}
    data = write(url, keys, **extra)
    stored = objects(tmp_path)
    assert stored and not {parse_key(p.name).page_hash for p in stored} & set(keys)
    for path in stored:
        raw = path.read_bytes()
        assert decode_header(raw).sealed
        assert all(d.view(torch.uint8).flatten()[:64].numpy().tobytes() not in raw for d in data)
    dst = StandInPool("layer_first")
    r = adapter(dst, url=url, **extra)
    assert r.batch_exists(keys) == 3
    assert r.batch_get_v1(keys, slots([4, 5, 6])) == [True] * 3
    for i, d in enumerate(data):
        assert same(dst.take(4 + i), d)
    assert "tamper" not in r.counters


def test_poison_without_the_secret_a_reader_finds_and_reads_nothing(url: str, ring: str) -> None:
    keys = keys_for(2)
    write(url, keys, tenant_key_file=ring)
    other = adapter(StandInPool("page_first"), url=url)  # same model and store, no ring
    assert other.batch_exists(keys) == 0
    assert other.batch_get_v1(keys, slots([0, 1])) == [False, False]


def test_poison_planted_objects_are_never_served(url: str, ring: str, tmp_path: Path) -> None:
    keys = keys_for(2)
    write(url, keys, tenant_key_file=ring)
    # The attacker lists the store and replaces each object with a correctly framed plain one
    # (valid checksums, its own bytes) under exactly the same key.
    for path in objects(tmp_path):
        header = decode_header(path.read_bytes())
        obj = parse_key(path.name)
        path.write_bytes(encode_object(obj, b"\x41" * header.payload_length, header.kv_planes))
    dst = StandInPool("page_first")
    r = adapter(dst, url=url, tenant_key_file=ring)
    assert r.batch_exists(keys) == 2  # they exist ...
    assert r.batch_get_v1(keys, slots([2, 3])) == [False, False]  # ... and are never served
    assert r.counters["tamper"] == 2
    assert not dst.kv_buffer.view(torch.int16).any()


def test_without_a_ring_keys_are_sglangs_hashes(url: str, tmp_path: Path) -> None:
    keys = keys_for(2)
    write(url, keys)
    assert {parse_key(p.name).page_hash for p in objects(tmp_path)} == set(keys)
    assert not any(decode_header(p.read_bytes()).sealed for p in objects(tmp_path))


def test_ring_from_the_environment_and_bad_rings_fail_at_startup(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_TEXT_ENV, (b"\x07" * 32).hex())
    keys = keys_for(1)
    write(url, keys)
    monkeypatch.delenv(KEY_TEXT_ENV)
    assert adapter(StandInPool("page_first"), url=url).batch_exists(keys) == 0
    bad = tmp_path / "bad.keys"
    bad.write_text("active 1234\n")
    with pytest.raises(MissingKeyError, match="line 1"):
        adapter(StandInPool("page_first"), url=url, tenant_key_file=str(bad))
    with pytest.raises(MissingKeyError, match="does not exist"):
        adapter(StandInPool("page_first"), url=url, tenant_key_file=str(tmp_path / "none"))


def test_poison_secret_never_reaches_the_logs(
    url: str, ring: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("DEBUG"):
        keys = keys_for(2)
        write(url, keys, tenant_key_file=ring)
        r = adapter(StandInPool("page_first"), url=url, tenant_key_file=ring)
        assert r.batch_get_v1(keys, slots([0, 1])) == [True, True]
        assert r.batch_get_v1(keys_for(1, "absent"), slots([2])) == [False]
        text = caplog.text + repr(r.keys) + repr(r.config)
    assert "sealed with key" in caplog.text
    assert (b"\x07" * 32).hex() not in text
