"""``layout.host.VllmCpuLayout`` held to vLLM's own CPU cache writer.

``cpu_attn_reshape_and_cache`` (what vLLM's CPU attention calls to store a step's K and V) writes
known values into one block of a scratch cache; every element must be where the layout's
offsets say, in every dtype vLLM's CPU attention takes, and nothing else may be written.
The connector runs the same check at start-up for its deployment's ISA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from hicache_store.layout.host import VllmCpuLayout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), [(2, 64, 128), (3, 32, 32)])
def test_layout_is_where_vllm_writes(
    dtype: torch.dtype, heads: int, head_dim: int, block_size: int
) -> None:
    isa = _get_attn_isa(dtype, block_size, head_dim, "auto")
    layout = VllmCpuLayout(1, heads, head_dim, block_size, 3)
    cache = torch.zeros(layout.shape, dtype=dtype)
    key_cache, value_cache = cache[0].view(3, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn((block_size, heads, head_dim), generator=gen).to(dtype)
    value = torch.randn((block_size, heads, head_dim), generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, torch.arange(block_size, 2 * block_size), isa
    )
    t, h, d = np.meshgrid(np.arange(block_size), np.arange(heads), np.arange(head_dim),
                          indexing="ij")
    flat = cache.reshape(-1)
    written = torch.zeros(flat.numel(), dtype=torch.bool)
    matches = []
    for plane, expected in ((0, key), (1, value)):
        at = torch.from_numpy(layout.element_offsets(plane, block_size + t, 0, h, d))
        matches.append(torch.equal(flat[at], expected))
        written[at] = True
    if isa == "amx":
        # AMX (bf16 on CPUs that have it) tiles the cache another way: the layout does not hold,
        # which is exactly what the connector's start-up check finds before refusing this ISA.
        assert not all(matches), isa
        return
    assert all(matches), (isa, matches)
    assert not flat[~written].any()  # blocks 0 and 2 untouched
