"""The CPU shim's worker (``cpu_spec.TorchCopyWorker``) without an engine: two ranks' workers
over one of vLLM's real ``SharedOffloadRegion`` s (a ``/dev/shm`` mapping, as vLLM's workers
share it), copying by ``CopyRun`` / ``CanonicalPageMapping`` s built here the way vLLM's
mapping derivation shapes them. Every byte of the primary region is checked against a plain
numpy oracle: where each rank's bytes land, which rank writes shared bytes, that nothing else
is touched, and that a load gives the engine back exactly what was stored.

The engine tests (``test_secondary_tier_tp2.py``) cover the mappings vLLM derives for the
tiny Llama (one run per head shard, one writer); these cover what that model does not reach:
strided fragments and several ranks holding the same bytes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from hicache_store.integrations.vllm.cpu_spec import TorchCopyWorker

PAGE = 4096  # one rank's engine page (bytes)
FRAG = 64  # interleave: each rank's page is fragments of 64 bytes, alternating in the canonical
BLOCKS, CHUNKS, RANKS = 4, 4, 2


def interleaved(rank: int) -> CanonicalPageMapping:
    """Head-sharded KV in an NHD-like order: rank ``r``'s fragment ``i`` goes to canonical
    ``i * 2 * FRAG + r * FRAG`` (canonical page: both ranks' bytes, one writer each)."""
    run = CopyRun(0, rank * FRAG, FRAG, PAGE // FRAG, FRAG, RANKS * FRAG)
    return CanonicalPageMapping(RANKS * PAGE, PAGE, (run,), 1, 0, True)


def replicated(rank: int) -> CanonicalPageMapping:
    """KV both ranks hold whole (as a replicated latent): ranks take turns by page id."""
    run = CopyRun(0, 0, PAGE, 1, PAGE, PAGE)
    return CanonicalPageMapping(PAGE, PAGE, (run,), RANKS, rank, True)


def engine_caches(rank: int, mapping: CanonicalPageMapping | None) -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(rank)
    data = torch.randint(-128, 128, (BLOCKS, PAGE), generator=gen, dtype=torch.int8)
    return CanonicalKVCaches([CanonicalKVCacheTensor(data, PAGE)],
                             [[CanonicalKVCacheRef(0, PAGE, mapping)]])


@pytest.fixture
def regions() -> Iterator[Any]:
    """``make(canonical_page)``: both ranks' views of one fresh shared region."""
    made: list[SharedOffloadRegion] = []
    engine_id = f"hicache-unit-{uuid.uuid4().hex}"

    def make(row: int) -> list[SharedOffloadRegion]:
        row = -(-row // 4096) * 4096  # vLLM's regions are page-aligned
        made.extend(SharedOffloadRegion(engine_id, CHUNKS, r, row, row // RANKS)
                    for r in range(RANKS))
        return made[-RANKS:]

    yield make
    for region in made:
        region.cleanup()


def region_bytes(region: SharedOffloadRegion) -> np.ndarray[Any, Any]:
    return region.base_tensor.numpy().reshape(CHUNKS, -1).copy()


def store(worker: TorchCopyWorker, blocks: list[int], chunks: list[int]) -> None:
    gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
    assert worker.submit_store(1, gpu, CPULoadStoreSpec(chunks))


def load(worker: TorchCopyWorker, chunks: list[int], blocks: list[int]) -> None:
    gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
    assert worker.submit_load(2, CPULoadStoreSpec(chunks), gpu)


def test_each_rank_scatters_its_fragments_into_the_shared_canonical_page(regions: Any) -> None:
    caches = [engine_caches(r, interleaved(r)) for r in range(RANKS)]
    shared = regions(RANKS * PAGE)
    workers = [TorchCopyWorker(c, 1, region, canonical=True)
               for c, region in zip(caches, shared, strict=True)]
    originals = [c.tensors[0].tensor.clone() for c in caches]
    for w in workers:
        store(w, [1, 3], [2, 0])  # block 1 -> chunk 2, block 3 -> chunk 0

    rows = region_bytes(shared[0])
    for chunk, block in ((2, 1), (0, 3)):
        expected = np.empty(RANKS * PAGE, dtype=np.int8).reshape(-1, RANKS, FRAG)
        for r in range(RANKS):
            expected[:, r] = originals[r][block].numpy().reshape(-1, FRAG)
        assert np.array_equal(rows[chunk, : RANKS * PAGE], expected.reshape(-1))
    assert not rows[[1, 3]].any()  # chunks not named are untouched

    for w, cache in zip(workers, caches, strict=True):
        cache.tensors[0].tensor.zero_()
        load(w, [2, 0], [0, 2])
    for r, cache in enumerate(caches):
        engine = cache.tensors[0].tensor
        assert torch.equal(engine[0], originals[r][1]) and torch.equal(engine[2], originals[r][3])
        assert not engine[[1, 3]].any()  # blocks not named are untouched


def test_ranks_holding_the_same_bytes_take_turns_writing_them(regions: Any) -> None:
    caches = [engine_caches(r, replicated(r)) for r in range(RANKS)]
    for r, cache in enumerate(caches):  # tell the writers apart: rank r's bytes are all r + 1
        cache.tensors[0].tensor.fill_(r + 1)
    shared = regions(RANKS * PAGE)
    workers = [TorchCopyWorker(c, 1, region, canonical=True)
               for c, region in zip(caches, shared, strict=True)]
    for w in workers:
        store(w, [0, 1, 2, 3], [0, 1, 2, 3])
    rows = region_bytes(shared[0])
    for chunk in range(CHUNKS):  # page id = chunk: written by rank chunk % 2, once
        assert (rows[chunk, :PAGE] == chunk % RANKS + 1).all()
    # A load reads the shared page, whichever rank wrote it.
    load(workers[0], [1], [3])
    assert (caches[0].tensors[0].tensor[3] == 2).all()


def test_the_direct_layout_puts_each_rank_page_in_its_own_slot(regions: Any) -> None:
    caches = [engine_caches(r, None) for r in range(RANKS)]
    shared = regions(RANKS * PAGE)
    workers = [TorchCopyWorker(c, 1, region) for c, region in zip(caches, shared, strict=True)]
    for w in workers:
        store(w, [2], [1])
    rows = region_bytes(shared[0])
    for r, cache in enumerate(caches):
        assert np.array_equal(rows[1, r * PAGE:(r + 1) * PAGE], cache.tensors[0].tensor[2].numpy())
    assert not rows[[0, 2, 3]].any()


def test_an_uncertified_layer_is_refused(regions: Any) -> None:
    (region, _) = regions(RANKS * PAGE)
    with pytest.raises(RuntimeError, match="no certified canonical mapping"):
        TorchCopyWorker(engine_caches(0, None), 1, region, canonical=True)


@pytest.mark.parametrize("run", [
    CopyRun(0, FRAG, FRAG, PAGE // FRAG, FRAG, RANKS * FRAG),  # last fragment past the page
    CopyRun(FRAG, 0, PAGE, 1, PAGE, PAGE),  # past the engine page
    CopyRun(0, 0, 0, 1, 0, 0),  # empty fragments
])
def test_a_run_outside_either_page_is_refused(regions: Any, run: CopyRun) -> None:
    (region, _) = regions(RANKS * PAGE)
    mapping = CanonicalPageMapping(PAGE * RANKS - FRAG, PAGE, (run,), 1, 0, True)
    with pytest.raises(RuntimeError, match="is empty or falls outside"):
        TorchCopyWorker(engine_caches(0, mapping), 1, region, canonical=True)


def test_a_primary_tier_smaller_than_one_long_request_is_named_with_the_size_that_fits() -> None:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from hicache_store.integrations.vllm.cpu_spec import primary_sizing_warning

    def config(groups: int, blocks_per_chunk: int) -> OffloadingConfig:
        return OffloadingConfig(
            groups=tuple(OffloadingGroupConfig(128, (f"l{g}",), g) for g in range(groups)),
            worker_kv_bytes_per_block=4096, enable_kv_cache_events=False, extra_config={},
            engine_id="unit", model=OffloadingModelConfig("tiny", "float32"),
            cache=OffloadingCacheConfig(tokens_per_hash=128, blocks_per_chunk=blocks_per_chunk),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=False))

    # 1536 tokens in chunks of 128: 12 rows; two groups: 24; chunks of 4 blocks: 3.
    assert primary_sizing_warning(config(1, 1), 12, 512, 1536) is None
    warning = primary_sizing_warning(config(1, 1), 8, 512, 1536)
    assert warning is not None and "holds 8 chunks" in warning and "fills up to 12" in warning
    assert "cpu_bytes_to_use to at least 6144 (12 chunks of 512 bytes)" in warning
    assert "fills up to 24" in str(primary_sizing_warning(config(2, 1), 12, 512, 1536))
    assert primary_sizing_warning(config(1, 4), 3, 2048, 1536) is None
