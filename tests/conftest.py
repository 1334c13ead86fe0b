"""Shared by every test folder: this directory is on ``sys.path`` (pytest's rootdir-relative
import of a ``conftest.py`` without ``__init__.py``), so tests import ``_serve`` by name.

The checkout's root is taken off ``sys.path`` (``python -m pytest`` puts the working directory
there): its source folders ``layout/``, ``kernels/`` and ``backends/`` are the package's
``hicache_store.layout`` / ``.kernels`` / ``.backends`` (mapped by the editable install) and must
never import as top-level packages. Left there, ``kernels/`` shadows Hugging Face's ``kernels``
distribution, which transformers (5.25 and later) imports when it is installed, and every test
that loads a model fails at ``from kernels import ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
