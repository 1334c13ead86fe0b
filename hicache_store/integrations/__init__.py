"""Engine integrations: adapters that plug hicache-store into inference engines.

* ``hicache_store.integrations.sglang``: ``HiCacheStoreStorage``, an SGLang HiCache storage
  backend loaded with ``--hicache-storage-backend dynamic`` (unified, topology-free L3 on any
  hicache-store backend). Importing it does not need SGLang; it subclasses SGLang's
  ``HiCacheStorage`` when SGLang is importable.
"""
