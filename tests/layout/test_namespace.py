"""Namespaces: validation naming the field, canonical digests, JSON round trip."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_store.layout.errors import InvalidNamespaceError
from hicache_store.layout.namespace import (
    CANONICAL_FIELDS,
    Grid,
    ModelShape,
    Namespace,
    namespace_differences,
    updated_weights,
    weights_revision,
)

BASE = Namespace.create(
    "meta-llama/Llama-3-8B", ModelShape.mha(32, 8, 128), "bfloat16", 64, Grid(16, 2)
)


def test_digest_is_16_hex_and_stable_across_processes() -> None:
    assert len(BASE.digest) == 16
    assert int(BASE.digest, 16) >= 0
    code = (
        "from hicache_store.layout.namespace import *;"
        "print(Namespace.create('meta-llama/Llama-3-8B', ModelShape.mha(32, 8, 128),"
        " 'bfloat16', 64, Grid(16, 2)).digest)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == BASE.digest


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"model_revision": "abc"},
        {"dtype": "float16"},
        {"dtype": "float8_e4m3fn"},
        {"page_size": 32},
        {"num_layers": 33},
        {"num_kv_heads": 16},
        {"head_dim": 64},
        {"grid": Grid(32, 2)},
        {"grid": Grid(16, 4)},
        {"replication": "replicated"},
        {"hash_algo": "xxh3_128"},
        {"tenant_salt": "tenant-a"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_any_field_change_changes_the_digest(change: dict[str, object]) -> None:
    assert dataclasses.replace(BASE, **change).digest != BASE.digest


def test_differences_name_each_field_once_the_grid_as_one_and_hide_the_salt() -> None:
    assert namespace_differences(BASE, BASE) == []
    other = dataclasses.replace(BASE, dtype="float16", grid=Grid(32, 4), tenant_salt="secret")
    found = namespace_differences(BASE, other)
    assert [d.field for d in found] == ["dtype", "grid", "tenant_salt"]
    assert (found[1].deployment, found[1].stored) == (Grid(16, 2), Grid(32, 4))
    assert str(found[2]) == "tenant_salt: deployment not set, stored set"
    assert "secret" not in "; ".join(map(str, found))
    # a field past version 1 set on one side only differs from its default on the other
    assert [d.field for d in namespace_differences(
        BASE, dataclasses.replace(BASE, sealed=True))] == ["sealed"]


def test_every_canonical_field_is_encoded() -> None:
    assert [name for name, _ in BASE.canonical_fields()] == list(CANONICAL_FIELDS)


def test_json_round_trip() -> None:
    data = json.loads(BASE.to_json_text())
    assert Namespace.from_json(data) == BASE
    assert data["digest"] == BASE.digest


def test_json_with_wrong_digest_is_refused() -> None:
    data = BASE.to_json() | {"digest": "0" * 16}
    with pytest.raises(InvalidNamespaceError, match="does not match"):
        Namespace.from_json(data)


def test_json_with_unknown_field_is_refused() -> None:
    with pytest.raises(InvalidNamespaceError, match="unknown fields"):
        Namespace.from_json(BASE.to_json() | {"colour": "red"})


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"page_size": 0}, "page_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": -1}, "head_dim"),
        ({"dtype": "float13"}, "dtype"),
        ({"grid": Grid(16, 3)}, "grid.heads_per_group"),
        ({"grid": Grid(0, 2)}, "grid.layers_per_chunk"),
        ({"grid": Grid(33, 2)}, "grid.layers_per_chunk"),
        ({"kv_kind": "gqa"}, "kv_kind"),
        ({"model": ""}, "model"),
        ({"model": "a\nb"}, "model"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"layout_version": 9}, "layout_version"),
        ({"num_layers": True}, "num_layers"),
    ],
)
def test_impossible_values_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        dataclasses.replace(BASE, **change)


def test_mla_rules() -> None:
    ns = Namespace.create("deepseek", ModelShape.mla(61, 576), "bfloat16", 64, Grid(61))
    assert ns.replication == "replicated"
    assert ns.kv_planes == 1
    assert ns.layer_block_bytes() == 64 * 576 * 2
    with pytest.raises(InvalidNamespaceError, match="^replication:"):
        dataclasses.replace(ns, replication="head_sharded")


def test_torch_style_dtype_is_normalised() -> None:
    assert dataclasses.replace(BASE, dtype="torch.bfloat16") == BASE


def test_geometry() -> None:
    assert BASE.num_layer_chunks == 2
    assert BASE.num_head_groups == 4
    assert BASE.objects_per_page == 8
    assert BASE.layer_block_bytes() == 2 * 64 * 2 * 128 * 2
    assert BASE.page_bytes == 8 * 1024 * 1024  # Llama-3-8B page of 64 tokens
    uneven = Namespace.create("m", ModelShape.mha(61, 8, 4), "float16", 4, Grid(31, 8))
    assert [uneven.chunk_layers(c) for c in range(uneven.num_layer_chunks)] == [(0, 31), (31, 61)]


@settings(max_examples=50, deadline=None)
@given(
    layers=st.integers(1, 200),
    heads_exp=st.integers(0, 4),
    dim=st.integers(1, 512),
    page=st.integers(1, 256),
    dtype=st.sampled_from(["bfloat16", "float16", "float32", "float8_e4m3fn"]),
    salt=st.text(max_size=20).filter(str.isprintable),
)
def test_json_round_trip_property(
    layers: int, heads_exp: int, dim: int, page: int, dtype: str, salt: str
) -> None:
    heads = 2**heads_exp
    ns = Namespace.create(
        "m", ModelShape.mha(layers, heads, dim), dtype, page, Grid(layers, heads), tenant_salt=salt
    )
    assert Namespace.from_json(json.loads(ns.to_json_text())) == ns


def test_sealed_namespaces_have_their_own_digest_and_plain_ones_keep_theirs() -> None:
    # The digest BASE had before ``sealed`` existed: stored objects keep their keys.
    assert BASE.digest == "38874e9b2c1b1d58"
    sealed = dataclasses.replace(BASE, sealed=True)
    assert sealed.digest != BASE.digest
    assert "sealed" not in dict(BASE.canonical_fields())
    data = json.loads(sealed.to_json_text())
    assert data["sealed"] is True
    assert Namespace.from_json(data) == sealed
    assert "sealed" not in BASE.to_json()
    with pytest.raises(InvalidNamespaceError, match="sealed"):
        dataclasses.replace(BASE, sealed="yes")  # type: ignore[arg-type]


def test_the_weights_revision_rule() -> None:
    """An explicit revision wins (an empty one: none), else the weights identity, else none;
    the revision is part of the digest."""
    assert weights_revision("r1", "fp-abc") == "r1"
    assert weights_revision("", "fp-abc") == ""
    assert weights_revision(None, "fp-abc") == "fp-abc"
    assert weights_revision(None, None) == ""
    a = dataclasses.replace(BASE, model_revision=weights_revision(None, "fp-aaaa"))
    b = dataclasses.replace(BASE, model_revision=weights_revision(None, "fp-bbbb"))
    assert len({a.digest, b.digest, BASE.digest}) == 3
    assert [d.field for d in namespace_differences(a, b)] == ["model_revision"]


def test_an_update_label_composes_with_the_files_identity() -> None:
    assert updated_weights("fp-abc", "step-7") == "fp-abc+step-7"
    assert updated_weights("fp-abc", "step-7") == updated_weights("fp-abc", "step-7")
    odd = updated_weights("fp-abc", "run 3 / step 7")  # outside the label alphabet: hashed
    assert odd.startswith("fp-abc+h") and len(odd) == len("fp-abc+h") + 16
    assert odd != updated_weights("fp-abc", "run 3 / step 8")
    long = updated_weights("hf-" + "0" * 40, "x" * 300)
    assert dataclasses.replace(BASE, model_revision=long).model_revision == long  # it fits
    with pytest.raises(InvalidNamespaceError, match="label"):
        updated_weights("fp-abc", "")
