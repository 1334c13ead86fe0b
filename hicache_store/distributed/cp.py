"""Context parallelism: each rank restores the pages it owns, then the ranks gather the prefix.

With ``N`` CP ranks every rank keeps the same logical view of a request, but a
logical page ``q`` lives only on rank ``q mod N``, at local page ``q // N`` (token slot ``x`` at
local row ``floor(floor(x/p)/N)*p + x mod p``: ``layout.cp.slot_owner``). A restore from L3
must keep that ownership, or the restored page sits on a rank that will not contribute it to
the next gather (restore local pages -> gather the prefix -> run attention).

``CPShardStore`` is that path for one CP rank holding every layer and head of its pages (the
TP1/PP1 shard, so its read plan reads whole objects): ``restore`` agrees with the other ranks
on how many pages L3 holds, reads *only the pages this rank owns* through its own ``L3Link``
(verified objects, a failed read is a miss) into its own pool at the owner-local pages, and
agrees on the restored prefix (the first page any rank failed to read ends it). ``gather_prefix``
all-gathers every rank's local pages (the same number per rank: a rank with fewer pages pads
with a padding page) and places logical slot ``x`` from its owner's local row.
The gather here is one collective for all layers, not one per layer with double buffering as
a GPU implementation would; ownership and order are what this module is about.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from hicache_store._sync import run_sync
from hicache_store.backends.base import Backend
from hicache_store.kernels.ops import unpack_pages
from hicache_store.kernels.pools import DevicePool
from hicache_store.layout.cp import page_owner, slot_owner
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.host import UnifiedPageLayout
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.topology import Topology, shard_of
from hicache_store.objects import DEFAULT_IO_TIMEOUT_S, IOStats, L3Link
from hicache_store.tenant import KeyRing
from hicache_store.tier.cache import DevicePagePool

from .group import TorchGroup


class CPShardStore:
    """One CP rank's pages in its own pool (``pool``: every layer and head, owner-local pages).

    ``keys``: the tenant key ring when ``namespace`` is sealed (the objects are then opened and
    authenticated with it, as the tier does; a sealed namespace without one raises
    ``MissingKeyError`` here, before any I/O)."""

    def __init__(
        self,
        namespace: Namespace,
        pool: DevicePagePool,
        group: TorchGroup,
        backend: Backend,
        *,
        io_timeout_s: float = DEFAULT_IO_TIMEOUT_S,
        keys: KeyRing | None = None,
    ) -> None:
        if pool.page_size != namespace.page_size:
            raise ValueError("pool and namespace page sizes differ")
        self.namespace = namespace
        self.pool = pool
        self.group = group
        self.size = group.size
        self.rank = group.rank
        topology = Topology()  # a CP rank holds every layer and head of the pages it owns
        self.layout = UnifiedPageLayout.for_shard(namespace, shard_of(namespace, topology, 0))
        self.link = L3Link(
            backend,
            namespace,
            topology,
            0,
            max_inflight_bytes=256 << 20,
            io_timeout_s=io_timeout_s,
            keys=keys,
        )
        self.io_timeout_s = io_timeout_s
        self.device = DevicePool.mha(pool.k_buffers, pool.v_buffers)
        self.pages = 0  # logical pages of the restored prefix

    def owned(self, count: int) -> list[int]:
        """Logical pages ``< count`` this rank owns."""
        return [q for q in range(count) if page_owner(q, self.size) == self.rank]

    def restore(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """Restore up to ``max_pages`` leading pages of ``tokens``; return the logical pages
        this rank restored (its own), having agreed on the prefix with the group."""
        page = self.namespace.page_size
        arr = np.asarray(tokens, dtype="<u4")
        hashes = page_hashes(arr, page, algo=self.namespace.hash_algo)[:max_pages]
        try:
            found = run_sync(self.link.exists_prefix(hashes), timeout=self.io_timeout_s)
        except Exception:
            found = 0
        count = self.group.agree_min(found, "cp_prefix_pages")
        mine = self.owned(count)
        need = math.ceil(count / self.size)
        if self.pool.num_pages < need:
            raise ValueError(f"the pool holds {self.pool.num_pages} pages, {need} are needed")
        rows = np.zeros((len(mine), self.layout.page_bytes), dtype=np.uint8)
        restored = count
        for i, q in enumerate(mine):
            ok = run_sync(self.link.read_page(hashes[q], rows[i], IOStats()))
            if not ok:
                restored = q  # a prefix ends before the first page any rank lacks
                break
        restored = self.group.agree_min(restored, "cp_restored_pages")
        mine = [q for q in mine if q < restored]
        if mine:
            first_slots = torch.tensor([(q // self.size) * page for q in mine], dtype=torch.int64)
            unpack_pages(torch.from_numpy(rows[: len(mine)]), self.device, first_slots, self.layout)
        self.pages = restored
        return mine

    def check_placement(self, reference: DevicePagePool, tokens: int) -> bool:
        """Whether every slot ``x < tokens`` this rank owns holds ``reference``'s slot ``x`` at
        the row ``layout.cp.slot_owner`` gives (``reference``: the full KV, slot = position)."""
        page = self.namespace.page_size
        xs = [
            x
            for x in range(min(tokens, self.pages * page))
            if slot_owner(x, page, self.size)[0] == self.rank
        ]
        rows = torch.tensor([slot_owner(x, page, self.size)[1] for x in xs], dtype=torch.int64)
        src = torch.tensor(xs, dtype=torch.int64)
        for mine, ref in (
            *zip(self.pool.k_buffers, reference.k_buffers, strict=True),
            *zip(self.pool.v_buffers, reference.v_buffers, strict=True),
        ):
            if not torch.equal(mine.index_select(0, rows), ref.index_select(0, src)):
                return False
        return True

    def gather_prefix(self, tokens: int, scratch: DevicePagePool) -> None:
        """Place the first ``tokens`` logical slots in ``scratch`` (slot = position), each from
        its owner's local row, after one all-gather of every rank's local pages."""
        page = self.namespace.page_size
        if tokens > self.pages * page:
            raise ValueError(f"only {self.pages} pages were restored, {tokens} tokens asked")
        local_rows = math.ceil(self.pages / self.size) * page
        layers = len(self.pool.k_buffers)
        local = torch.stack(
            [
                torch.stack([k[:local_rows], v[:local_rows]])
                for k, v in zip(self.pool.k_buffers, self.pool.v_buffers, strict=True)
            ]
        ).contiguous()  # [layers, K/V, rows, heads, dim]
        shape = local.shape
        data = local.view(-1).view(torch.uint8)
        parts = self.group.all_gather_bytes(data, [data.numel()] * self.size)
        gathered = torch.stack([p.view(local.dtype).view(shape) for p in parts])
        owners = torch.tensor([slot_owner(x, page, self.size)[0] for x in range(tokens)])
        rows = torch.tensor([slot_owner(x, page, self.size)[1] for x in range(tokens)])
        for layer in range(layers):
            scratch.k_buffers[layer][:tokens] = gathered[owners, layer, 0, rows]
            scratch.v_buffers[layer][:tokens] = gathered[owners, layer, 1, rows]
