"""Engine integrations: hicache-store inside inference engines, loaded by each engine from a
module path and never imported by hicache-store itself.

* ``sglang/``: SGLang's HiCache storage backend (``hicache_store.integrations.sglang``) and its
  external cache linker (``hicache_store.integrations.sglang_linker``, the linker's load path).
* ``vllm/``: vLLM's KV connector and secondary tier.
* ``_lookups``: the lookup counters every integration reports.
"""
