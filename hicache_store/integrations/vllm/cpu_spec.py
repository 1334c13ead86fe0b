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
tune: on CUDA or XPU use vLLM's own ``TieringOffloadingSpec``. Loaded by::

    kv_connector="OffloadingConnector",
    kv_connector_extra_config={
        "spec_name": "CPUTieringOffloadingSpec",
        "spec_module_path": "hicache_store.integrations.vllm.cpu_spec",
        "cpu_bytes_to_use": ..., "secondary_tiers": [...]}

Refused at start-up: ``canonical_layout`` (its per-fragment copy plans are not implemented
here) and KV tensors that are not in host memory.
"""

from __future__ import annotations

import time

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class TorchCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """Copies blocks between the engine's KV tensors and the primary region with torch.

    Block ``j`` of a group (its first ``block_indices[g] % blocks_per_chunk`` slots skipped,
    as vLLM's own worker does) goes to sub-block ``j % blocks_per_chunk`` of chunk
    ``j // blocks_per_chunk`` of the group's chunk list; each layer copies its un-padded page.
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        self._region = region
        self._bpc = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._engine: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for tensor in kv_caches.tensors:
            if tensor.tensor.device.type != "cpu":
                raise RuntimeError(
                    "CPUTieringOffloadingSpec copies host KV tensors only; on "
                    f"{tensor.tensor.device.type} use vLLM's TieringOffloadingSpec"
                )
            page = tensor.page_size_bytes
            self._engine.append(tensor.tensor)
            host = region.create_next_worker_view(page * blocks_per_chunk)
            self._host.append(host.view(host.shape[0], blocks_per_chunk, page))
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, *, store: bool) -> bool:
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        engine_ids = torch.from_numpy(gpu.block_ids.astype("int64"))
        chunk_ids = torch.from_numpy(cpu.block_ids.astype("int64"))
        moved, engine_at, chunk_at = 0, 0, 0
        for group, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % self._bpc
            slots = torch.arange(skip, skip + size)
            chunks = chunk_ids[chunk_at:][slots // self._bpc]
            subs = slots % self._bpc
            blocks = engine_ids[engine_at : engine_at + size]
            for ref in self._refs[group]:
                n = ref.page_size_bytes
                host, engine = self._host[ref.tensor_idx], self._engine[ref.tensor_idx]
                if store:
                    host[chunks, subs, :n] = engine[blocks, :n]
                else:
                    engine[blocks, :n] = host[chunks, subs, :n]
                moved += size * n
            engine_at += size
            chunk_at += -(-(skip + size) // self._bpc)
        self._finished.append(TransferResult(job_id, True, moved, time.perf_counter() - start))
        return True

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
        if self.config.canonical_layout:
            raise RuntimeError(
                "CPUTieringOffloadingSpec does not implement canonical_layout: remove it from "
                "kv_connector_extra_config"
            )
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return TorchCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
