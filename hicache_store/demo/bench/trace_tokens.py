"""Deterministic prompt tokens for block-hash traces.

Traces publish one id per block of ``block_tokens`` tokens instead of the tokens themselves
(``trace_format``). To replay one through a cache that hashes tokens, each block id is given
its own token sequence, a pure function of ``(seed, id, position in block)``:

* the same id always yields the same tokens (in any request, in any process);
* a request's tokens are the concatenation of its blocks' tokens, cut at ``input_length``, so a
  partial last block is a prefix of the same id's full block;
* different ids yield different tokens (a 64-bit mix per token, reduced to ``vocab_size``; two
  512-token blocks collide with probability ~ vocab_size ** -512).

Hence two requests share a token prefix exactly as long as their id lists share a prefix (to
the end of the shorter request), and the page-hash chain over the tokens reproduces the trace's
sharing at any page size that divides ``block_tokens``: a page is shared iff the blocks it lies
in are. The mix is SplitMix64's finaliser, vectorised with numpy (seconds for a whole trace).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .trace_format import TraceRequest

#: default token range: a realistic vocabulary size (token values do not matter to a cache).
DEFAULT_VOCAB_SIZE = 1 << 17

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's output function over a uint64 array (wrapping arithmetic, as specified)."""
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def blocks_tokens(
    hash_ids: Sequence[int],
    block_tokens: int,
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> np.ndarray:
    """The tokens of the blocks ``hash_ids``, concatenated: a uint32 array of
    ``len(hash_ids) * block_tokens`` values in ``[0, vocab_size)``."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if not 1 < vocab_size <= 1 << 32:
        raise ValueError(f"vocab_size must be in (1, 2**32], got {vocab_size}")
    ids = np.asarray(hash_ids, dtype=np.uint64)
    positions = ids[:, None] * np.uint64(block_tokens) + np.arange(block_tokens, dtype=np.uint64)
    # The seed moves every block to another stream; the golden-ratio multiple keeps seeds apart.
    salt = np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _GOLDEN
    flat = positions.reshape(-1).astype(np.uint64, copy=False)
    mixed = _splitmix64(flat ^ salt)
    return (mixed % np.uint64(vocab_size)).astype(np.uint32)


def request_tokens(
    request: TraceRequest,
    block_tokens: int,
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> np.ndarray:
    """The ``input_length`` prompt tokens of ``request`` (uint32; see the module docstring)."""
    tokens = blocks_tokens(request.hash_ids, block_tokens, seed=seed, vocab_size=vocab_size)
    return tokens[: request.input_length]
