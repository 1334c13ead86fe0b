"""The adapter's keys in SGLang's ``--hicache-storage-backend-extra-config`` JSON, and their parser.

One parser for everything that reads the extra-config: the SGLang adapter and linker
(``integrations``) and the operator tools that derive a deployment's namespace
(``ops.deployment``), so a key means the same, and a typo fails the same way, everywhere. It sits
below both: neither imports the other.

SGLang hands the backend the whole extra-config dict (``storage_config.extra_config``) after
popping its own prefetch keys. The keys read here, all optional except ``url``:

``url``              our backend URL: ``file:///var/cache/kv``, ``s3://bucket/prefix``,
                     ``mooncake://host:port``, ``hf3fs:///mnt/3fs/kv``, ``memory``, ...
``backend_options``  a JSON object of options for that backend (``{"durability": "full"}``).
``grid``             the partition grid, ``"LxH"`` (layers per chunk x KV heads per group) or
                     ``[L, H]``. Deployments share stored KV only when their grids are equal.
``share_with``       instead of ``grid``: the other topologies that will share this store,
                     ``["tp=1,pp=1", "tp=4,pp=2"]``; the grid is the coarsest every one of
                     them and this deployment can write (``suggest_grid``).
``tenant_salt``      isolates tenants: different salts never hit each other's KV.
``tenant_key_file``  a tenant key ring (``hicache_store.tenant``): seals this deployment's KV
                     (keyed page keys, AES-256-GCM at rest) against other users of the store.
                     Without it, ``$HICACHE_STORE_TENANT_KEY_FILE`` or
                     ``$HICACHE_STORE_TENANT_KEY`` are used when set.
``model``            the model identity in the namespace (default: SGLang's ``model_name``,
                     the served model path; set it when deployments load one model from
                     different paths).
``model_revision``   the weights' revision in the namespace; default: the identity of the
                     model's files, derived (``integrations.sglang._weights``: the hub
                     snapshot commit, else a fingerprint), so other weights under the same
                     name never hit. Set it
                     where the files are not on this host; ``""`` keys no revision (only to
                     share with writers that key none: other weights are then served).
``kv_dtype``         the logical KV dtype; needed for float8 KV (SGLang stores it as uint8):
                     SGLang's ``--kv-cache-dtype`` value (``fp8_e4m3``, ``fp8_e5m2``) or the
                     torch name (``float8_e4m3fn``, ``float8_e5m2``).
``kv_scales``        required for float8 KV: the per-layer k/v scales the model's attention
                     layers quantize with (SGLang loads them from the checkpoint, 1.0 where it
                     has none), ``{"k": [...], "v": [...]}`` one number per layer of the
                     model, or one number each for every layer. Their digest is in the
                     namespace, so KV stored under other scales never hits. SGLang gives a
                     storage backend no access to its layers: float8 KV without this key is
                     refused at start-up, never stored.
``num_layers``       the model's layer count; needed with PP (a stage's pool holds only its
                     own layers). ``pp_layers``: explicit per-stage layer counts.
``num_kv_heads``     the model's KV heads; default local heads x TP size (right whenever TP
                     size <= KV heads).
``io_timeout_s``     the floor of every call's deadline (default 20 s, above every built-in
                     backend's own bound: docs/guide/backends/deadlines.md).
``min_bandwidth_mib_s`` the slowest rate a batch is given time for (default 16 MiB/s): a
                     ``batch_get_v1``, or a ``batch_set_v1`` (per ``staging_mib`` chunk),
                     moving ``n`` bytes ends within ``io_timeout_s + n / min_bandwidth``
                     (``objects.io.Deadline``), with the pages stored or loaded by then
                     ``True`` and the rest ``False``.
``staging_mib``      staging memory per SGLang thread and direction (default 256 MiB; a read
                     window takes at most 16 pages of it).
``max_inflight_mib`` bytes of reads in flight per rank (default 1024 MiB).
``key_scheme``       ``"hicache"`` (default: this library's keyspace, framed objects) or
                     ``"sglang-ukv1"``: SGLang 0.5.23's own unified keyspace
                     (``hicache_key_scheme.plan_unified_kv``), bare ``page-unified-v1``
                     objects, shared with SGLang deployments that use its native scheme.
                     There ``grid`` is SGLang's ``"{layer_partition}x{head_group}"``
                     (``"0x4"``: one object per PP stage and 4 heads); unset, SGLang's
                     defaults (one object per stage, this rank's heads). ``tenant_salt`` and
                     ``share_with`` have no place in it (SGLang salts tenants through the
                     request's ``cache_salt`` in the page hashes); the weights' revision is
                     folded into its model id (``{model}@{revision}``), so SGLang's native
                     backends share these keys only with ``"model_revision": ""``.
``object_format``    ``"framed"`` or ``"page-unified-v1"``: stated for clarity, it must be
                     the key scheme's (``framed`` for ``hicache``, ``page-unified-v1`` for
                     ``sglang-ukv1``; see ``hicache_store.objects.format`` for what bare
                     objects do not check).
``events_endpoint``  publish KV events (vLLM's wire format, medium ``STORAGE``) of the pages
                     this server stores in L3, from TP rank 0 of PP stage 0, on this ZMQ
                     address (default: off; the ``events`` extra). ``events_replay_endpoint``,
                     ``events_topic``, ``events_history``: the replay socket, the topic and
                     the batches held for replay (``hicache_store.events.publisher``).
``allow_clear``      ``true`` lets SGLang's ``clear()`` (``POST /hicache/storage-backend/clear``,
                     a P/D role switch) delete this namespace's objects; default ``false``:
                     a shared store is never wiped by one server.

Without ``grid`` and ``share_with`` the grid is the coarsest this deployment's own topology
can write (one object per page per writing rank). That is the fastest choice but only other
deployments configured with the same grid share it, so for topology-free sharing set ``grid``
(or the same ``share_with``) on every deployment: e.g. ``"grid": "1x1"`` is writable and
readable by every topology, at one object per (layer, head) per page.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache_store.events.publisher import PublisherConfig
from hicache_store.layout.errors import ConfigError, HiCacheStoreError
from hicache_store.layout.namespace import Grid, ModelShape, check_kv_scales, kv_scales_digest
from hicache_store.layout.plans import suggest_grid
from hicache_store.layout.topology import Topology
from hicache_store.layout.ukv1 import ukv1_grid
from hicache_store.objects.io import DEFAULT_IO_TIMEOUT_S, DEFAULT_MIN_BANDWIDTH_MIB_S

#: keys SGLang itself reads from the same JSON (ignored here, never an error). Any other key
#: that is not in ``ADAPTER_KEYS`` is refused: a typo must not silently change the namespace.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "prefetch_timeout_max",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
ADAPTER_KEYS = frozenset(
    {
        "url",
        "backend",
        "backend_options",
        "grid",
        "share_with",
        "tenant_salt",
        "tenant_key_file",
        "model",
        "model_revision",
        "kv_dtype",
        "kv_scales",
        "num_layers",
        "pp_layers",
        "num_kv_heads",
        "io_timeout_s",
        "min_bandwidth_mib_s",
        "staging_mib",
        "max_inflight_mib",
        "allow_clear",
        "key_scheme",
        "object_format",
        "events_endpoint",
        "events_replay_endpoint",
        "events_topic",
        "events_history",
    }
)


def parse_grid(value: Any) -> Grid:
    """``"30x2"`` or ``[30, 2]``: layers per chunk x KV heads per group.

    A bare number (``"30"``) is layers per chunk with one KV head per group.
    """
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", value)
        if match is None:
            raise ConfigError(f"grid: {value!r} is not 'LxH' (e.g. '30x2')")
        return Grid(int(match[1]), int(match[2] or 1))
    if isinstance(value, list | tuple) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return Grid(int(value[0]), int(value[1]))
    raise ConfigError(f"grid: {value!r} is not 'LxH' or [L, H]")


@dataclass(frozen=True)
class AdapterConfig:
    """The parsed extra-config (see the module docstring for each key)."""

    backend: dict[str, Any]
    grid: Grid | None = None
    share_with: tuple[Topology, ...] = ()
    tenant_salt: str = ""
    tenant_key_file: str | None = None
    model: str | None = None
    model_revision: str | None = None  # None: derived from the model's files
    kv_dtype: str | None = None
    #: the ``kv_scales`` key as given: k scales, v scales (one each: every layer's).
    kv_scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    num_layers: int | None = None
    pp_layers: tuple[int, ...] | None = None
    num_kv_heads: int | None = None
    io_timeout_s: float = DEFAULT_IO_TIMEOUT_S
    min_bandwidth_mib_s: float = DEFAULT_MIN_BANDWIDTH_MIB_S
    staging_bytes: int = 256 << 20
    max_inflight_bytes: int = 1 << 30
    allow_clear: bool = False
    key_scheme: str = "hicache"
    events: PublisherConfig | None = None

    def grid_for(self, shape: ModelShape, topology: Topology, replication: str) -> Grid:
        """The deployment's grid: ``grid`` if set, else the coarsest grid ``topology`` and every
        ``share_with`` topology can write (``suggest_grid``). The one rule the adapter and the
        operator tools (``prepopulate``, ``doctor``) share, so they agree on the namespace.

        In SGLang's ukv1 keyspace ``grid`` is its layer partition x head group, and unset means
        SGLang's defaults for ``topology`` (``ukv1_grid``)."""
        if self.key_scheme == "sglang-ukv1":
            given = self.grid
            return ukv1_grid(
                shape,
                topology,
                layer_partition=None if given is None else given.layers_per_chunk,
                head_group=None if given is None else given.heads_per_group,
            )
        if self.grid is not None:
            return self.grid
        return suggest_grid(shape, [topology, *self.share_with], replication)

    def kv_scales_for(self, dtype: str, num_layers: int) -> str:
        """The namespace's ``kv_scales`` for a deployment of ``num_layers`` layers (the model's,
        not a PP stage's) keeping ``dtype`` KV: the one rule the adapter and the operator tools
        share. Raises ``ConfigError`` (one line naming ``kv_scales``) for a float8 dtype
        without scales or scales for another layer count."""
        if self.kv_scales is None:
            try:
                check_kv_scales(dtype, "", setting=_KV_SCALES_SETTING)
            except ValueError as exc:
                raise ConfigError(f"extra-config: {exc}") from None
            return ""
        k, v = self.kv_scales
        if len(k) == 1 and len(v) == 1:
            k, v = k * num_layers, v * num_layers
        if len(k) != num_layers or len(v) != num_layers:
            raise ConfigError(
                f'extra-config: "kv_scales" holds {len(k)} k and {len(v)} v scales for a model '
                f"of {num_layers} layers; give one per layer, or one each for every layer"
            )
        try:
            return kv_scales_digest(k, v)
        except ValueError as exc:
            raise ConfigError(f'extra-config: "kv_scales": {exc}') from None

    def topology(self, tp_size: int, pp_size: int, num_layers: int) -> Topology:
        """The deployment's topology, its PP stages as SGLang splits them (``pp_layers``, else
        ``sglang_stage_sizes``)."""
        stages = self.pp_layers or (
            sglang_stage_sizes(num_layers, pp_size) if pp_size > 1 else None
        )
        return Topology(tp_size, pp_size, stages)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | str | None) -> AdapterConfig:
        """Parse SGLang's extra-config dict (or its JSON text).

        Raises ``ConfigError``: one line naming the key and the value (a misspelled key with
        its close spellings), for every mistake, a value of the wrong type included.
        """
        try:
            return cls._parse_extra_config(extra)
        except HiCacheStoreError:
            raise
        except (ValueError, TypeError) as exc:  # a value of the wrong type (float("x"), ...)
            raise ConfigError(f"extra-config: {' '.join(str(exc).split())}") from exc

    @classmethod
    def _parse_extra_config(cls, extra: Mapping[str, Any] | str | None) -> AdapterConfig:
        if isinstance(extra, str):
            extra = json.loads(extra)
        if not isinstance(extra, Mapping):
            raise ConfigError(
                "the hicache-store SGLang backend needs --hicache-storage-backend-extra-config "
                'with at least {"url": ...}'
            )
        if "url" not in extra and "backend" not in extra:
            raise ConfigError('extra-config: "url" (our backend URL, e.g. "file:///kv") is required')
        options = extra.get("backend_options") or {}
        if not isinstance(options, Mapping):
            raise ConfigError("extra-config: backend_options must be a JSON object")
        backend: dict[str, Any] = dict(options)
        for key in ("url", "backend"):
            if key in extra:
                backend[key] = extra[key]
        grid = parse_grid(extra["grid"]) if extra.get("grid") is not None else None
        share = extra.get("share_with") or ()
        if isinstance(share, str):
            share = [share]
        pp_layers = extra.get("pp_layers")
        _refuse_unknown_keys(extra)
        return cls(
            backend=backend,
            grid=grid,
            share_with=tuple(Topology.parse(str(t)) for t in share),
            tenant_salt=str(extra.get("tenant_salt", "")),
            tenant_key_file=str(extra["tenant_key_file"]) if extra.get("tenant_key_file") else None,
            model=str(extra["model"]) if extra.get("model") else None,
            model_revision=(None if extra.get("model_revision") is None
                            else str(extra["model_revision"])),
            kv_dtype=_kv_dtype(extra.get("kv_dtype")),
            kv_scales=_kv_scales(extra.get("kv_scales")),
            num_layers=_optional_int(extra, "num_layers"),
            pp_layers=tuple(int(n) for n in pp_layers) if pp_layers else None,
            num_kv_heads=_optional_int(extra, "num_kv_heads"),
            io_timeout_s=_number(extra, "io_timeout_s", DEFAULT_IO_TIMEOUT_S),
            min_bandwidth_mib_s=_number(
                extra, "min_bandwidth_mib_s", DEFAULT_MIN_BANDWIDTH_MIB_S
            ),
            staging_bytes=int(_number(extra, "staging_mib", 256) * (1 << 20)),
            max_inflight_bytes=int(_number(extra, "max_inflight_mib", 1024) * (1 << 20)),
            allow_clear=_optional_bool(extra, "allow_clear"),
            key_scheme=_key_scheme(extra),
            events=_events(extra),
        )


