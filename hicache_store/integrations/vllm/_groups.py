"""vLLM's KV cache groups as the connector's parts: what each holds, its hit rule, its namespace.

With vLLM 0.32's hybrid memory allocator (kept on: the connector is ``SupportsHMA``) every kind
of layer has its own KV cache group, with its own block table per request. Each group is one
*part* of the connector: a cache component in the tier's sense (``tier.components``), with
its own objects, keyed by the page hashes of the request's tokens (a page is one vLLM block):

| vLLM's spec | part | hit rule (``ComponentSpec``) | namespace shape | per-layer cache |
|---|---|---|---|---|
| ``FullAttentionSpec`` | ``mha`` | ``FULL`` | ``mha(layers, KV heads, head dim)`` | ``[blocks, heads, block, 2 D]`` |
| ``SlidingWindowSpec`` | ``mha`` | ``WINDOW`` of ``sliding_window - 1`` tokens | the same | the same |
| ``MLAAttentionSpec`` | ``mla`` | ``FULL`` | ``mla(layers, latent)`` | ``[blocks, 1, block, latent]`` |
| ``MambaSpec``, ``align`` | ``state`` | ``CHECKPOINT`` | ``mla(layers, state bytes)``, ``uint8`` | a raw page per block |

A hit is the longest prefix at which every part can resume (``match_components``: full parts
need every page, window parts the pages holding the last ``window - 1`` tokens, state parts the
snapshot at the prefix end), exactly vLLM's own rule for a hybrid prefix hit.

**Namespaces.** A model whose cache is one group of full attention (MHA/GQA, or MLA) keeps the
plain namespace (the model, its shape, dtype, page size and grid: the one the SGLang adapter and
``prepopulate`` build). Any other model names its layer pattern: each part's namespace is
``{model}#vllm-{pattern digest}#{part}``, where the pattern lists every group's kind, layers,
window and state structure. A model served with another window, with its sliding window
disabled (every layer full attention, other KV under the same model name) or with another
grouping never reads these objects.

Refused (``ConfigError``, one line): any other spec (cross-attention, chunked local attention,
sparse attention indexers ...), a state group without per-block states (``mamba_cache_mode``
other than ``align``, i.e. prefix caching off) or under TP > 1 (vLLM shards a recurrent state
by heads in a way only the model knows), groups of different block sizes, and sliding windows
promoted to full allocation (the hybrid manager turned off by the user).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache_store.layout.dtypes import normalize_dtype
from hicache_store.layout.errors import ConfigError
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.layout.plans import suggest_grid
from hicache_store.layout.topology import Topology
from hicache_store.tier.components import (
    KV_TAG,
    RECURRENT_TAG,
    WINDOW_TAG,
    ComponentSpec,
    HitRule,
    SpecHolder,
)

from ._config import ConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

MHA, MLA, STATE = "mha", "mla", "state"


@dataclass(frozen=True)
class GroupPart(SpecHolder):
    """One KV cache group of the deployment (see the module docstring).

    ``layers``: its layers' names in vLLM, in layer order; ``indices`` their layer numbers.
    ``kind``: ``mha`` (K and V per token and head), ``mla`` (one latent per token) or
    ``state`` (one recurrent state per block). ``state_bytes``: a state part's bytes per layer
    and block (the state's tensors back to back, without vLLM's padding).
    """

    group: int
    kind: str
    spec: ComponentSpec
    namespace: Namespace
    layers: tuple[str, ...]
    indices: tuple[int, ...]
    state_bytes: int = 0

    @property
    def rule(self) -> HitRule:
        return self.spec.rule


def with_revision(part: GroupPart, revision: str) -> GroupPart:
    """``part`` with its namespace at the weights ``revision``."""
    return dataclasses.replace(
        part, namespace=dataclasses.replace(part.namespace, model_revision=revision))


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(name))


def _state_structure(spec: Any) -> str:
    """What a state group's bytes are: its tensors' shapes and dtypes, in order."""
    return ";".join(f"{tuple(shape)}:{normalize_dtype(str(dtype))}"
                    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))


def state_bytes(spec: Any) -> int:
    """Bytes of one block's state (every tensor of ``MambaSpec.shapes``, unpadded)."""
    import math

    import torch

    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))


