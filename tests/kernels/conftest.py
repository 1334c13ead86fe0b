"""Kernel tests: run the Triton kernels through Triton's CPU interpreter when there is no GPU.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is decorated, i.e. when
``hicache_store.kernels._triton_kernel`` is first imported (the package imports it lazily, on
the first Triton launch). Setting the variable here, before any test module runs, is early
enough. With a CUDA device the kernels compile for it instead and the interpreter tests skip.
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh random seed per test (printed, so a failure can be replayed)."""
    seed = secrets.randbits(63)
    print(f"torch generator seed: {seed}")
    g = torch.Generator()
    g.manual_seed(seed)
    return g
