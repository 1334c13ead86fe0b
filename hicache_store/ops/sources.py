"""Prompts in, token ids and their KV out: what ``prepopulate`` computes stored KV from.

**Prompts** (``load_prompts``): JSONL files, one JSON value per line, each either an object with
``text`` (a string), ``messages`` (a chat: ``[{"role": ..., "content": ...}, ...]``) or
``input_ids`` (token ids, used as they are), or a bare JSON string; blank lines are skipped.
Any other file (``.txt``, ``.md``, ...) is one prompt: its whole UTF-8 text.

**KV sources** (``KVSource``) turn a prompt into token ids and compute the KV of a token
sequence with a real forward pass:

* ``HFSource``: a Hugging Face tokenizer and causal LM loaded from a *local* directory through
  ``transformers`` (``AutoTokenizer`` / ``AutoModelForCausalLM``; the Llama, Qwen and Mistral
  families, any model whose cache holds per-layer K/V of shape ``[batch, kv_heads, seq,
  head_dim]``). Text is tokenized with the tokenizer's defaults (special tokens included, as a
  server tokenizes a completion request); ``messages`` go through the tokenizer's chat template
  without a generation prompt (the conversation is the shared prefix; each request appends its
  own generation prompt after it). The KV is the model's own ``past_key_values`` after one
  forward pass over the sequence, in the dtype the model runs in. Needs the ``hf`` extra
  (transformers, tokenizers).

The demo's mini engine is a third ``KVSource`` (``hicache_store.demo.engine.source.
MiniEngineSource``): it lives with the engine, outside the library's core, and only the
``prepopulate`` command (``--mini-engine``) and tests import it.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from hicache_store.layout.namespace import ModelShape
from hicache_store.weights import WeightsIdentity, weights_identity

#: JSONL suffixes; every other file is one text prompt.
JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class Prompt:
    """One prompt: exactly one of ``text``, ``messages``, ``input_ids``; ``origin`` for errors."""

    origin: str
    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    input_ids: tuple[int, ...] | None = None


class PromptError(ValueError):
    """A prompt file or line cannot be used (the message names file and line)."""


def _prompt_from_json(value: Any, origin: str) -> Prompt:
    if isinstance(value, str):
        return Prompt(origin, text=value)
    if not isinstance(value, dict):
        raise PromptError(f"{origin}: expected an object or a string, got {type(value).__name__}")
    fields = [f for f in ("text", "messages", "input_ids") if f in value]
    if len(fields) != 1:
        raise PromptError(f"{origin}: expected exactly one of text, messages, input_ids")
    (name,) = fields
    item = value[name]
    if name == "text":
        if not isinstance(item, str):
            raise PromptError(f"{origin}: text must be a string")
        return Prompt(origin, text=item)
    if name == "messages":
        if not isinstance(item, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in item
        ):
            raise PromptError(f"{origin}: messages must be a list of {{role, content}} objects")
        return Prompt(origin, messages=tuple(item))
    if not isinstance(item, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item
    ):
        raise PromptError(f"{origin}: input_ids must be a list of non-negative integers")
    return Prompt(origin, input_ids=tuple(item))


def load_prompts(paths: Sequence[str | Path]) -> Iterator[Prompt]:
    """Yield the prompts of every file, in order (see the module docstring for formats)."""
    for raw in paths:
        path = Path(raw)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PromptError(f"{path}: {exc}") from None
        if path.suffix.lower() not in JSONL_SUFFIXES:
            yield Prompt(str(path), text=text)
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            origin = f"{path}:{number}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{origin}: not JSON ({exc.msg})") from None
            yield _prompt_from_json(value, origin)


#: per layer, ``(K, V)`` each ``[kv_heads, seq, head_dim]``.
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


class KVSource(Protocol):
    """What prepopulation needs from a model: identity, KV shape, tokens and a forward pass."""

    model_name: str
    shape: ModelShape
    dtype: str  # the KV dtype, as a layout dtype name (``bfloat16``)
    #: the identity of the weights the KV is computed by (``hicache_store.weights``); None:
    #: unknown (no model files, as the demo engine's seeded weights)
    weights: WeightsIdentity | None

    def tokenize(self, prompt: Prompt) -> list[int]: ...

    def kv(self, tokens: Sequence[int]) -> LayerKV: ...


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _transformers() -> Any:
    """The ``transformers`` module, or ``MissingDependencyError`` naming the extra."""
    try:
        # Typed as Any: transformers' own annotations are partial and vary by release.
        return importlib.import_module("transformers")
    except ImportError as exc:
        from hicache_store.backends.errors import MissingDependencyError

        raise MissingDependencyError(
            f"a Hugging Face model or tokenizer needs transformers ({exc})",
            install_hint="pip install transformers tokenizers (the hf extra)",
        ) from exc


def tokenize_with(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt`` with a Hugging Face tokenizer (see the module docstring)."""
    if prompt.input_ids is not None:
        return list(prompt.input_ids)
    if prompt.messages is not None:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                list(prompt.messages), tokenize=True, add_generation_prompt=False,
                return_dict=False,
            )
            return [int(t) for t in ids]
        text = "".join(f"{m['role']}: {m['content']}\n" for m in prompt.messages)
        return [int(t) for t in tokenizer(text)["input_ids"]]
    assert prompt.text is not None
    return [int(t) for t in tokenizer(prompt.text)["input_ids"]]


