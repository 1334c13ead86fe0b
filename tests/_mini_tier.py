"""A cache tier over the demo ``MiniLlama`` (float32, 4-token pages) for the tier's own tests.

``make_tier`` builds one on a device pool of ``l1_pages`` pages with ``l2_pages`` host rows and
an optional L3 ``backend``; any other ``TierConfig`` field comes as a keyword. ``prompts``
draws reproducible token lists from the model's vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from hicache_store.backends.base import Backend
from hicache_store.demo.engine.config import MiniLlamaConfig
from hicache_store.demo.engine.kv_pool import DeviceKVPool
from hicache_store.layout.namespace import Grid, ModelShape, Namespace
from hicache_store.tier.cache import HiCache
from hicache_store.tier.config import TierConfig

PAGE = 4
CONFIG = MiniLlamaConfig(dtype="float32")


def namespace() -> Namespace:
    shape = ModelShape.mha(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim)
    grid = Grid(CONFIG.num_layers, CONFIG.num_kv_heads)
    return Namespace.create("mini-llama", shape, "float32", PAGE, grid)


def make_tier(
    l1_pages: int, l2_pages: int = 0, backend: Backend | None = None, **options: object
) -> HiCache:
    pool = DeviceKVPool.for_model(CONFIG, num_pages=l1_pages, page_size=PAGE)
    config = TierConfig(
        l1_pages=l1_pages,
        l2_pages=l2_pages,
        prefetch_threshold_tokens=PAGE,
        **options,  # type: ignore[arg-type]
    )
    return HiCache(namespace(), config, pool, backend=backend)


def prompts(seed: int, n: int, length: int) -> Iterator[list[int]]:
    rng = random.Random(seed)
    for _ in range(n):
        yield [rng.randrange(CONFIG.vocab_size) for _ in range(length)]
