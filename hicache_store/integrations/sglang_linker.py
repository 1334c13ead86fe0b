"""The module path SGLang's external cache linker is configured with
(``"linker_module_path": "hicache_store.integrations.sglang_linker"``); the linker itself is
``hicache_store.integrations.sglang.linker``."""

from .sglang.linker import HiCacheStoreLinker

__all__ = ["HiCacheStoreLinker"]
