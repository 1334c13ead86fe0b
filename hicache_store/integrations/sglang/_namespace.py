"""The adapter's namespace in the store: reported at start, and a warning when it keeps missing.

A populated store that never hits is the failure operators cannot see from SGLang: the adapter
derives a namespace (model id, dtype, page size, grid, salt, ...) and a store prepopulated or
written under another one simply has no objects for it. So, at registration, the adapter logs
its namespace and whether the store holds its manifest (a writing rank stores it then, in this
library's keyspace, so that ``hicache-store inspect`` / ``doctor`` see what SGLang writes); and if lookups keep finding
nothing (``MISSES_BEFORE_CHECK`` exists calls without a single hit) while the store holds the
same model (same model id, or same KV shape) under another namespace, it warns once, naming
the fields that differ and the ``doctor`` command to run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hicache_store.backends.base import Backend
from hicache_store.layout.namespace import Namespace, namespace_differences

log = logging.getLogger(__name__)
T = TypeVar("T")

#: exists calls with no hit at all before the store's other namespaces are looked at.
MISSES_BEFORE_CHECK = 16


class NamespaceWatch:
    """One rank's namespace: a start-up report and at most one "keeps missing" warning."""

    def __init__(self, backend: Backend, namespace: Namespace,
                 run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self.backend = backend
        self.namespace = namespace
        self._run = run
        self._lock = threading.Lock()
        self._misses = 0
        self._settled = False  # a hit was seen, or the check has run: nothing more to do

    def at_start(self, *, writes: bool) -> str:
        """Whether the store holds this namespace's manifest (``stored``, ``stored now``,
        ``not stored``, or ``unknown`` when the store could not answer); written if ``writes``."""
        from hicache_store.layout.manifest import manifest_key
        from hicache_store.objects.manifest import ensure_manifest, read_manifest

        try:
            if self._run(read_manifest(self.backend, manifest_key(self.namespace))) is not None:
                return "stored"
            # In SGLang's own keyspace (key_scheme sglang-ukv1) the store holds exactly what
            # SGLang would write: the manifest is only looked up there, never added.
            if writes and self.namespace.key_scheme == "hicache":
                self._run(ensure_manifest(self.backend, self.namespace))
                return "stored now"
            return "not stored"
        except Exception as exc:  # a start-up report must never stop the server
            log.warning("hicache-store: could not look up the namespace manifest: %s", exc)
            return "unknown"

    def observe(self, hits: int, asked: int) -> None:
        """Count one exists call; after enough calls without any hit, check the store once."""
        with self._lock:
            if self._settled or asked == 0:
                return
            if hits:
                self._settled = True
                return
            self._misses += 1
            if self._misses < MISSES_BEFORE_CHECK:
                return
            self._settled = True
        self._check()

    def _check(self) -> None:
        from hicache_store.objects.manifest import list_manifests, read_manifest

        if not self.backend.capabilities.listing:
            return
        mine = self.namespace
        try:
            keys = self._run(list_manifests(self.backend))
            stored = [self._run(read_manifest(self.backend, key)) for key in keys]
        except Exception as exc:
            log.debug("hicache-store: listing namespaces failed: %s", exc)
            return
        same_model = [ns for ns in stored if ns is not None and ns.digest != mine.digest
                      and (ns.model == mine.model or ns.shape == mine.shape)]
        if not same_model:
            return
        nearest = min(same_model, key=lambda ns: len(namespace_differences(mine, ns)))
        fields = "; ".join(str(d) for d in namespace_differences(mine, nearest))
        log.warning(
            "hicache-store: %d lookups in namespace %s found nothing, but the store holds %s "
            "under namespace %s (%s). Run `hicache-store doctor URL` with this deployment's "
            "extra-config to see what to change.",
            MISSES_BEFORE_CHECK, mine.digest, nearest.model, nearest.digest, fields,
        )
