"""hicache-store inside SGLang (pinned: SGLang 0.5.23), both loaded by SGLang from a module path.

- ``storage``: ``HiCacheStoreStorage``, a HiCache storage backend (L3 under SGLang's host
  tier), loaded with ``--hicache-storage-backend dynamic`` and
  ``"module_path": "hicache_store.integrations.sglang"``, the path of this package, which
  exports it. Its parts: ``_pool`` (SGLang's host pools), ``_namespace`` (the namespace check),
  ``_weights`` (the served weights' revision), ``_metrics`` (``get_stats`` and Prometheus),
  ``_events`` (KV events for routers), ``_v2`` (the multi-pool interface of hybrid models).
- ``linker``: ``HiCacheStoreLinker``, SGLang's external cache linker (device pools straight to
  L3), loaded with ``"linker_module_path": "hicache_store.integrations.sglang_linker"``.

The extra-config both read is ``hicache_store.sglang_config``. Importing this package does not
need SGLang: ``HiCacheStoreStorage`` subclasses SGLang's ``HiCacheStorage`` when SGLang is
importable, and is a plain class with the same methods otherwise (``SGLANG_AVAILABLE``).
"""

from .storage import SGLANG_AVAILABLE, HiCacheStoreStorage

__all__ = ["SGLANG_AVAILABLE", "HiCacheStoreStorage"]
