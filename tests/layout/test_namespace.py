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
    check_kv_scales,
    kv_scales_digest,
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


FP8 = dataclasses.replace(BASE, dtype="float8_e4m3fn")
K_SCALES, V_SCALES = [0.5 + i / 64 for i in range(32)], [0.25 + i / 128 for i in range(32)]


def test_fp8_kv_under_other_scales_has_another_digest() -> None:
    """The scales are part of the identity: one k or v scale of one layer moves the digest."""
    scaled = dataclasses.replace(FP8, kv_scales=kv_scales_digest(K_SCALES, V_SCALES))
    assert scaled.digest not in (FP8.digest, BASE.digest)
    other_k = [*K_SCALES[:-1], K_SCALES[-1] * 2]
    other_v = [*V_SCALES[:3], V_SCALES[3] + 2**-10, *V_SCALES[4:]]
    swapped = kv_scales_digest(V_SCALES, K_SCALES)  # k and v are not interchangeable
    digests = {
        dataclasses.replace(FP8, kv_scales=scales).digest
        for scales in (kv_scales_digest(other_k, V_SCALES), kv_scales_digest(K_SCALES, other_v),
                       swapped)
    }
    assert len(digests | {scaled.digest}) == 4
    assert [d.field for d in namespace_differences(scaled, FP8)] == ["kv_scales"]


def test_equal_scales_give_the_same_digest_in_another_process() -> None:
    """Equal scales on another host (here: another process, another hash seed) hit: the
    digest depends on the scale values alone, as float32 bytes (a tensor's, a Python float's)."""
    mine = dataclasses.replace(FP8, kv_scales=kv_scales_digest(K_SCALES, V_SCALES))
    code = (
        "import dataclasses; from hicache_store.layout.namespace import *;"
        "ns = Namespace.create('meta-llama/Llama-3-8B', ModelShape.mha(32, 8, 128),"
        " 'float8_e4m3fn', 64, Grid(16, 2));"
        "k = [0.5 + i / 64 for i in range(32)]; v = [0.25 + i / 128 for i in range(32)];"
        "print(dataclasses.replace(ns, kv_scales=kv_scales_digest(k, v)).digest)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "7"})
    assert out.stdout.strip() == mine.digest
    assert kv_scales_digest([1, 1], [1, 1]) == kv_scales_digest([1.0, 1.0], [1.0, 1.0])


def test_kv_scales_round_trip_through_json_and_old_digests_stay() -> None:
    assert "kv_scales" not in dict(FP8.canonical_fields())
    assert BASE.digest == "38874e9b2c1b1d58"  # namespaces without scales keep their keys
    scaled = dataclasses.replace(FP8, kv_scales=kv_scales_digest(K_SCALES, V_SCALES))
    data = json.loads(scaled.to_json_text())
    assert data["kv_scales"] == scaled.kv_scales
    assert Namespace.from_json(data) == scaled


@pytest.mark.parametrize(
    ("k", "v", "match"),
    [
        ([1.0], [1.0, 1.0], "1 k and 2 v scales"),
        ([], [], "0 k and 0 v"),
        ([1.0, 0.0], [1.0, 1.0], "layer 1's k scale 0.0"),
        ([1.0], [float("nan")], "layer 0's v scale nan"),
        ([1.0], [float("inf")], "not a finite positive"),
        ([1e39], [1.0], "float32"),
        ([True], [1.0], "layer 0's k scale True"),
    ],
)
def test_impossible_scales_are_refused(k: list[float], v: list[float], match: str) -> None:
    with pytest.raises(InvalidNamespaceError, match=match):
        kv_scales_digest(k, v)


def test_a_kv_scales_field_is_only_a_scales_digest() -> None:
    with pytest.raises(InvalidNamespaceError, match="kv_scales"):
        dataclasses.replace(FP8, kv_scales="0.5,0.25")


def test_float8_kv_without_scales_is_refused_naming_the_setting() -> None:
    for dtype in ("float8_e4m3fn", "torch.float8_e5m2", "float8_e4m3fnuz"):
        with pytest.raises(InvalidNamespaceError, match=r"KV needs its per-layer k/v scales .*"
                           r"set THE-SETTING; float8 KV is not stored"):
            check_kv_scales(dtype, "", setting="THE-SETTING")
        check_kv_scales(dtype, kv_scales_digest([1.0], [1.0]), setting="x")
    for dtype in ("bfloat16", "float16", "float32", "uint8"):
        check_kv_scales(dtype, "", setting="x")  # unscaled KV needs none
