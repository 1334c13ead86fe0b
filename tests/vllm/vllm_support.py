"""Helpers of the vLLM tests (imported by ``conftest`` and the test modules; no vLLM import at
module level, so the project's ``.venv`` can import it to report the folder skipped).

The model: ``LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
num_attention_heads=4, num_key_value_heads=2)`` (head dim 64, which vLLM's CPU attention
supports) with random weights from a fixed seed, and a BPE tokenizer trained on a few lines
with ``tokenizers``, both saved with ``save_pretrained`` and loaded back offline. Engines run
in float32 (greedy decoding without near-ties: token ids are a sharp check for wrong KV) in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a start takes seconds instead of ~100 s
with spawned processes on 2 cores), so tests share engines through module-scoped fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Before vLLM is imported: offline, in-process engine, no usage reporting.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

SKIP_REASON = (
    "vLLM is not installed in this environment: the vLLM tests run in .venv-vllm "
    "(`make setup-vllm`, then `.venv-vllm/bin/python -m pytest tests/vllm`; `make test` runs them)"
)

#: KV memory of every test engine: 8 MiB, 2048 tokens of the tiny model (4 layers x K/V x
#: 2 heads x 64 x 4 bytes = 4 KiB per token), so a short multi-turn history outgrows it.
KV_CACHE_BYTES = 8 << 20

WORDS = [
    "the", "cache", "keeps", "pages", "of", "keys", "and", "values", "so", "a", "long",
    "shared", "prefix", "is", "computed", "once", "read", "back", "from", "storage", "when",
    "next", "request", "arrives", "with", "same", "system", "prompt", "model", "layer",
    "token", "head", "block", "engine", "store", "file", "object", "hash", "chain", "page",
]

CONNECTOR_MODULE = "hicache_store.integrations.vllm.connector"
CONNECTOR_NAME = "HiCacheStoreConnector"


def make_tiny_llama(folder: Path, *, seed: int = 0) -> Path:
    """The test model (see the module docstring) saved under ``folder``; returns ``folder``."""
    import tokenizers
    import torch
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"]
    )
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=max(fast.vocab_size, 256),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = transformers.LlamaForCausalLM(config)
    # Larger random weights than the default init: logits far apart, no greedy near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return folder


#: the tiny model of each family vLLM serves here (``make_tiny_model``): transformers'
#: config class, its arguments, and the dtype vLLM runs it in on this CPU.
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    # every other layer sliding (window 64) beside full attention: 2 KV cache groups
    "gemma2": ("Gemma2Config", {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "sliding_window": 64, "tie_word_embeddings": True}, "float32"),
    # every layer sliding (window 64): 1 group
    "mistral": ("MistralConfig", {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "sliding_window": 64, "tie_word_embeddings": False}, "float32"),
    # MLA: latent 512 + rope 64 (the only latent vLLM's CPU MLA backend compiles), block 16
    "deepseek_v2": ("DeepseekV2Config", {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 128, "tie_word_embeddings": False},
        "float32"),
    # gated delta net + full attention (layers linear, full, linear, full): bf16 only on CPU
    "qwen3_next": ("Qwen3NextConfig", {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False}, "bfloat16"),
}


def make_tiny_model(folder: Path, family: str, *, seed: int = 0) -> Path:
    """A tiny random model of ``family`` (``FAMILIES``) with the test tokenizer, saved under
    ``folder``; returns ``folder``. ``"llama"`` is ``make_tiny_llama``."""
    import torch
    import transformers

    if family == "llama":
        return make_tiny_llama(folder, seed=seed)
    make_tiny_llama(folder, seed=seed)  # the tokenizer (its weights are overwritten below)
    for stale in folder.glob("*.safetensors"):
        stale.unlink()
    config_name, kwargs, dtype = FAMILIES[family]
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    config = getattr(transformers, config_name)(
        vocab_size=max(tok.vocab_size, 256), max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype=dtype, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        if family == "deepseek_v2":
            # Sharper logits: the tiny MLA model's top tokens are otherwise within 0.05 of each
            # other, and greedy decoding flips on the last bits of any float sum.
            model.get_output_embeddings().weight.mul_(10.0)
        if family == "gemma2":
            # Gemma scales embeddings by sqrt(hidden_size): undo it, or the token's own
            # embedding drowns what attention adds and the output ignores the KV.
            model.get_input_embeddings().weight.div_(config.hidden_size ** 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


def sentence(start: int, words: int) -> str:
    """``words`` words of the tokenizer's corpus from ``start`` on (cycling)."""
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(words))


def connector_config(extra: dict[str, Any], **kwargs: Any) -> Any:
    """A ``KVTransferConfig`` loading the hicache-store connector with ``extra`` (failed loads
    recomputed, as the connector requires); ``kwargs`` override its fields."""
    from vllm.config import KVTransferConfig

    fields: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }
    fields.update(kwargs)
    return KVTransferConfig(**fields)


def make_llm(model_dir: Path, *, kv_transfer_config: Any = None, **kwargs: Any) -> Any:
    """An in-process ``vllm.LLM`` of the tiny model with the test settings (float32, eager,
    prefix caching on, 8 MiB of KV); ``kwargs`` override or add engine arguments."""
    import vllm

    args: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "dtype": "float32",
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "max_model_len": 1536,
        "max_num_seqs": 4,
        "seed": 0,
        "disable_log_stats": False,
    }
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    args.update(kwargs)
    return vllm.LLM(**args)


def close_llm(llm: Any) -> None:
    """Stop an engine made by ``make_llm`` and free what it holds, so another can start in
    this process."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm, engine, core
    gc.collect()
