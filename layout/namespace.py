"""Namespaces: everything that decides what stored KV bytes mean.

Two deployments share stored KV exactly when their namespaces are equal, and the namespace
digest is part of every object key, so a dtype, model, tenant, grid or layout mismatch can never
produce a hit (one would serve KV computed by another model, or read bytes in another layout).

``Namespace`` is also the single source of truth for the page geometry derived from the model
shape and the grid: layer chunks, head groups, block and object sizes. Every other module asks it
rather than recomputing.

Conventions: layer and head ranges are half-open ``[start, stop)`` in code; object keys print
the layer range with an inclusive end (``L30-59``) as the key format requires.

**Key schemes.** ``key_scheme="hicache"`` (the default) is this library's keyspace: the digest is
16 hex characters of a hash of every field, keys print layer ranges end-inclusive.
``key_scheme="sglang-ukv1"`` is SGLang 0.5.23's own unified keyspace
(``sglang/srt/mem_cache/hicache_key_scheme.py``): the digest is SGLang's ``ukv1-<16 hex>``,
a hash of its ``KVCacheNamespace`` (model, dtype, page size, rank replication, total KV heads,
layer partition, head group, object layout ``page-unified-v1``), keys print layer ranges
end-exclusive (``L0-30``), and objects are SGLang's bare payloads. That namespace holds no
layer count, head dim, revision, tenant salt or hash algorithm (SGLang seeds the page-hash chain
with a request's ``cache_salt`` instead), so a ukv1 namespace must leave ``tenant_salt`` empty
and use sha256, and carries a ``model_revision`` in the model id it hashes
(``{model}@{revision}``); ``ukv1_grid`` resolves SGLang's grid defaults.

**Weights.** KV depends on the weights, not on the model's name: ``model_revision`` is what
tells two sets of weights under one name apart. The engine integrations and tools fill it
with ``weights_revision``: an operator's explicit revision, else the weights identity derived
from the model's files (``hicache_store.weights``), else nothing (the weights are unknown and
only the model id separates them); an online weight update moves it (``updated_weights``).

**KV scales.** float8 KV bytes mean nothing without the per-layer k/v scales they were
quantized with: the same bytes read back under other scales are fluent garbage, and nothing
downstream notices. ``kv_scales`` holds ``kv_scales_digest`` of the scales a deployment's
engine uses, so pages stored under other scales miss. It is part of the digest only when set
(namespaces without it keep theirs); ``check_kv_scales`` is the one rule the integrations apply
at start-up: a float8 dtype without scales is refused, never stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

import msgpack

from .dtypes import dtype_itemsize, is_float8, normalize_dtype
from .errors import InvalidNamespaceError

KVKind = Literal["mha", "mla"]
Replication = Literal["head_sharded", "replicated"]
HashAlgo = Literal["sha256", "xxh3_128"]
KeyScheme = Literal["hicache", "sglang-ukv1"]

KV_KINDS: tuple[str, ...] = ("mha", "mla")
REPLICATIONS: tuple[str, ...] = ("head_sharded", "replicated")
HASH_ALGOS: tuple[str, ...] = ("sha256", "xxh3_128")
KEY_SCHEMES: tuple[str, ...] = ("hicache", "sglang-ukv1")
#: SGLang's object layout id (``pool_host/page_unified.py``): the bare payload of a ukv1 object.
UKV1_OBJECT_LAYOUT = "page-unified-v1"
#: the prefix of SGLang's unified-keyspace digests (schema version 1).
UKV1_DIGEST_PREFIX = "ukv1-"
#: object layout versions this library reads and writes.
LAYOUT_VERSIONS: tuple[int, ...] = (1,)
#: hex characters of a namespace digest (64 bits: collisions need ~4e9 namespaces).
DIGEST_HEX_CHARS = 16
#: the most layers one object may hold (bounds the header's checksum table).
MAX_LAYERS_PER_OBJECT = 1024
_MAX_TEXT = 256
_MAX_DIM = 1 << 20
_ENCODING_TAG = "hicache-store/namespace"
#: field names in canonical (encoding) order; the grid appears as its two numbers.
CANONICAL_FIELDS: tuple[str, ...] = (
    "model",
    "model_revision",
    "kv_kind",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "page_size",
    "replication",
    "layers_per_chunk",
    "heads_per_group",
    "layout_version",
    "hash_algo",
    "tenant_salt",
)


@dataclass(frozen=True)
class Grid:
    """The partition grid: layers per object chunk and KV heads per object head group.

    The last layer chunk may be shorter when ``layers_per_chunk`` does not divide the layer
    count (a 61-layer model with chunks of 31 has chunks 0-30 and 31-60).

    ``layer_starts`` instead lists each chunk's first layer (``(0, 30)``: chunks 0-29 and
    30-end); ``layers_per_chunk`` is then 0. SGLang's unified keyspace cuts a page this way
    when its layer partition is 0 (one chunk per pipeline stage, ``Grid.per_stage``).
    """

    layers_per_chunk: int
    heads_per_group: int = 1
    layer_starts: tuple[int, ...] | None = None

    @classmethod
    def per_stage(cls, stages: Sequence[tuple[int, int]], heads_per_group: int) -> Grid:
        """One layer chunk per ``(start, stop)`` stage range (SGLang's layer partition 0)."""
        return cls(0, heads_per_group, tuple(start for start, _stop in stages))

    def __str__(self) -> str:
        if self.layer_starts is not None:
            return f"L{','.join(map(str, self.layer_starts))}x{self.heads_per_group}"
        return f"{self.layers_per_chunk}x{self.heads_per_group}"


@dataclass(frozen=True)
class ModelShape:
    """The KV shape of a model, independent of how it is stored.

    For MLA, ``num_kv_heads`` is 1 and ``head_dim`` is the latent KV dimension.
    """

    kv_kind: KVKind
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def mha(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> ModelShape:
        return cls("mha", num_layers, num_kv_heads, head_dim)

    @classmethod
    def mla(cls, num_layers: int, kv_dim: int) -> ModelShape:
        return cls("mla", num_layers, 1, kv_dim)


def _require_int(field: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNamespaceError(f"{field}: expected an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidNamespaceError(f"{field}: {value} is outside [{low}, {high}]")
    return value


def _require_text(field: str, value: object, *, allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise InvalidNamespaceError(f"{field}: expected a string, got {value!r}")
    if not allow_empty and not value:
        raise InvalidNamespaceError(f"{field}: must not be empty")
    if len(value) > _MAX_TEXT or not value.isprintable():
        raise InvalidNamespaceError(
            f"{field}: must be printable and at most {_MAX_TEXT} characters"
        )
    return value


def _require_choice(field: str, value: object, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise InvalidNamespaceError(
            f"{field}: {value!r} is not one of {', '.join(map(str, choices))}"
        )


@dataclass(frozen=True)
class Namespace:
    """What stored KV means: model, KV shape and dtype, page size, grid, format, tenant.

    Construction validates every field and raises ``InvalidNamespaceError`` (a ``ValueError``)
    naming the field. Equal namespaces have equal digests in every process and on every
    machine (the digest is a hash of a canonical msgpack encoding, not of Python's ``hash``);
    changing any field changes the digest.
    """

    model: str
    kv_kind: KVKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    grid: Grid
    replication: Replication = "head_sharded"
    model_revision: str = ""
    layout_version: int = 1
    hash_algo: HashAlgo = "sha256"
    tenant_salt: str = ""
    key_scheme: KeyScheme = "hicache"
    #: objects are sealed with a tenant key ring (``layout.sealing``): page keys keyed by HMAC,
    #: payloads encrypted and authenticated (AES-256-GCM) per layer block. Readers without the
    #: ring find nothing. Part of the digest, so sealed and plain KV never meet.
    sealed: bool = False
    #: ``kv_scales_digest`` of the per-layer k/v scales float8 KV was quantized with; empty
    #: for unscaled KV. Part of the digest, so KV under other scales never hits.
    kv_scales: str = ""

    def __post_init__(self) -> None:
        _require_text("model", self.model, allow_empty=False)
        _require_text("model_revision", self.model_revision, allow_empty=True)
        _require_text("tenant_salt", self.tenant_salt, allow_empty=True)
        if not isinstance(self.kv_scales, str) or (
            self.kv_scales and not _KV_SCALES_DIGEST.fullmatch(self.kv_scales)
        ):
            raise InvalidNamespaceError(
                f"kv_scales: expected kv_scales_digest's output (kvs- and 16 hex), got "
                f"{self.kv_scales!r}"
            )
        _require_choice("kv_kind", self.kv_kind, KV_KINDS)
        _require_choice("replication", self.replication, REPLICATIONS)
        _require_choice("hash_algo", self.hash_algo, HASH_ALGOS)
        _require_choice("layout_version", self.layout_version, LAYOUT_VERSIONS)
        _require_choice("key_scheme", self.key_scheme, KEY_SCHEMES)
        if not isinstance(self.sealed, bool):
            raise InvalidNamespaceError(f"sealed: expected true or false, got {self.sealed!r}")
        if self.sealed and self.key_scheme != "hicache":
            raise InvalidNamespaceError(
                f"sealed: key scheme {self.key_scheme!r} stores bare objects, which have no "
                "header to carry a seal; sealed namespaces use the 'hicache' scheme"
            )
        _require_int("num_layers", self.num_layers, 1, 1 << 16)
        _require_int("num_kv_heads", self.num_kv_heads, 1, 1 << 16)
        _require_int("head_dim", self.head_dim, 1, _MAX_DIM)
        _require_int("page_size", self.page_size, 1, 1 << 20)
        try:
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        except ValueError as exc:
            raise InvalidNamespaceError(str(exc)) from None
        if not isinstance(self.grid, Grid):
            raise InvalidNamespaceError(f"grid: expected a Grid, got {self.grid!r}")
        self._check_layer_chunks()
        hpg = _require_int("grid.heads_per_group", self.grid.heads_per_group, 1, self.num_kv_heads)
        if self.kv_kind == "mla":
            if self.num_kv_heads != 1:
                raise InvalidNamespaceError(
                    f"num_kv_heads: an MLA namespace has one latent KV head, got {self.num_kv_heads}"
                )
            if self.replication != "replicated":
                raise InvalidNamespaceError(
                    "replication: MLA KV is replicated across TP ranks; use 'replicated'"
                )
        if self.num_kv_heads % hpg:
            divisors = [d for d in range(1, self.num_kv_heads + 1) if self.num_kv_heads % d == 0]
            raise InvalidNamespaceError(
                f"grid.heads_per_group: {hpg} does not divide num_kv_heads={self.num_kv_heads}; "
                f"use one of {divisors}"
            )
        if self.key_scheme == "sglang-ukv1":
            self._check_ukv1()

    def _check_layer_chunks(self) -> None:
        starts = self.grid.layer_starts
        if starts is None:
            _require_int(
                "grid.layers_per_chunk",
                self.grid.layers_per_chunk,
                1,
                min(self.num_layers, MAX_LAYERS_PER_OBJECT),
            )
            return
        bounds = [*starts, self.num_layers]
        if (
            self.grid.layers_per_chunk != 0
            or not starts
            or starts[0] != 0
            or any(not isinstance(b, int) or isinstance(b, bool) for b in starts)
            or any(not 0 < b - a <= MAX_LAYERS_PER_OBJECT for a, b in pairwise(bounds))
        ):
            raise InvalidNamespaceError(
                f"grid.layer_starts: {starts} must start at 0 and rise to below "
                f"{self.num_layers} in steps of at most {MAX_LAYERS_PER_OBJECT} layers "
                "(with layers_per_chunk 0)"
            )

    def _check_ukv1(self) -> None:
        """What SGLang's unified keyspace cannot express is refused, never silently dropped."""
        if self.tenant_salt:
            raise InvalidNamespaceError(
                "tenant_salt: the sglang-ukv1 key scheme has no tenant_salt (SGLang isolates "
                "tenants with a request's cache_salt, which seeds the page-hash chain)"
            )
        if self.hash_algo != "sha256":
            raise InvalidNamespaceError("hash_algo: the sglang-ukv1 key scheme keys sha256 pages")

    # -- construction helpers -------------------------------------------------------------

    @classmethod
    def create(
        cls, model: str, shape: ModelShape, dtype: str, page_size: int, grid: Grid, **options: Any
    ) -> Namespace:
        """Build a namespace from a model shape; MLA defaults to ``replicated``."""
        if shape.kv_kind == "mla":
            options.setdefault("replication", "replicated")
        return cls(
            model=model,
            kv_kind=shape.kv_kind,
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=dtype,
            page_size=page_size,
            grid=grid,
            **options,
        )

    def with_grid(self, grid: Grid) -> Namespace:
        return dataclasses.replace(self, grid=grid)

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.kv_kind, self.num_layers, self.num_kv_heads, self.head_dim)

    # -- identity ---------------------------------------------------------------------------

    def canonical_fields(self) -> list[tuple[str, Any]]:
        """The fields in their canonical order, as plain values (the encoding's input).

        Fields added after version 1 (``key_scheme``, ``layer_starts``, ``sealed``,
        ``kv_scales``) follow only when they differ from their default, so every namespace that
        existed before keeps its digest.
        """
        values = {
            "layers_per_chunk": self.grid.layers_per_chunk,
            "heads_per_group": self.grid.heads_per_group,
        }
        fields = [(name, values.get(name, getattr(self, name, None))) for name in CANONICAL_FIELDS]
        if self.key_scheme != "hicache":
            fields.append(("key_scheme", self.key_scheme))
        if self.grid.layer_starts is not None:
            fields.append(("layer_starts", list(self.grid.layer_starts)))
        if self.sealed:
            fields.append(("sealed", True))
        if self.kv_scales:
            fields.append(("kv_scales", self.kv_scales))
        return fields

    def canonical_encoding(self) -> bytes:
        """Deterministic bytes identifying this namespace (msgpack of tagged, ordered fields)."""
        packed = msgpack.packb([_ENCODING_TAG, 1, self.canonical_fields()], use_bin_type=True)
        assert isinstance(packed, bytes)
        return packed

    @property
    def digest(self) -> str:
        """16 lowercase hex characters: the first 64 bits of sha256(canonical encoding).

        For ``key_scheme="sglang-ukv1"``: SGLang's ``ukv1-`` + 16 hex (``ukv1_encoding``).
        """
        cached: str | None = self.__dict__.get("_digest")
        if cached is None:
            if self.key_scheme == "sglang-ukv1":
                tail = hashlib.sha256(self.ukv1_encoding()).hexdigest()[:DIGEST_HEX_CHARS]
                cached = UKV1_DIGEST_PREFIX + tail
            else:
                cached = hashlib.sha256(self.canonical_encoding()).hexdigest()[:DIGEST_HEX_CHARS]
            object.__setattr__(self, "_digest", cached)
        return cached

    def ukv1_fields(self) -> dict[str, Any]:
        """SGLang's ``KVCacheNamespace`` for this namespace, field by field in its order.

        Layer partition 0 means one chunk per pipeline stage (``Grid.layer_starts``); MLA is
        rank-replicated: no head axis (total KV heads and head group 0). SGLang's namespace has
        no revision: a ``model_revision`` is folded into the model id (``{model}@{revision}``),
        so other weights never share keys; without one the keys are SGLang's own. Nor has it
        scales: ``kv_scales`` is folded in the same way (``{model}@{revision}~{kv_scales}``).
        """
        replicated = self.kv_kind == "mla"
        model_id = f"{self.model}@{self.model_revision}" if self.model_revision else self.model
        if self.kv_scales:
            model_id = f"{model_id}~{self.kv_scales}"
        return {
            "schema_version": 1,
            "model_id": model_id,
            "dtype": self.dtype,
            "page_size": self.page_size,
            "rank_replicated": replicated,
            "total_kv_heads": 0 if replicated else self.num_kv_heads,
            "layer_partition": self.grid.layers_per_chunk,
            "head_group": 0 if replicated else self.grid.heads_per_group,
            "object_layout": UKV1_OBJECT_LAYOUT,
        }

    def ukv1_encoding(self) -> bytes:
        """The msgpack map SGLang hashes (msgspec encodes a struct's fields in order)."""
        packed = msgpack.packb(self.ukv1_fields(), use_bin_type=True)
        assert isinstance(packed, bytes)
        return packed

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict for manifests; ``from_json`` is its inverse (it checks the digest)."""
        fields = dict(self.canonical_fields())
        return {"format": _ENCODING_TAG, "version": 1, **fields, "digest": self.digest}

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, indent=2)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Namespace:
        """Inverse of ``to_json``. Unknown or missing fields and a wrong digest are errors."""
        if not isinstance(data, dict):
            raise InvalidNamespaceError("namespace JSON must be an object")
        expected = set(CANONICAL_FIELDS)
        optional = {"key_scheme", "layer_starts", "sealed", "kv_scales"}
        body = {k: v for k, v in data.items() if k not in ("format", "version", "digest")}
        missing = expected - body.keys()
        unknown = body.keys() - expected - optional
        if data.get("format") != _ENCODING_TAG or data.get("version") != 1:
            raise InvalidNamespaceError("namespace JSON: not a hicache-store namespace v1")
        if missing or unknown:
            raise InvalidNamespaceError(
                f"namespace JSON: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}"
            )
        starts = body.pop("layer_starts", None)
        grid = Grid(
            body.pop("layers_per_chunk"),
            body.pop("heads_per_group"),
            None if starts is None else tuple(starts),
        )
        namespace = cls(grid=grid, **body)
        if "digest" in data and data["digest"] != namespace.digest:
            raise InvalidNamespaceError(
                f"namespace JSON: digest {data['digest']!r} does not match its fields "
                f"({namespace.digest})"
            )
        return namespace

    # -- geometry: the single source of truth for sizes -------------------------------------

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def kv_planes(self) -> int:
        """2 (K and V) for MHA, 1 (the latent vector) for MLA."""
        return 2 if self.kv_kind == "mha" else 1

    @property
    def num_layer_chunks(self) -> int:
        if self.grid.layer_starts is not None:
            return len(self.grid.layer_starts)
        return -(-self.num_layers // self.grid.layers_per_chunk)

    @property
    def num_head_groups(self) -> int:
        return self.num_kv_heads // self.grid.heads_per_group

    @property
    def uses_head_groups(self) -> bool:
        """Whether object keys carry ``_H{group}`` (MHA) or not (MLA)."""
        return self.kv_kind == "mha"

    def chunk_layers(self, chunk: int) -> tuple[int, int]:
        """Half-open layer range ``[start, stop)`` of a layer chunk."""
        if not 0 <= chunk < self.num_layer_chunks:
            raise IndexError(f"layer chunk {chunk} outside [0, {self.num_layer_chunks})")
        starts = self.grid.layer_starts
        if starts is not None:
            stop = starts[chunk + 1] if chunk + 1 < len(starts) else self.num_layers
            return starts[chunk], stop
        start = chunk * self.grid.layers_per_chunk
        return start, min(start + self.grid.layers_per_chunk, self.num_layers)

    def chunk_of_layer(self, layer: int) -> int:
        """The layer chunk that holds ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers})")
        starts = self.grid.layer_starts
        if starts is not None:
            return bisect_right(starts, layer) - 1
        return layer // self.grid.layers_per_chunk

    def is_chunk_boundary(self, layer: int) -> bool:
        """Whether a layer chunk starts at ``layer`` (``num_layers`` counts: the end)."""
        return layer == self.num_layers or self.chunk_layers(self.chunk_of_layer(layer))[0] == layer

    def group_heads(self, group: int) -> tuple[int, int]:
        """Half-open KV-head range ``[start, stop)`` of a head group."""
        if not 0 <= group < self.num_head_groups:
            raise IndexError(f"head group {group} outside [0, {self.num_head_groups})")
        start = group * self.grid.heads_per_group
        return start, start + self.grid.heads_per_group

    def layer_block_bytes(self, num_heads: int | None = None) -> int:
        """Bytes of one layer of one page for ``num_heads`` heads (default: a head group).

        MHA: K and V, ``page_size`` tokens, ``num_heads`` heads of ``head_dim``.
        MLA: ``page_size`` tokens of the latent vector.
        """
        heads = self.grid.heads_per_group if num_heads is None else num_heads
        return self.kv_planes * self.page_size * heads * self.head_dim * self.itemsize

    def object_payload_bytes(self, chunk: int) -> int:
        start, stop = self.chunk_layers(chunk)
        return (stop - start) * self.layer_block_bytes()

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole page: every layer and every KV head."""
        return self.num_layers * self.layer_block_bytes(self.num_kv_heads)

    @property
    def objects_per_page(self) -> int:
        return self.num_layer_chunks * self.num_head_groups


#: an online update's label as it may stand in a revision; any other is hashed.
_VERSION_LABEL = re.compile(r"[A-Za-z0-9._-]{1,64}")


def weights_revision(explicit: str | None, identity: str | None) -> str:
    """The ``model_revision`` a deployment's namespace carries: the one rule every integration
    and tool applies.

    ``explicit`` (an operator's ``model_revision``) wins when given, an empty one included: no
    revision at all, to share keys with writers that key none (SGLang's native ukv1 backends),
    at the price that other weights under the same model id are served. Else ``identity``, the
    weights identity derived from the model's files (``hicache_store.weights``); else ``""``:
    the weights are unknown, and only the model id separates them.
    """
    if explicit is not None:
        return explicit
    return identity or ""


def updated_weights(identity: str, version: str) -> str:
    """The identity of the weights ``identity`` after an online update labelled ``version``.

    ``{identity}+{version}``; a label outside ``[A-Za-z0-9._-]{1,64}`` stands as ``h`` and
    16 hex characters of its sha256, so the result always fits the namespace. Always composed
    from the files' identity, never chained: the same label on the same files gives the same
    identity in every process (every TP rank of a deployment agrees), so a label must name the
    weights it stands for. Raises ``InvalidNamespaceError`` for an empty label.
    """
    if not isinstance(version, str) or not version:
        raise InvalidNamespaceError(f"a weights update needs a non-empty label, got {version!r}")
    if not _VERSION_LABEL.fullmatch(version):
        version = "h" + hashlib.sha256(version.encode()).hexdigest()[:16]
    return f"{identity}+{version}"


#: the form of ``kv_scales_digest``'s output.
_KV_SCALES_DIGEST = re.compile(r"kvs-[0-9a-f]{16}")
_KV_SCALES_TAG = b"hicache-store/kv-scales/1"


def kv_scales_digest(k_scales: Sequence[float], v_scales: Sequence[float]) -> str:
    """The ``kv_scales`` of a deployment whose layer *i* quantizes K with ``k_scales[i]`` and V
    with ``v_scales[i]`` (the engine's per-tensor scales, in layer order, every layer of the
    model).

    ``kvs-`` and 16 hex characters of a sha256 over the scales as float32 little-endian bytes
    (the bytes of the engines' float32 scale tensors), so equal scales give equal digests on
    every host and any scale that differs in any layer changes it. A scale that is not a finite
    positive number, or lists of different or zero lengths, raise ``InvalidNamespaceError``.
    """
    k, v = list(k_scales), list(v_scales)
    if not k or len(k) != len(v):
        raise InvalidNamespaceError(
            f"kv_scales: expected one k and one v scale per layer, got {len(k)} k and "
            f"{len(v)} v scales"
        )
    for name, values in (("k", k), ("v", v)):
        for layer, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0.0 < float(value) < float("inf")
            ):
                raise InvalidNamespaceError(
                    f"kv_scales: layer {layer}'s {name} scale {value!r} is not a finite "
                    "positive number"
                )
    try:
        packed = struct.pack(f"<{len(k)}f{len(v)}f", *k, *v)
    except OverflowError:
        raise InvalidNamespaceError("kv_scales: a scale is beyond float32's range") from None
    return "kvs-" + hashlib.sha256(_KV_SCALES_TAG + packed).hexdigest()[:DIGEST_HEX_CHARS]


def check_kv_scales(dtype: str, kv_scales: str, *, setting: str) -> None:
    """The start-up rule for scaled KV: a float8 ``dtype`` needs its ``kv_scales``.

    Raises ``InvalidNamespaceError`` (one line, naming ``setting``: where the operator or the
    engine provides the scales) when ``dtype`` is a float8 dtype and ``kv_scales`` is empty;
    float8 KV stored without its scales would be served to readers under other scales.
    """
    if is_float8(dtype) and not kv_scales:
        raise InvalidNamespaceError(
            f"{normalize_dtype(dtype)} KV needs its per-layer k/v scales in the namespace and "
            f"none were found: set {setting}; float8 KV is not stored without them"
        )


#: the field that holds no secret but the salt: shown as set / not set, never by value.
_SECRET_FIELDS = frozenset({"tenant_salt"})


@dataclass(frozen=True)
class Difference:
    """One namespace field where a deployment's namespace and a stored one disagree."""

    field: str
    deployment: Any
    stored: Any

    def __str__(self) -> str:
        if self.field in _SECRET_FIELDS:
            mine = "set" if self.deployment else "not set"
            theirs = "a different one" if self.deployment and self.stored else (
                "set" if self.stored else "not set")
            return f"{self.field}: deployment {mine}, stored {theirs}"
        return f"{self.field}: deployment {self.deployment!s}, stored {self.stored!s}"


def namespace_differences(mine: Namespace, stored: Namespace) -> list[Difference]:
    """The fields in which two namespaces differ, in canonical order (the grid as one field).

    Empty exactly when the two namespaces are equal (same canonical fields, so same digest).
    """
    out: list[Difference] = []
    # Fields past version 1 (key_scheme, layer_starts, sealed, kv_scales) appear only when set:
    # compare the union, a missing one at its default.
    defaults: dict[str, Any] = {
        "key_scheme": "hicache", "layer_starts": None, "sealed": False, "kv_scales": ""}
    ours, theirs = dict(mine.canonical_fields()), dict(stored.canonical_fields())
    for name in [*ours, *(n for n in theirs if n not in ours)]:
        value, other = ours.get(name, defaults.get(name)), theirs.get(name, defaults.get(name))
        if value == other:
            continue
        if name in ("layers_per_chunk", "heads_per_group", "layer_starts"):  # as the grid
            if not any(d.field == "grid" for d in out):
                out.append(Difference("grid", mine.grid, stored.grid))
            continue
        out.append(Difference(name, value, other))
    return out
