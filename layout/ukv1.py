"""SGLang's unified keyspace (``sglang-ukv1``) in this library's terms: its grid defaults.

SGLang 0.5.23's ``hicache_key_scheme.plan_unified_kv`` cuts a page by two fleet-wide settings:
``head_group`` (KV heads per object; default: this rank's own heads) and ``layer_partition``
(layers per object; default 0: one object per pipeline stage, its layer range). ``ukv1_grid``
turns those settings, resolved exactly as SGLang resolves them for a topology, into a ``Grid``;
a ``Namespace(key_scheme="sglang-ukv1")`` with that grid then has SGLang's digest and its plans
SGLang's keys (``tests/sglang/test_sglang_storage_ukv1.py`` holds them to SGLang's function).
"""

from __future__ import annotations

from .errors import InvalidNamespaceError
from .namespace import Grid, ModelShape
from .topology import Topology


def ukv1_grid(
    shape: ModelShape,
    topology: Topology,
    *,
    layer_partition: int | None = None,
    head_group: int | None = None,
) -> Grid:
    """The grid of SGLang's unified keyspace for a deployment of ``topology``.

    ``layer_partition`` None or 0: one layer chunk per PP stage of ``topology`` (so another
    PP split is another keyspace, as in SGLang). ``head_group`` None: the heads of one TP rank
    (so another TP size is another keyspace; set it to share across TP sizes). MLA has no head
    axis. KV-head replication (TP size above the KV-head count) has no keys in SGLang's scheme
    and is refused. At one KV head per rank SGLang asks for an explicit head group (it cannot
    tell sharding from replication); the only one there is, 1, is the default here.
    """
    if shape.kv_kind == "mla":
        heads = 1
    else:
        if topology.tp_size > shape.num_kv_heads:
            raise InvalidNamespaceError(
                f"sglang-ukv1: TP {topology.tp_size} replicates the model's "
                f"{shape.num_kv_heads} KV heads; SGLang's unified keyspace only keys sharded heads"
            )
        heads = head_group or shape.num_kv_heads // topology.tp_size
    if not layer_partition:
        return Grid.per_stage(topology.stage_layers(shape.num_layers), heads)
    return Grid(layer_partition, heads)
