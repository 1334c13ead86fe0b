"""Our page-hash chain equals SGLang 0.5.23's ``get_hash_str`` on the inputs SGLang gives it."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from hicache_store.layout.hashing import page_hashes


def _cases() -> list[tuple[str, list[Any], int, str | None]]:
    rng = random.Random(21)
    narrow = [rng.randrange(2**32) for _ in range(96)]
    wide = list(narrow)
    for i in (0, 17, 40, 95):  # pages with ids of 2**32 and more, next to narrow pages
        wide[i] = rng.choice([2**32, 2**47 + 3, 2**63 - 1])
    seed = "ab" * 32
    return [
        ("narrow", narrow, 16, None),
        ("wide", wide, 8, None),
        ("wide page size 1", wide[:12], 1, None),
        ("numpy int64 items", [np.int64(t) for t in wide], 8, None),
        ("numpy uint32 items", [np.uint32(t) for t in narrow], 32, None),
        ("empty prior", wide, 8, ""),
        ("prior", wide, 8, seed),
        ("one page", narrow[:64], 64, seed),
    ]


@pytest.mark.parametrize("accelerate", [True, False], ids=["C", "python"])
@pytest.mark.parametrize(("tokens", "page_size", "prior"),
                         [c[1:] for c in _cases()], ids=[c[0] for c in _cases()])
def test_page_hashes_equal_sglangs_get_hash_str(
    sglang: ModuleType, tokens: list[Any], page_size: int, prior: str | None, accelerate: bool
) -> None:
    get_hash_str = sglang.module("sglang.srt.mem_cache.utils").get_hash_str
    theirs = get_hash_str(list(tokens), prior, page_size=page_size)
    full = len(tokens) // page_size  # SGLang also hashes a partial last page; we never do
    ours = page_hashes(tokens, page_size, prior_hash=prior, accelerate=accelerate)
    assert ours == theirs[:full]
    as_array = np.array([int(t) for t in tokens], dtype=np.int64)
    assert page_hashes(as_array, page_size, prior_hash=prior, accelerate=accelerate) == ours


def test_sglangs_request_namespace_seed_is_a_valid_prior(sglang: ModuleType) -> None:
    """SGLang seeds a chain with ``storage_namespace_seed(extra_key, cache_salt)``."""
    utils = sglang.module("sglang.srt.mem_cache.utils")
    seed = utils.storage_namespace_seed("lora-a", "tenant-1")
    tokens = list(range(1000, 1064))
    assert page_hashes(tokens, 16, prior_hash=seed) == utils.get_hash_str(tokens, seed, 16)


@pytest.mark.parametrize("bad", [[-1], [2**63]])
def test_ids_sglang_refuses_are_refused(sglang: ModuleType, bad: list[int]) -> None:
    get_hash_str = sglang.module("sglang.srt.mem_cache.utils").get_hash_str
    with pytest.raises((IndexError, OverflowError, ValueError)):
        get_hash_str(bad * 4, None, page_size=4)
    with pytest.raises(ValueError, match="2\\*\\*63"):
        page_hashes(bad * 4, 4)
