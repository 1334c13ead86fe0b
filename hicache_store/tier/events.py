"""The tier's KV events: its KV pages entering and leaving L2 (medium ``CPU``) and L3
(medium ``STORAGE``), published in vLLM's wire format (``hicache_store.events``).

What is reported, and when: the page tree tells ``TierEvents`` every time a KV page's L2 copy
appears or goes and every time the tier learns that L3 holds a page or no longer does (its own
backup finished; another instance's copy found by a prefetch; a read that missed). The events
of one tier call (``match``, ``prepare``, ``complete``, ``poll``, ...) are one batch,
published when ``flush`` is called at the end of the call; consecutive stores of one chain are
one ``BlockStored``. ``close`` reports the L2 copies as removed (host memory goes with the
process; L3 stays). Only rank 0 of a deployment publishes (every rank holds the same pages).

**Block hashes** are the page hashes as bytes (``bytes.fromhex``: 32 bytes for sha256, 16 for
xxh3_128), the parent is the previous page's; ``token_ids`` are the page's tokens when the tier
still knows them (it remembers those of the last ``memory`` pages it matched; older ones are
sent empty). **Sealed namespaces**: every hash is the tenant-keyed one (what names the objects
in the store, ``layout.sealing.key_page_hash`` with the active key) and ``token_ids`` are always
empty, so no event carries anything the sealing protects; without the key ring the tier refuses
to publish.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from hicache_store.events.publisher import EventPublisher, PublisherConfig
from hicache_store.events.wire import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, Event
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.sealing import key_page_hash
from hicache_store.tenant import KeyRing

from .components import KV_TAG, Tier
from .radix import PageNode

_MEDIUM = {Tier.L2: MEDIUM_CPU, Tier.L3: MEDIUM_STORAGE}


class TierEvents:
    """Collects the tier's KV page events and publishes them a batch per tier call."""

    def __init__(
        self,
        config: PublisherConfig,
        namespace: Namespace,
        *,
        keys: KeyRing | None = None,
        memory: int = 1 << 16,
    ) -> None:
        if namespace.sealed and keys is None:
            raise ValueError(
                "kv events: a sealed namespace publishes keyed page hashes only, which needs "
                "its key ring (keys=...); refusing to publish"
            )
        self._page_key = keys.active.page_key if namespace.sealed and keys is not None else None
        self._page_size = namespace.page_size
        self._memory = memory
        self._tokens: collections.OrderedDict[str, tuple[list[int], int]] = (
            collections.OrderedDict())
        self._pending: list[Event] = []
        self.publisher = EventPublisher(config)

    def note_tokens(self, hashes: Sequence[str], tokens: list[int]) -> None:
        """Remember the tokens of the pages ``hashes`` (page ``i`` is ``tokens[i*p:(i+1)*p]``)
        for the stores reported later. Nothing for a sealed namespace."""
        if self._page_key is not None or not self._memory:
            return
        remembered = self._tokens
        for i, page_hash in enumerate(hashes):
            remembered[page_hash] = (tokens, i)
            remembered.move_to_end(page_hash)
        while len(remembered) > self._memory:
            remembered.popitem(last=False)

    def changed(self, node: PageNode, tag: int, tier: Tier, present: bool) -> None:
        """The page tree's observer: one KV copy in L2 or L3 appeared or went."""
        if tag != KV_TAG:
            return
        medium = _MEDIUM[tier]
        block = self._hash(node.page_hash)
        if not present:
            self._pending.append(BlockRemoved((block,), medium))
            return
        parent = node.parent
        parent_hash = None
        if parent is not None and parent.depth >= 0:
            parent_hash = self._hash(parent.page_hash)
        last = self._pending[-1] if self._pending else None
        if (isinstance(last, BlockStored) and last.medium == medium
                and last.block_hashes[-1] == parent_hash):
            tokens = self._page_tokens(node.page_hash)
            whole = bool(last.token_ids) and len(tokens) == self._page_size
            self._pending[-1] = BlockStored(
                (*last.block_hashes, block), last.parent_block_hash,
                (*last.token_ids, *tokens) if whole else (), self._page_size, medium)
            return
        self._pending.append(BlockStored(
            (block,), parent_hash, self._page_tokens(node.page_hash), self._page_size, medium))

    def flush(self) -> None:
        """Publish what the last tier call changed (one batch; nothing when nothing did)."""
        if self._pending:
            self.publisher.publish(self._pending)
            self._pending = []

    def close(self, l2_pages: Sequence[PageNode]) -> None:
        """Report ``l2_pages`` (the KV's L2 copies) removed, publish, close the sockets."""
        self._pending.extend(
            BlockRemoved((self._hash(n.page_hash),), MEDIUM_CPU) for n in l2_pages)
        self.flush()
        self.publisher.close()

    def _hash(self, page_hash: str) -> bytes:
        if self._page_key is not None:
            page_hash = key_page_hash(self._page_key, page_hash)
        return bytes.fromhex(page_hash)

    def _page_tokens(self, page_hash: str) -> tuple[int, ...]:
        found = self._tokens.get(page_hash)
        if found is None:
            return ()
        tokens, i = found
        page = self._page_size
        return tuple(tokens[i * page:(i + 1) * page])
