"""Which weights a vLLM engine serves: the revision in the connector's and the tier's namespaces.

Both carry ``layout.namespace.weights_revision``: their ``model_revision`` when it is set, else
the identity of vLLM's model files (``hicache_store.weights``: ``model_config.model``, a
directory or a hub id, at ``model_config.revision`` in ``load_config.download_dir``), else
nothing (the start-up log says the identity is unknown).

**Weight updates.** vLLM 0.32 reloads or receives weights in its workers
(``collective_rpc("reload_weights")``, the weight-transfer API's ``update_weights``) and tells
neither the KV connector nor the offloading tiers. What it does call is the scheduler-side
connector's ``reset_cache`` (``reset_prefix_cache(reset_connector=True)``, and
``pause_generation(clear_cache=True)``, the pause RL frameworks put around a weight sync), which
reaches a secondary tier as ``drain_jobs`` (the offloading manager's ``reset_cache``). The
connector and the tier take that reset as "the weights may have changed" (they cannot tell
it from a plain reset): the revision moves to ``updated_weights(files, <random label>)``, so
everything stored before misses for this engine and nothing stored after is shared with
anyone else. The workers follow the scheduler's revision, which travels with every step's
metadata. So after updating weights without such a pause, call
``reset_prefix_cache(reset_connector=True)``: nothing else tells the connector.

``keep_revision_on_reset`` (connector extra-config key, tier option) turns the move off, for
deployments whose resets never change the weights (a sleep and wake-up, an operator emptying
the local tiers to read from the store): stored KV is then served across resets, also after a
weight update.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from hicache_store.layout.namespace import updated_weights, weights_revision
from hicache_store.weights import WeightsIdentity, revision_source, weights_identity


class Revision:
    """A vLLM component's weights revision: the base (explicit, or the files') and the label
    of the last reset, if any."""

    def __init__(self, explicit: str | None, identity: WeightsIdentity | None, *,
                 keep_on_reset: bool = False) -> None:
        self.explicit = explicit
        self.identity = identity
        self.keep_on_reset = keep_on_reset
        self.base = weights_revision(explicit, identity.value if identity else None)
        self.current = self.base
        self.resets = 0

    def reset(self) -> str:
        """A connector reset: a new random label on the base revision (never chained), or
        the same revision with ``keep_on_reset``."""
        if self.keep_on_reset:
            return self.current
        self.resets += 1
        self.current = updated_weights(self.base, f"reset-{uuid.uuid4().hex[:12]}")
        return self.current

    def describe(self) -> str:
        """Where the revision comes from, for the start-up log."""
        source = revision_source(self.explicit, self.identity, given="as configured",
                                 engine_model="vLLM's model")
        if self.keep_on_reset:
            return source + ", kept across connector resets"
        return source + (f", {self.resets} connector reset(s) since start" if self.resets else "")


def model_identity(model: str, model_config: Any = None,
                   load_config: Any = None) -> WeightsIdentity | None:
    """The identity of the weights vLLM loads as ``model``: at ``model_config.revision`` and
    in ``load_config.download_dir`` when those are given (and ``model_config`` is of
    ``model``)."""
    revision = None
    if model_config is not None and str(getattr(model_config, "model", "")) == model:
        revision = getattr(model_config, "revision", None)
    download = getattr(load_config, "download_dir", None) if load_config is not None else None
    return weights_identity(model, revision, hub_cache=Path(download) if download else None)