def _check_mla_platform(config: ConnectorConfig) -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not config.allow_cpu_mla:
        raise ConfigError(
            "HiCacheStoreConnector: MLA on vLLM's CPU platform is refused: vLLM 0.32's CPU MLA "
            "computes a prefill over a restored context differently from a full prefill (vLLM "
            "turns prefix caching off for MLA there; its own offloading gives the same other "
            "tokens). Set allow_cpu_mla to serve it anyway")


def describe_groups(
    config: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
    topology: Topology, model: str,
) -> list[GroupPart]:
    """The deployment's parts, or a ``ConfigError`` naming what is refused. ``model``: the
    model identity in the namespaces; the plain single-group full-attention MHA case is the
    caller's (it keeps the SGLang adapter's namespace and grid rules)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    blocks = {int(g.kv_cache_spec.block_size) for g in groups}
    if len(blocks) != 1:
        raise ConfigError(f"HiCacheStoreConnector: KV cache groups of block sizes "
                          f"{sorted(blocks)}; every group must have one block size")
    (block,) = blocks
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    kinds: list[tuple[str, HitRule, int, str]] = []  # (kind, rule, window tokens, detail)
    for g in groups:
        spec = g.kv_cache_spec
        name = type(spec).__name__
        # Exact types: a subclass (sliding-window MLA, hidden-state or sink caches) is another
        # layout, refused below rather than read as its base.
        if type(spec) is MLAAttentionSpec and not getattr(spec, "sliding_window", None):
            _check_mla_platform(config)
            kinds.append((MLA, HitRule.FULL, 0, f"mla{spec.head_size}"))
        elif type(spec) is SlidingWindowSpec and not getattr(spec, "extra_retained_tokens", 0):
            window = int(spec.sliding_window)
            kinds.append((MHA, HitRule.WINDOW, window - 1, f"swa{window}"))
        elif type(spec) is FullAttentionSpec:
            if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size",
                                                                None):
                raise ConfigError(
                    "HiCacheStoreConnector: sliding-window or chunked layers promoted to full "
                    "attention (the hybrid KV cache manager is off: "
                    "--disable-hybrid-kv-cache-manager); leave it on for this model")
            kinds.append((MHA, HitRule.FULL, 0, "full"))
        elif type(spec) is MambaSpec:
            if tp > 1:
                raise ConfigError(
                    f"HiCacheStoreConnector: {name} under tensor parallelism (a recurrent "
                    "state is sharded by heads in a way only the model knows); run TP 1")
            if spec.mamba_cache_mode != "align":
                raise ConfigError(
                    f"HiCacheStoreConnector: {name} with mamba_cache_mode "
                    f"{spec.mamba_cache_mode!r} keeps no state per block (enable prefix "
                    "caching: vLLM then keeps them, mode 'align')")
            kinds.append((STATE, HitRule.CHECKPOINT, 0, f"state[{_state_structure(spec)}]"))
        else:
            raise ConfigError(f"HiCacheStoreConnector: KV cache spec {name} is not supported "
                              "(full, sliding-window and MLA attention, and recurrent states "
                              "kept per block, are)")
    indices = [tuple(sorted(_layer_index(n) for n in g.layer_names)) for g in groups]
    plain = len(groups) == 1 and kinds[0][1] is HitRule.FULL
    pattern = ";".join(f"{detail}:{','.join(map(str, idx))}"
                       for (_, _, _, detail), idx in zip(kinds, indices, strict=True))
    prefix = model if plain else (
        f"{model}#vllm-{hashlib.sha256(pattern.encode()).hexdigest()[:12]}")
    tags = {HitRule.FULL: KV_TAG, HitRule.WINDOW: WINDOW_TAG, HitRule.CHECKPOINT: RECURRENT_TAG}
    parts = []
    for number, (g, (kind, rule, window, detail), idx) in enumerate(
            zip(groups, kinds, indices, strict=True)):
        spec = g.kv_cache_spec
        part_name = "kv" if plain else f"g{number}-{detail.split('[')[0]}"
        layers = tuple(sorted(g.layer_names, key=_layer_index))
        page_size, nbytes = block, 0
        if kind == MLA:
            shape = ModelShape.mla(len(layers), int(spec.head_size))
            dtype = normalize_dtype(str(spec.dtype))
            grid = config.grid or suggest_grid(shape, [topology, *config.share_with])
        elif kind == MHA:
            heads = int(vllm_config.model_config.get_total_num_kv_heads())
            shape = ModelShape.mha(len(layers), heads, int(spec.head_size))
            dtype = normalize_dtype(str(spec.dtype))
            grid = suggest_grid(shape, [topology, *config.share_with], "head_sharded")
        else:
            nbytes = state_bytes(spec)
            shape = ModelShape.mla(len(layers), nbytes)
            dtype, page_size, grid = "uint8", 1, Grid(len(layers), 1)
        namespace = Namespace.create(
            prefix if plain else f"{prefix}#{part_name}", shape, dtype, page_size, grid,
            model_revision=config.model_revision or "", tenant_salt=config.tenant_salt,
        )
        component = ComponentSpec(part_name, tags[rule], rule, window_tokens=window)
        parts.append(GroupPart(number, kind, component, namespace, layers, idx, nbytes))
    return parts


def pages_to_save(part: GroupPart, start: int, end: int, on_page_end: bool,
                  block_size: int) -> list[int]:
    """The pages of ``part`` among ``[start, end)``, complete after a step that ends ``end``
    pages in, that a later hit can read: a full part's every page; a window part's those a
    hit at ``end`` or at ``end - 1`` reads (a continuation of the request resumes at or past
    its end, the same prompt asked again one page before it when it ends on a page end: a
    prompt keeps its last token to compute), never the pages behind them, which no such hit
    reads; a state part's snapshot at ``end`` where the step ends ``on_page_end`` (the state
    in that block is the state *at* that end). A later request that shares only a part of the
    step's tokens resumes at the last point where every part was saved."""
    if part.rule is HitRule.FULL:
        return list(range(start, end))
    if part.rule is HitRule.CHECKPOINT:
        return [end - 1] if on_page_end and end > start else []
    # (the window behind ``end - 1`` starts no later than the one behind ``end``)
    first = part.spec.pages_needed(end - 1, block_size).start if end > 1 else 0
    return list(range(max(start, first), end))


def lookup_evidence(
    parts: list[GroupPart], present: list[list[bool]], local: int, stored: int, block_size: int,
) -> list[tuple[list[int], list[int]]]:
    """Per part, what a lookup's answers say of the store for the write admission: the pages
    (indices into the request's pages) the hit of ``stored`` pages reads from it (found), and
    those absent that stop the hit one page further (missing): ``present[p][i - local]``
    answers for page ``i`` of part ``p``, ``local`` pages are vLLM's own. Pages no hit of
    this length reads (a window part's behind the window, a full part's past a gap) are no
    evidence either way: their absence costs nothing, their presence serves nothing."""
    out: list[tuple[list[int], list[int]]] = []
    looked = local + (len(present[0]) if present else 0)
    for part, there in zip(parts, present, strict=True):
        found = [i for i in part.spec.pages_needed(stored, block_size)
                 if i >= local and there[i - local]]
        missing = []
        if stored < looked:
            missing = [i for i in part.spec.pages_needed(stored + 1, block_size)
                       if i >= local and not there[i - local]][:1]
        out.append((found, missing))
    return out