class HFTokenizer:
    """Only the tokenizer of a local Hugging Face model directory (no weights loaded)."""

    def __init__(self, path: str | Path) -> None:
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer directory {folder} does not exist")
        self.tokenizer = _transformers().AutoTokenizer.from_pretrained(folder,
                                                                       local_files_only=True)

    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize_with(self.tokenizer, prompt)


class HFSource:
    """A local Hugging Face causal LM and its tokenizer (see the module docstring)."""

    def __init__(self, path: str | Path, *, dtype: str = "auto", device: str = "cpu",
                 model_name: str | None = None, progress: bool = True) -> None:
        transformers = _transformers()
        if not progress:
            transformers.utils.logging.disable_progress_bar()
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"model directory {folder} does not exist")
        kwargs: dict[str, Any] = {"local_files_only": True}
        if dtype != "auto":
            if dtype not in _TORCH_DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_TORCH_DTYPES)}")
            kwargs["dtype"] = _TORCH_DTYPES[dtype]
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        self.model.to(device).eval()
        self.device = torch.device(device)
        config = self.model.config
        if getattr(config, "kv_lora_rank", None):
            raise ValueError("MLA models (latent KV) are not supported by HFSource yet")
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        self.shape = ModelShape.mha(
            int(config.num_hidden_layers),
            int(getattr(config, "num_key_value_heads", None) or heads),
            int(head_dim),
        )
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        # SGLang names the model by its --model-path exactly as given (unless a served name
        # is set): the same string here, so a store prepopulated from the path SGLang serves
        # is found by it (ops.deployment).
        self.model_name = model_name or str(path)
        self.weights = weights_identity(folder)

    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize_with(self.tokenizer, prompt)

    def kv(self, tokens: Sequence[int]) -> LayerKV:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.model(input_ids=ids, use_cache=True)
        return cache_layers(output_cache(out))

    def logits(self, tokens: Sequence[int], cache: Any = None) -> torch.Tensor:
        """Last-position logits of ``tokens`` (over ``cache`` when given): for checks."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name still works,
        # with a deprecation warning); pass whichever this version's forward declares.
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else (
            "past_key_values")
        with torch.no_grad():
            out = self.model(input_ids=ids, use_cache=cache is not None, **{name: cache})
        logits: torch.Tensor = out.logits[0, -1]
        return logits


def output_cache(output: Any) -> Any:
    """The KV cache of a model output (``cache`` in transformers 5, else ``past_key_values``)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def cache_layers(cache: Any) -> LayerKV:
    """Per-layer ``(K, V)`` of batch row 0 from a transformers cache (v5 ``DynamicCache`` with
    ``.layers[i].keys/.values``, v4 ``key_cache``/``value_cache`` lists, or legacy tuples)."""
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    elif hasattr(cache, "key_cache"):
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    else:
        pairs = [(k, v) for k, v in cache]
    return [(k[0], v[0]) for k, v in pairs]
