"""SGLang's unified keyspace (``key_scheme="sglang-ukv1"``) at the layout layer.

The keys and digests are held to SGLang's own ``plan_unified_kv`` in
``tests/sglang/test_sglang_storage_ukv1.py``; here: the key grammar, per-stage grids, what the
scheme refuses, and that this library's own digests did not move.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_store.layout.errors import InvalidKeyError, InvalidNamespaceError
from hicache_store.layout.keys import (
    ObjectCoords,
    ObjectKey,
    format_key,
    is_ukv1_digest,
    parse_key,
    validate_storage_key,
    validate_storage_keys,
)
from hicache_store.layout.namespace import Grid, ModelShape, Namespace, kv_scales_digest
from hicache_store.layout.plans import plan_reads, plan_writes
from hicache_store.layout.topology import Topology
from hicache_store.layout.ukv1 import ukv1_grid

HASH = "a1" * 32
UKV = "ukv1-0123456789abcdef"
MHA = ModelShape.mha(61, 8, 128)


def test_ukv1_keys_print_the_layer_range_end_exclusive() -> None:
    key = ObjectKey(HASH, UKV, ObjectCoords(30, 61, 1))
    assert format_key(key) == f"{HASH}_{UKV}_L30-61_H1"
    assert parse_key(f"{HASH}_{UKV}_L30-61_H1") == key
    assert format_key(ObjectKey(HASH, UKV, ObjectCoords(0, 1, None))) == f"{HASH}_{UKV}_L0-1"
    # the same coordinates in this library's keyspace print end-inclusive
    assert format_key(ObjectKey(HASH, "0123456789abcdef", ObjectCoords(30, 61, 1))).endswith(
        "_L30-60_H1"
    )
    assert is_ukv1_digest(UKV) and not is_ukv1_digest("0123456789abcdef")


@pytest.mark.parametrize(
    "bad",
    [
        f"{HASH}_{UKV}_L30-30_H1",  # empty range (end-exclusive)
        f"{HASH}_{UKV}_L31-30",
        f"{HASH}_{UKV}_L0-30_H1_C2",  # no components in SGLang's keyspace
        f"{HASH}_ukv2-0123456789abcdef_L0-30",
        f"{HASH}_ukv1-0123456789ABCDEF_L0-30",
        f"{HASH}_ukv1-0123456789abcde_L0-30",
        f"{HASH}_{UKV}_L00-30",
    ],
)
def test_malformed_ukv1_keys_are_refused(bad: str) -> None:
    with pytest.raises(InvalidKeyError):
        parse_key(bad)


def test_ukv1_objects_have_no_component() -> None:
    with pytest.raises(InvalidKeyError, match="component"):
        ObjectKey(HASH, UKV, ObjectCoords(0, 30, 1, component=2))


def test_the_storage_alphabet_admits_the_ukv_tag_and_nothing_more() -> None:
    assert validate_storage_key(f"{HASH}_{UKV}_L0-30") == f"{HASH}_{UKV}_L0-30"
    assert validate_storage_keys([f"{HASH}_{UKV}_L0-30", "M_abc"]) == [
        f"{HASH}_{UKV}_L0-30", "M_abc"]
    for bad in ("ukv1/../x", "ukv1.x", "w", "ukv1-zz", "_ukv1"):
        with pytest.raises(InvalidKeyError):
            validate_storage_keys([bad])


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(0, 2000),
    length=st.integers(1, 500),
    group=st.none() | st.integers(0, 300),
    tail=st.text("0123456789abcdef", min_size=16, max_size=16),
)
def test_ukv1_format_and_parse_are_inverses(start: int, length: int, group: int | None,
                                            tail: str) -> None:
    key = ObjectKey(HASH, "ukv1-" + tail, ObjectCoords(start, start + length, group))
    assert parse_key(format_key(key)) == key


def test_per_stage_grid_cuts_at_the_stages() -> None:
    topology = Topology(2, 2, (30, 31))  # SGLang's split of 61 layers
    ns = Namespace.create("m", MHA, "bfloat16", 64, ukv1_grid(MHA, topology),
                          key_scheme="sglang-ukv1")
    assert ns.grid == Grid(0, 4, (0, 30))
    assert ns.num_layer_chunks == 2
    assert [ns.chunk_layers(c) for c in range(2)] == [(0, 30), (30, 61)]
    assert [ns.chunk_of_layer(x) for x in (0, 29, 30, 60)] == [0, 0, 1, 1]
    assert ns.is_chunk_boundary(30) and ns.is_chunk_boundary(61) and not ns.is_chunk_boundary(31)
    # each rank writes one object per page; a PP1 reader reads both stages' objects
    writes = [plan_writes(ns, topology, r).object_keys(HASH) for r in range(4)]
    assert [len(w) for w in writes] == [1, 1, 1, 1]
    reader = plan_reads(ns, Topology(1, 1), 0).object_keys(HASH)
    assert sorted(reader) == sorted(k for w in writes for k in w)
    # a PP split that does not fall on the stages cannot write
    with pytest.raises(Exception, match="chunks starting at layers"):
        plan_writes(ns, Topology(1, 2), 1)


def test_uniform_grid_and_group_defaults() -> None:
    assert ukv1_grid(MHA, Topology(4, 1)) == Grid(0, 2, (0,))
    assert ukv1_grid(MHA, Topology(4, 1), layer_partition=8, head_group=1) == Grid(8, 1)
    assert ukv1_grid(ModelShape.mla(61, 576), Topology(8, 1)) == Grid(0, 1, (0,))
    with pytest.raises(InvalidNamespaceError, match="replicates"):
        ukv1_grid(MHA, Topology(16, 1))


@pytest.mark.parametrize(
    ("field", "value"),
    [("tenant_salt", "t"), ("hash_algo", "xxh3_128")],
)
def test_what_the_ukv1_namespace_cannot_hold_is_refused(field: str, value: str) -> None:
    with pytest.raises(InvalidNamespaceError, match=field):
        Namespace.create("m", MHA, "bfloat16", 64, Grid(61, 8), key_scheme="sglang-ukv1",
                         **{field: value})


def test_a_ukv1_revision_is_folded_into_the_model_id() -> None:
    """SGLang's namespace has no revision: the weights' revision is hashed as part of the
    model id, so other weights under one model name never share SGLang's keys."""
    bare = Namespace.create("m", MHA, "bfloat16", 64, Grid(61, 8), key_scheme="sglang-ukv1")
    revised = Namespace.create("m", MHA, "bfloat16", 64, Grid(61, 8), key_scheme="sglang-ukv1",
                               model_revision="fp-1234")
    folded = Namespace.create("m@fp-1234", MHA, "bfloat16", 64, Grid(61, 8),
                              key_scheme="sglang-ukv1")
    assert revised.ukv1_fields()["model_id"] == "m@fp-1234"
    assert revised.digest == folded.digest != bare.digest
    assert bare.ukv1_fields()["model_id"] == "m"  # no revision: SGLang's own keys


