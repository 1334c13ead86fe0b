"""GPU check and benchmark of the Triton pack/unpack kernels. One command, under 5 minutes.

    .venv/bin/python bench/bench_kernels_gpu.py [--json out.json]

1. Correctness: the Triton kernels against the torch reference on the same CUDA tensors, byte
   for byte (Llama-3-8B full page and a TP shard, bf16 and fp8; DeepSeek-style MLA; every
   SGLang host layout), including a layer-by-layer unpack and a poisoned destination.
2. Bandwidth, Llama-3-8B-shaped pool (32 layers, 8 KV heads, head dim 128, bf16, page size 64,
   one buffer per layer and K/V as SGLang allocates them; 8 MiB per page), 256 shuffled pages:
   pack, unpack, and layer-wise unpack (one launch per layer) against
   * one device-to-device ``copy_`` of the same number of bytes (the target: >= 80 % of it);
   * one ``cudaMemcpyAsync`` per page (256 copies of 8 MiB from a page-contiguous source: the
     best a copy-based scheme can do, only possible if the pool were page-major);
   * one ``cudaMemcpyAsync`` per contiguous run the pool really has (page x layer x K/V:
     16,384 copies of 128 KiB: what packing without a kernel costs).
   GB/s counts the bytes moved once (read or write, not both).

``--smoke`` runs the same code with tiny shapes on CPU tensors through Triton's interpreter
(set ``TRITON_INTERPRET=1``), to check the script itself where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache_store.kernels import (
    DevicePool,
    HostPool,
    host_to_unified,
    pack_pages,
    unified_to_host,
    unpack_pages,
)
from hicache_store.kernels.pools import as_bits
from hicache_store.layout.host import PoolLayout, UnifiedPageLayout
from hicache_store.layout.namespace import Grid, ModelShape, Namespace


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    dim: int
    page_size: int
    pages: int
    pool_pages: int


FULL = Shape(layers=32, heads=8, dim=128, page_size=64, pages=256, pool_pages=320)
SMOKE = Shape(layers=2, heads=2, dim=8, page_size=4, pages=3, pool_pages=5)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random bit patterns (not zeros) in ``dtype``."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * item), dtype=torch.uint8, device=device)
    return raw.view(dtype)


def device_pool(
    kind: str, layers: int, heads: int, dim: int, slots: int, dtype: torch.dtype, device: str
) -> DevicePool:
    if kind == "mla":
        return DevicePool.mla(
            [random_tensor((slots, 1, dim), dtype, device) for _ in range(layers)]
        )
    k = [random_tensor((slots, heads, dim), dtype, device) for _ in range(layers)]
    v = [random_tensor((slots, heads, dim), dtype, device) for _ in range(layers)]
    return DevicePool.mha(k, v)


def clone_pool(pool: DevicePool) -> DevicePool:
    planes = [[b.clone() for b in plane] for plane in pool.planes]
    return DevicePool.mha(*planes) if pool.kv_kind == "mha" else DevicePool.mla(planes[0])


def same_pool(a: DevicePool, b: DevicePool) -> bool:
    return all(
        torch.equal(as_bits(x), as_bits(y))
        for pa, pb in zip(a.planes, b.planes, strict=True)
        for x, y in zip(pa, pb, strict=True)
    )


def check_device_case(
    name: str, layout: UnifiedPageLayout, dtype: torch.dtype, pages: int, device: str
) -> None:
    ns = layout.namespace
    slots = (pages + 7) * ns.page_size
    pool = device_pool(
        ns.kv_kind, layout.num_layers, layout.num_heads, ns.head_dim, slots, dtype, device
    )
    firsts = (torch.randperm(pages + 7)[:pages] * ns.page_size).to(device)
    ref = random_tensor((pages, layout.page_bytes), torch.uint8, device)
    tri = ref.clone()
    pack_pages(pool, firsts, ref, layout, backend="torch")
    pack_pages(pool, firsts, tri, layout, backend="triton")
    ok_pack = torch.equal(ref, tri)
    target = device_pool(
        ns.kv_kind, layout.num_layers, layout.num_heads, ns.head_dim, slots, dtype, device
    )
    twin = clone_pool(target)
    unpack_pages(ref, target, firsts, layout, backend="torch")
    for layer in range(layout.layer_start, layout.layer_stop):  # layer-wise restore
        unpack_pages(ref, twin, firsts, layout, layers=(layer, layer + 1), backend="triton")
    ok_unpack = same_pool(target, twin)
    print(
        f"correctness {name:40s} pack {'ok' if ok_pack else 'MISMATCH'}  "
        f"unpack {'ok' if ok_unpack else 'MISMATCH'}",
        flush=True,
    )
    if not (ok_pack and ok_unpack):
        raise SystemExit(f"{name}: Triton and the torch reference differ")


def check_host_case(name: str, layout_name: str, device: str) -> None:
    ns = Namespace.create("bench", ModelShape.mha(4, 8, 128), "bfloat16", 64, Grid(2, 4))
    layout = UnifiedPageLayout.full_page(ns)
    pl = PoolLayout(layout_name, "mha", 4, 8, 128, 64, 12)  # type: ignore[arg-type]
    host = HostPool(random_tensor(pl.shape, torch.bfloat16, device).contiguous(), pl)
    firsts = (torch.randperm(12)[:5] * 64).to(device)
    ref = random_tensor((5, layout.page_bytes), torch.uint8, device)
    tri = ref.clone()
    host_to_unified(host, firsts, ref, layout, backend="torch")
    host_to_unified(host, firsts, tri, layout, backend="triton")
    back = HostPool(random_tensor(pl.shape, torch.bfloat16, device).contiguous(), pl)
    twin = HostPool(back.buffer.clone(), pl)
    unified_to_host(ref, back, firsts, layout, backend="torch")
    unified_to_host(ref, twin, firsts, layout, backend="triton")
    ok = torch.equal(ref, tri) and torch.equal(as_bits(back.buffer), as_bits(twin.buffer))
    print(f"correctness {name:40s} {'ok' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        raise SystemExit(f"{name}: Triton and the torch reference differ")


def timer(device: str) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of ``fn``, averaged over ``iters`` calls after warm-up."""

    def cuda_time(fn: Callable[[], object], iters: int) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / 1e3 / iters

    def cpu_time(fn: Callable[[], object], iters: int) -> float:
        fn()
        begin = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - begin) / iters

    return cuda_time if device == "cuda" else cpu_time


