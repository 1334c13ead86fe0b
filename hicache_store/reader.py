"""Read stored KV back as tensors: the KV of given tokens, for one rank of a deployment.

For offline use (inspecting, evaluating, moving KV to another system) without a cache tier::

    from hicache_store.reader import KVReader

    with KVReader("file:///var/cache/kv", namespace, topology=Topology(2, 1), rank=1) as reader:
        kv = reader.read(token_ids)          # the longest stored prefix, whole pages
        kv.tokens                            # how many leading tokens came back (0: a miss)
        kv.keys, kv.values                   # MHA: [layers, tokens, heads, head_dim]
        kv.latent                            # MLA: [layers, tokens, dim]

    async with KVReader(url, namespace) as reader:  # the same, from async code
        kv = await reader.aread(token_ids)

``store`` is anything ``open_backend`` takes (a URL, a config mapping) or an open ``Backend``
(then the caller keeps owning it: ``close`` leaves it open). ``namespace`` is a ``Namespace``
or the digest of one whose manifest the store holds (``hicache-store inspect`` lists them): a
string that is no digest raises ``InvalidNamespaceError`` (a ``ValueError``), a digest the
store holds no manifest of ``UnknownNamespaceError`` (a ``LookupError``), at the first call
that needs the namespace. ``model`` is the model directory (or hub id) whose weights the KV is
wanted for: its weights identity (``hicache_store.weights``) becomes the namespace's
``model_revision`` as the engine integrations derive it, unless the ``Namespace`` given carries
one (an explicit revision wins); a digest whose stored namespace holds other weights raises
``InvalidNamespaceError``, a ``model`` with no weights files ``WeightsError`` (both
``ValueError``). Without ``model`` the namespace is read as given.
The tensors hold this rank's shard: layers ``[kv.layer_start, kv.layer_stop)`` and KV heads
``[kv.head_start, kv.head_stop)`` of the model, in the namespace's dtype, on the CPU.

Every byte is verified through the object framing (per-layer checksums, the header matched to
the key asked for); a missing or corrupt object ends the prefix there, so what comes back is
always the stored KV of ``tokens[:kv.tokens]``, never bytes of another page. Reads run through
the same ``L3Link`` (``hicache_store.objects``) as the cache tier: at most ``max_inflight_bytes`` in flight, each page
bounded by ``io_timeout_s``. A sealed namespace (a tenant's) needs its key ring: ``keys=``
(``hicache_store.tenant.load_key_ring``); without it the reader raises ``MissingKeyError``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache_store import _sync
from hicache_store.backends import Backend, aligned_buffer, open_backend
from hicache_store.backends.lifetime import gather_settled
from hicache_store.layout.errors import (
    InvalidNamespaceError,
    UnknownNamespaceError,
    WeightsError,
)
from hicache_store.layout.hashing import page_hashes
from hicache_store.layout.keys import validate_page_hash
from hicache_store.layout.namespace import Namespace, weights_revision
from hicache_store.layout.topology import Topology
from hicache_store.objects import IOStats, L3Link
from hicache_store.tenant import KeyRing
from hicache_store.weights import WeightsIdentity, weights_identity

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

__all__ = ["KVReader", "StoredKV"]


@dataclass(frozen=True)
class StoredKV:
    """The KV of ``tokens`` leading tokens for one rank's shard (see the module docstring).

    MHA: ``keys`` and ``values`` are ``[layers, tokens, heads, head_dim]`` and ``latent`` is
    None; MLA: ``latent`` is ``[layers, tokens, dim]`` and the other two are None.
    """

    tokens: int
    layer_start: int
    layer_stop: int
    head_start: int
    head_stop: int
    keys: torch.Tensor | None
    values: torch.Tensor | None
    latent: torch.Tensor | None
    corruptions: int = 0


class KVReader:
    """Reads a deployment rank's stored KV by tokens (see the module docstring)."""

    def __init__(
        self,
        store: str | Mapping[str, Any] | Backend,
        namespace: Namespace | str,
        topology: Topology | None = None,
        rank: int = 0,
        *,
        max_inflight_bytes: int = 256 << 20,
        io_timeout_s: float = 30.0,
        keys: KeyRing | None = None,
        model: str | os.PathLike[str] | None = None,
    ) -> None:
        self._keys = keys
        self._weights: WeightsIdentity | None = None
        if model is not None:
            self._weights = weights_identity(model)
            if self._weights is None:
                raise WeightsError(f"model {model}: no weights files there (nor a hub snapshot "
                                   "in the local cache)")
        self._owns_backend = not isinstance(store, Backend)
        self.backend: Backend = store if isinstance(store, Backend) else open_backend(store)
        self.topology = topology or Topology()
        self.rank = rank
        self._namespace = namespace
        self._limits = (max_inflight_bytes, io_timeout_s)
        self._link: L3Link | None = None

    # -- namespace -------------------------------------------------------------------------------

    async def _get_link(self) -> L3Link:
        if self._link is None:
            namespace = self._namespace
            if isinstance(namespace, str):
                from hicache_store.layout.manifest import manifest_key
                from hicache_store.objects.manifest import read_manifest

                found = await read_manifest(self.backend, manifest_key(namespace))
                if found is None:
                    raise UnknownNamespaceError(
                        f"the store holds no manifest of namespace {namespace} "
                        "(`hicache-store inspect URL` lists the namespaces it holds)")
                if self._weights is not None and found.model_revision != self._weights.value:
                    raise InvalidNamespaceError(
                        f"model_revision: namespace {namespace} holds the KV of weights "
                        f"{found.model_revision or '(unknown)'}, not of the model given "
                        f"({self._weights})")
                namespace = found
            elif self._weights is not None:
                namespace = dataclasses.replace(namespace, model_revision=weights_revision(
                    namespace.model_revision or None, self._weights.value))
            max_inflight, timeout = self._limits
            self._link = L3Link(self.backend, namespace, self.topology, self.rank,
                                max_inflight_bytes=max_inflight, io_timeout_s=timeout,
                                keys=self._keys)
        return self._link

    async def anamespace(self) -> Namespace:
        """The namespace read (its manifest is fetched first when given as a digest)."""
        return (await self._get_link()).namespace

    # -- reads -------------------------------------------------------------------------------------

    async def astored_pages(self, tokens: Sequence[int]) -> int:
        """How many leading full pages of ``tokens`` the store holds for this rank (existence
        only; ``aread`` verifies the bytes)."""
        link = await self._get_link()
        ns = link.namespace
        return await link.exists_prefix(page_hashes(list(tokens), ns.page_size, algo=ns.hash_algo))

    async def astored_pages_of_hashes(self, hashes: Sequence[str]) -> int:
        """How many leading pages of these chain page hashes (``layout.hashing.page_hashes``,
        unkeyed) the store holds for this rank; a sealed namespace keys them here. A hash that
        is not one raises ``InvalidKeyError``."""
        link = await self._get_link()
        return await link.exists_prefix([validate_page_hash(h) for h in hashes])

    async def aread(self, tokens: Sequence[int]) -> StoredKV:
        """The KV of the longest stored, verified prefix of ``tokens`` (whole pages)."""
        link = await self._get_link()
        ns = link.namespace
        hashes = page_hashes(list(tokens), ns.page_size, algo=ns.hash_algo)
        hashes = hashes[: await link.exists_prefix(hashes)]
        layout = link.read_plan.page
        rows = np.frombuffer(aligned_buffer(max(1, len(hashes)) * layout.page_bytes),
                             dtype=np.uint8).reshape(max(1, len(hashes)), layout.page_bytes)
        io = IOStats()
        ok = await gather_settled(*(link.read_page(h, rows[i], io) for i, h in enumerate(hashes)))
        pages = ok.index(False) if False in ok else len(ok)
        return _tensors(link, rows[:pages], pages, io.corruptions)

    def stored_pages(self, tokens: Sequence[int]) -> int:
        """``astored_pages`` from synchronous code."""
        return _sync.run_sync(self.astored_pages(tokens))

    def stored_pages_of_hashes(self, hashes: Sequence[str]) -> int:
        """``astored_pages_of_hashes`` from synchronous code."""
        return _sync.run_sync(self.astored_pages_of_hashes(hashes))

    def read(self, tokens: Sequence[int]) -> StoredKV:
        """``aread`` from synchronous code."""
        return _sync.run_sync(self.aread(tokens))

    def namespace(self) -> Namespace:
        """``anamespace`` from synchronous code."""
        return _sync.run_sync(self.anamespace())

    # -- lifecycle ---------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the backend if this reader opened it (idempotent)."""
        if self._owns_backend:
            await self.backend.close()

    def close(self) -> None:
        """``aclose`` from synchronous code."""
        _sync.run_sync(self.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _tensors(link: L3Link, rows: np.ndarray[Any, Any], pages: int, corruptions: int) -> StoredKV:
    """Unified host rows of a shard -> per-plane tensors ``[layers, tokens, heads, dim]``."""
    import torch

    layout = link.read_plan.page
    ns = link.namespace
    dtype = getattr(torch, ns.dtype)
    flat = torch.from_numpy(np.ascontiguousarray(rows))  # [pages, page_bytes] uint8
    planes = []
    for block in layout.blocks:
        shape = layout.block_shape(block)  # (layer, plane, token, head, dim)
        part = flat[:, block.offset : block.offset + block.nbytes].contiguous().view(dtype)
        part = part.reshape(pages, *shape).permute(2, 1, 0, 3, 4, 5)
        # -> [plane, layer, page, token, head, dim] -> [plane, layer, tokens, head, dim]
        planes.append(part.reshape(shape[1], shape[0], pages * ns.page_size, *shape[3:]))
    kv = torch.cat(planes, dim=3) if len(planes) > 1 else planes[0]
    mla = ns.kv_kind == "mla"
    return StoredKV(
        tokens=pages * ns.page_size,
        layer_start=layout.layer_start,
        layer_stop=layout.layer_stop,
        head_start=layout.head_start,
        head_stop=layout.head_stop,
        keys=None if mla else kv[0].contiguous(),
        values=None if mla else kv[1].contiguous(),
        latent=kv[0, :, :, 0].contiguous() if mla else None,
        corruptions=corruptions,
    )
