"""Why does a deployment not hit? What a store holds against what a deployment will look for.

``diagnose`` answers three questions an operator asks when a populated store gives zero hits:

1. which namespaces the store holds (their manifests, ``ops.manifest``);
2. which namespace the deployment uses, whether the store holds it, and if not, the nearest
   stored namespace and the fields that differ (model id, dtype, page size, grid, salt, ...):
   inputs the operator did not give are taken from each stored namespace in turn, so they
   never count as a difference, and the nearest is the one with the fewest differences;
3. how much of a prompt file would hit: for each prompt, the leading full pages that every
   rank of the deployment's topology finds (the minimum over ranks, as the ranks agree).

A backend that cannot list keys (Mooncake) shows no namespace list: only the deployment's own
manifest is looked up, which needs a fully given deployment (shape included).

For a file-layout root (``file://``, ``hf3fs://``), ``site_of`` also says where it lives: the
filesystem type of the root (a network or FUSE one takes ``index=none`` or an explicit
``index=sqlite``), its index, and the host its index records, read without opening the store,
so that a store whose open is refused (another host, a network filesystem) is still described.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache_store.backends import RootSite, get_backend_class
from hicache_store.backends.base import Backend
from hicache_store.backends.index import IndexCheck
from hicache_store.backends.types import BackendURL
from hicache_store.layout.namespace import Difference, Namespace
from hicache_store.reader import KVReader

from .deployment import Deployment
from .manifest import ManifestError, list_manifests, manifest_key, read_manifest

__all__ = ["Diagnosis", "PromptHit", "diagnose", "site_of"]


@dataclass(frozen=True)
class PromptHit:
    """One prompt: its tokens and how many leading tokens every rank would find stored."""

    origin: str
    tokens: int
    hit_tokens: int


@dataclass
class Diagnosis:
    """What ``diagnose`` found (see the module docstring)."""

    namespaces: list[Namespace] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)  # manifest keys that failed to parse
    listing: bool = True
    deployment: Namespace | None = None  # the deployment's namespace (unknowns completed)
    found: bool = False  # the store holds the deployment's manifest
    nearest: Namespace | None = None
    differences: list[Difference] = field(default_factory=list)
    prompts: list[PromptHit] = field(default_factory=list)
    site: RootSite | None = None  # a file-layout root's filesystem and host (``site_of``)
    refused: str | None = None  # why the store's open was refused (then nothing else is known)
    index: IndexCheck | None = None  # the store's index against a listing (``check_index``)

    @property
    def hit_tokens(self) -> int:
        return sum(p.hit_tokens for p in self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(p.tokens for p in self.prompts)


async def diagnose(
    backend: Backend,
    deployment: Deployment | None,
    prompts: Sequence[tuple[str, Sequence[int]]] = (),
) -> Diagnosis:
    """Look at ``backend`` for ``deployment`` (None: only list) and ``prompts`` (origin, ids)."""
    result = Diagnosis(listing=backend.capabilities.listing)
    result.index = await backend.check_index()
    if result.listing:
        for key in await list_manifests(backend):
            try:
                found = await read_manifest(backend, key)
            except ManifestError:
                result.unreadable.append(key)
                continue
            if found is not None:
                result.namespaces.append(found)
    if deployment is None:
        return result
    if result.namespaces:
        ranked = sorted(result.namespaces, key=lambda ns: len(deployment.differences(ns)))
        result.nearest = ranked[0]
        result.differences = deployment.differences(ranked[0])
        result.deployment = deployment.completed_by(ranked[0])
    elif deployment.shape is not None:
        try:
            result.deployment = deployment.namespace()
        except ValueError:
            result.deployment = None
    if result.deployment is not None:
        result.found = result.deployment in result.namespaces or (
            not result.listing
            and await read_manifest(backend, manifest_key(result.deployment)) is not None)
        if result.found:
            result.differences = []
            result.nearest = result.deployment
        if prompts:
            result.prompts = await _prompt_hits(backend, result.deployment, deployment, prompts)
    return result


def site_of(url: str) -> RootSite | None:
    """Where the root of a URL lives (``Backend.root_site``: file-layout roots); None for the
    others."""
    if "://" not in url:
        return None  # a bare backend name: not a file-layout root
    parsed = BackendURL.parse(url)
    return get_backend_class(parsed.scheme).root_site(parsed)


async def _prompt_hits(
    backend: Backend, namespace: Namespace, deployment: Deployment,
    prompts: Sequence[tuple[str, Sequence[int]]],
) -> list[PromptHit]:
    topology = deployment.topology
    keys = deployment.keys if namespace.sealed else None  # keyed page names: the ring's
    readers = [KVReader(backend, namespace, topology, rank, keys=keys)
               for rank in range(topology.world_size)]
    hits = []
    for origin, tokens in prompts:
        pages = min([await r.astored_pages(tokens) for r in readers])
        hits.append(PromptHit(origin, len(tokens), pages * namespace.page_size))
    return hits
