"""Tenant key rings: strict parsing that never echoes a secret, rotation and retirement
rewrites, and where a ring is loaded from (file, environment)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hicache_store.layout.errors import MissingKeyError
from hicache_store.layout.sealing import TenantKey
from hicache_store.tenant import (
    KEY_FILE_ENV,
    KEY_TEXT_ENV,
    KeyRing,
    format_key_ring,
    load_key_ring,
    new_ring_text,
    parse_key_ring,
    read_key_file,
    retire_text,
    rotate_text,
)

A, B, C = (bytes([n]) * 32 for n in (1, 2, 3))


def test_parse_states_and_order() -> None:
    text = format_key_ring(A, (B,), (TenantKey(C).key_id,))
    ring = parse_key_ring(text)
    assert ring.active == TenantKey(A)
    assert [k.key_id for k in ring.readable] == [TenantKey(A).key_id, TenantKey(B).key_id]
    assert ring.retired == {TenantKey(C).key_id}
    assert ring.state(TenantKey(A).key_id) == "active"
    assert ring.state(TenantKey(B).key_id) == "read"
    assert ring.state(TenantKey(C).key_id) == "retired"
    assert ring.state("00" * 8) is None
    assert ring.key(TenantKey(C).key_id) is None


def test_bare_secret_is_an_active_key_and_retired_secrets_keep_only_their_id() -> None:
    assert parse_key_ring(A.hex() + "\n").active == TenantKey(A)
    ring = parse_key_ring(f"active {A.hex()}\nretired {C.hex()}  # old\n")
    assert ring.retired == {TenantKey(C).key_id}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "exactly one active key"),
        (f"read {A.hex()}\n", "exactly one active key"),
        (f"active {A.hex()}\nactive {B.hex()}\n", "exactly one active key"),
        (f"active {A.hex()}\nactive {A.hex()}\n", "exactly one active key"),
        (f"active {A.hex()}\nread {A.hex()}\n", "appears twice"),
        (f"active {A.hex()[:-2]}\n", "line 1: a active key is 64 hex"),
        (f"# keys\nactive {A.hex()}\nsealing {B.hex()}\n", "line 3: expected"),
        (f"active {A.hex()} extra\n", "line 1: expected"),
        ("zz" * 32, "line 1: expected"),
    ],
)
def test_bad_rings_name_the_line_never_the_secret(text: str, match: str) -> None:
    with pytest.raises(MissingKeyError, match=match) as info:
        parse_key_ring(text, "keys.txt")
    for secret in (A, B):
        assert secret.hex() not in str(info.value)


def test_repr_shows_ids_only() -> None:
    ring = parse_key_ring(format_key_ring(A, (B,)))
    for shown in (repr(ring), str(ring), repr(ring.readable)):
        assert A.hex() not in shown and B.hex() not in shown
    assert TenantKey(A).key_id in repr(ring)


def test_rotate_then_retire() -> None:
    first = parse_key_ring(new_ring_text())
    rotated_text = rotate_text(format_key_ring(A))
    rotated = parse_key_ring(rotated_text)
    assert rotated.active != TenantKey(A)
    assert rotated.readable[1] == TenantKey(A)
    retired = parse_key_ring(retire_text(rotated_text, TenantKey(A).key_id))
    assert retired.active == rotated.active
    assert retired.readable == (rotated.active,)
    assert retired.retired == {TenantKey(A).key_id}
    assert A.hex() not in retire_text(rotated_text, TenantKey(A).key_id)
    with pytest.raises(MissingKeyError, match="active key"):
        retire_text(rotated_text, rotated.active.key_id)
    with pytest.raises(MissingKeyError, match="no read key"):
        retire_text(rotated_text, first.active.key_id)


def test_rings_are_random() -> None:
    assert parse_key_ring(new_ring_text()).active != parse_key_ring(new_ring_text()).active


def test_key_file_loading_and_permission_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tenant.keys"
    path.write_text(format_key_ring(A))
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert read_key_file(path).active == TenantKey(A)
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        ring = read_key_file(path)
    assert "readable by other users" in caplog.text and A.hex() not in caplog.text
    assert ring.source == str(path)
    with pytest.raises(MissingKeyError, match="does not exist"):
        read_key_file(tmp_path / "missing")
    (tmp_path / "big").write_bytes(b"#" * (65 << 10))
    with pytest.raises(MissingKeyError, match="not a key file"):
        read_key_file(tmp_path / "big")


def test_load_order_file_then_env_file_then_env_text(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.write_text(format_key_ring(A))
    two.write_text(format_key_ring(B))
    env = {KEY_FILE_ENV: str(two), KEY_TEXT_ENV: C.hex()}
    assert load_key_ring(one, env) == KeyRing((TenantKey(A),), source=str(one))
    loaded = load_key_ring(None, env)
    assert loaded is not None and loaded.active == TenantKey(B)
    loaded = load_key_ring(None, {KEY_TEXT_ENV: C.hex()})
    assert loaded is not None and loaded.active == TenantKey(C)
    assert loaded.source == f"${KEY_TEXT_ENV}"
    assert load_key_ring(None, {}) is None
