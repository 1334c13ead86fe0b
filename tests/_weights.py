"""Model directories for the weights-identity tests: ``config.json`` and a real safetensors
file (``safetensors.torch.save_file``), small, built offline. Same name and config, other
seed: other weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64}


def checkpoint(folder: Path, tensors: dict[str, torch.Tensor] | None = None,
               config: dict[str, object] | None = None, *, seed: int = 0) -> Path:
    """A model directory at ``folder``: ``config`` and ``tensors`` (default: two random
    tensors from ``seed``, 512 KiB, so the fingerprint samples rather than reads them whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    if tensors is None:
        g = torch.Generator().manual_seed(seed)
        tensors = {"embed.weight": torch.randn(512, 256, generator=g),
                   "norm.weight": torch.randn(64, generator=g)}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
