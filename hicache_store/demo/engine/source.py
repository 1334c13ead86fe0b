"""``MiniEngineSource``: the demo's ``MiniLlama`` as a prepopulation ``KVSource``.

Seeded random weights and no tokenizer (prompts must give ``input_ids``); the KV of a token
sequence is read back from a ``DeviceKVPool`` after one prefill. It lives with the mini engine,
outside the library's core (``hicache_store.ops.sources`` holds the protocol and the Hugging Face
source); ``hicache-store prepopulate --mini-engine PRESET`` uses it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.model import MiniLlama
from hicache_store.layout.namespace import ModelShape
from hicache_store.ops.sources import LayerKV, Prompt, PromptError
from hicache_store.weights import WeightsIdentity


class MiniEngineSource:
    """The project's ``MiniLlama`` (prompts must carry ``input_ids``)."""

    def __init__(self, preset: str = "tiny", *, seed: int | None = None,
                 model_name: str | None = None) -> None:
        config = MiniLlamaConfig.preset(preset)
        if seed is not None:
            config = config.with_(seed=seed)
        self.engine = MiniLlama(config)
        self.shape = ModelShape.mha(config.num_layers, config.num_kv_heads, config.head_dim)
        self.dtype = config.dtype
        self.model_name = model_name or f"mini-llama-{preset}-seed{config.seed}"
        # Seeded weights, no model files: their identity is unknown (the default model name
        # carries the preset and the seed instead).
        self.weights: WeightsIdentity | None = None

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.input_ids is None:
            raise PromptError(f"{prompt.origin}: the mini engine has no tokenizer; give input_ids")
        return list(prompt.input_ids)

    def kv(self, tokens: Sequence[int]) -> LayerKV:
        page = 16
        pages = -(-len(tokens) // page)
        pool = self.engine.make_pool(pages, page)
        slots = list(range(len(tokens)))
        self.engine.prefill(list(tokens), 0, slots, pool, last_only=True)
        n = len(tokens)
        return [(k[:n].transpose(0, 1), v[:n].transpose(0, 1))
                for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True)]
