"""Object keys: format/parse are inverses; everything outside the grammar is refused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_store.layout.errors import InvalidKeyError
from hicache_store.layout.keys import (
    ObjectCoords,
    ObjectKey,
    format_key,
    object_key,
    parse_key,
    validate_storage_key,
    validate_storage_keys,
)

HASH = "a1" * 32
NS = "0123456789abcdef"


@contextmanager
def key_check(accelerated: bool) -> Iterator[None]:
    """The batch check with the C accelerator (skipped where it is not built) or without it."""
    from hicache_store.layout import keys

    saved = keys._accelerated
    if accelerated and saved is None:
        pytest.skip("the C accelerator (layout/_keys.c) is not built here")
    keys._accelerated = saved if accelerated else None
    try:
        yield
    finally:
        keys._accelerated = saved


def test_seed_format() -> None:
    assert object_key(HASH, NS, ObjectCoords(30, 60, 2)) == f"{HASH}_{NS}_L30-59_H2"
    assert object_key(HASH, NS, ObjectCoords(0, 61, None)) == f"{HASH}_{NS}_L0-60"
    assert object_key(HASH, NS, ObjectCoords(0, 1, 0, 3)) == f"{HASH}_{NS}_L0-0_H0_C3"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "a/b",
        "..",
        "../etc/passwd",
        "a\x00b",
        "x" * 10_000,
        "key with space",
        "UPPER.case",
        "ключ",
        "abc%2F",
    ],
)
def test_storage_grammar_refuses(bad: str) -> None:
    with pytest.raises(InvalidKeyError):
        validate_storage_key(bad)


def test_storage_grammar_refuses_non_strings() -> None:
    with pytest.raises(InvalidKeyError, match="must be a str"):
        validate_storage_key(b"abc")


def test_long_key_message_is_bounded() -> None:
    with pytest.raises(InvalidKeyError) as info:
        validate_storage_key("a" * 300)
    assert len(str(info.value)) < 200


@pytest.mark.parametrize(
    "bad",
    [
        f"{HASH}_{NS}_L30-29_H2",  # end before start
        f"{HASH}_{NS}_L030-59_H2",  # leading zero: two spellings of one key
        f"{HASH}_{NS}_L30-59_H02",
        f"{HASH[:-1]}_{NS}_L30-59",  # 63 hex chars
        f"{HASH}_{NS[:-1]}_L30-59",
        f"{HASH}_{NS}_L30-59_C0",  # component 0 is spelled by omission
        f"{HASH.upper()}_{NS}_L30-59",
        f"{HASH}_{NS}_L30-59_H2_",
    ],
)
def test_parse_refuses(bad: str) -> None:
    with pytest.raises(InvalidKeyError):
        parse_key(bad)


@settings(max_examples=200, deadline=None)
@given(
    page_hash=st.one_of(
        st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32)
    ).map(bytes.hex),
    ns=st.binary(min_size=8, max_size=8).map(bytes.hex),
    start=st.integers(0, 99_999),
    length=st.integers(1, 1000),
    group=st.one_of(st.none(), st.integers(0, 99_999)),
    component=st.integers(0, 999),
)
def test_parse_is_the_inverse_of_format(
    page_hash: str, ns: str, start: int, length: int, group: int | None, component: int
) -> None:
    key = ObjectKey(page_hash, ns, ObjectCoords(start, start + length, group, component))
    text = format_key(key)
    assert validate_storage_key(text) == text
    assert parse_key(text) == key
    assert format_key(parse_key(text)) == text


@pytest.mark.parametrize(
    "bad",
    ["", "_lead", "-lead", "a/b", "..", "a\x00b", "x" * 256, "ключ", "a.b", "a b", "g",
     "ab\ncd", "ab\n", "\nab", "\n", "ab\n_cd", "ab\n\ncd"],
)
@pytest.mark.parametrize("many", [1, 50])  # a small batch, and one that takes the joined check
@pytest.mark.parametrize("accelerated", [True, False])
def test_batch_validation_refuses_what_the_single_check_refuses(
    bad: str, many: int, accelerated: bool
) -> None:
    good = ["ab" * 16 + "_L0-1", "ff"] * many
    with pytest.raises(InvalidKeyError):
        validate_storage_key(bad)
    with key_check(accelerated), pytest.raises(InvalidKeyError):
        validate_storage_keys([*good, bad, *good])


@pytest.mark.parametrize("padding", [0, 70])  # a small batch, and one that takes the joined check
@pytest.mark.parametrize("accelerated", [True, False])
@settings(max_examples=400, deadline=None)
@given(
    batch=st.lists(
        st.text(alphabet="0af_-kuvAZ\n./ \x00é", max_size=6)
        | st.text(alphabet="09afkuvAZ_-", min_size=14, max_size=40)  # the C check's 16-byte steps
        | st.sampled_from(["F" * 255, "F" * 256, "a" * 31 + "/", "a" * 16 + "g" + "a" * 15]),
        max_size=5,
    )
)
def test_batch_validation_agrees_with_the_single_check(
    batch: list[str], padding: int, accelerated: bool
) -> None:
    """Any batch: the batch check returns the keys exactly when every key passes the single
    check, and otherwise refuses the same first key the same way."""
    batch = ["a0"] * padding + batch
    expected: list[str] | InvalidKeyError
    try:
        expected = [validate_storage_key(k) for k in batch]
    except InvalidKeyError as exc:
        expected = exc
    with key_check(accelerated):
        if isinstance(expected, InvalidKeyError):
            with pytest.raises(InvalidKeyError) as got:
                validate_storage_keys(batch)
            assert str(got.value) == str(expected)
        else:
            assert validate_storage_keys(batch) == expected


@settings(max_examples=300, deadline=None)
@given(key=st.text(alphabet="09afkuvAZ_-./\x00\x7f\x80é", min_size=0, max_size=300))
def test_the_c_check_agrees_with_the_grammar_at_every_length_and_offset(key: str) -> None:
    """Every position of a key is checked (whole 16-byte steps and the overlapping last one)."""
    from hicache_store.layout import keys

    if keys._accelerated is None:
        pytest.skip("the C accelerator (layout/_keys.c) is not built here")
    try:
        validate_storage_key(key)
        valid = True
    except InvalidKeyError:
        valid = False
    assert keys._accelerated.storage_keys_valid([key]) is valid
    for bad in ("/", "\x80", "g"):  # one bad character at each position of a valid key
        good = "a" * len(key)
        for at in range(len(good)):
            assert not keys._accelerated.storage_keys_valid([good[:at] + bad + good[at + 1 :]])


def test_the_key_accelerator_is_built_where_a_compiler_exists() -> None:
    # Where a C compiler exists (this project's machines and CI) the fast path must really be
    # in use, or the benchmark figures would describe code that does not run.
    import shutil

    from hicache_store.layout import keys

    if shutil.which("cc") is None:
        pytest.skip("no C compiler here: the pure-Python check is used")
    assert keys._accelerated is not None


@pytest.mark.parametrize("accelerated", [True, False])
def test_batch_validation_accepts_valid_keys_and_refuses_non_strings(accelerated: bool) -> None:
    keys = ["ab" * 32 + "_0123456789abcdef_L0-29_H1", "M0123", "x" * 0 + "F" * 255]
    with key_check(accelerated):
        assert validate_storage_keys(keys) == keys
        assert validate_storage_keys(tuple(keys)) == keys
        with pytest.raises(InvalidKeyError, match="must be a str"):
            validate_storage_keys(["ab", b"cd"])

        class Key(str):
            pass

        assert validate_storage_keys([Key("ab")]) == ["ab"]  # a str subclass is a str


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(0, 70),
    length=st.integers(-2, 70),
    group=st.one_of(st.none(), st.integers(0, 20)),
    digest=st.sampled_from([NS, "ukv1-" + NS, "ukv1-" + NS[:-1], "M", NS.upper()]),
    tail=st.sampled_from(["", "_", "_C2", "x"]),
)
def test_object_key_parts_agrees_with_parse_key(
    start: int, length: int, group: int | None, digest: str, tail: str
) -> None:
    # The cheap classifier the operator tools stream millions of keys through: it says
    # "object key" exactly when ``parse_key`` does, with the same page hash and digest.
    from hicache_store.layout.keys import object_key_parts

    text = f"{HASH}_{digest}_L{start}-{start + length}" + (
        "" if group is None else f"_H{group}") + tail
    try:
        parsed = parse_key(text)
    except InvalidKeyError:
        assert object_key_parts(text) is None
    else:
        assert object_key_parts(text) == (parsed.page_hash, parsed.namespace_digest)
    assert object_key_parts("M_" + NS) is None
