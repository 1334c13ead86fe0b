"""Which weights an SGLang server serves: the revision in the namespace, and when it moves.

The adapter's and the linker's namespaces carry ``layout.namespace.weights_revision``: the
extra-config's ``model_revision`` when it is set, else the identity of the model's files
(``hicache_store.weights``) at SGLang's model path (its runtime context's
``get_model().model_path``, ``revision`` and ``download_dir``, published in the scheduler
process where both run; else SGLang's ``model_name``, the ``--model-path`` as given unless
``--served-model-name`` is set). Where neither names files this host holds, the identity is
unknown: the namespace is what it was without one, and the start-up log says so.

**Online weight updates** (``WeightsWatch.current``, read on every call: a few attribute reads).
SGLang 0.5.23 records an update in its runtime context: ``update_weights_from_disk`` logs the
new model path (``ModelRunner.update_model_fields``), and every ``update_weights_from_*`` that
carries a ``weight_version`` sets ``serving.weight_version``
(``Scheduler.record_weight_version_change``). When either moved, the identity is derived
again: the files at the (new) path, and a ``weight_version`` other than SGLang's
``"default"`` as the update's label (``updated_weights``), so pages stored before the update
miss. An update from tensors, a process group or IPC without a ``weight_version`` leaves no
record the adapter can see: pass ``weight_version`` with it (a label that names the weights,
the same on every rank), or call the adapter's ``weights_updated`` (the linker's too).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hicache_store.layout.errors import WeightsError
from hicache_store.layout.namespace import updated_weights, weights_revision
from hicache_store.weights import WeightsIdentity, revision_source, weights_identity

log = logging.getLogger(__name__)

#: SGLang's ``--weight-version`` when none is given: not an update.
DEFAULT_WEIGHT_VERSION = "default"


@dataclass(frozen=True)
class ServedModel:
    """What SGLang's runtime context says of the served weights (``served_model``)."""

    model_path: str | None
    revision: str | None
    download_dir: str | None
    weight_version: str | None
    reloads: int  # disk reloads logged (``update_model_fields`` overrides)


def served_model() -> ServedModel | None:
    """SGLang's record of the served weights, or None where its runtime context is not
    published (another process, a test without one, SGLang absent)."""
    try:
        from sglang.srt.runtime_context import (  # type: ignore[import-untyped]
            get_context,
            get_model,
            get_serving,
        )

        model, serving = get_model(), get_serving()
        reloads = sum(1 for _source, fields in get_context().overrides_log()
                      if "model_path" in fields)
        return ServedModel(
            _text(getattr(model, "model_path", None)), _text(getattr(model, "revision", None)),
            _text(getattr(model, "download_dir", None)),
            _text(getattr(serving, "weight_version", None)), reloads,
        )
    except Exception:  # not published here: the start-up inputs are all there is
        return None


class WeightsWatch:
    """The revision of one SGLang process's namespace, followed across weight updates."""

    def __init__(
        self, explicit: str | None, model_name: str | None,
        record: Callable[[], ServedModel | None] = served_model,
    ) -> None:
        """``explicit``: the extra-config's ``model_revision`` (None: not set); ``model_name``:
        SGLang's ``model_name``, used when its runtime context names no model path."""
        self._explicit = explicit
        self._model_name = model_name
        self._record = record
        self._lock = threading.Lock()
        self._seen: ServedModel | None = None
        self._bump: str | None = None  # the label of the last ``bump`` since the last reload
        self.identity: WeightsIdentity | None = None
        self.revision = ""
        self._derive(record(), initial=True)

    def current(self) -> str:
        """The revision now: derived again when SGLang recorded an update since the last call."""
        seen = self._record()
        if seen != self._seen:
            with self._lock:
                if seen != self._seen:
                    self._derive(seen)
        return self.revision

    def bump(self, label: str | None = None) -> str:
        """An update SGLang does not record: the revision moves to ``updated_weights(..,
        label)``; ``label`` None is a random one (then no other process shares it: TP ranks
        each get their own, and their pages miss until every rank's label agrees)."""
        with self._lock:
            self._bump = label or uuid.uuid4().hex[:16]
            self._derive(self._seen)
            return self.revision

    def describe(self) -> str:
        """Where the revision comes from, for the start-up log and ``doctor``."""
        source = revision_source(self._explicit, self.identity, given="from the extra-config",
                                 engine_model="SGLang's model path")
        labels = self._labels()
        return source + (f", updated as {'+'.join(labels)}" if labels else "")

    def _labels(self) -> list[str]:
        seen = self._seen
        version = seen.weight_version if seen is not None else None
        return [label for label in (None if version == DEFAULT_WEIGHT_VERSION else version,
                                    self._bump) if label]

    def _derive(self, seen: ServedModel | None, *, initial: bool = False) -> None:
        """Derive the revision from ``seen``; at start a ``WeightsError`` is raised (the server
        must not start), after an update an unidentifiable model gets a random label (its
        pages share nothing, and nothing stored before is served)."""
        if seen is not None and self._seen is not None and seen.reloads != self._seen.reloads:
            self._bump = None  # reloaded from disk: the files say it all again
        if self._explicit is None:
            known = self.identity is not None
            try:
                self.identity = self._identify(seen)
            except WeightsError as exc:
                if initial:
                    raise
                log.warning("hicache-store: the updated weights cannot be identified (%s); "
                            "their KV shares nothing with any other", exc)
                self.identity = None
            if self.identity is None and known:
                self._bump = uuid.uuid4().hex[:16]
        self._seen = seen
        base = weights_revision(self._explicit, self.identity.value if self.identity else None)
        labels = self._labels()
        self.revision = updated_weights(base, "+".join(labels)) if labels else base

    def _identify(self, seen: ServedModel | None) -> WeightsIdentity | None:
        path = seen.model_path if seen is not None and seen.model_path else self._model_name
        if not path:
            return None
        hub = seen.download_dir if seen is not None else None
        return weights_identity(path, seen.revision if seen is not None else None,
                                hub_cache=Path(hub) if hub else None)


def _text(value: object) -> str | None:
    return None if value is None else str(value)
