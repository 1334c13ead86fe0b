#!/usr/bin/env bash
# Builds .build/bench-venv: the peer interpreter in which the benchmarks run SGLang's and
# LMCache's own storage classes (HiCacheFile, LocalDiskBackend, get_hash_str) side by side with
# ours. Kept apart from .venv so that neither engine becomes a dependency of hicache-store.
# torch is pinned first (an unpinned one pulls a multi-GB CUDA build); everything else goes in
# with --no-deps so pip never replaces it. The package list is the one that imports those
# classes on a CPU machine (see ../shared/notes/peer-packages.md of the project notes).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.build/bench-venv
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q torch==2.13.0 numpy
"$PY" -m pip install -q --no-deps sglang==0.5.23 lmcache==0.5.6
"$PY" -m pip install -q --no-deps orjson psutil pybase64 requests urllib3 idna certifi \
  charset-normalizer triton packaging pillow starlette anyio msgspec pydantic pydantic_core \
  typing-inspection pyzmq tqdm ipython traitlets Pygments aiohttp multidict attrs yarl propcache \
  aiohappyeyeballs aiosignal frozenlist
"$PY" -m pip install -q --no-deps numba llvmlite PyYAML cachetools sortedcontainers \
  prometheus_client py-cpuinfo aiofile caio transformers regex huggingface_hub httpx2 httpcore2 \
  truststore h11 safetensors tokenizers cryptography cffi pycparser
"$PY" -c "from sglang.srt.mem_cache.hicache_storage import HiCacheFile; \
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend; print('peers ok')"
