"""hicache-store: hierarchical KV-cache storage for LLM inference engines.

Subpackages: ``hicache_store.layout`` (the unified KV layout), ``hicache_store.kernels``
(pack/unpack kernels), ``hicache_store.backends`` (async storage backends), and in this package
the cache tier, engine integrations, the conformance kit and the ``hicache-store`` CLI.
"""

from __future__ import annotations

__version__ = "0.1.0"
