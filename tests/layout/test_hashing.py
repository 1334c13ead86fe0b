"""Page hashes against an independent, slow reference written from the formula."""

from __future__ import annotations

import array
import hashlib
import random

import numpy as np
import pytest
import xxhash

from hicache_store.layout.hashing import page_hashes


def reference_chain(tokens: list[int], page_size: int, digest: str = "sha256") -> list[str]:
    """h_i = H(bytes.fromhex(h_{i-1}) + tokens_i as uint32 LE), full pages only (SGLang's rule)."""
    hashes: list[str] = []
    prior: str | None = None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size])
        prefix = bytes.fromhex(prior) if prior is not None else b""
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


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_out_of_range_tokens_are_refused(bad: list[float]) -> None:
    with pytest.raises(ValueError, match="uint32"):
        page_hashes(bad * 4, 4)  # type: ignore[arg-type]


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
    prior = rng.choice([None, "ab" * 32])
    fast = page_hashes(tokens, page, prior_hash=prior)
    slow = page_hashes(tokens, page, prior_hash=prior, accelerate=False)
    assert fast == slow
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


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["x"]])
def test_accelerated_chain_refuses_bad_ids(bad: list[object]) -> None:
    with pytest.raises(ValueError, match="uint32"):
        page_hashes(bad * 4, 4)  # type: ignore[arg-type]