def bandwidth(shape: Shape, device: str, iters: int) -> dict[str, float]:
    L, H, D, P, N = shape.layers, shape.heads, shape.dim, shape.page_size, shape.pages
    ns = Namespace.create("llama-3-8b", ModelShape.mha(L, H, D), "bfloat16", P, Grid(L, H))
    layout = UnifiedPageLayout.full_page(ns)
    pool = device_pool("mha", L, H, D, shape.pool_pages * P, torch.bfloat16, device)
    firsts = (torch.randperm(shape.pool_pages)[:N] * P).to(device)
    staging = torch.empty(N, layout.page_bytes, dtype=torch.uint8, device=device)
    nbytes = staging.numel()
    flat_src = random_tensor((nbytes,), torch.uint8, device)
    flat_dst = staging.view(-1)
    # A page-major source: page i is one contiguous 8 MiB run.
    page_src = flat_src.view(N, -1)
    pages_list = firsts.tolist()
    measure = timer(device)

    def per_page() -> None:
        for i in range(N):
            staging[i].copy_(page_src[i], non_blocking=True)

    def per_run() -> None:
        # one copy per (page, layer, K/V) run of the real per-layer pool
        rows = staging.view(N, L, 2, P * H * D * 2)
        for i, first in enumerate(pages_list):
            for layer in range(L):
                for p in range(2):
                    src = pool.planes[p][layer][first : first + P].view(torch.uint8).view(-1)
                    rows[i, layer, p].copy_(src, non_blocking=True)

    def layerwise() -> None:
        for layer in range(L):
            unpack_pages(
                staging,
                pool,
                firsts,
                layout,
                layers=(layer, layer + 1),
                check_indices=False,
                backend="triton",
            )

    results = {
        "bytes": float(nbytes),
        "d2d_copy_s": measure(lambda: flat_dst.copy_(flat_src), iters),
        "pack_s": measure(
            lambda: pack_pages(
                pool, firsts, staging, layout, check_indices=False, backend="triton"
            ),
            iters,
        ),
        "unpack_s": measure(
            lambda: unpack_pages(
                staging, pool, firsts, layout, check_indices=False, backend="triton"
            ),
            iters,
        ),
        "unpack_layerwise_s": measure(layerwise, iters),
        "pack_checked_s": measure(
            lambda: pack_pages(pool, firsts, staging, layout, backend="triton"), iters
        ),
        "memcpy_per_page_s": measure(per_page, max(1, iters // 4)),
        "memcpy_per_run_s": measure(per_run, max(1, iters // 10)),
    }
    # The timed pack wrote the staging rows last-but-one (per_run rewrote them): check the
    # Triton result of the full-size case against the reference once more.
    pack_pages(pool, firsts, staging, layout, backend="triton")
    expected = torch.empty_like(staging)
    pack_pages(pool, firsts, expected, layout, backend="torch")
    if not torch.equal(staging, expected):
        raise SystemExit("full-size pack: Triton and the torch reference differ")
    print(f"correctness full-size pack ({N} pages, per-layer pool) ok", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke needs TRITON_INTERPRET=1 in the environment")
        device, shape, iters = "cpu", SMOKE, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: this benchmark needs a GPU (or use --smoke)")
        device, shape, iters = "cuda", FULL, args.iters
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    started = time.perf_counter()

    small = 7 if args.smoke else 33
    llama = Namespace.create(
        "llama",
        ModelShape.mha(4 if args.smoke else 32, 8, 128),
        "bfloat16",
        4 if args.smoke else 64,
        Grid(2 if args.smoke else 8, 2),
    )
    fp8 = Namespace.create(
        "llama-fp8", ModelShape.mha(4, 8, 128), "float8_e4m3fn", 4 if args.smoke else 64, Grid(2, 4)
    )
    mla = Namespace.create(
        "deepseek",
        ModelShape.mla(4 if args.smoke else 61, 576),
        "bfloat16",
        4 if args.smoke else 64,
        Grid(1),
    )
    check_device_case(
        "mha full page bf16 (4 head blocks)",
        UnifiedPageLayout.full_page(llama),
        torch.bfloat16,
        small,
        device,
    )
    check_device_case(
        "mha tp4 shard heads 2-4 bf16",
        UnifiedPageLayout(llama, 0, llama.num_layers, 2, 4),
        torch.bfloat16,
        small,
        device,
    )
    check_device_case(
        "mha cut head group heads 1-6 fp8",
        UnifiedPageLayout(fp8, 1, 4, 1, 6),
        torch.float8_e4m3fn,
        small,
        device,
    )
    check_device_case(
        "mla 576 bf16", UnifiedPageLayout.full_page(mla), torch.bfloat16, small, device
    )
    if not args.smoke:
        for name in ("layer_first", "page_first", "page_first_direct", "page_head"):
            check_host_case(f"host {name}", name, device)

    r = bandwidth(shape, device, iters)
    gb = r["bytes"] / 1e9
    print(
        f"\n{shape.pages} pages x {r['bytes'] / shape.pages / 2**20:.1f} MiB "
        f"({r['bytes'] / 2**30:.2f} GiB), Llama-3-8B-shaped per-layer pool"
    )
    print("| op | ms | GB/s | vs D2D copy |\n|---|---|---|---|")
    for key, label in (
        ("d2d_copy_s", "D2D copy_ of the same bytes"),
        ("pack_s", "pack (Triton)"),
        ("pack_checked_s", "pack, with index checks (one sync)"),
        ("unpack_s", "unpack (Triton)"),
        ("unpack_layerwise_s", f"unpack layer by layer ({shape.layers} launches)"),
        ("memcpy_per_page_s", "cudaMemcpyAsync per page (page-major source)"),
        ("memcpy_per_run_s", "cudaMemcpyAsync per (page, layer, K/V) run"),
    ):
        print(
            f"| {label} | {r[key] * 1e3:.3f} | {gb / r[key]:.1f} | "
            f"{r['d2d_copy_s'] / r[key] * 100:.0f} % |"
        )
    print(f"\ntotal {time.perf_counter() - started:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "shape": shape.__dict__, **r}, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