def _events(extra: Mapping[str, Any]) -> PublisherConfig | None:
    """The KV event publisher the ``events_*`` keys ask for (None: off)."""
    endpoint = extra.get("events_endpoint")
    if not endpoint:
        if extra.get("events_replay_endpoint"):
            raise ConfigError("extra-config: events_replay_endpoint needs events_endpoint")
        return None
    replay = extra.get("events_replay_endpoint")
    return PublisherConfig(
        str(endpoint), str(replay) if replay else None, topic=str(extra.get("events_topic", "")),
        history=int(extra.get("events_history", 10_000)),
    )


def _refuse_unknown_keys(extra: Mapping[str, Any]) -> None:
    """A key neither SGLang nor the adapter reads is a typo: refuse it, never ignore it.

    Ignoring ``"tenant-salt"`` would put a tenant into the shared unsalted namespace, and a
    misspelled ``"grid"`` would give a deployment a grid nobody else shares (zero hits).
    """
    unknown = sorted(str(k) for k in extra if k not in ADAPTER_KEYS | SGLANG_KEYS)
    if not unknown:
        return
    known = sorted(ADAPTER_KEYS)
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key.replace("-", "_"), known, n=1, cutoff=0.6)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ConfigError(
        f"extra-config: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(parts)}; the "
        f"hicache-store keys are {', '.join(known)} (backend options go in backend_options)"
    )


