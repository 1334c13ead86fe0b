"""Fixtures for the operator tools: a tiny Llama with random weights and a tokenizer trained on
the fly, saved to a temporary folder and loaded back offline (no downloads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

WORDS = ["the", "cache", "keeps", "pages", "of", "keys", "and", "values", "so", "a", "long", "shared", "prefix", "is", "computed", "once", "and", "read", "back", "from", "storage", "when", "the", "next", "request", "arrives", "with", "the", "same", "system", "prompt"]


def make_tiny_llama(folder: Path) -> Path:
    """A 2-layer Llama (GQA: 4 query heads, 2 KV heads of 16) plus a BPE tokenizer."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    import torch

    os.environ["HF_HUB_OFFLINE"] = "1"
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]
    )
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=fast.vocab_size if fast.vocab_size >= 3 else 200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def sentence(start: int, words: int) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(words))


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
