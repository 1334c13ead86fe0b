"""``integrations.vllm._groups.describe_groups``: vLLM 0.32's own KV cache specs as the
connector's parts, and the one-line refusals, without an engine.

The parts of the families vLLM serves here (their hit rules, namespaces, and that any change of
window, grouping or state structure is another namespace) and each refusal: a spec the connector
does not know (cross-attention, chunked-local, a subclass such as sliding-window MLA), a state
group without per-block snapshots or under TP > 1, groups of different block sizes, sliding
layers promoted to full attention, MLA on the CPU platform unless allowed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from hicache_store.integrations.vllm._config import ConnectorConfig
from hicache_store.integrations.vllm._groups import describe_groups
from hicache_store.integrations.vllm.connector import deployment
from hicache_store.layout.errors import ConfigError
from hicache_store.layout.topology import Topology
from hicache_store.tier.components import HitRule

BLOCK = 128


def full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=kw.pop("block_size", BLOCK), num_kv_heads=2,
                             head_size=64, dtype=torch.float32, **kw)


def sliding(window: int = 64) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                             dtype=torch.float32, sliding_window=window)


def state(mode: str = "align", shapes: tuple[tuple[int, ...], ...] = ((3, 512), (4, 64, 64))
          ) -> MambaSpec:
    return MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=(torch.bfloat16, torch.bfloat16),
                     mamba_cache_mode=mode)


def mla() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)


def layers(*indices: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in indices]


def describe(*groups: tuple[Any, list[str]], tp: int = 1, **config: Any) -> list[Any]:
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names, spec) for spec, names in groups])
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2))
    return describe_groups(ConnectorConfig(**config), vllm_config,  # type: ignore[arg-type]
                           kv, Topology(tp, 1), "tiny")


def gemma(window: int = 64) -> list[Any]:
    return describe((sliding(window), layers(0, 2)), (full(), layers(1, 3)))


def test_sliding_and_full_groups_are_a_window_part_and_a_full_part() -> None:
    window, whole = gemma()
    assert (window.kind, window.rule, window.spec.window_tokens) == ("mha", HitRule.WINDOW, 63)
    assert (whole.kind, whole.rule) == ("mha", HitRule.FULL)
    assert window.indices == (0, 2) and whole.indices == (1, 3)
    assert window.namespace.num_layers == 2 and window.namespace.page_size == BLOCK
    # Each part its own namespace; the pattern (window, grouping) in both.
    assert window.namespace.digest != whole.namespace.digest
    assert gemma()[0].namespace == window.namespace
    assert gemma(128)[0].namespace.digest != window.namespace.digest
    assert gemma(128)[1].namespace.digest != whole.namespace.digest
    swapped = describe((sliding(), layers(1, 3)), (full(), layers(0, 2)))
    assert swapped[1].namespace.digest != whole.namespace.digest


def test_a_state_group_is_a_checkpoint_part_of_its_unpadded_state() -> None:
    snapshot, attention = describe((state(), layers(0, 2)), (full(), layers(1, 3)))
    assert (snapshot.kind, snapshot.rule) == ("state", HitRule.CHECKPOINT)
    assert snapshot.state_bytes == (3 * 512 + 4 * 64 * 64) * 2  # bf16, no padding
    assert snapshot.namespace.dtype == "uint8"
    assert attention.rule is HitRule.FULL
    other = describe((state(shapes=((3, 512), (4, 64, 32))), layers(0, 2)),
                     (full(), layers(1, 3)))
    assert other[0].namespace.digest != snapshot.namespace.digest


def test_one_full_group_keeps_the_plain_namespace_and_mla_is_allowed_only_when_asked() -> None:
    (plain,) = describe((full(), layers(0, 1)))
    assert plain.namespace.model == "tiny" and plain.rule is HitRule.FULL
    with pytest.raises(ConfigError, match="MLA on vLLM's CPU platform is refused.*allow_cpu_mla"):
        describe((mla(), layers(0, 1)))
    (latent,) = describe((mla(), layers(0, 1)), allow_cpu_mla=True)
    assert latent.kind == "mla" and latent.namespace.kv_kind == "mla"
    assert latent.namespace.head_dim == 576 and latent.namespace.model == "tiny"


@pytest.mark.parametrize(("groups", "message"), [
    (((CrossAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                          dtype=torch.float32), layers(0)),),
     "KV cache spec CrossAttentionSpec is not supported"),
    (((ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                 dtype=torch.float32, attention_chunk_size=256), layers(0)),
      (full(), layers(1))),
     "KV cache spec ChunkedLocalAttentionSpec is not supported"),
    (((SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32,
                            sliding_window=64), layers(0)),),
     "KV cache spec SlidingWindowMLASpec is not supported"),
    (((full(sliding_window=64), layers(0, 1)),),
     "promoted to full attention .*--disable-hybrid-kv-cache-manager"),
    (((state(mode="none"), layers(0)), (full(), layers(1))),
     "mamba_cache_mode 'none' keeps no state per block"),
    (((sliding(), layers(0)), (full(block_size=2 * BLOCK), layers(1))),
     r"block sizes \[128, 256\]"),
])
def test_what_is_not_supported_is_refused_with_one_line(
    groups: tuple[tuple[Any, list[str]], ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        describe(*groups, allow_cpu_mla=True)


def test_a_state_under_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match="under tensor parallelism"):
        describe((state(), layers(0)), (full(), layers(1)), tp=2)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"])
def test_the_connector_refuses_quantized_kv_naming_the_setting(cache_dtype: str) -> None:
    """float8 KV without its per-layer scales in the namespace would be served under other
    scales: the connector refuses it at start-up, before any part is described."""
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layers(0, 1), full())])
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype))
    with pytest.raises(ConfigError, match=rf"kv_cache_dtype '{cache_dtype}' is not supported "
                       r"\(quantized KV needs its per-layer k/v scales.*use 'auto'"):
        deployment(ConnectorConfig(), vllm_config, kv)  # type: ignore[arg-type]
