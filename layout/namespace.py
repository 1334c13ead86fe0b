"""Namespaces: everything that decides what stored KV bytes mean.

Two deployments share stored KV exactly when their namespaces are equal, and the namespace
digest is part of every object key, so a dtype, model, tenant, grid or layout mismatch can never
produce a hit (SGLang issues #33268 and #26747 are the bugs this prevents).

``Namespace`` is also the single source of truth for the page geometry derived from the model
shape and the grid: layer chunks, head groups, block and object sizes. Every other module asks it
rather than recomputing.

Conventions: layer and head ranges are half-open ``[start, stop)`` in code; object keys print
the layer range with an inclusive end (``L30-59``) as the key format requires.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from .dtypes import dtype_itemsize, normalize_dtype
from .errors import InvalidNamespaceError

KVKind = Literal["mha", "mla"]
Replication = Literal["head_sharded", "replicated"]
HashAlgo = Literal["sha256", "xxh3_128"]

KV_KINDS: tuple[str, ...] = ("mha", "mla")
REPLICATIONS: tuple[str, ...] = ("head_sharded", "replicated")
HASH_ALGOS: tuple[str, ...] = ("sha256", "xxh3_128")
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
    """

    layers_per_chunk: int
    heads_per_group: int = 1

    def __str__(self) -> str:
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

    def __post_init__(self) -> None:
        _require_text("model", self.model, allow_empty=False)
        _require_text("model_revision", self.model_revision, allow_empty=True)
        _require_text("tenant_salt", self.tenant_salt, allow_empty=True)
        _require_choice("kv_kind", self.kv_kind, KV_KINDS)
        _require_choice("replication", self.replication, REPLICATIONS)
        _require_choice("hash_algo", self.hash_algo, HASH_ALGOS)
        _require_choice("layout_version", self.layout_version, LAYOUT_VERSIONS)
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
        lpc = _require_int(
            "grid.layers_per_chunk",
            self.grid.layers_per_chunk,
            1,
            min(self.num_layers, MAX_LAYERS_PER_OBJECT),
        )
        hpg = _require_int("grid.heads_per_group", self.grid.heads_per_group, 1, self.num_kv_heads)
        del lpc
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
        """The fields in their canonical order, as plain values (the encoding's input)."""
        values = {
            "layers_per_chunk": self.grid.layers_per_chunk,
            "heads_per_group": self.grid.heads_per_group,
        }
        return [(name, values.get(name, getattr(self, name, None))) for name in CANONICAL_FIELDS]

    def canonical_encoding(self) -> bytes:
        """Deterministic bytes identifying this namespace (msgpack of tagged, ordered fields)."""
        packed = msgpack.packb([_ENCODING_TAG, 1, self.canonical_fields()], use_bin_type=True)
        assert isinstance(packed, bytes)
        return packed

    @property
    def digest(self) -> str:
        """16 lowercase hex characters: the first 64 bits of sha256(canonical encoding)."""
        cached: str | None = self.__dict__.get("_digest")
        if cached is None:
            cached = hashlib.sha256(self.canonical_encoding()).hexdigest()[:DIGEST_HEX_CHARS]
            object.__setattr__(self, "_digest", cached)
        return cached

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
        body = {k: v for k, v in data.items() if k not in ("format", "version", "digest")}
        missing = expected - body.keys()
        unknown = body.keys() - expected
        if data.get("format") != _ENCODING_TAG or data.get("version") != 1:
            raise InvalidNamespaceError("namespace JSON: not a hicache-store namespace v1")
        if missing or unknown:
            raise InvalidNamespaceError(
                f"namespace JSON: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}"
            )
        grid = Grid(body.pop("layers_per_chunk"), body.pop("heads_per_group"))
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
        start = chunk * self.grid.layers_per_chunk
        return start, min(start + self.grid.layers_per_chunk, self.num_layers)

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
