"""The namespace a deployment reads and writes, derived the way the SGLang adapter derives it.

Stored KV is found only under the namespace it was written for (model id, KV shape, dtype, page
size, grid, replication, hash algorithm, tenant salt, sealed or not). The SGLang adapter derives
its namespace at start from four sources:

* SGLang's ``model_name``: its ``--served-model-name``, which defaults to the ``--model-path``
  string exactly as given (``/models/llama``, ``meta-llama/Llama-3.1-8B``); the extra-config's
  ``"model"`` overrides it;
* the host pool: KV shape, dtype (``"kv_dtype"`` overrides it) and page size;
* the extra-config: ``grid`` (else the coarsest grid the deployment's topology and its
  ``share_with`` topologies can all write: ``AdapterConfig.grid_for``), ``tenant_salt``,
  ``model_revision``;
* the model's files: without ``model_revision``, the identity of the weights SGLang loads
  (``hicache_store.weights``: the hub snapshot commit, else a fingerprint) is the revision;
* the tenant key ring (``tenant_key_file``, else ``$HICACHE_STORE_TENANT_KEY_FILE`` /
  ``$HICACHE_STORE_TENANT_KEY``: ``deployment_keys``): with one, the namespace is sealed.

``Deployment`` holds what an operator knows of these, any of it possibly unknown, so that
``prepopulate`` writes under the namespace the engine will look in, and ``doctor`` can name the
fields in which a deployment differs from what a store holds. Both parse the extra-config with
the adapter's own parser (``hicache_store.sglang_config.AdapterConfig``), so a typo fails the
same way everywhere.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from hicache_store.layout.namespace import (
    Difference,
    Grid,
    ModelShape,
    Namespace,
    namespace_differences,
    weights_revision,
)
from hicache_store.layout.topology import Topology
from hicache_store.sglang_config import AdapterConfig
from hicache_store.tenant import KeyRing, load_key_ring
from hicache_store.weights import WeightsIdentity


def load_extra_config(text: str) -> dict[str, Any]:
    """SGLang's ``--hicache-storage-backend-extra-config`` value: JSON text, or ``@PATH`` to a
    ``.json``, ``.toml`` or ``.yaml`` file (as SGLang reads it). Raises ``ValueError``."""
    if text.startswith("@"):
        path = Path(text[1:])
        suffix = path.suffix.lower()
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"extra-config file {path}: {exc.strerror or exc}") from None
        try:
            if suffix == ".json":
                value: Any = json.loads(raw)
            elif suffix == ".toml":
                value = tomllib.loads(raw.decode())
            elif suffix in (".yaml", ".yml"):
                import yaml  # type: ignore[import-untyped]

                value = yaml.safe_load(raw)
            else:
                raise ValueError(f"extra-config file {path}: use .json, .toml or .yaml")
        except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"extra-config file {path}: {exc}") from None
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"extra-config is not JSON ({exc.msg}); give JSON or @FILE") from None
    if not isinstance(value, dict):
        raise ValueError("extra-config must be a JSON object")
    return value


def parse_adapter_config(extra: Mapping[str, Any] | None) -> AdapterConfig:
    """The adapter's parse of ``extra`` (its ``url`` is optional here: tools take the URL as an
    argument). Unknown keys are errors, as in the adapter."""
    values = dict(extra or {})
    if "url" not in values and "backend" not in values:
        values["url"] = "memory://"  # a placeholder: only the namespace fields are used
    return AdapterConfig.from_extra_config(values)


def merge_extra_config(
    extra_text: str | None,
    flags: Mapping[str, tuple[str, Any]],
    share_with: Sequence[str] = (),
) -> AdapterConfig:
    """The extra-config (``load_extra_config`` text, or None) with command-line values merged.

    ``flags`` maps extra-config keys to ``(flag name, value)``; a value of None was not given.
    A given value that contradicts the extra-config is a ``ValueError`` naming both (one of them
    is not what the engine runs); ``share_with`` topologies are added to the extra-config's.
    """
    extra = load_extra_config(extra_text) if extra_text else {}
    for key, (flag, value) in flags.items():
        if value is None:
            continue
        if extra.get(key) not in (None, value):
            raise ValueError(f"{flag} {value!r} differs from the extra-config's {key}")
        extra[key] = value
    if share_with:
        listed = extra.get("share_with")
        listed = [] if listed is None else [listed] if isinstance(listed, str) else list(listed)
        extra["share_with"] = [*listed, *share_with]
    return parse_adapter_config(extra)


def deployment_keys(
    config: AdapterConfig, path: str | None = None, environ: Mapping[str, str] | None = None
) -> KeyRing | None:
    """The tenant key ring a deployment runs with, found the adapter's way: ``path`` (a
    tool's ``--tenant-key-file``), else the extra-config's ``tenant_key_file``, else the
    environment. None: not sealed. Raises ``ValueError`` for an unreadable ring."""
    return load_key_ring(path or config.tenant_key_file, environ)


@dataclass(frozen=True)
class Deployment:
    """What is known of a deployment's namespace inputs (``None``: unknown).

    ``model_id`` is SGLang's ``model_name``; ``dtype`` the host pool's KV dtype; ``topology``
    the deployment's TP x PP (used for the default grid); ``config`` the parsed extra-config;
    ``keys`` the tenant key ring (``deployment_keys``): with one, the namespace is sealed, as
    the adapter's is; ``weights`` the identity of the model's files (``weights_identity`` of
    the directory the engine loads), which the extra-config's ``model_revision`` overrides.
    """

    config: AdapterConfig = field(default_factory=lambda: parse_adapter_config(None))
    model_id: str | None = None
    dtype: str | None = None
    page_size: int | None = None
    topology: Topology = field(default_factory=Topology)
    shape: ModelShape | None = None
    hash_algo: str = "sha256"
    keys: KeyRing | None = None
    weights: WeightsIdentity | None = None

    @property
    def model_revision(self) -> str | None:
        """The namespace's revision (``weights_revision``); None: unknown (neither the
        extra-config's ``model_revision`` nor the model's files are given)."""
        if self.config.model_revision is None and self.weights is None:
            return None
        return weights_revision(self.config.model_revision,
                                self.weights.value if self.weights else None)

    @property
    def model(self) -> str | None:
        """The model identity in the namespace: the extra-config's ``model``, else SGLang's."""
        return self.config.model or self.model_id

    @property
    def kv_dtype(self) -> str | None:
        return self.config.kv_dtype or self.dtype

    def grid_for(self, shape: ModelShape) -> Grid:
        return self.config.grid_for(shape, self.topology, _replication(shape))

    def namespace(self, shape: ModelShape | None = None) -> Namespace:
        """The deployment's namespace; every input must be known (``ValueError`` names the
        first that is not)."""
        shape = shape or self.shape
        model, dtype, page_size = self.model, self.kv_dtype, self.page_size
        if model is None or dtype is None or page_size is None or shape is None:
            missing = [name for name, value in (("model id", model), ("dtype", dtype),
                                                ("page size", page_size), ("model shape", shape))
                       if value is None]
            raise ValueError(f"the deployment's {', '.join(missing)} must be given")
        return Namespace.create(
            model, shape, dtype, page_size, self.grid_for(shape),
            replication=_replication(shape), model_revision=self.model_revision or "",
            hash_algo=self.hash_algo, tenant_salt=self.config.tenant_salt,
            key_scheme=self.config.key_scheme, sealed=self.keys is not None,
            kv_scales=self.config.kv_scales_for(dtype, shape.num_layers),
        )

    def completed_by(self, stored: Namespace) -> Namespace:
        """This deployment's namespace with every unknown input taken from ``stored``."""
        shape = self.shape or stored.shape
        revision = self.model_revision
        dtype = self.kv_dtype or stored.dtype
        scales = (stored.kv_scales if self.config.kv_scales is None
                  else self.config.kv_scales_for(dtype, shape.num_layers))
        return Namespace.create(
            self.model or stored.model, shape, dtype,
            self.page_size or stored.page_size, self.grid_for(shape),
            replication=_replication(shape),
            model_revision=stored.model_revision if revision is None else revision,
            hash_algo=self.hash_algo, tenant_salt=self.config.tenant_salt,
            key_scheme=self.config.key_scheme, sealed=self.keys is not None,
            kv_scales=scales,
        )

    def differences(self, stored: Namespace) -> list[Difference]:
        """The fields in which this deployment's namespace differs from ``stored`` (unknown
        inputs are taken from ``stored``, so they never differ). Empty: the same namespace."""
        return namespace_differences(self.completed_by(stored), stored)


def _replication(shape: ModelShape) -> str:
    """MLA KV is one latent per token, the same on every TP rank (only rank 0 writes)."""
    return "replicated" if shape.kv_kind == "mla" else "head_sharded"
