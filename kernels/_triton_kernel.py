# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (a @triton.jit kernel's parameters are typed by Triton, not by Python annotations.)
"""The Triton kernel behind every op. Imported lazily: importing it needs triton.

Triton decides at decoration time whether ``@triton.jit`` compiles for a GPU or wraps the
function for its CPU interpreter (``TRITON_INTERPRET=1`` read when this module is imported), so
tests that run the kernel on CPU tensors set the variable before the first import of this
module. ``INTERPRETED`` records which of the two this process got.

The kernel trusts its arguments; ``triton_ops`` validates them (through ``plan_copy``) and
computes ``ALIGN`` so that the alignment promises below are true.
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


@triton.jit
def kv_page_copy_kernel(
    pool_base,  # *int: element (slot 0, head 0, dim 0) of the first (layer, plane) buffer
    lp_off,  # *i64 [LP]: element offset of each selected (layer, plane) buffer from pool_base
    tok_off,  # *i64 [N, P]: element offset of token t of page n inside a (layer, plane) buffer
    stage_ptr,  # *int staging, [N, page elements]
    stage_page_stride,  # elements between staging rows
    stage_off,  # element offset in a row of (first layer, plane 0, token 0, first head, dim 0)
    block_stride,  # elements between consecutive head blocks of the run
    head_stride,  # pool elements between consecutive heads
    pool_head0,  # first pool head of the run
    P: tl.constexpr,  # tokens per page
    HEADS: tl.constexpr,  # heads per block
    NUM_HEADS: tl.constexpr,  # heads of the run (blocks * HEADS)
    D: tl.constexpr,  # head dim
    BLOCK_R: tl.constexpr,  # (token, head) rows per program
    BLOCK_D: tl.constexpr,  # next power of two >= D
    ALIGN: tl.constexpr,  # every row offset on both sides is a multiple of ALIGN elements
    PACK: tl.constexpr,  # True: pool -> staging; False: staging -> pool
):
    """Copy one tile of (token, head) rows of one page of one (layer, plane).

    Grid: (pages, layers * planes, cdiv(P * NUM_HEADS, BLOCK_R)). A row is one head of one
    token: ``D`` contiguous elements on both sides, so the tile's inner axis is contiguous and,
    with the ``ALIGN`` promise, loads and stores become wide vector accesses. Unified order
    inside a block is ``(layer, plane, token, head, dim)``, so the (layer, plane) program index
    ``lp`` counts whole ``P * HEADS * D`` slabs of the block.
    """
    n = tl.program_id(0).to(tl.int64)
    lp = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    # Plain bound masks (the standard Triton pattern): with P * NUM_HEADS and D multiples of
    # the tile, the compiler sees them constant along the contiguous axis and still vectorises.
    row_ok = rows < P * NUM_HEADS
    mask = row_ok[:, None] & (dims < D)[None, :]
    t = rows // NUM_HEADS
    h = rows % NUM_HEADS
    group = h // HEADS
    h_in = h % HEADS

    token = tl.load(tok_off + n * P + t, mask=row_ok, other=0)
    pool_row = tl.load(lp_off + lp) + token + (pool_head0 + h).to(tl.int64) * head_stride
    pool_row = tl.multiple_of(pool_row, ALIGN)
    stage_row = (
        n * stage_page_stride
        + stage_off
        + group.to(tl.int64) * block_stride
        + ((lp * P + t) * HEADS + h_in) * D
    )
    stage_row = tl.multiple_of(stage_row, ALIGN)
    pool_addr = pool_base + pool_row[:, None] + dims[None, :]
    stage_addr = stage_ptr + stage_row[:, None] + dims[None, :]
    if PACK:
        tl.store(stage_addr, tl.load(pool_addr, mask=mask), mask=mask)
    else:
        tl.store(pool_addr, tl.load(stage_addr, mask=mask), mask=mask)
