"""Page hashes against an independent, slow reference written from the formula."""

from __future__ import annotations

import array
import hashlib
import random

import numpy as np
import pytest
import xxhash

from hicache_store.layout.hashing import page_hashes


def reference_chain(
    tokens: list[int], page_size: int, digest: str = "sha256", prior: str | None = None
) -> list[str]:
    """h_i = H(bytes.fromhex(h_{i-1}) + page_i), full pages only (SGLang's rule): page_i is
    its ids as uint32 LE, or 0xff + the ids as uint64 LE when one id is 2**32 or more."""
    hashes: list[str] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        if max(page) >= 2**32:
            data = b"\xff" + b"".join(t.to_bytes(8, "little") for t in page)
        else:
            data = b"".join(t.to_bytes(4, "little") for t in page)
        prefix = bytes.fromhex(prior) if prior else b""
        if digest == "sha256":
            prior = hashlib.sha256(prefix + data).hexdigest()
        else:
            prior = xxhash.xxh3_128(prefix + data).hexdigest()
        hashes.append(prior)
    return hashes


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_sha256_chain_matches_reference(seed: int, page_size: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 700))]
    assert page_hashes(tokens, page_size) == reference_chain(tokens, page_size)


def test_xxh3_chain_matches_reference() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(200_000) for _ in range(1000)]
    got = page_hashes(tokens, 64, algo="xxh3_128")
    assert got == reference_chain(tokens, 64, "xxh3_128")
    assert all(len(h) == 32 for h in got)


def test_partial_last_page_has_no_hash() -> None:
    assert len(page_hashes(list(range(130)), 64)) == 2
    assert page_hashes(list(range(63)), 64) == []


def test_prior_hash_continues_the_chain() -> None:
    tokens = list(range(1000, 1000 + 64 * 5))
    whole = page_hashes(tokens, 64)
    assert page_hashes(tokens[128:], 64, prior_hash=whole[1]) == whole[2:]


def test_input_forms_agree() -> None:
    tokens = [random.randrange(2**32) for _ in range(256)]
    expected = page_hashes(tokens, 32)
    assert page_hashes(np.array(tokens, dtype=np.int64), 32) == expected
    assert page_hashes(array.array("I", tokens), 32) == expected
    assert page_hashes(np.array(tokens, dtype="<u4").tobytes(), 32) == expected


@pytest.mark.parametrize("bad", [[-1], [2**63], [1.5], ["x"]])
@pytest.mark.parametrize("accelerate", [True, False])
def test_out_of_range_tokens_are_refused(bad: list[object], accelerate: bool) -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
        page_hashes(bad * 4, 4, accelerate=accelerate)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
        page_hashes([1, 2, 3, *bad], 4, accelerate=accelerate)  # type: ignore[arg-type]


WIDE = [2**32, 2**40 + 5, 2**63 - 1]


@pytest.mark.parametrize("accelerate", [True, False])
@pytest.mark.parametrize("page_size", [1, 3, 8])
def test_wide_token_ids_use_the_wide_page_encoding(accelerate: bool, page_size: int) -> None:
    rng = random.Random(page_size)
    tokens = [rng.randrange(2**32) for _ in range(8 * page_size)]
    for i in range(0, len(tokens), 2 * page_size + 1):  # some pages wide, some not
        tokens[i] = rng.choice(WIDE)
    expected = reference_chain(tokens, page_size)
    assert page_hashes(tokens, page_size, accelerate=accelerate) == expected
    assert page_hashes(np.array(tokens, dtype=np.int64), page_size, accelerate=accelerate) == expected
    assert page_hashes(np.array(tokens, dtype=np.uint64), page_size, accelerate=accelerate) == expected
    # a narrow page next to a wide one hashes exactly as it would alone
    narrow = list(tokens[:page_size])
    if max(narrow) < 2**32:
        assert page_hashes(narrow, page_size)[0] == expected[0]


@pytest.mark.parametrize("accelerate", [True, False])
def test_numpy_integer_items_and_empty_prior(accelerate: bool) -> None:
    tokens = [random.randrange(2**32) for _ in range(64)] + [2**33]
    expected = reference_chain(tokens[:64], 16)
    items = [np.int64(t) for t in tokens]
    assert page_hashes(items[:64], 16, accelerate=accelerate) == expected
    assert page_hashes([np.uint32(t) for t in tokens[:64]], 16, accelerate=accelerate) == expected
    assert page_hashes(items, 13, accelerate=accelerate) == reference_chain(tokens, 13)
    assert page_hashes(tokens[:64], 16, prior_hash="", accelerate=accelerate) == expected
    with pytest.raises(ValueError, match="prior_hash"):
        page_hashes(tokens, 16, prior_hash="ab", accelerate=accelerate)
    with pytest.raises(ValueError, match="prior_hash"):
        page_hashes(tokens, 16, prior_hash="zz" * 32, accelerate=accelerate)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="algo"):
        page_hashes([1, 2], 1, algo="md5")


@pytest.mark.parametrize("seed", range(6))
def test_accelerated_and_python_chains_agree(seed: int) -> None:
    rng = random.Random(100 + seed)
    page = rng.choice([1, 3, 64])
    tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 900))]
    if tokens and seed % 2:
        tokens[rng.randrange(len(tokens))] = rng.choice(WIDE)
    prior = rng.choice([None, "", "ab" * 32])
    fast = page_hashes(tokens, page, prior_hash=prior)
    slow = page_hashes(tokens, page, prior_hash=prior, accelerate=False)
    assert fast == slow == reference_chain(tokens, page, prior=prior)
    if not tokens or max(tokens) < 2**32:
        as_bytes = np.array(tokens, dtype="<u4").tobytes()
        assert page_hashes(as_bytes, page, prior_hash=prior) == slow


def test_accelerator_is_built_where_openssl_headers_exist() -> None:
    # Where a compiler and OpenSSL headers exist (this project's machines and CI), the fast
    # path must really be in use, or the benchmark figures would describe code that does not run.
    import shutil
    from pathlib import Path

    from hicache_store.layout import hashing

    if shutil.which("cc") is None or not Path("/usr/include/openssl/evp.h").exists():
        pytest.skip("no C compiler or OpenSSL headers here: the pure-Python chain is used")
    assert hashing._accelerated is not None


def test_the_accelerator_survives_a_list_mutated_by_index() -> None:
    """``__index__`` runs Python code; a list shrunk under the C loop is an error, not a crash.

    (``page_hashes`` hands the C loop only lists it built itself; this calls it directly.)"""
    from hicache_store.layout import hashing

    if hashing._accelerated is None:
        pytest.skip("the C accelerator is not built here")
    tokens: list[object] = list(range(8))

    class Shrinks:
        def __index__(self) -> int:
            del tokens[2:]
            return 1

    tokens[1] = Shrinks()
    with pytest.raises(ValueError, match="changed"):
        hashing._accelerated.chain_sha256(tokens, 4, None)
    assert hashing._accelerated.chain_sha256([np.int64(1), 2**40], 2, None) == bytes.fromhex(
        reference_chain([1, 2**40], 2)[0]
    )
