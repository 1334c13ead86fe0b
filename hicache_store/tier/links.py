"""The tier's way to L3: each component's ``L3Link`` (the namespace's manifest written where
the link writes), and the KV's host pool offered to backends that read into registered memory.

Best effort where the store is not needed for correctness: a manifest the store cannot take
leaves the namespace unknown to operators' tools, an unregistered pool makes the backend stage
through its own buffers; both are logged, neither raises.
"""

from __future__ import annotations

import logging

from hicache_store._sync import run_sync
from hicache_store.backends.base import Backend
from hicache_store.backends.protocols import HostBuffers
from hicache_store.layout.namespace import Namespace
from hicache_store.layout.topology import Topology
from hicache_store.objects import L3Link
from hicache_store.objects.manifest import ensure_manifest
from hicache_store.tenant import KeyRing

from .config import TierConfig
from .host_pool import HostPagePool

log = logging.getLogger(__name__)


def open_link(
    backend: Backend,
    namespace: Namespace,
    topology: Topology,
    rank: int,
    config: TierConfig,
    keys: KeyRing | None,
    *,
    tag: int,
    read_only: bool,
) -> L3Link:
    """The L3 link of component ``tag`` on ``rank``; a link that writes records ``namespace``
    in L3 (``M_{digest}``) so operators' tools can describe it."""
    link = L3Link.for_component(
        backend, namespace, topology, rank, config, keys=keys, component=tag,
        read_only=read_only,
    )
    link.trusted_hashes = True  # the tier hashes tokens itself
    if link.can_write:
        try:
            run_sync(ensure_manifest(backend, namespace), timeout=config.io_timeout_s)
        except Exception as exc:
            log.warning("could not write the namespace manifest: %s", exc)
    return link


def register_host_pool(backend: Backend, host: HostPagePool, timeout: float) -> HostBuffers | None:
    """Offer ``host`` to a backend that reads into registered memory without a copy
    (``capabilities.host_buffers``: Mooncake's ``register_buffer``, 3FS's USRBIO iovec); where
    it went, or ``None``. Best effort: unregistered, the backend stages through its own
    buffers."""
    if not backend.capabilities.host_buffers or host.num_pages == 0:
        return None
    buffers = backend.host_buffers()
    try:
        run_sync(buffers.register(host.data.numpy().data), timeout=timeout)
    except Exception as exc:
        log.warning("could not register the host pool with the backend: %s", exc)
        return None
    return buffers


def unregister_host_pool(buffers: HostBuffers, host: HostPagePool, timeout: float) -> None:
    """Take back what ``register_host_pool`` offered to ``buffers``."""
    try:
        run_sync(buffers.unregister(host.data.numpy().data), timeout=timeout)
    except Exception as exc:
        log.warning("could not unregister the host pool: %s", exc)
