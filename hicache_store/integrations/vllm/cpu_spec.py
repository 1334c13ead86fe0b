"""A shim for vLLM's CPU platform: tiered KV offloading where the engine's KV lives in host memory.

vLLM 0.32's offloading stack (``OffloadingConnector`` + ``TieringOffloadingSpec``: a CPU
primary tier, then secondary tiers such as ``secondary_tier.HiCacheStoreTier``) refuses to
start on the CPU platform: ``CPUOffloadingSpec.get_worker`` raises "CPU Offloading is currently
only supported on CUDA-alike and XPU GPUs" (``vllm/v1/kv_offload/cpu/spec.py``), because its
worker copies with CUDA streams and the ``swap_blocks`` kernels. The scheduler side (the primary
tier, its shared region, the secondary tiers) has no such dependency.

``CPUTieringOffloadingSpec`` is ``TieringOffloadingSpec`` with one change: its worker,
``TorchCopyWorker``, copies with plain torch indexing between the engine's KV tensors and this
rank's slots of the primary region, synchronously (on the CPU the model has finished writing
a block when vLLM submits its store, and a load completes before the forward pass that reads
it). It is a shim for running and testing the tiered stack on CPU hosts, not a data path to
tune: on CUDA or XPU use vLLM's own ``TieringOffloadingSpec``.

Both primary-tier layouts of vLLM are copied: the direct one (each rank's pages in its own
slot of a chunk row) and, with ``canonical_layout``, vLLM's canonical pages (every layer's
full KV of a block as if there were no parallelism, each rank scattering its bytes into the
page all ranks share by the byte runs vLLM certified for its layer; ``CopyRun`` /
``CanonicalPageMapping``). The runs are vLLM's, derived from the engine's KV tensors; this
worker only follows them (checked to stay inside both pages), so the bytes are the ones
vLLM's own worker would write. Loaded by::

    kv_connector="OffloadingConnector",
    kv_connector_extra_config={
        "spec_name": "CPUTieringOffloadingSpec",
        "spec_module_path": "hicache_store.integrations.vllm.cpu_spec",
        "cpu_bytes_to_use": ..., "secondary_tiers": [...]}

Refused at start-up: KV tensors that are not in host memory, and (vLLM's own check)
``canonical_layout`` where a layer has no certified mapping or is not portable while the
namespace is shared across topologies. Warned at start-up: a primary tier (``cpu_bytes_to_use``)
with fewer chunk rows than one request of ``max_model_len`` tokens fills
(``primary_sizing_warning``): a reused prefix longer than the primary holds cannot be promoted
whole from a secondary tier.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CopyRun,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from ._logging import attach as attach_logging

log = logging.getLogger(__name__)
attach_logging()  # this library's lines in vLLM's log, in its format


def primary_rows_needed(config: OffloadingConfig, num_tokens: int) -> int:
    """Chunk rows of the primary tier one request of ``num_tokens`` tokens fills at most: a
    row per chunk of every KV cache group (a sliding-window or state group fills fewer)."""
    return sum(-(-num_tokens // (g.tokens_per_block * config.cache.blocks_per_chunk))
               for g in config.groups)


def primary_sizing_warning(
    config: OffloadingConfig, num_chunks: int, bytes_per_chunk: int, max_model_len: int
) -> str | None:
    """Why a primary tier of ``num_chunks`` rows is too small for requests of
    ``max_model_len`` tokens (and the ``cpu_bytes_to_use`` that is not), or None."""
    needed = primary_rows_needed(config, max_model_len)
    if num_chunks >= needed:
        return None
    return (
        f"the CPU primary tier holds {num_chunks} chunks (cpu_bytes_to_use), a request of "
        f"max_model_len={max_model_len} tokens fills up to {needed}: a reused prefix longer "
        "than the primary holds cannot be promoted from a secondary tier whole: the rest is "
        "recomputed, and vLLM 0.32 has been seen to retry such a request forever. Set "
        "cpu_bytes_to_use to at least "
        f"{needed * bytes_per_chunk} ({needed} chunks of {bytes_per_chunk} bytes), plus room "
        "for the requests that run at the same time"
    )


@dataclass(frozen=True)
class _RefPlan:
    """How one layer's (un-padded) engine page maps into its primary-tier page: byte runs
    (vLLM's ``CopyRun``: fragment ``i`` of a run spans ``[local_offset + i * local_stride,
    +fragment_size)`` in the engine page and ``[canonical_offset + i * canonical_stride,
    +fragment_size)`` in the primary page), and which blocks this rank stores (ranks holding
    the same bytes take turns by page id: ``page % writers == writer``)."""

    tensor_idx: int
    runs: tuple[CopyRun, ...]
    writers: int = 1
    writer: int = 0

    @property
    def whole_page(self) -> bool:
        """One run copying a page prefix as it is, by this rank alone (the direct layout)."""
        (first, *rest) = self.runs
        return (not rest and self.writers == 1 and first.num_fragments == 1
                and first.local_offset == 0 and first.canonical_offset == 0)


def _direct_plan(ref: CanonicalKVCacheRef) -> _RefPlan:
    """vLLM's direct layout: the engine page as it is, at the start of this rank's slot."""
    n = ref.page_size_bytes
    return _RefPlan(ref.tensor_idx, (CopyRun(0, 0, n, 1, n, n),))


def _canonical_plan(ref: CanonicalKVCacheRef, engine_page: int, host_page: int) -> _RefPlan:
    """vLLM's canonical layout: the ref's certified mapping, every run checked to lie inside
    the engine page and the primary page it copies between."""
    mapping = ref.mapping
    assert mapping is not None  # the worker refuses uncertified layers first
    for run in mapping.runs:
        last = run.num_fragments - 1
        if (
            run.num_fragments < 1 or run.fragment_size < 1
            or min(run.local_offset, run.canonical_offset, run.local_stride,
                   run.canonical_stride) < 0
            or run.local_offset + last * run.local_stride + run.fragment_size > engine_page
            or run.canonical_offset + last * run.canonical_stride + run.fragment_size > host_page
        ):
            raise RuntimeError(
                f"canonical_layout: copy run {run} is empty or falls outside the engine page "
                f"({engine_page} bytes) or the canonical page ({host_page} bytes)"
            )
    return _RefPlan(ref.tensor_idx, tuple(mapping.runs), mapping.num_writers,
                    mapping.writer_index)


def _fragments(row: torch.Tensor, offset: int, stride: int, run: CopyRun) -> torch.Tensor:
    """A run's fragments within one page ``row`` (1-D bytes) as a [fragments, size] view."""
    return row.as_strided((run.num_fragments, run.fragment_size), (stride, 1),
                          row.storage_offset() + offset)


class TorchCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies blocks between the engine's KV tensors and the primary region with torch.

    Block ``j`` of a group (its first ``block_indices[g] % blocks_per_chunk`` slots skipped,
    as vLLM's own worker does) goes to sub-block ``j % blocks_per_chunk`` of chunk
    ``j // blocks_per_chunk`` of the group's chunk list. Direct layout: each layer copies its
    un-padded page into this rank's slot of the chunk row. Canonical layout: each layer's page
    is scattered by its certified byte runs into the canonical page that every rank shares
    (``SharedOffloadRegion.create_next_canonical_view``), each rank writing only its own
    bytes, and of bytes several ranks hold, only the blocks it is elected to write.
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion,
        *, canonical: bool = False,
    ) -> None:
        self._region = region
        self._bpc = blocks_per_chunk
        self._engine: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        refs = [ref for group in kv_caches.group_data_refs for ref in group]
        # Bytes of one block of each tensor in the primary region: the engine page, or the
        # largest canonical page of the layers stored in that tensor.
        host_pages = [t.page_size_bytes for t in kv_caches.tensors]
        if canonical:
            host_pages = [0] * len(kv_caches.tensors)
            for ref in refs:
                if ref.mapping is None:
                    raise RuntimeError(
                        "canonical_layout: a KV layer has no certified canonical mapping"
                    )
                host_pages[ref.tensor_idx] = max(host_pages[ref.tensor_idx],
                                                 ref.mapping.canonical_page_size_bytes)
        for tensor, host_page in zip(kv_caches.tensors, host_pages, strict=True):
            if tensor.tensor.device.type != "cpu":
                raise RuntimeError(
                    "CPUTieringOffloadingSpec copies host KV tensors only; on "
                    f"{tensor.tensor.device.type} use vLLM's TieringOffloadingSpec"
                )
            self._engine.append(tensor.tensor)
            if canonical:
                host = region.create_next_canonical_view(host_page * blocks_per_chunk)
            else:
                host = region.create_next_worker_view(host_page * blocks_per_chunk)
            self._host.append(host.view(host.shape[0], blocks_per_chunk, host_page))
        self._plans = [
            [_canonical_plan(ref, ref.page_size_bytes, host_pages[ref.tensor_idx])
             if canonical else _direct_plan(ref) for ref in group]
            for group in kv_caches.group_data_refs
        ]
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, *, store: bool) -> bool:
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        engine_ids = gpu.block_ids.astype("int64")
        chunk_ids = cpu.block_ids.astype("int64")
        moved, engine_at, chunk_at = 0, 0, 0
        for group, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % self._bpc
            slots = np.arange(skip, skip + size)
            chunks = chunk_ids[chunk_at:][slots // self._bpc]
            subs = slots % self._bpc
            blocks = engine_ids[engine_at : engine_at + size]
            for plan in self._plans[group]:
                moved += self._copy_ref(plan, blocks, chunks, subs, store=store)
            engine_at += size
            chunk_at += -(-(skip + size) // self._bpc)
        self._finished.append(TransferResult(job_id, True, moved, time.perf_counter() - start))
        return True

    def _copy_ref(self, plan: _RefPlan, blocks: np.ndarray[Any, Any],
                  chunks: np.ndarray[Any, Any], subs: np.ndarray[Any, Any], *,
                  store: bool) -> int:
        host, engine = self._host[plan.tensor_idx], self._engine[plan.tensor_idx]
        if plan.whole_page:
            # The direct layout: one indexed copy of every block's page (no loop per block).
            n = plan.runs[0].fragment_size
            b, c, s = (torch.from_numpy(a) for a in (blocks, chunks, subs))
            if store:
                host[c, s, :n] = engine[b, :n]
            else:
                engine[b, :n] = host[c, s, :n]
            return len(blocks) * int(n)
        moved = 0
        for block, chunk, sub in zip(blocks.tolist(), chunks.tolist(), subs.tolist(),
                                     strict=True):
            if store and (chunk * self._bpc + sub) % plan.writers != plan.writer:
                continue  # another rank holding the same bytes stores this block
            engine_row, host_row = engine[block], host[chunk, sub]
            for run in plan.runs:
                local = _fragments(engine_row, run.local_offset, run.local_stride, run)
                canonical = _fragments(host_row, run.canonical_offset, run.canonical_stride,
                                       run)
                if store:
                    canonical.copy_(local)
                else:
                    local.copy_(canonical)
                moved += run.num_fragments * run.fragment_size
        return moved

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy completed inside its submit call

    def shutdown(self) -> None:
        self._engine.clear()
        self._host.clear()
        self._region.cleanup()


class CPUTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """``TieringOffloadingSpec`` whose worker is ``TorchCopyWorker`` (see the module docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        worker: OffloadingWorker | None = getattr(self, "_worker", None)
        if worker is None:
            worker = self.create_worker(kv_caches)
            self._worker = worker
        return worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> TorchCopyWorker:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()  # (set while vLLM builds a worker)
        if vllm_config is not None and self.config.parallel.rank == 0:
            warning = primary_sizing_warning(self.config, self.num_chunks,
                                             self.kv_bytes_per_chunk,
                                             vllm_config.model_config.max_model_len)
            if warning:
                log.warning("CPUTieringOffloadingSpec: %s", warning)
        if self.config.canonical_layout:
            # vLLM's own check: every layer certified, portable where the namespace is shared.
            self._validate_canonical_refs(kv_caches)
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return TorchCopyWorker(kv_caches, self.blocks_per_chunk, region,
                                   canonical=bool(self.config.canonical_layout))
        except Exception:
            region.cleanup()
            raise
