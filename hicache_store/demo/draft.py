"""Draft-model KV beside the target's, in both organisations (demo harness).

A prefix hit lets the target skip prefill, but a speculative-decoding draft model still needs
its own KV of that prefix, or its acceptance rate drops. Two ways to keep it with the target:

**Packed**: when the draft's KV rows have the target's shape and dtype, the draft's layers are
appended to the target's: the tier's namespace has ``target + draft`` layers
(``packed_namespace``) and one device pool holds ``target + draft`` per-layer K/V buffers
(``make_packed_pool``; the draft's buffers are its own GPU tensors but share the target's page
allocator and slot mapping). Every page object carries the draft's layers, so backup, restore,
layer-wise load, checksums and completion events are the tier's own, and a target hit is a
draft hit by construction. Each model runs on a layer view of the pool (``layer_view``); the
draft waits on the load of its layers (``offset_wait``).

**Sidecar** (``DraftPool``): the draft's KV is a tier component (rule ``full``, tag 3) that
*follows the KV pages*: its L1 is a device pool of the draft's geometry whose page indices are
the target's (the draft reads and writes the slots the tier hands out for the target), its L2
and L3 are its own (objects keyed by the target's page hashes in the draft's namespace, ``_C3``).
A request that speculates asks for it (``tier.match(tokens)``: every component) and its prefix
is the longest at which both models' KV is available; one that does not leaves it out
(``need=()``) and matches on the target alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.components import DRAFT_TAG, Component, ComponentSpec, HitRule

#: a sidecar draft's objects are tagged DRAFT_TAG (``_C3`` in keys; ``tier.components.TAGS``).


def draft_config(target: MiniLlamaConfig, *, num_layers: int = 2, seed: int = 1) -> MiniLlamaConfig:
    """A small draft model for ``target``: fewer layers, another seed, the same vocabulary and
    the same KV row shape and dtype (so it is packable as well)."""
    if seed == target.seed:
        raise ValueError("the draft model needs a seed of its own")
    return target.with_(num_layers=num_layers, seed=seed)


def layer_view(pool: DeviceKVPool, start: int, stop: int) -> DeviceKVPool:
    """A ``DeviceKVPool`` over layers ``[start, stop)`` of ``pool``: the same buffers and
    allocator (a shallow copy), presenting ``stop - start`` layers to a model."""
    if not 0 <= start < stop <= pool.num_layers:
        raise ValueError(f"layers [{start}, {stop}) outside the pool's {pool.num_layers}")
    view = copy.copy(pool)
    view.k_buffers = pool.k_buffers[start:stop]
    view.v_buffers = pool.v_buffers[start:stop]
    view.num_layers = stop - start
    return view


def offset_wait(
    wait_layer: Callable[[int], None] | None, offset: int
) -> Callable[[int], None] | None:
    """``wait_layer`` for a layer view starting at layer ``offset`` of the pool."""
    if wait_layer is None:
        return None
    return lambda layer: wait_layer(layer + offset)


# == packed ======================================================================================


def check_packable(target: MiniLlamaConfig, draft: MiniLlamaConfig) -> None:
    """``ValueError`` unless the draft's KV rows have the target's shape and dtype."""
    mine = (target.num_kv_heads, target.head_dim, target.dtype)
    theirs = (draft.num_kv_heads, draft.head_dim, draft.dtype)
    if mine != theirs:
        raise ValueError(
            f"draft KV rows (kv_heads, head_dim, dtype) {theirs} differ from the target's {mine}: "
            "use the sidecar organisation"
        )


def packed_namespace(
    model: str, target: MiniLlamaConfig, draft: MiniLlamaConfig, page_size: int
) -> Namespace:
    """The tier namespace of target + draft packed: ``target + draft`` layers in one object per
    page. The draft's identity is part of the model name (another draft, another namespace)."""
    check_packable(target, draft)
    layers = target.num_layers + draft.num_layers
    shape = ModelShape.mha(layers, target.num_kv_heads, target.head_dim)
    name = f"{model}+draft-L{draft.num_layers}-s{draft.seed}"
    return Namespace.create(name, shape, target.dtype, page_size, Grid(layers, target.num_kv_heads))


def make_packed_pool(
    target: MiniLlamaConfig,
    draft: MiniLlamaConfig,
    num_pages: int,
    page_size: int,
    device: torch.device | str = "cpu",
) -> DeviceKVPool:
    """One pool of ``target + draft`` layers (per-layer buffers: the draft's are its own)."""
    check_packable(target, draft)
    return DeviceKVPool.for_model(
        target, num_pages=num_pages, page_size=page_size, device=device,
        num_layers=target.num_layers + draft.num_layers,
    )


class DraftPool:
    """A sidecar draft model's KV as a tier component that follows the target's pages.

    ``pool`` is the draft's device pool (its own layers, heads, dims and dtype; as many pages
    as the target's pool, whose page indices it uses); ``namespace`` names its objects (the
    target's page size and page-hash algorithm: objects are keyed by the target's pages).
    """

    def __init__(self, pool: DeviceKVPool, namespace: Namespace, *, l2_slots: int = 0) -> None:
        self.pool = pool
        self.namespace = namespace
        spec = ComponentSpec("draft", DRAFT_TAG, HitRule.FULL)
        device = DevicePool.mha(pool.k_buffers, pool.v_buffers)
        self.component = Component(spec, namespace, device, None, l2_slots)
