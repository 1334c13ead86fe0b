"""The SGLang adapter's KV events: the pages a server stores in L3 (medium ``STORAGE``).

SGLang keeps L1 and L2 itself (its own events cover them); the adapter sees only L3 writes.
TP rank 0 of PP stage 0 publishes (one publisher per server, like vLLM's per DP rank): for each
``batch_set_v1``, every run of pages it stored is one ``BlockStored`` whose parent is the page
before the run (SGLang's ``extra_info.prefix_keys`` gives the page before the batch; without
it the first run's parent is None). ``token_ids`` are empty (SGLang passes hashes only);
block hashes are SGLang's page hashes as bytes, keyed with the tenant's active key in a sealed
namespace. ``clear`` that deleted the namespace is ``AllBlocksCleared``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache_store.events.publisher import EventPublisher, PublisherConfig
from hicache_store.events.wire import MEDIUM_STORAGE, AllBlocksCleared, BlockStored, Event
from hicache_store.layout.sealing import key_page_hash


class AdapterEvents:
    """Publishes the adapter's L3 stores (module docstring)."""

    def __init__(self, config: PublisherConfig, page_size: int,
                 page_key: bytes | None = None) -> None:
        self.page_size = page_size
        self._page_key = page_key
        self.publisher = EventPublisher(config)

    def stored(self, keys: Sequence[str], results: Sequence[bool], extra_info: Any) -> None:
        """Publish the pages of ``keys`` stored (``results[i]``), one event per run."""
        prefix = getattr(extra_info, "prefix_keys", None) or ()
        parent = self._hash(prefix[-1]) if prefix else None
        events: list[Event] = []
        run: list[bytes] = []
        for key, ok in zip(keys, results, strict=True):
            block = self._hash(key)
            if ok:
                run.append(block)
                continue
            if run:
                events.append(BlockStored(tuple(run), parent, (), self.page_size, MEDIUM_STORAGE))
                run = []
            parent = block
        if run:
            events.append(BlockStored(tuple(run), parent, (), self.page_size, MEDIUM_STORAGE))
        self.publisher.publish(events)

    def cleared(self) -> None:
        self.publisher.publish([AllBlocksCleared()])

    def close(self) -> None:
        self.publisher.close()

    def _hash(self, page_hash: str) -> bytes:
        if self._page_key is not None:
            page_hash = key_page_hash(self._page_key, page_hash)
        return bytes.fromhex(page_hash)
