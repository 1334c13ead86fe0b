"""CPU benchmark: packing and unpacking pages of vLLM's CPU KV cache, by the size of that cache.

A connector's save packs a few pages out of vLLM's whole cache each step, so the cost of a pack
must follow the pages moved, not the cache they are taken from. For each cache size (vLLM's
CPU layout, a tiny Llama's shape by default: 4 layers, 2 KV heads x 64, float32, blocks of
128 tokens: 512 KiB a block) this times ``pack_blocks`` and ``unpack_blocks`` of ``--pages``
whole blocks against one contiguous ``copy_`` of the same bytes, as the best of ``--repeat``
rounds with the three alternating (one warm-up call each first), on one thread.

    .venv/bin/python bench/bench_kernels_vllm_cpu.py [--pages 1,4] [--cache-mib 32,256] [--repeat 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import interleaved_best

from hicache_store.kernels.vllm_cpu import pack_blocks, unpack_blocks
from hicache_store.layout.host import UnifiedPageLayout, VllmCpuLayout
from hicache_store.layout.namespace import Grid, ModelShape, Namespace

MIB = 1 << 20


def time_pack_unpack(cache: torch.Tensor, layout: VllmCpuLayout, slots: torch.Tensor,
                     unified: UnifiedPageLayout, repeat: int) -> dict[str, float]:
    """Best seconds of a contiguous ``copy_`` of the pages' bytes, ``pack_blocks`` and
    ``unpack_blocks`` of ``slots``."""
    staging = torch.empty((slots.numel(), unified.page_bytes), dtype=torch.uint8)
    src, dst = torch.empty_like(staging), torch.empty_like(staging)
    return interleaved_best({
        "copy": lambda: dst.copy_(src),
        "pack": lambda: pack_blocks(cache, layout, slots, staging, unified),
        "unpack": lambda: unpack_blocks(staging, cache, layout, slots, unified),
    }, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", default="1,4", help="pages a call moves (comma-separated)")
    parser.add_argument("--cache-mib", default="32,256", help="cache sizes (comma-separated)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = ModelShape.mha(num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim)
    ns = Namespace.create("bench", shape, "float32", args.block, Grid(args.layers, args.heads))
    unified = UnifiedPageLayout(ns, 0, args.layers, 0, args.heads)
    print("| cache MiB | pages | copy_ ms | pack ms | unpack ms | pack MiB/s | unpack MiB/s |")
    print("|---|---|---|---|---|---|---|")
    for cache_mib in (int(x) for x in args.cache_mib.split(",")):
        blocks = max(1, cache_mib * MIB // unified.page_bytes)
        layout = VllmCpuLayout(args.layers, args.heads, args.head_dim, args.block, blocks)
        cache = torch.randn(layout.shape)
        for pages in (int(x) for x in args.pages.split(",")):
            slots = torch.randperm(blocks)[:pages]
            best = time_pack_unpack(cache, layout, slots, unified, args.repeat)
            mib = pages * unified.page_bytes / MIB
            print(f"| {cache_mib} | {pages} | {best['copy'] * 1e3:.3f} | {best['pack'] * 1e3:.3f} "
                  f"| {best['unpack'] * 1e3:.3f} | {mib / best['pack']:.0f} "
                  f"| {mib / best['unpack']:.0f} |")


if __name__ == "__main__":
    main()