#: SGLang's ``--kv-cache-dtype`` spellings, as the logical dtype names of the namespace.
KV_DTYPE_ALIASES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "bf16": "bfloat16"}


def _kv_dtype(value: Any) -> str | None:
    """``kv_dtype``: a torch name (``float8_e4m3fn``) or SGLang's flag value (``fp8_e4m3``)."""
    if not value:
        return None
    return KV_DTYPE_ALIASES.get(str(value), str(value))


_KV_SCALES_SETTING = (
    '"kv_scales" in the extra-config ({"k": [...], "v": [...]}, the scales SGLang loads '
    "from the checkpoint, 1.0 where it has none)"
)


def _kv_scales(value: Any) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """``kv_scales``: ``{"k": ..., "v": ...}``, each a number or a list of numbers."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"k", "v"}:
        raise ConfigError(
            f'extra-config: "kv_scales" must be {{"k": [...], "v": [...]}}, got {value!r}'
        )

    def scales(name: str) -> tuple[float, ...]:
        given = value[name]
        items = given if isinstance(given, list) else [given]
        if not items or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) for x in items
        ):
            raise ConfigError(
                f'extra-config: "kv_scales" {name!r} must be a number or a list of numbers, '
                f"got {given!r}"
            )
        return tuple(float(x) for x in items)

    return scales("k"), scales("v")


#: the object format each key scheme stores.
OBJECT_FORMATS = {"hicache": "framed", "sglang-ukv1": "page-unified-v1"}


def _key_scheme(extra: Mapping[str, Any]) -> str:
    scheme = str(extra.get("key_scheme", "hicache"))
    if scheme not in OBJECT_FORMATS:
        raise ConfigError(
            f"extra-config: key_scheme {scheme!r} is not one of {', '.join(OBJECT_FORMATS)}"
        )
    fmt = extra.get("object_format", OBJECT_FORMATS[scheme])
    if fmt != OBJECT_FORMATS[scheme]:
        raise ConfigError(
            f"extra-config: object_format {fmt!r} does not go with key_scheme {scheme!r}, "
            f"which stores {OBJECT_FORMATS[scheme]!r} objects (SGLang reads ukv1 objects raw: "
            "framed objects under its keys would be wrong KV to it)"
        )
    if scheme == "sglang-ukv1" and extra.get("share_with"):
        raise ConfigError(
            'extra-config: share_with does not apply to key_scheme "sglang-ukv1": its grid is '
            'SGLang\'s; set "grid": "{layer_partition}x{head_group}" on every deployment'
        )
    return scheme


def sglang_stage_sizes(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Layers per PP stage as SGLang 0.5.23 splits them (``distributed.utils.get_pp_indices``).

    ``SGLANG_PP_LAYER_PARTITION`` (comma-separated stage sizes) when set and ``pp_size > 1``;
    otherwise ``num_layers // pp_size`` each, with one more layer for each of the *last*
    ``num_layers % pp_size`` stages (vLLM, and ``Topology``'s default, give them to the stages
    before the last instead).
    """
    explicit = os.environ.get("SGLANG_PP_LAYER_PARTITION")
    if explicit is not None and pp_size > 1:
        sizes = tuple(int(n) for n in explicit.split(","))
        if len(sizes) != pp_size or sum(sizes) != num_layers:
            raise ConfigError(
                f"SGLANG_PP_LAYER_PARTITION={explicit!r} does not split {num_layers} layers "
                f"into {pp_size} stages"
            )
        return sizes
    base, extra = divmod(num_layers, pp_size)
    return tuple(base + (1 if stage >= pp_size - extra else 0) for stage in range(pp_size))


def _optional_int(extra: Mapping[str, Any], key: str) -> int | None:
    value = extra.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"extra-config: {key} must be an integer, got {value!r}")
    return int(value)


def _number(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"extra-config: {key} must be a number, got {value!r}") from None
    if not number > 0:
        raise ConfigError(f"extra-config: {key} must be > 0, got {value!r}")
    return number


def _optional_bool(extra: Mapping[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"extra-config: {key} must be true or false, got {value!r}")
    return value
