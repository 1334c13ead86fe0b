"""``ShardedEngine``: one rank of a TP x PP deployment of the mini engine over its own tier.

What is real and what is simulated. **Real:** each rank is its own process; its L1 pool holds
only its shard of the KV (layers ``[layer_start, layer_stop)`` x KV heads
``[head_start, head_stop)`` of ``shard_of(namespace, topology, rank)``); its tier (``HiCache``)
moves only that shard between L1, its own L2 and the shared L3, writing only the objects its
shard covers (one writer among replicas) and reading through its own read plan (layer range
reads, head subsets read whole and sliced); every cache decision is agreed over a
``torch.distributed`` group. **Simulated:** the TP/PP *compute* split. Every rank holds the full
model weights (same seed) and computes the full forward pass: after the ranks agree on the
prefix (through their tiers) and each restores its shard into its own pool, they all-gather
their shards of the prefix KV into a scratch pool with every layer and head, run
``MiniLlama.prefill`` over it, and each keeps its shard of the new tokens' KV. Logits are then
bit-identical to a single-process recompute, which is what the tests check: a rank that used a
prefix another rank did not have, or restored wrong bytes, would change them.

The gather takes each shard once (replica 0 of each; replicas hold the same bytes) and is one
``all_gather`` of raw bytes per request, sized from the topology, so every rank knows every
other rank's contribution without asking.

A ``HybridMiniLlama`` brings its cache components into the rank's tier: the sliding-window KV
on the KV grid of its own namespace (each rank holds, backs up and restores its shard of the
window layers and heads; the shards are gathered like the KV's) and the recurrent checkpoints
replicated (every rank restores the same objects; rank 0 writes them). So hybrid state that one
topology wrote is restored by another, with logits equal to a recompute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache_store.backends.base import Backend
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.demo.engine.model import MiniLlama, WindowKV
from hicache_store.distributed.group import TorchGroup
from hicache_store.kernels.ops import Backend as KernelBackend
from hicache_store.layout.namespace import Grid, Namespace
from hicache_store.layout.topology import Shard, Topology, shard_of, shards
from hicache_store.tier.cache import HiCache, Prepared
from hicache_store.tier.config import TierConfig

from .hybrid import HybridMiniLlama, RecurrentPool, WindowPool


@dataclass(frozen=True)
class Served:
    """One request's outcome on one rank: logits of the computed positions and where the
    computation started (the agreed prefix, in tokens)."""

    logits: torch.Tensor
    start: int


def _shard_numel(shard: Shard, tokens: int, head_dim: int) -> int:
    return shard.num_layers * 2 * tokens * shard.num_heads * head_dim


class ShardedEngine:
    """One rank: the mini engine's KV shard, its tier, and the group it agrees with.

    ``group``'s rank is this rank's topology rank and its size the topology's world size.
    A ``HybridMiniLlama`` brings its window KV (on ``window_grid``, default one layer and one
    head per object) and ``snapshot_slots`` recurrent checkpoints in L1 (and as many in L2).
    """

    def __init__(
        self,
        model: MiniLlama | HybridMiniLlama,
        namespace: Namespace,
        topology: Topology,
        group: TorchGroup,
        config: TierConfig,
        *,
        backend: Backend | None = None,
        kernel_backend: KernelBackend = "auto",
        window_grid: Grid | None = None,
        snapshot_slots: int = 16,
    ) -> None:
        self.hybrid = model if isinstance(model, HybridMiniLlama) else None
        base = model.base if isinstance(model, HybridMiniLlama) else model
        cfg = base.config
        if (namespace.num_layers, namespace.num_kv_heads, namespace.head_dim) != (
            len(cfg.full_layers),
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            raise ValueError("the namespace's KV shape does not match the model")
        self.model = base
        self.namespace = namespace
        self.topology = topology
        self.group = group
        self.rank = group.rank
        self.shard = shard_of(namespace, topology, self.rank)
        self.all_shards = shards(namespace, topology)
        self.pool = DeviceKVPool(
            num_layers=self.shard.num_layers,
            num_kv_heads=self.shard.num_heads,
            head_dim=cfg.head_dim,
            num_pages=config.l1_pages,
            page_size=namespace.page_size,
            dtype=cfg.torch_dtype,
        )
        self.window: WindowPool | None = None
        self.recurrent: RecurrentPool | None = None
        if self.hybrid is not None:
            l2 = config.l2_pages
            if cfg.window_layers:
                self.window = WindowPool(
                    cfg, namespace, config.l1_pages, l2_slots=l2,
                    grid=window_grid or Grid(1, 1), topology=topology, rank=self.rank,
                )
            self.recurrent = RecurrentPool(
                self.hybrid.state_dim, namespace, snapshot_slots,
                l2_slots=snapshot_slots if l2 else 0,
            )
        self.tier = HiCache(
            namespace,
            config,
            self.pool,
            backend=backend,
            topology=topology,
            rank=self.rank,
            group=group,
            kernel_backend=kernel_backend,
            components=[p.component for p in (self.window, self.recurrent) if p is not None],
        )

    # -- one request ------------------------------------------------------------------------

    def serve(self, tokens: Sequence[int] | torch.Tensor) -> Served:
        """Match, restore this rank's shard, gather the prefix, compute, keep the new shard."""
        toks = torch.as_tensor(tokens, dtype=torch.int64)
        n = int(toks.numel())
        req = self.tier.match(toks)
        prep = self.tier.prepare(req)
        start = prep.start
        if prep.wait_layer is not None:  # the restore of our shard into our pool (layer-wise)
            for local_layer in range(self.shard.num_layers):
                prep.wait_layer(local_layer)
        scratch = DeviceKVPool.for_model(
            self.model.config,
            num_pages=max(1, math.ceil(n / self.namespace.page_size)),
            page_size=self.namespace.page_size,
        )
        if start:
            self._gather_prefix(prep.slots[:start], scratch)
        if self.hybrid is None:
            logits = self.model.prefill(toks[start:], start, torch.arange(n), scratch)
        else:
            logits = self._hybrid_prefill(toks, prep, scratch)
        self._keep_new(scratch, prep.slots, start, n)
        self.tier.complete(req)
        return Served(logits, start)

    def _hybrid_prefill(
        self, toks: torch.Tensor, prep: Prepared, scratch: DeviceKVPool
    ) -> torch.Tensor:
        """The hybrid model over the gathered prefix: the restored checkpoint (every rank holds
        it), the window KV gathered from every rank's shard; the new snapshots and this rank's
        shard of the new window pages go into the slots the tier handed out."""
        assert self.hybrid is not None
        assert self.recurrent is not None
        page, start, n = self.namespace.page_size, prep.start, int(toks.numel())
        rec = prep.components["recurrent"]
        state = None
        if start:
            (slot,) = [s for i, s in rec.restored if (i + 1) * page == start]
            state = self.recurrent.state(slot)
        buffer = self.hybrid.new_window(n)
        win = prep.components.get("window")
        if self.window is not None and win is not None and buffer is not None:
            self.window.restore(buffer, win.restored)
            if start:
                self._gather_window(buffer, start)
        logits, _, snaps = self.hybrid.prefill(
            toks[start:], start, torch.arange(n), scratch, state,
            snapshot_at=tuple((i + 1) * page for i, _ in rec.produce), window=buffer,
        )
        for i, slot in rec.produce:
            self.recurrent.store(slot, snaps[(i + 1) * page])
        if self.window is not None and win is not None and buffer is not None:
            self.window.capture(buffer, win.produce)
        return logits

    def _gather_window(self, buffer: WindowKV, tokens: int) -> None:
        """Every rank's shard of the window layers' KV of the prefix into ``buffer``."""
        assert self.window is not None
        ns = self.window.namespace
        mine = self.window.shard
        local = torch.stack(
            [
                torch.stack([buffer.k[layer, :tokens, mine.head_start : mine.head_stop],
                             buffer.v[layer, :tokens, mine.head_start : mine.head_stop]])
                for layer in range(mine.layer_start, mine.layer_stop)
            ]
        ).contiguous()
        everyone = shards(ns, self.topology)
        itemsize = local.element_size()
        sizes = [_shard_numel(s, tokens, ns.head_dim) * itemsize for s in everyone]
        parts = self.group.all_gather_bytes(local.view(-1).view(torch.uint8), sizes)
        for shard, data in zip(everyone, parts, strict=True):
            if shard.replica:
                continue
            kv = data.view(local.dtype).view(shard.num_layers, 2, tokens, shard.num_heads, ns.head_dim)
            heads = slice(shard.head_start, shard.head_stop)
            for i, layer in enumerate(range(shard.layer_start, shard.layer_stop)):
                buffer.k[layer, :tokens, heads] = kv[i, 0]
                buffer.v[layer, :tokens, heads] = kv[i, 1]

    def _local_prefix(self, slots: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the prefix KV: ``[layers, K/V, tokens, heads, dim]`` as bytes."""
        planes = [
            torch.stack([k.index_select(0, slots), v.index_select(0, slots)])
            for k, v in zip(self.pool.k_buffers, self.pool.v_buffers, strict=True)
        ]
        return torch.stack(planes).contiguous().view(-1).view(torch.uint8)

    def _gather_prefix(self, slots: torch.Tensor, scratch: DeviceKVPool) -> None:
        tokens = int(slots.numel())
        head_dim = self.namespace.head_dim
        itemsize = scratch.k_buffers[0].element_size()
        sizes = [_shard_numel(s, tokens, head_dim) * itemsize for s in self.all_shards]
        self.group.note(tokens, "gather_prefix_tokens")
        parts = self.group.all_gather_bytes(self._local_prefix(slots), sizes)
        dtype = scratch.k_buffers[0].dtype
        for shard, data in zip(self.all_shards, parts, strict=True):
            if shard.replica:
                continue  # replicas hold the same bytes as replica 0
            kv = data.view(dtype).view(shard.num_layers, 2, tokens, shard.num_heads, head_dim)
            heads = slice(shard.head_start, shard.head_stop)
            for i, layer in enumerate(range(shard.layer_start, shard.layer_stop)):
                scratch.k_buffers[layer][:tokens, heads] = kv[i, 0]
                scratch.v_buffers[layer][:tokens, heads] = kv[i, 1]

    def _keep_new(self, scratch: DeviceKVPool, slots: torch.Tensor, start: int, n: int) -> None:
        new = slots[start:n]
        heads = slice(self.shard.head_start, self.shard.head_stop)
        for i, layer in enumerate(range(self.shard.layer_start, self.shard.layer_stop)):
            self.pool.k_buffers[i][new] = scratch.k_buffers[layer][start:n, heads]
            self.pool.v_buffers[i][new] = scratch.v_buffers[layer][start:n, heads]

    def close(self) -> None:
        self.tier.close()