def test_ukv1_kv_scales_are_folded_into_the_model_id() -> None:
    """SGLang's namespace has no scales either: float8 KV under other scales gets other keys."""
    def ns(scales: str, revision: str = "") -> Namespace:
        return Namespace.create("m", MHA, "float8_e4m3fn", 64, Grid(61, 8),
                                key_scheme="sglang-ukv1", model_revision=revision,
                                kv_scales=scales)
    a, b = kv_scales_digest([1.0], [1.0]), kv_scales_digest([0.5], [1.0])
    assert ns(a, "fp-1").ukv1_fields()["model_id"] == f"m@fp-1~{a}"
    assert ns(a).ukv1_fields()["model_id"] == f"m~{a}"
    assert len({ns("").digest, ns(a).digest, ns(b).digest}) == 3
    assert ns(a).digest == ns(a).digest


@pytest.mark.parametrize(
    "starts", [(), (1, 30), (0, 30, 30), (0, 61), (0, 2000)]
)
def test_bad_layer_starts_are_refused(starts: tuple[int, ...]) -> None:
    with pytest.raises(InvalidNamespaceError, match="layer_starts"):
        Namespace.create("m", MHA, "bfloat16", 64, Grid(0, 8, starts))
    with pytest.raises(InvalidNamespaceError, match="layer_starts"):
        Namespace.create("m", MHA, "bfloat16", 64, Grid(30, 8, (0, 30)))  # both ways at once


def test_this_librarys_digests_did_not_move() -> None:
    """Digests computed before key schemes and per-stage grids existed (stored data)."""
    a = Namespace.create("org/model", ModelShape.mha(60, 8, 128), "bfloat16", 64, Grid(30, 2))
    b = Namespace.create("deepseek-ai/DeepSeek-V3", ModelShape.mla(61, 576), "float8_e4m3fn",
                         64, Grid(61, 1), tenant_salt="t", model_revision="r1")
    assert (a.digest, b.digest) == ("7558577c920d66eb", "6c13b058b07e1c07")
    staged = Namespace.create("org/model", ModelShape.mha(60, 8, 128), "bfloat16", 64,
                              Grid(0, 2, (0, 30)))
    assert staged.digest not in (a.digest,) and len(staged.digest) == 16


@pytest.mark.parametrize(
    "ns",
    [
        Namespace.create("m", MHA, "bfloat16", 64, Grid(0, 4, (0, 30)), key_scheme="sglang-ukv1"),
        Namespace.create("m", MHA, "bfloat16", 64, Grid(0, 4, (0, 30))),
        Namespace.create("m", MHA, "bfloat16", 64, Grid(8, 2), key_scheme="sglang-ukv1"),
    ],
)
def test_json_round_trip_keeps_the_scheme_and_stages(ns: Namespace) -> None:
    again = Namespace.from_json(ns.to_json())
    assert again == ns and again.digest == ns.digest
