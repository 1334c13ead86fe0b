"""Topologies (TP x PP, optional explicit PP layer splits) and the shard each rank holds.

Rank numbering follows SGLang: ``rank = pp_rank * tp_size + tp_rank``.

* PP splits layers into contiguous stages: explicitly (``pp_layers``, one count per stage), or
  evenly with vLLM/SGLang's rule: ``num_layers // pp_size`` per stage and the remainder given
  one layer each to the stages just before the last (the last stage also runs the LM head).
* TP splits KV heads for ``head_sharded`` namespaces: ``num_kv_heads / tp_size`` heads per rank
  when ``tp_size <= num_kv_heads`` (it must divide), else one head per rank replicated
  ``tp_size / num_kv_heads`` times (it must divide), with a replica index.
* ``replicated`` namespaces (MLA, or MHA under DP attention) give every TP rank every head; the
  TP rank is the replica index.

Among replicas of a shard, replica 0 is the one writer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .namespace import ModelShape, Namespace

Replication = str


@dataclass(frozen=True)
class Topology:
    """A parallel configuration: TP size, PP size and optionally explicit PP stage sizes."""

    tp_size: int = 1
    pp_size: int = 1
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
            assert self.pp_layers is not None
            if len(self.pp_layers) != self.pp_size or any(n < 1 for n in self.pp_layers):
                raise ValueError(
                    f"pp_layers: need {self.pp_size} positive stage sizes, got {self.pp_layers}"
                )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank_of(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def coords_of(self, rank: int) -> tuple[int, int]:
        """``(tp_rank, pp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return rank % self.tp_size, rank // self.tp_size

    def stage_layers(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """Half-open layer range of every PP stage."""
        if self.pp_layers is not None:
            if sum(self.pp_layers) != num_layers:
                raise ValueError(
                    f"pp_layers {self.pp_layers} sum to {sum(self.pp_layers)}, "
                    f"the model has {num_layers} layers"
                )
            sizes = list(self.pp_layers)
        else:
            if self.pp_size > num_layers:
                raise ValueError(f"pp_size {self.pp_size} exceeds the {num_layers} layers")
            sizes = [num_layers // self.pp_size] * self.pp_size
            for i in range(2, num_layers % self.pp_size + 2):
                sizes[-i] += 1
        ranges = []
        start = 0
        for size in sizes:
            ranges.append((start, start + size))
            start += size
        return tuple(ranges)

    def __str__(self) -> str:
        text = f"tp={self.tp_size},pp={self.pp_size}"
        if self.pp_layers is not None:
            text += ",layers=" + "/".join(map(str, self.pp_layers))
        return text

    @classmethod
    def parse(cls, text: str) -> Topology:
        """Parse ``tp=4,pp=2`` or ``tp=1,pp=2,layers=31/30`` (the inverse of ``str``)."""
        fields: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            match = re.fullmatch(r"(tp|pp|layers)=([0-9/]+)", part)
            if match is None or match[1] in fields:
                raise ValueError(f"topology {text!r}: expected tp=N,pp=M[,layers=A/B/...]")
            fields[match[1]] = match[2]
        try:
            tp = int(fields.get("tp", "1"))
            pp = int(fields.get("pp", "1"))
            layers = (
                tuple(int(n) for n in fields["layers"].split("/")) if "layers" in fields else None
            )
        except ValueError:
            raise ValueError(f"topology {text!r}: expected tp=N,pp=M[,layers=A/B/...]") from None
        return cls(tp, pp, layers)


class HeadSpan:
    """The count of a KV-head range ``[head_start, head_stop)``, for the dataclasses that hold
    one (a host page's ``HeadBlock``). A mixin: it declares no dataclass fields."""

    head_start: int
    head_stop: int

    @property
    def num_heads(self) -> int:
        return self.head_stop - self.head_start


class LayerHeadSpan(HeadSpan):
    """Counts of a layer range ``[layer_start, layer_stop)`` and a KV-head range, for the
    dataclasses that hold both (a rank's ``Shard``, a host page's ``UnifiedPageLayout``)."""

    layer_start: int
    layer_stop: int

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start


@dataclass(frozen=True)
class Shard(LayerHeadSpan):
    """What one rank holds: a layer range and a KV-head range, and which replica it is."""

    rank: int
    tp_rank: int
    pp_rank: int
    layer_start: int
    layer_stop: int
    head_start: int
    head_stop: int
    replica: int
    num_replicas: int

    @property
    def is_writer(self) -> bool:
        """Exactly one replica of each shard writes."""
        return self.replica == 0


def head_range(
    shape: ModelShape, replication: Replication, tp_size: int, tp_rank: int
) -> tuple[int, int, int, int]:
    """``(head_start, head_stop, replica, num_replicas)`` of a TP rank."""
    heads = shape.num_kv_heads
    if replication == "replicated" or shape.kv_kind == "mla":
        return 0, heads, tp_rank, tp_size
    if tp_size <= heads:
        if heads % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide the {heads} KV heads")
        per_rank = heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank, 0, 1
    if tp_size % heads:
        raise ValueError(f"tp_size {tp_size} is not a multiple of the {heads} KV heads")
    replicas = tp_size // heads
    head = tp_rank // replicas
    return head, head + 1, tp_rank % replicas, replicas


def shard_of(namespace: Namespace, topology: Topology, rank: int) -> Shard:
    """The shard of global ``rank`` under ``topology`` for ``namespace``'s model."""
    tp_rank, pp_rank = topology.coords_of(rank)
    layer_start, layer_stop = topology.stage_layers(namespace.num_layers)[pp_rank]
    head_start, head_stop, replica, replicas = head_range(
        namespace.shape, namespace.replication, topology.tp_size, tp_rank
    )
    return Shard(
        rank, tp_rank, pp_rank, layer_start, layer_stop, head_start, head_stop, replica, replicas
    )


def shards(namespace: Namespace, topology: Topology) -> tuple[Shard, ...]:
    """Every rank's shard, in rank order."""
    return tuple(shard_of(namespace, topology, r) for r in range(topology.world_size))
